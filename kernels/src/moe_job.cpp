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

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

void MoEEngine::submit(int id, int T, const void* x, int x_dtype, int64_t x_stride, int k, const int32_t* ids,
                       const float* weights, float* out, int64_t out_stride, bool accumulate,
                       const uint8_t* skip) {
    auto it = layers_.find(id);
    if (it == layers_.end()) throw std::invalid_argument("layer " + std::to_string(id) + " was not added");
    const Layer& L = it->second;
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
    if (T == 0) return;

    // Routing: rows grouped by expert (counting sort), in (expert, token, slot) order. Experts marked in skip are
    // computed elsewhere (GPU-resident): their entries are left out here, exactly like ids < 0.
    auto routed = [&](int64_t i) { return ids[i] >= 0 && !(skip && skip[ids[i]]); };
    std::vector<int> count(L.n_experts + 1, 0);
    for (int64_t i = 0; i < (int64_t)T * k; ++i) if (routed(i)) ++count[ids[i] + 1];
    std::partial_sum(count.begin(), count.end(), count.begin());
    const int R = count[L.n_experts];
    tok_.assign(R, 0);
    wt_.assign(R, 0.0f);
    slots_.clear();
    int max_m = 1;
    for (int e = 0; e < L.n_experts; ++e)
        if (count[e + 1] > count[e]) {
            slots_.push_back(Slot{e, count[e], count[e + 1] - count[e]});
            max_m = std::max(max_m, count[e + 1] - count[e]);
        }
    {
        std::vector<int> fill(count.begin(), count.end() - 1);
        for (int64_t i = 0; i < (int64_t)T * k; ++i)
            if (routed(i)) { const int r = fill[ids[i]]++; tok_[r] = (int)(i / k); wt_[r] = weights[i]; }
    }

    const bool bf16 = L.bits == 16;
    const int ngx = L.kx / L.kx_glen;
    if (bf16) xb_.resize((size_t)T * L.kx);
    else { xq_.resize((size_t)T * L.kx); xs_.resize((size_t)T * ngx); xsum_.resize((size_t)T * ngx); }
    xq_rows_.resize(R); xs_rows_.resize(R); xsum_rows_.resize(R); xb_rows_.resize(R);
    for (int r = 0; r < R; ++r) {
        const size_t t = tok_[r];
        if (bf16) xb_rows_[r] = xb_.data() + t * L.kx;
        else { xq_rows_[r] = xq_.data() + t * L.kx; xs_rows_[r] = xs_.data() + t * ngx; xsum_rows_[r] = xsum_.data() + t * ngx; }
    }

    const int n_pools = pool_->n_pools();
    pbuf_.resize(L.pieces.size());
    for (int pi = 0; pi < (int)L.pieces.size(); ++pi) {
        const Piece& P = L.pieces[pi];
        PieceBuf& B = pbuf_[pi];
        const int cols = P.cols(), ng = bf16 ? 1 : cols / P.d_glen;
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
    items1_.assign(n_pools, {}); items2_.assign(n_pools, {});
    const size_t n_ps = L.pieces.size() * slots_.size();
    if (remaining_cap_ < n_ps) { remaining_.reset(new std::atomic<int>[n_ps]); remaining_cap_ = n_ps; }
    for (size_t i = 0; i < n_ps; ++i) remaining_[i] = 0;
    for (int pi = 0; pi < (int)L.pieces.size(); ++pi) {
        const Piece& P = L.pieces[pi];
        for (int s = 0; s < (int)slots_.size(); ++s) {
            for (int nb = P.r0 / 16; nb < P.r1 / 16; nb += kChunkBlocks) {
                items1_[P.pool].push_back(Item{pi, s, nb, std::min(kChunkBlocks, P.r1 / 16 - nb)});
                ++remaining_[(size_t)pi * slots_.size() + s];
            }
        }
    }
    for (int p = 0; p < n_pools; ++p) {
        for (int nb = 0; nb < L.down_blocks; nb += kChunkBlocks)
            items2_[p].push_back(Item{-1, -1, nb, std::min(kChunkBlocks, L.down_blocks - nb)});
        next1_[p] = 0; next2_[p] = 0;
    }
    if (n_pools > 1) {
        partial_.resize(n_pools);
        for (auto& v : partial_) v.resize((size_t)T * L.hidden);
    }
    const size_t need = std::max((size_t)2 * max_m * kChunkBlocks * 16, (size_t)L.kx);
    for (auto& s : scratch_) if (s.size() < need) s.resize(need);
    x_ready_ = T <= kDecodeMaxRows;   // a few rows: quantize here, the workers start on weights right away
    if (x_ready_) for (int t = 0; t < T; ++t) quantize_x(t, 0);
    launch_time_ = now_s();
    pool_->launch([this](const WorkerInfo& w) { run(w); });
}

}  // namespace kt
