// Preparing one job: validation, routing (rows grouped by expert), activation and h buffers, work items.
#include <algorithm>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <string>

#include "moe_engine.h"

namespace kt {

namespace {
constexpr int kChunkBlocks = 8;   // column blocks (of 16) per work item, gate/up and down
static_assert(kChunkBlocks % kPrefillChunkQuantum == 0, "prefill items must hold whole register tiles");
// Decode jobs (T <= kDecodeMaxRows) give gate/up items of up to kMaxDecodeGateUpBlocks blocks, ~kDecodeItemsPerThread
// per worker of the sub-pool: longer weight streams per item (linear_engine.cpp, kMaxDecodeChunkBlocks, has the
// measurement); with many workers the items get smaller instead, so every worker has some.
constexpr int kMaxDecodeGateUpBlocks = 24;
constexpr int kDecodeItemsPerThread = 2;

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void MoEEngine::submit(int id, int T, const void* x, int x_dtype, int64_t x_stride, int k, const int32_t* ids,
                       const float* weights, float* out, int64_t out_stride, bool accumulate,
                       const uint8_t* skip, int shared_id, const float* shared_w) {
    auto it = layers_.find(id);
    if (it == layers_.end()) throw std::invalid_argument("layer " + std::to_string(id) + " was not added");
    const Layer& L = it->second;
    const Layer* SL = nullptr;
    if (shared_id >= 0) {
        auto is = layers_.find(shared_id);
        if (is == layers_.end() || shared_id == id)
            throw std::invalid_argument("shared expert layer " + std::to_string(shared_id) +
                                        (shared_id == id ? " is the routed layer itself" : " was not added"));
        SL = &is->second;
        if (SL->n_experts != 1 || SL->hidden != L.hidden)
            throw std::invalid_argument("shared expert layer " + std::to_string(shared_id) + " must have one expert and "
                                        "the routed layer's hidden size " + std::to_string(L.hidden) + ", has " +
                                        std::to_string(SL->n_experts) + " expert(s) of hidden " +
                                        std::to_string(SL->hidden));
    }
    if (T < 0 || k < 0) throw std::invalid_argument("n_tokens and k must be >= 0");
    if (x_dtype != KT_F32 && x_dtype != KT_BF16) throw std::invalid_argument("x dtype must be f32 or bf16");
    if (T > 0 && (!x || !out || (k > 0 && (!ids || !weights)))) throw std::invalid_argument("null x, ids, weights or out");
    if (T > 0 && (x_stride < L.hidden || out_stride < L.hidden))
        throw std::invalid_argument("row strides of x and out must be >= hidden (" + std::to_string(L.hidden) + ")");
    for (int64_t i = 0; i < (int64_t)T * k; ++i)
        if (ids[i] >= L.n_experts)
            throw std::invalid_argument("expert id " + std::to_string(ids[i]) + " at token " + std::to_string(i / k) +
                                        ", slot " + std::to_string(i % k) + " is out of range (layer " +
                                        std::to_string(id) + " has " + std::to_string(L.n_experts) + " experts)");
    pool_->wait();   // the previous job's buffers are reused below
    L_ = &L; T_ = T; x_ = x; x_dtype_ = x_dtype; x_stride_ = x_stride; out_ = out; out_stride_ = out_stride;
    accumulate_ = accumulate;
    job_tag_ = next_rows_tag_base();
    if (T == 0) return;

    n_parts_ = SL ? 2 : 1;
    max_m_ = 1;
    route(parts_[0], L, k, ids, weights, skip);
    prepare(parts_[0], nullptr);
    if (SL) {   // the shared expert: every token, expert 0, weight shared_w[t] (1 without)
        std::vector<int32_t> zero((size_t)T, 0);
        std::vector<float> one;
        if (!shared_w) one.assign((size_t)T, 1.0f);
        route(parts_[1], *SL, 1, zero.data(), shared_w ? shared_w : one.data(), nullptr);
        const bool same_x = SL->bits == L.bits && SL->kx == L.kx && SL->kx_glen == L.kx_glen;
        prepare(parts_[1], same_x ? &parts_[0] : nullptr);
    }

    const int n_pools = pool_->n_pools();
    items1_.assign(n_pools, {}); items2_.assign(n_pools, {});
    size_t n_ps = 0;
    for (int pi = 0; pi < n_parts_; ++pi) {
        parts_[pi].remaining0 = n_ps;
        n_ps += parts_[pi].L->pieces.size() * parts_[pi].slots.size();
    }
    if (remaining_cap_ < n_ps) { remaining_.reset(new std::atomic<int>[n_ps]); remaining_cap_ = n_ps; }
    for (size_t i = 0; i < n_ps; ++i) remaining_[i] = 0;
    std::vector<int> chunk1(n_pools, kChunkBlocks);   // gate/up blocks per item, per sub-pool
    if (T <= kDecodeMaxRows) {
        std::vector<int64_t> blocks(n_pools, 0);
        for (int part = 0; part < n_parts_; ++part)
            for (const Piece& Pc : parts_[part].L->pieces)
                blocks[Pc.pool] += (int64_t)(Pc.r1 - Pc.r0) / 16 * (int64_t)parts_[part].slots.size();
        for (int p = 0; p < n_pools; ++p) {
            int workers = 0;
            for (int w = 0; w < pool_->n_threads(); ++w) workers += pool_->info(w).pool == p;
            const int64_t per_item = blocks[p] / (std::max(1, workers) * kDecodeItemsPerThread);
            chunk1[p] = (int)std::max<int64_t>(1, std::min<int64_t>(kMaxDecodeGateUpBlocks, per_item));
        }
    }
    for (int part = 0; part < n_parts_; ++part) {
        const Part& P = parts_[part];
        for (int pi = 0; pi < (int)P.L->pieces.size(); ++pi) {
            const Piece& Pc = P.L->pieces[pi];
            const int cb = chunk1[Pc.pool];
            for (int s = 0; s < (int)P.slots.size(); ++s) {
                for (int nb = Pc.r0 / 16; nb < Pc.r1 / 16; nb += cb) {
                    items1_[Pc.pool].push_back(Item{part, pi, s, nb, std::min(cb, Pc.r1 / 16 - nb)});
                    ++remaining_[P.remaining0 + (size_t)pi * P.slots.size() + s];
                }
            }
        }
    }
    for (int p = 0; p < n_pools; ++p) {
        for (int nb = 0; nb < L.down_blocks; nb += kChunkBlocks)
            items2_[p].push_back(Item{-1, -1, -1, nb, std::min(kChunkBlocks, L.down_blocks - nb)});
        next1_[p] = 0; next2_[p] = 0;
    }
    if (n_pools > 1) {
        partial_.resize(n_pools);
        for (auto& v : partial_) v.resize((size_t)T * L.hidden);
    }
    size_t need = (size_t)2 * max_m_ * std::max(kChunkBlocks, kMaxDecodeGateUpBlocks) * 16;
    for (int pi = 0; pi < n_parts_; ++pi) need = std::max(need, (size_t)parts_[pi].L->kx);
    for (auto& s : scratch_) if (s.size() < need) s.resize(need);
    x_ready_ = T <= kDecodeMaxRows;   // a few rows: quantize here, the workers start on weights right away
    if (x_ready_)
        for (int pi = 0; pi < n_parts_; ++pi)
            if (parts_[pi].own_x) for (int t = 0; t < T; ++t) quantize_x(parts_[pi], t, 0);
    launch_time_ = now_s();
    pool_->launch([this](const WorkerInfo& w) { run(w); });
}

// Routing of one part: rows grouped by expert (counting sort), in (expert, token, slot) order. Experts marked in skip
// are computed elsewhere (GPU-resident): their entries are left out here, exactly like ids < 0.
void MoEEngine::route(Part& P, const Layer& L, int k, const int32_t* ids, const float* weights, const uint8_t* skip) {
    P.L = &L;
    const int T = T_;
    auto routed = [&](int64_t i) { return ids[i] >= 0 && !(skip && skip[ids[i]]); };
    std::vector<int> count(L.n_experts + 1, 0);
    for (int64_t i = 0; i < (int64_t)T * k; ++i) if (routed(i)) ++count[ids[i] + 1];
    std::partial_sum(count.begin(), count.end(), count.begin());
    const int R = count[L.n_experts];
    P.tok.assign(R, 0);
    P.wt.assign(R, 0.0f);
    P.slots.clear();
    for (int e = 0; e < L.n_experts; ++e)
        if (count[e + 1] > count[e]) {
            P.slots.push_back(Slot{e, count[e], count[e + 1] - count[e]});
            max_m_ = std::max(max_m_, count[e + 1] - count[e]);
        }
    std::vector<int> fill(count.begin(), count.end() - 1);
    for (int64_t i = 0; i < (int64_t)T * k; ++i)
        if (routed(i)) { const int r = fill[ids[i]]++; P.tok[r] = (int)(i / k); P.wt[r] = weights[i]; }
}

// Activation buffers of one part: x quantized for its layer (or part 0's, when same_x), h per shard piece.
void MoEEngine::prepare(Part& P, const Part* same_x) {
    const Layer& L = *P.L;
    const int T = T_, R = (int)P.tok.size();
    const bool bf16 = L.bits == 16;
    const int ngx = L.kx / L.kx_glen;
    P.own_x = same_x == nullptr;
    const Part& X = same_x ? *same_x : P;
    if (P.own_x) {
        if (bf16) P.xb.resize((size_t)T * L.kx);
        else { P.xq.resize((size_t)T * L.kx); P.xs.resize((size_t)T * ngx); P.xsum.resize((size_t)T * ngx); }
    }
    P.xq_rows.resize(R); P.xs_rows.resize(R); P.xsum_rows.resize(R); P.xb_rows.resize(R);
    for (int r = 0; r < R; ++r) {
        const size_t t = P.tok[r];
        if (bf16) P.xb_rows[r] = X.xb.data() + t * L.kx;
        else { P.xq_rows[r] = X.xq.data() + t * L.kx; P.xs_rows[r] = X.xs.data() + t * ngx; P.xsum_rows[r] = X.xsum.data() + t * ngx; }
    }
    P.pbuf.resize(L.pieces.size());
    for (int pi = 0; pi < (int)L.pieces.size(); ++pi) {
        const Piece& Pc = L.pieces[pi];
        PieceBuf& B = P.pbuf[pi];
        const int cols = Pc.cols(), ng = bf16 ? 1 : cols / Pc.d_glen;
        B.h.resize((size_t)R * cols);
        if (bf16) { B.hb.resize((size_t)R * cols); B.b_rows.resize(R); }
        else {
            B.hq.resize((size_t)R * cols); B.hs.resize((size_t)R * ng); B.hsum.resize((size_t)R * ng);
            B.q_rows.resize(R); B.s_rows.resize(R); B.sum_rows.resize(R);
        }
        for (int r = 0; r < R; ++r) {
            if (bf16) B.b_rows[r] = B.hb.data() + (size_t)r * cols;
            else { B.q_rows[r] = B.hq.data() + (size_t)r * cols; B.s_rows[r] = B.hs.data() + (size_t)r * ng; B.sum_rows[r] = B.hsum.data() + (size_t)r * ng; }
        }
    }
}

}  // namespace kt
