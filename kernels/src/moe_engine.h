// The routed-expert part of MoE layers on packed cpu-expert layouts, run on a ThreadPool.
// moe_layer.cpp: add_layer (validation, strides); moe_job.cpp: submit (routing, buffers, work items);
// moe_engine.cpp: the phases each worker runs.
//
// One submit = one job on every worker, in phases:
//   0 (all workers)        x -> int8 per token and gate/up group (or bf16), split over tokens (for a few tokens
//                          the submitting thread does it, saving a barrier)
//   1 (each sub-pool)      gate/up of (expert, block chunk) items of the pool's shard pieces; h = act(g, u):
//                          silu(g) * u, or gpt-oss's clamped SwiGLU on biased g, u (Activation)
//   1b (each sub-pool)     h -> int8 per token and down group (or bf16), by the worker that finished the last
//                          gate/up item of that (piece, expert)
//   2 (each sub-pool)      down over output-column chunks: each item loops over all experts, so the columns it
//                          owns are written by one worker only; out[t] += w[t,j] * y
//   3 (all, n_pools > 1)   out = sum of the pools' partial outputs
// A job has one or two parts: the submitted layer's routed experts and, optionally, a shared expert registered as a
// one-expert layer of the same hidden size (kt_submit_shared): its gate/up items join the same queue and its down
// product is added by the same down items after the routed experts, so the shared expert costs no job of its own.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../include/ktkernels.h"
#include "kernel_types.h"
#include "thread_pool.h"

namespace kt {

struct Piece {
    const uint8_t *gq, *uq, *dq;
    const uint8_t *gs, *us, *ds;   // scales, of the layer's s_type
    int width;        // i1 - i0 of the shard
    int r0, r1;       // shard-local rows computed here
    int pool;
    size_t g_expert_q, g_block_q, g_expert_s, g_block_s;   // gate/up strides (bytes / scales)
    size_t d_expert_q, d_block_q, d_expert_s, d_block_s;   // down strides
    int d_glen, d_g0;  // down group length inside the piece and index of its first group
    int row0;          // first row of the padded intermediate dimension this piece computes (i0 + r0)
    int cols() const { return r1 - r0; }
};

// What runs between gate/up and down (kt_set_layer_activation). kSwigluClamped (gpt-oss):
//   g = min(g + bg, limit), u = clamp(u + bu, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g)
// and the expert's down bias bd is added to its output before the routing weight: out += w * (y + bd).
// kSiluClamped (DeepSeek-V4's swiglu_limit): g = min(g, limit), u = clamp(u, -limit, limit), h = silu(g) * u.
// Plain C++ in the engine, run the same on every backend (the ISA kernels only compute the products).
enum { kActSilu = 0, kActSwigluClamped = 1, kActSiluClamped = 2 };
struct Activation {
    int kind = kActSilu;
    float alpha = 1.702f, limit = 7.0f;
    const float *gate_bias = nullptr, *up_bias = nullptr;   // (E, inter_pad) or null
    const float* down_bias = nullptr;                         // (E, hidden) or null
};

inline float activate(const Activation& a, float g, float u) {
    if (a.kind == kActSilu) return g / (1.0f + std::exp(-g)) * u;
    g = std::min(g, a.limit);
    u = std::max(-a.limit, std::min(u, a.limit));
    if (a.kind == kActSiluClamped) return g / (1.0f + std::exp(-g)) * u;
    return (u + 1.0f) * (g / (1.0f + std::exp(-a.alpha * g)));
}

struct Layer {
    int n_experts, hidden, inter_pad, bits, group;
    int s_type = kScaleF32, s_bytes = 4;   // scale dtype (scale_types.h) and its size
    int kx;            // gate/up K_pad (hidden padded)
    int kx_glen;       // gate/up group length (G, or kx for per-row / bf16)
    int down_blocks;   // round_up(hidden, 16) / 16
    std::vector<Piece> pieces;
    Activation act;
};

struct Slot { int expert, row0, m; };

class MoEEngine {
public:
    MoEEngine(int n_threads, int n_pools, const std::string& backend);
    ~MoEEngine();
    const KernelTable& table() const { return *table_; }
    ThreadPool& pool() { return *pool_; }

