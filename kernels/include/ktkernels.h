/* ktkernels: CPU MoE routed-expert kernels on the packed cpu-expert layouts (layouts/README.md), C ABI.
 *
 * All weights are read in place (pointers into the mmapped files); nothing here parses files or copies weights.
 * Errors: functions return a negative value (or NULL) and kt_last_error() gives the message (per thread). */
#ifndef KTKERNELS_H
#define KTKERNELS_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default)

#define KT_ABI_VERSION 3   /* 3: kt_submit_masked */

typedef struct kt_ctx kt_ctx;

/* One shard of a layer's experts (or a unit sub-range of it) computed by one sub-pool.
 * Arrays stack all experts: gate_q (E, (i1-i0)/16, K_pad(H)/64, tile_bytes) u8, gate_s (E, (i1-i0)/16, n_groups, 16) f32,
 * up likewise, down_q (E, round_up(H,16)/16, (i1-i0)/64, tile_bytes), down_s (E, round_up(H,16)/16, n_groups, 16).
 * bf16 layout: the scales are NULL and K tiles are 32 wide. */
typedef struct {
    const void* gate_q;
    const float* gate_s;
    const void* up_q;
    const float* up_s;
    const void* down_q;
    const float* down_s;
    int32_t i0, i1;   /* the shard's rows of the padded intermediate dimension; strides follow i1 - i0 */
    int32_t r0, r1;   /* the part computed here, shard-local, on unit boundaries ([0, i1-i0) for all of it) */
    int32_t pool;     /* sub-pool (NUMA node) that computes this piece */
} kt_shard_piece;

enum { KT_F32 = 0, KT_BF16 = 1 };

int kt_abi_version(void);
const char* kt_last_error(void);

/* 1 when the named backend ("scalar", "avx2", "avx512", "amx") can run on this CPU. */
int kt_backend_supported(const char* name);
/* n_threads <= 0: all CPUs of the process; n_pools <= 0: one per NUMA node (env KT_NUMA_POOLS overrides);
 * backend NULL or "": env KT_KERNEL_BACKEND, else the best supported. Returns NULL on error. */
kt_ctx* kt_create(int n_threads, int n_pools, const char* backend);
void kt_destroy(kt_ctx* ctx);
const char* kt_backend_name(const kt_ctx* ctx);      /* e.g. "avx512" */
const char* kt_backend_detail(const kt_ctx* ctx);    /* e.g. "avx512 (int: vpdpbusd zmm, bf16: vdpbf16ps)" */
int kt_n_threads(const kt_ctx* ctx);
int kt_n_pools(const kt_ctx* ctx);
/* CPU the worker thread runs pinned to (-1 if pinning failed), and its sub-pool. */
int kt_thread_cpu(const kt_ctx* ctx, int thread);
int kt_thread_pool(const kt_ctx* ctx, int thread);

/* bits: 4, 8 or 16 (bf16 layout); group_size: 32, 64m or -1 (per row), ignored for bf16. */
int kt_add_layer(kt_ctx* ctx, int layer_id, int n_experts, int hidden, int intermediate_pad, int bits,
                 int group_size, int n_pieces, const kt_shard_piece* pieces);

/* out[t, :H] (=|+=) sum_j weights[t,j] * expert_{ids[t,j]}(x[t]) ; ids < 0 are skipped.
 * x: (T, H) f32 or bf16 with row stride x_stride elements; ids (T, k) int32; weights (T, k) f32;
 * out (T, H) f32 with row stride out_stride. Returns at once: x, ids, weights, out must stay valid until kt_sync.
 * A submit while another is in flight waits for it first. */
int kt_submit(kt_ctx* ctx, int layer_id, int n_tokens, const void* x, int x_dtype, int64_t x_stride, int k,
              const int32_t* ids, const float* weights, float* out, int64_t out_stride, int accumulate);
/* kt_submit, leaving out the experts marked in skip (n_experts bytes of this layer; skip[e] != 0: expert e is
 * computed elsewhere, e.g. resident on the GPU): their (token, slot) entries count as ids < 0, nothing is copied.
 * skip is read during this call only, so the caller may change it as soon as the call returns; NULL skips none. */
int kt_submit_masked(kt_ctx* ctx, int layer_id, int n_tokens, const void* x, int x_dtype, int64_t x_stride, int k,
                     const int32_t* ids, const float* weights, float* out, int64_t out_stride, int accumulate,
                     const uint8_t* skip);
int kt_sync(kt_ctx* ctx);

/* Where the last job's time went: 9 doubles (seconds) per worker thread: x quantization (0 when the submitting
 * thread did it: few tokens), barrier wait, gate/up (+ silu + h quantization), barrier wait, down, barrier wait and
 * partial-sum reduction (the last two only with n_pools > 1), delay from submit to the worker starting, and the
 * CPU time the worker got during the job (less than its wall time when other processes share the cores).
 * Returns the number of doubles written. */
int kt_profile(kt_ctx* ctx, double* out, int capacity);

/* Read bandwidth of this machine with the context's threads, bytes/s (best of reps, a buffer of `bytes`). */
double kt_measure_read_bandwidth(kt_ctx* ctx, size_t bytes, int reps);
/* Register-only int8 dot-product peak (vpdpbusd zmm, or ymm) with the context's threads, int8 ops/s (2 per MAC). */
double kt_measure_int8_peak(kt_ctx* ctx, double seconds);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif
#endif
