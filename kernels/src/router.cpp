// kt_route_sigmoid: the sigmoid router with group-limited top-k (DeepSeek-V3 / V3.2, GLM-4.5 "noaux_tc", MiniMax-M2
// with one group; ktrun.models.routing.sigmoid_grouped) for a few tokens, on the calling thread:
//   scores = sigmoid(x W^T) (E per token); choice = scores + bias; keep the topk_group groups with the best sum of
//   their two best choices; ids = the top_k best choices inside them; weights = scores[ids], normalized to sum 1 when
//   norm (plus 1e-20), times scaling.
// Why: a decode step's router was an MKL GEMV of 1 x K x E plus ~12 small torch ops, ~140 us per MoE layer with
// caches cold from the jobs around it, while the kernel pool waited; here one call.
// Numerics: the logits are float_dots (mla_attend.cpp: one fixed order on every ISA), the rest plain float code in
// a fixed order, so a token's choice depends on its own row only (not on the batch or the ISA). Ties go to the lower
// index (expert or group); ids come out best first.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../include/ktkernels.h"
#include "context.h"
#include "mla_attend.h"

namespace {

// indices of the k largest of v[0..n), best first, ties to the lower index (masked entries are -inf: chosen last)
void top_k(const float* v, int64_t n, int64_t k, int64_t* out) {
    for (int64_t i = 0; i < k; ++i) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; ++e) {
            bool taken = false;
            for (int64_t j = 0; j < i; ++j) taken = taken || out[j] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        out[i] = best;
    }
}

// A router call's scratch, sized for T tokens of E experts in n_group groups, with the logits of the T tokens
// (logits[t * E + e], float_dots' fixed order) computed: the first steps both routers share.
struct RouterScratch {
    std::vector<float> logits, per_expert, group_score;
    std::vector<int64_t> groups;
};


// The logits of T tokens on ctx's pool (the experts' rows split between its workers: each expert's dot products are
// the same whoever computes them) when the gate is large enough, else on the calling thread. A decode step's router
// reads its whole gate (DeepSeek-V3: 256 x 7168, 3.7 MB per layer as the checkpoint's bfloat16, 7.3 MB widened)
// right after the kernel jobs have flushed it from the caches; one thread streams it at a fraction of the machine's
// bandwidth. The gate is float32 or bfloat16 (widened exactly in the dot products: float_linear_rows, float_dots'
// bits), so a bfloat16 gate gives the bits of its float32 copy from half the bytes.
RouterScratch& router_logits(kt_ctx* ctx, int64_t T, int64_t E, int64_t K, const float* x, int64_t x_stride,
                             const void* w, bool bf16, int64_t w_stride, int64_t n_group, int64_t topk_group) {
    thread_local RouterScratch s;
    s.logits.resize((size_t)(E * T));
    s.per_expert.resize((size_t)E);
    s.group_score.resize((size_t)n_group);
    s.groups.resize((size_t)topk_group);
    float* logits = s.logits.data();
    if (!ctx || E * K < kt::kPoolMinFloats || ctx->engine.pool().n_threads() < 2) {
        kt::float_linear_rows(0, E, K, w, bf16, w_stride, x, x_stride, T, logits, E);
        return s;
    }
    kt::ThreadPool& pool = ctx->engine.pool();
    pool.wait();   // the job in flight may be an earlier one's
    pool.launch([=](const kt::WorkerInfo& wi) {
        const int64_t e0 = E * wi.index / wi.n_threads, e1 = E * (wi.index + 1) / wi.n_threads;
        if (e1 > e0) kt::float_linear_rows(e0, e1, K, w, bf16, w_stride, x, x_stride, T, logits, E);
    });
    pool.wait();
    return s;
}

// v[e] = fill for every expert outside the topk_group groups of the best group_score (ties to the lower group)
void keep_best_groups(RouterScratch& s, float* v, int64_t n_group, int64_t per_group, int64_t topk_group, float fill) {
    top_k(s.group_score.data(), n_group, topk_group, s.groups.data());
    for (int64_t g = 0; g < n_group; ++g) {
        bool kept = false;
        for (int64_t j = 0; j < topk_group; ++j) kept = kept || s.groups[j] == g;
        if (!kept)
            for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) v[e] = fill;
    }
}

}  // namespace