    void add_layer(int id, int n_experts, int hidden, int inter_pad, int bits, int group, int n_pieces,
                   const kt_shard_piece* pieces, int scale_dtype = kScaleF32);   // throws std::invalid_argument
    // the expert activation and biases of a registered layer (bias arrays read in place until the layer goes)
    void set_activation(int id, const Activation& act);   // throws std::invalid_argument
    // shared_id >= 0: also out[t] += shared_w[t] * shared_expert(x[t]) (shared_w null: weight 1), where shared_id
    // is a one-expert layer with this layer's hidden size, added after the routed experts of each column
    void submit(int id, int T, const void* x, int x_dtype, int64_t x_stride, int k, const int32_t* ids,
                const float* weights, float* out, int64_t out_stride, bool accumulate,
                const uint8_t* skip,   // skip: (n_experts) experts left out (computed elsewhere), or null
                int shared_id = -1, const float* shared_w = nullptr);
    void sync() { pool_->wait(); }
    // Seconds each worker spent in each phase of the last job (kProfilePhases per worker, see ktkernels.h).
    static constexpr int kProfilePhases = 9;
    const std::vector<double>& profile() { pool_->wait(); return profile_; }

private:
    struct PieceBuf {
        std::vector<float> h;        // (R, cols) silu(g) * u
        std::vector<int8_t> hq;      // (R, cols)
        std::vector<float> hs;       // (R, groups)
        std::vector<int32_t> hsum;   // (R, groups)
        std::vector<uint16_t> hb;    // (R, cols) bf16 layout
        std::vector<const int8_t*> q_rows;
        std::vector<const float*> s_rows;
        std::vector<const int32_t*> sum_rows;
        std::vector<const uint16_t*> b_rows;
    };
    // One layer's share of the job (see the header comment): its routing, quantized x and h buffers.
    struct Part {
        const Layer* L = nullptr;
        std::vector<Slot> slots;
        std::vector<int> tok;         // (R) token of each routed row, rows grouped by slot
        std::vector<float> wt;        // (R) routing weight
        bool own_x = true;            // false: x is quantized exactly as for part 0 (same K, groups, dtype): shared
        std::vector<int8_t> xq;       // (T, kx)
        std::vector<float> xs;        // (T, kx / kx_glen)
        std::vector<int32_t> xsum;
        std::vector<uint16_t> xb;     // (T, kx) bf16 layout
        std::vector<const int8_t*> xq_rows;
        std::vector<const float*> xs_rows;
        std::vector<const int32_t*> xsum_rows;
        std::vector<const uint16_t*> xb_rows;
        std::vector<PieceBuf> pbuf;
        size_t remaining0 = 0;        // its (piece, slot) counters start here in remaining_
    };
    struct Item { int part, piece, slot, nb0, nbn; };

    void route(Part& P, const Layer& L, int k, const int32_t* ids, const float* weights, const uint8_t* skip);
    void prepare(Part& P, const Part* same_x);

    void run(const WorkerInfo& w);
    void quantize_x(Part& P, int t, int worker);
    void gate_up(const Item& it, int worker);
    void quantize_h(const Item& it);
    void down(const Item& it, int pool, int worker);
    void down_part(const Part& P, const Item& it, int pool, float* dst, int64_t ld, float* y);
    QView gate_view(const Layer& L, const Piece& p, const uint8_t* q, const uint8_t* s, int e, int nb) const;

    const KernelTable* table_;
    std::unique_ptr<ThreadPool> pool_;
    std::map<int, Layer> layers_;

    // the job in flight
    const Layer* L_ = nullptr;    // the submitted layer (part 0)
    int T_ = 0;
    const void* x_ = nullptr;
    int x_dtype_ = KT_F32;
    int64_t x_stride_ = 0, out_stride_ = 0;
    float* out_ = nullptr;
    bool accumulate_ = false;
    Part parts_[2];
    int n_parts_ = 1;
    int max_m_ = 1;               // most rows of one slot, over the parts
    std::vector<std::vector<Item>> items1_, items2_;   // per pool
    std::unique_ptr<std::atomic<int>[]> next1_, next2_;
    // gate/up items still to finish per (part, piece, slot): the worker finishing the last one quantizes that h
    // (phase 1b without a barrier of its own)
    std::unique_ptr<std::atomic<int>[]> remaining_;
    size_t remaining_cap_ = 0;
    double launch_time_ = 0.0;
    bool x_ready_ = false;   // x quantized by submit itself (few tokens): no phase 0 and no barrier after it
    // This job's ActRows::tag base (next_rows_tag_base): gate/up rows of (part, slot) carry
    // job_tag_ + (part << 22) + slot + 1, so a kernel may keep its packed copy of them between the calls of this job
    uint64_t job_tag_ = 0;
    std::vector<std::vector<float>> partial_;   // per pool (T, hidden) when n_pools > 1
    std::vector<std::vector<float>> scratch_;   // per worker
    std::vector<double> profile_;                // (n_threads, kProfilePhases)
};

}  // namespace kt
