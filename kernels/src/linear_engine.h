// Dense quantized Linears y = x W^T on the cpu-linear-int4/int8 layouts (one cpu-expert matrix each,
// layouts/README.md "CPU dense Linears"), run on the kernel context's ThreadPool, async like the MoE op.
// linear_engine.cpp: registration, submit, the worker phases; linear_repack.cpp: GPU codes -> tiles.
//
// One submit = one job on every worker (the MoE job and this one never overlap: the pool runs one job at a time):
//   0 (all workers, T > kDecodeMaxRows)  x -> int8 per token and group; for fewer tokens the submitting thread does
//                                        it and the workers start on the weights at once (no barrier)
//   1 (all workers)                      items (linear, column-block chunk, row chunk) taken dynamically; each runs
//                                        the shared qgemm of kernel_body.inc (the MoE kernels' inner loops):
//                                        T <= 8 streams each weight block once for all rows (decode, bandwidth-bound),
//                                        more rows use the register-tiled loop on blocks reused from L2
//                                        (prefill, compute-bound)
// Several Linears sharing one input (q_a/kv_a, gate/up) go in one submit: x is quantized once and their items
// share one queue.
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <vector>

#include "kernel_types.h"
#include "thread_pool.h"

namespace kt {

struct Linear {
    int n, k, bits, group;     // logical (N, K); group as registered: 32, 64m, or -1 (per row)
    int kx;                    // K_pad
    int glen;                  // group length along K_pad (kx for per row)
    int n_blocks;              // N_pad / 16
    const uint8_t* q;          // (n_blocks, kx / 64, tile_bytes)
    const uint8_t* s;          // (n_blocks, kx / glen, 16) scales of s_type
    int s_type, s_bytes;       // float32 or float16 (scale_types.h)
    size_t q_block_stride;     // bytes
    size_t s_block_stride;     // scales (elements)
};

class LinearEngine {
public:
    LinearEngine(ThreadPool& pool, const KernelTable& table);
    ~LinearEngine();

    // scales of scale_dtype: KT_F32 or KT_F16 (the GPU layers' own float16 scales, moved)
    void add(int id, int n, int k, int bits, int group, const void* qweight, const void* scales,
             int scale_dtype = kScaleF32);   // throws
    // outs[i]: (T, N_i) f32 with row stride out_strides[i] (elements), overwritten.
    void submit(int n_linears, const int* ids, int T, const void* x, int x_dtype, int64_t x_stride,
                float* const* outs, const int64_t* out_strides);
    // One Linear applied to n_groups row ranges, each with its own input (per-head products: MLA's absorbed kv_b).
    // Group j: rows [row0 + j*row_step, +rows) of W (multiples of 16), inputs x + (j / x_group_div)*x_group_stride +
    // t*x_stride (elements), times x_scale[j*K .. +K] elementwise if x_scale is given (float32, before the int8
    // quantization), outputs out + j*out_group_stride + t*out_stride, t < T.
    void submit_grouped(int id, int n_groups, int row0, int row_step, int rows, int T, const void* x, int x_dtype,
                        int64_t x_stride, int64_t x_group_stride, float* out, int64_t out_stride,
                        int64_t out_group_stride, int x_group_div = 1, const float* x_scale = nullptr);
    void sync() { pool_.wait(); }
    // the registered Linear `id`, or nullptr (kt_gqa_layer checks its callers' geometry with it)
    const Linear* find(int id) const {
        auto it = linears_.find(id);
        return it == linears_.end() ? nullptr : &it->second;
    }

    // GPU codes -> tiles + f32 scales (ktkernels.h kt_linear_repack), on the pool; synchronous.
    void repack(int n, int k, int bits, int group, const void* codes, int codes_kind, int64_t code_stride_k,
                int64_t code_stride_n, const uint16_t* scales, int64_t scale_stride_g, int64_t scale_stride_n,
                uint8_t* qweight, void* scales_out, int scales_dtype = kScaleF32);

private:
    // linear (index into job), column blocks (relative to the group's first block), token rows, row groups g..g+ng
    struct Item { int lin, nb0, nbn, t0, tm, g, ng; };

    void prepare_x(int n_rows);          // activation buffers for n_rows quantized rows
    void start(int n_rows);              // quantize here (few rows) or in phase 0, then launch the workers
    void run(const WorkerInfo& w);
    void quantize_x(int r, int worker);  // quantized row r: token r (plain), group r / T, token r % T (grouped)
    void compute(const Item& it, int worker);

    ThreadPool& pool_;
    const KernelTable& table_;
    std::map<int, Linear> linears_;

    // the job in flight
    std::vector<const Linear*> job_;
    std::vector<float*> outs_;
    std::vector<int64_t> out_strides_;
    int T_ = 0;
    const void* x_ = nullptr;
    int x_dtype_ = 0;
    int64_t x_stride_ = 0;
    int kx_ = 0, glen_ = 0, k_ = 0;
    int n_rows_ = 0;              // quantized input rows: T (plain) or n_groups * T (grouped)
    int n_groups_ = 0;            // 0: a plain job; else a grouped one over job_[0]
    int g_block0_ = 0, g_block_step_ = 0;          // column block of group 0, blocks between groups
    int64_t x_group_stride_ = 0, out_group_stride_ = 0;
    int x_group_div_ = 1;                          // groups per input vector (grouped)
    const float* x_scale_ = nullptr;               // (n_groups, K) input scaling (grouped), or null
    bool x_ready_ = false;
    uint64_t job_tag_ = 0;        // ActRows::tag base of this job (next_rows_tag_base): rows from r0 carry + r0 + 1
    std::vector<int8_t> xq_;      // (T, kx)
    std::vector<float> xs_;       // (T, kx / glen)
    std::vector<int32_t> xsum_;
    std::vector<const int8_t*> xq_rows_;
    std::vector<const float*> xs_rows_;
    std::vector<const int32_t*> xsum_rows_;
    std::vector<Item> items_;
    std::atomic<int> next_{0};
    std::vector<std::vector<float>> scratch_;   // per worker: bf16 rows as f32, outputs of a partial last block
};

}  // namespace kt