extern "C" int kt_route_sigmoid(kt_ctx* ctx, int64_t T, int64_t E, int64_t K, const float* x, int64_t x_stride,
                                const void* w, int w_dtype, int64_t w_stride, const float* bias, int64_t n_group,
                                int64_t topk_group, int64_t top_k_, int norm, float scaling, int64_t* ids,
                                float* weights) {
    if ((w_dtype != KT_F32 && w_dtype != KT_BF16) || T < 0 || E < 1 || K < 16 || K % 16 || !w || w_stride < K ||
        n_group < 1 || E % n_group || topk_group < 1 ||
        topk_group > n_group || top_k_ < 1 || top_k_ > E / n_group * topk_group || (T && (!x || x_stride < K || !ids ||
        !weights)))
        return -1;
    if (T == 0) return 0;
    RouterScratch& s = router_logits(ctx, T, E, K, x, x_stride, w, w_dtype == KT_BF16, w_stride, n_group, topk_group);
    std::vector<float>& choice = s.per_expert;
    std::vector<float>& group_score = s.group_score;
    const int64_t per_group = E / n_group;
    for (int64_t t = 0; t < T; ++t) {
        float* sc = s.logits.data() + t * E;   // sigmoid in place, token t's row
        for (int64_t e = 0; e < E; ++e) {
            float& l = sc[e];
            l = 1.0f / (1.0f + std::exp(-l));
            choice[e] = bias ? l + bias[e] : l;
        }
        if (topk_group < n_group) {
            for (int64_t g = 0; g < n_group; ++g) {   // the group's two best choices, best first, summed
                int64_t two[2];
                top_k(choice.data() + g * per_group, per_group, per_group < 2 ? per_group : 2, two);
                const float* c = choice.data() + g * per_group;
                group_score[g] = per_group < 2 ? c[two[0]] : c[two[0]] + c[two[1]];
            }
            keep_best_groups(s, choice.data(), n_group, per_group, topk_group, -INFINITY);
        }
        int64_t* id = ids + t * top_k_;
        float* wt = weights + t * top_k_;
        top_k(choice.data(), E, top_k_, id);
        float sum = 0.0f;
        for (int64_t i = 0; i < top_k_; ++i) {
            wt[i] = sc[id[i]];
            sum += wt[i];
        }
        const float denom = sum + 1e-20f;
        for (int64_t i = 0; i < top_k_; ++i) wt[i] = (norm ? wt[i] / denom : wt[i]) * scaling;
    }
    return 0;
}

// kt_route_softmax: the softmax router (DeepSeek-V2 greedy / group_limited_greedy, Qwen3-MoE, Qwen3-Next, Mixtral;
// ktrun.models.routing.softmax_topk) for a few tokens, on the calling thread:
//   scores = softmax(x W^T) over the E experts; with groups (topk_group < n_group) only the topk_group groups with the
//   best single score keep theirs (the others' become 0, as the reference masks them); ids = the top_k best scores;
//   weights = scores[ids], normalized to sum 1 when norm, times scaling.
// Why: as kt_route_sigmoid: a decode step's router was a GEMV plus ~8 small torch ops per MoE layer while the pool
// waited. Numerics: logits by float_dots (one fixed order on every ISA); max, exp and the sum in index order; so a
// token's result depends on its own row only. Ties go to the lower index; ids come out best first.
extern "C" int kt_route_softmax(kt_ctx* ctx, int64_t T, int64_t E, int64_t K, const float* x, int64_t x_stride,
                                const void* w, int w_dtype, int64_t w_stride, int64_t n_group, int64_t topk_group,
                                int64_t top_k_, int norm, float scaling, int64_t* ids, float* weights) {
    if ((w_dtype != KT_F32 && w_dtype != KT_BF16) || T < 0 || E < 1 || K < 16 || K % 16 || !w || w_stride < K ||
        n_group < 1 || E % n_group || topk_group < 1 ||
        topk_group > n_group || top_k_ < 1 || top_k_ > E || (T && (!x || x_stride < K || !ids || !weights)))
        return -1;
    if (T == 0) return 0;
    RouterScratch& s = router_logits(ctx, T, E, K, x, x_stride, w, w_dtype == KT_BF16, w_stride, n_group, topk_group);
    std::vector<float>& scores = s.per_expert;
    std::vector<float>& group_score = s.group_score;
    const int64_t per_group = E / n_group;
    for (int64_t t = 0; t < T; ++t) {
        const float* logits = s.logits.data() + t * E;   // token t's row
        float m = -INFINITY;
        for (int64_t e = 0; e < E; ++e) m = std::max(m, logits[e]);
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) {
            scores[e] = std::exp(logits[e] - m);
            sum += scores[e];
        }
        for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
        if (topk_group < n_group) {
            for (int64_t g = 0; g < n_group; ++g) {   // the group's best score
                float best = scores[g * per_group];
                for (int64_t e = 1; e < per_group; ++e) best = std::max(best, scores[g * per_group + e]);
                group_score[g] = best;
            }
            keep_best_groups(s, scores.data(), n_group, per_group, topk_group, 0.0f);
        }
        int64_t* id = ids + t * top_k_;
        float* wt = weights + t * top_k_;
        top_k(scores.data(), E, top_k_, id);
        float total = 0.0f;
        for (int64_t i = 0; i < top_k_; ++i) {
            wt[i] = scores[id[i]];
            total += wt[i];
        }
        for (int64_t i = 0; i < top_k_; ++i) wt[i] = (norm ? wt[i] / total : wt[i]) * scaling;
    }
    return 0;
}
