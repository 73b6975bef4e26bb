// kt_moe_decode: a MoE layer's few new rows from the attention's output to the next layer's normed input, in one call
// (ktrun.models.model.MoEModel's steps for them on the kernels, each the same function with the same arguments, so
// the bits are those of the separate calls: tests/test_kernels_moe_decode.py; with finish 0 the call returns after
// the submit, for a shared expert the caller adds outside the job):
//   s = x + delta, h = norm(s)          kt_rms_norm with the residual add
//   ids, weights = router(h)            kt_route_sigmoid / kt_route_softmax (the logits on the pool for a large gate)
//   e = experts(h) [+ shared(h)]        the routed job (MoEEngine::submit), waited for here
//   x_out = s + e, h_out = norm'(x_out) kt_rms_norm with the residual add
// router 2 (dense): a dense layer's MLP registered as a one-expert layer (ktrun.experts.kernel fuse_dense): no router,
// every row's one expert 0 at weight 1 (ids 0, weights 1 written out), so e = the MLP's output, exactly (1 * y, summed
// from zero).
// Why: these were five library calls with Python between them per MoE layer (~70 us of the embedded default model's
// decode step per layer on a 2-core machine), the pool idle meanwhile.
#include <chrono>
#include <string>
#include <vector>

#include "../include/ktkernels.h"
#include "context.h"

namespace {

struct MoeDecodeScratch {
    std::vector<float> s, h, e;
    std::vector<int32_t> ids32;
};

}  // namespace

extern "C" int kt_moe_decode_impl(kt_ctx* ctx, kt_moe_decode_args* a, const char** why) {
    const bool dense = a->router == 2;
    *why = "bad geometry (T, H, E, top_k, groups) or router kind (dense: E, top_k and groups 1, no gate or bias)";
    if (a->T < 1 || a->H < 16 || a->E < 1 || a->top_k < 1 || a->top_k > a->E || a->n_group < 1 || a->topk_group < 1 ||
        a->topk_group > a->n_group || a->router < 0 || a->router > 2 || (a->router != 0 && a->bias) ||
        (dense && (a->E != 1 || a->top_k != 1 || a->n_group != 1 || a->gate)))
        return -1;
    *why = "missing x / delta / norms / gate / outputs (finish 0 needs e_out)";
    if (!a->x || !a->delta || !a->norm || !a->next_norm || (!a->gate && !dense) || !a->x_out || !a->h_out || !a->ids ||
        !a->weights || a->x_stride < a->H || a->delta_stride < a->H || (!a->finish && !a->e_out))
        return -1;
    ctx->engine.sync();   // a job in flight (a finish-0 call's) may still read the scratch below
    thread_local MoeDecodeScratch sc;
    const int64_t T = a->T, H = a->H, k = a->top_k;
    // finish 0: s, h and e are the caller's (the job in flight reads h and writes e after this returns)
    float* s = a->x_out;
    float* h = a->h_out;
    if (a->finish) {
        sc.s.resize((size_t)(T * H));
        sc.h.resize((size_t)(T * H));
        s = sc.s.data();
        h = sc.h.data();
    }
    float* e = a->e_out;
    if (!e) {
        sc.e.resize((size_t)(T * H));
        e = sc.e.data();
    }
    sc.ids32.resize((size_t)(T * k));
    *why = "bad norm arguments (lanes, H)";
    if (kt_rms_norm(T, H, a->x, a->x_stride, a->delta, a->delta_stride, s, H, a->norm, a->eps, a->lanes, h, H) != 0)
        return -1;
    *why = "bad router arguments (gate_dtype KT_F32 or KT_BF16)";
    if (dense) {
        for (int64_t t = 0; t < T; ++t) { a->ids[t] = 0; a->weights[t] = 1.0f; }
    }
    const int rc = dense ? 0
        : a->router == 0
        ? kt_route_sigmoid(ctx, T, a->E, H, h, H, a->gate, a->gate_dtype, H, a->bias, a->n_group, a->topk_group, k,
                           a->renorm, a->scaling, a->ids, a->weights)
        : kt_route_softmax(ctx, T, a->E, H, h, H, a->gate, a->gate_dtype, H, a->n_group, a->topk_group, k, a->renorm,
                           a->scaling, a->ids, a->weights);
    if (rc != 0) return -1;
    for (int64_t i = 0; i < T * k; ++i) sc.ids32[i] = (int32_t)a->ids[i];
    // the job reads ids32 and weights until it ends: with finish 0 the next call waits for it before reusing them
    ctx->engine.submit(a->layer, (int)T, h, KT_F32, H, (int)k, sc.ids32.data(), a->weights, e, H, false, nullptr,
                       a->shared, nullptr);   // throws for an unknown layer (guarded by the caller)
    if (!a->finish) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    ctx->engine.sync();
    a->wait_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    kt_rms_norm(T, H, s, H, e, H, a->x_out, H, a->next_norm, a->eps, a->lanes, a->h_out, H);
    return 0;
}
