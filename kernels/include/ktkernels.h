/* ktkernels: CPU kernels on the packed layouts of layouts/README.md, C ABI: the routed-expert part of MoE layers
 * (cpu-expert-int4/int8/bf16) and dense quantized Linears (cpu-linear-int4/int8), on one persistent thread pool.
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

#define KT_ABI_VERSION 26  /* 3: kt_submit_masked; 4: dense Linears (kt_add_linear, kt_linear_submit, kt_linear_repack);
                              5: kt_add_layer_ex (scale dtype of the int expert layouts);
                              6: kt_set_layer_activation (gpt-oss's clamped SwiGLU and expert biases);
                              7: kt_linear_submit_grouped (per-head products of one Linear);
                              8: KT_SUB6, two-level expert scales (cpu-expert-int4 layout version 3);
                              9: kt_submit_shared (a shared expert inside the routed job),
                                 kt_linear_submit_grouped_scaled (groups sharing a scaled input),
                                 kt_add_linear_ex / kt_linear_repack_ex (float16 scales of dense Linears);
                             10: kt_rms_norm (float32 RMSNorm rows, optionally after a residual add, on the calling
                                 thread, bit-identical to torch's CPU F.rms_norm), kt_rope (float32 rotary embedding,
                                 bit-identical to torch's elementwise formula);
                             11: kt_mla_attend (MLA's absorbed decode attention core: scores, softmax, latent
                                 output of one query row per head, on the calling thread or the context's pool),
                                 kt_route_sigmoid (the sigmoid router with group-limited top-k, on the calling
                                 thread);
                             12: kt_mla_attend_batch (kt_mla_attend for m requests in one pool job);
                             13: kt_search_scales (ktconvert's importance-weighted scale search);
                             14: kt_route_softmax (the softmax router with optional group-limited top-k, on the
                                 calling thread);
                             15: kt_gqa_attend_batch (GQA / MQA decode attention of m query rows, each over its own
                                 cache rows, in one pool job);
                             16: kt_gqa_decode (a GQA layer's decode rows after their q/k/v projections: q/k norm,
                                 RoPE, the KV cache write and the attention, in one call); kt_route_sigmoid /
                                 kt_route_softmax take a context: a large gate's logits on its pool; kt_mla_decode
                                 (an MLA layer's decode rows, x to o_proj's output, in one call); kt_moe_decode (a
                                 MoE layer's decode rows, residual add to the next norm, in one call);
                             17: kt_float_linear (y = x W^T, float32 or bfloat16 weights, float32 rows: the output
                                 head, on the context's pool); the attention ops take a cache longer than 128
                                 positions in chunks (merged in chunk order), split between the workers;
                             18: kt_measure_tile_int8_peak (the AMX tile unit's int8 peak);
                             19: kt_gptq_block (one block of ktconvert's GPTQ column loop);
                             20: kt_gqa_layer (a GQA layer's decode rows, x to o_proj's output, in one call);
                             21: kt_decode_layers (a decode step's decoder layers, each a kt_gqa_layer or
                                 kt_mla_decode call then a kt_moe_decode call, in one call);
                             22: kt_pool_wake / kt_pool_rest (the pool's workers woken ahead of a step's
                                 first job, sent to sleep after its last), kt_moe_decode's router 2 (a dense
                                 layer's MLP as a one-expert layer);
                             23: kt_decode_layers runs the output head after the last layer (head_kind);
                             24: kt_prompt_attend (a prompt's causal attention, GQA / MQA / MHA, windows, sinks,
                                 a key in two parts, on the context's pool);
                             25: the routers' gate in float32 or bfloat16 (kt_route_sigmoid / kt_route_softmax's
                                 w_dtype, kt_moe_decode_args.gate_dtype: the checkpoint's bf16 router read as
                                 stored, half the bytes, the same bits); kt_decode_layers takes the step's token
                                 ids (the embedding rows) and layer 0's norm (tokens, embed, norm0);
                             26: kt_decode_layers takes an MTP block's first steps (mtp_hidden, mtp_enorm,
                                 mtp_hnorm, mtp_ctx, mtp_eh_id) and runs the head on chosen rows (head_rows); */

typedef struct kt_ctx kt_ctx;

/* One shard of a layer's experts (or a unit sub-range of it) computed by one sub-pool.
 * Arrays stack all experts: gate_q (E, (i1-i0)/16, K_pad(H)/64, tile_bytes) u8, gate_s (E, (i1-i0)/16, n_groups, 16)
 * scales (f32, or f16 / bf16 with kt_add_layer_ex), up likewise, down_q (E, round_up(H,16)/16, (i1-i0)/64, tile_bytes),
 * down_s (E, round_up(H,16)/16, n_groups, 16). bf16 layout: the scales are NULL and K tiles are 32 wide. */
typedef struct {
    const void* gate_q;
    const void* gate_s;
    const void* up_q;
    const void* up_s;
    const void* down_q;
    const void* down_s;
    int32_t i0, i1;   /* the shard's rows of the padded intermediate dimension; strides follow i1 - i0 */
    int32_t r0, r1;   /* the part computed here, shard-local, on unit boundaries ([0, i1-i0) for all of it) */
    int32_t pool;     /* sub-pool (NUMA node) that computes this piece */
} kt_shard_piece;

enum { KT_F32 = 0, KT_BF16 = 1, KT_F16 = 2,    /* dtypes of activations (f32, bf16) and scales (all three) */
       KT_SUB6 = 3 };                          /* two-level scales: uint8 records (int4, group 32; layouts/README.md) */

int kt_abi_version(void);
const char* kt_last_error(void);

/* 1 when the named backend ("scalar", "avx2", "avx512", "amx") can run on this CPU. */
int kt_backend_supported(const char* name);
/* n_threads <= 0: all CPUs of the process; n_pools <= 0: one per NUMA node (env KT_NUMA_POOLS overrides);
 * backend NULL or "": env KT_KERNEL_BACKEND, else the best supported. Returns NULL on error.
 * Worker 0 is the thread that calls kt_sync (or a submit, which waits for the job in flight): it computes its share of
 * the job there, so n_threads workers start n_threads - 1 threads; env KT_POOL_CALLER=0 makes all n pinned threads
 * (kernels/README.md "The thread pool"). */
kt_ctx* kt_create(int n_threads, int n_pools, const char* backend);
void kt_destroy(kt_ctx* ctx);
const char* kt_backend_name(const kt_ctx* ctx);      /* e.g. "avx512" */
const char* kt_backend_detail(const kt_ctx* ctx);    /* e.g. "avx512 (int: vpdpbusd zmm, bf16: vdpbf16ps); decode prefetch t1 (non-AMD default)": valid until the thread's next call */
int kt_n_threads(const kt_ctx* ctx);
int kt_n_pools(const kt_ctx* ctx);
/* Wake the pool's sleeping workers ahead of a burst of jobs (an empty job, not waited for; the next launch waits). */
void kt_pool_wake(kt_ctx* ctx);
/* Idle workers sleep at once instead of spinning (after a burst of jobs, when other work needs the cores). */
void kt_pool_rest(kt_ctx* ctx);
/* CPU the worker thread runs pinned to (-1 if pinning failed, or for worker 0 when it is the calling thread), and its
 * sub-pool. */
int kt_thread_cpu(const kt_ctx* ctx, int thread);
int kt_thread_pool(const kt_ctx* ctx, int thread);

/* bits: 4, 8 or 16 (bf16 layout); group_size: 32, 64m or -1 (per row), ignored for bf16. */
int kt_add_layer(kt_ctx* ctx, int layer_id, int n_experts, int hidden, int intermediate_pad, int bits,
                 int group_size, int n_pieces, const kt_shard_piece* pieces);
/* The same with the scales' dtype: KT_F32 (layout version 1), KT_F16 or KT_BF16 (version 2), KT_SUB6 (version 3:
 * scales (E, blocks, n_groups, 16) uint8, one 128-byte record per block and 8 groups; bits 4, group_size 32; the
 * unit of shard ranges and pieces is 256). */
int kt_add_layer_ex(kt_ctx* ctx, int layer_id, int n_experts, int hidden, int intermediate_pad, int bits,
                    int group_size, int scale_dtype, int n_pieces, const kt_shard_piece* pieces);

enum { KT_ACT_SILU = 0, KT_ACT_SWIGLU_CLAMPED = 1, KT_ACT_SILU_CLAMPED = 2 };

/* The activation between a layer's gate/up and down (default KT_ACT_SILU: h = silu(g) * u) and its expert biases.
 * KT_ACT_SWIGLU_CLAMPED (gpt-oss): g = min(g + gate_bias, limit), u = clamp(u + up_bias, -limit, limit),
 * h = (u + 1) * g * sigmoid(alpha * g); each expert's output is y + down_bias. KT_ACT_SILU_CLAMPED (DeepSeek-V4):
 * g = min(g, limit), u = clamp(u, -limit, limit), h = silu(g) * u (alpha unused). gate_bias / up_bias (E,
 * intermediate_pad) f32 (padded rows 0), down_bias (E, hidden) f32, each NULL for none (gate and up together);
 * read in place: they must stay valid while the layer is used. Same on every backend. */
int kt_set_layer_activation(kt_ctx* ctx, int layer_id, int activation, float alpha, float limit,
                            const float* gate_bias, const float* up_bias, const float* down_bias);

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
/* kt_submit_masked with a shared expert in the same job (no job of its own, its work in the same queue):
 *   out[t, :H] (=|+=) sum_j weights[t,j] * expert_{ids[t,j]}(x[t]) + shared_weights[t] * shared(x[t])
 * shared_layer_id: a layer added with n_experts = 1 and this layer's hidden size (the shared expert's gate, up and
 * down tiles: cpu-linear tiles are cpu-expert matrices, so a shared expert's Linears register as is; any bits, group
 * size, scale dtype or intermediate size); shared_weights (T) f32, or NULL for 1 (read during this call only).
 * Each output column adds the routed experts in ascending order, then the shared expert: with one sub-pool, out is
 * bit for bit kt_submit_masked's result plus, in float32, shared_weights[t] times the shared layer's own kt_submit
 * with expert 0 and weight 1. */
int kt_submit_shared(kt_ctx* ctx, int layer_id, int n_tokens, const void* x, int x_dtype, int64_t x_stride, int k,
                     const int32_t* ids, const float* weights, float* out, int64_t out_stride, int accumulate,
                     const uint8_t* skip, int shared_layer_id, const float* shared_weights);
int kt_sync(kt_ctx* ctx);

/* --- dense Linears: y = x W^T on cpu-linear-int4/int8 (one cpu-expert matrix: layouts/README.md) ---------------
 * Registered once (weights read in place, never copied), run asynchronously on the same pool as the MoE layers:
 * a submit of either kind waits for the job in flight first, kt_sync waits for the last one. Linear ids are their
 * own namespace (not MoE layer ids). */

/* qweight (round_up(n,16)/16, K_pad/64, tile_bytes) u8, scales (round_up(n,16)/16, n_groups, 16) f32, where
 * K_pad = round_up(k, lcm(64, G)) (64 for G = -1), n_groups = K_pad / G (1 for G = -1), tile_bytes 512 (int4) or
 * 1024 (int8). bits 4 or 8; group_size 32, 64m or -1 (per row). Re-adding an id replaces it. */
int kt_add_linear(kt_ctx* ctx, int linear_id, int n, int k, int bits, int group_size, const void* qweight,
                  const float* scales);
/* The same with the scales' dtype: KT_F32, or KT_F16 (cpu-linear tiles with the GPU layers' float16 scales moved,
 * not widened: 2 bytes per group instead of 4; every backend converts them to f32 exactly, so results are those of
 * the widened scales, bit for bit). */
int kt_add_linear_ex(kt_ctx* ctx, int linear_id, int n, int k, int bits, int group_size, int scale_dtype,
                     const void* qweight, const void* scales);

/* outs[i][t, :N_i] = x[t] W_i^T for the n_linears linears ids[i], which share the input x (same K and group size:
 * x is quantized once and their work shares one queue; e.g. q_a + kv_a, gate + up).
 * x: (T, K) f32 or bf16 with row stride x_stride elements; outs[i]: (T, N_i) f32 with row stride out_strides[i],
 * overwritten. Returns at once: x and the outputs must stay valid until kt_sync (ids/outs/out_strides are copied). */
int kt_linear_submit(kt_ctx* ctx, int n_linears, const int32_t* ids, int n_tokens, const void* x, int x_dtype,
                     int64_t x_stride, float* const* outs, const int64_t* out_strides);

/* One Linear over n_groups row ranges, each with its own input (per-head products: MLA's absorbed kv_b):
 *   out_j[t, :rows] = x_j[t] W[row0 + j*row_step : row0 + j*row_step + rows]^T        j < n_groups, t < n_tokens
 * x_j[t] = x + j*x_group_stride + t*x_stride and out_j[t] = out + j*out_group_stride + t*out_stride (elements;
 * K values / rows outputs each, contiguous). row0, row_step, rows: multiples of 16, the last range inside N.
 * x: f32 or bf16; out f32, overwritten. Async like kt_linear_submit (x and out valid until kt_sync). */
int kt_linear_submit_grouped(kt_ctx* ctx, int linear_id, int n_groups, int row0, int row_step, int rows,
                             int n_tokens, const void* x, int x_dtype, int64_t x_stride, int64_t x_group_stride,
                             float* out, int64_t out_stride, int64_t out_group_stride);

/* kt_linear_submit_grouped where x_group_div consecutive groups read one input vector, each scaled elementwise by
 * its own row of x_scale before the int8 quantization (NULL: no scaling):
 *   x_j[t] = (x + (j / x_group_div)*x_group_stride + t*x_stride) * x_scale[j*K .. j*K + K)
 * x_scale (n_groups, K) f32, read until kt_sync. MLA's absorbed W_uk: one query vector per head, one scaling per
 * head and kv_b scale group (ktrun.ops.kernel_linear.AbsorbedKvB). */
int kt_linear_submit_grouped_scaled(kt_ctx* ctx, int linear_id, int n_groups, int row0, int row_step, int rows,
                                    int n_tokens, const void* x, int x_dtype, int64_t x_stride,
                                    int64_t x_group_stride, int x_group_div, const float* x_scale, float* out,
                                    int64_t out_stride, int64_t out_group_stride);

enum { KT_CODES_U8 = 0, KT_CODES_PACKED_K = 1 };

/* GPU codes -> cpu-linear tiles (bit-exact; ktlayouts.cpu_linear.repack_gpu_codes is the reference), synchronous,
 * on the context's threads. Codes of the logical (K, N) matrix, unsigned with zero point 2^(bits-1):
 *   KT_CODES_U8:       code(k, n) = ((const uint8_t*)codes)[k * code_stride_k + n * code_stride_n]   (one per byte)
 *   KT_CODES_PACKED_K: 32/bits codes per little-endian 32-bit word along K, least significant bits first:
 *                      word (k / (32/bits)) * code_stride_k + n * code_stride_n   (strides in words; gptq qweight:
 *                      (N, 1), compressed-tensors weight_packed: (1, K*bits/32))
 * scales: float16 bits, scale(g, n) = scales[g * scale_stride_g + n * scale_stride_n], g < K / G (1 group for -1).
 * Writes qweight and scales_out as kt_add_linear takes them (padding: codes 2^(bits-1), scales 0).
 * K must be a multiple of G. Fails (after writing) if a KT_CODES_U8 int4 code is above 15. */
int kt_linear_repack(kt_ctx* ctx, int n, int k, int bits, int group_size, const void* codes, int codes_kind,
                     int64_t code_stride_k, int64_t code_stride_n, const uint16_t* scales, int64_t scale_stride_g,
                     int64_t scale_stride_n, void* qweight, float* scales_out);
/* kt_linear_repack writing scales_out as scales_dtype: KT_F32 (widened) or KT_F16 (the float16 bits moved; padding
 * +0), for kt_add_linear_ex. */
int kt_linear_repack_ex(kt_ctx* ctx, int n, int k, int bits, int group_size, const void* codes, int codes_kind,
                        int64_t code_stride_k, int64_t code_stride_n, const uint16_t* scales, int64_t scale_stride_g,
                        int64_t scale_stride_n, void* qweight, void* scales_out, int scales_dtype);

/* Where the last MoE job's time went: 9 doubles (seconds) per worker thread: x quantization (0 when the submitting
 * thread did it: few tokens), barrier wait, gate/up (+ silu + h quantization), barrier wait, down, barrier wait and
 * partial-sum reduction (the last two only with n_pools > 1), delay from submit to the worker starting, and the
 * CPU time the worker got during the job (less than its wall time when other processes share the cores).
 * Returns the number of doubles written. */
int kt_profile(kt_ctx* ctx, double* out, int capacity);

/* Read bandwidth of this machine with the context's threads, bytes/s (best of reps, a buffer of `bytes`). */
double kt_measure_read_bandwidth(kt_ctx* ctx, size_t bytes, int reps);
/* Register-only int8 dot-product peak (vpdpbusd zmm, or ymm) with the context's threads, int8 ops/s (2 per MAC). */
double kt_measure_int8_peak(kt_ctx* ctx, double seconds);
/* The same on AMX tile registers (tdpbssd, 16 x 16 x 64 per instruction, four independent accumulators), int8 ops/s;
 * 0 when the context's backend has no tiles. */
double kt_measure_tile_int8_peak(kt_ctx* ctx, double seconds);

/* Float32 RMSNorm of T rows of D contiguous floats on the calling thread (no context, no pool; may run while a job
 * is in flight): out[t] = (s[t] * r) * weight, r = 1 / sqrt(mean(s[t]^2) + eps), s[t] = x[t], or with delta != NULL
 * s[t] = x[t] + delta[t], written to sum_out[t] (may alias x). weight may be NULL (then no scale). Strides in floats.
 * Bit-identical to torch's CPU float32 F.rms_norm (and to its formula pow/mean/add/rsqrt/mul): the mean's sum follows
 * torch's cascaded vector sum for `lanes` floats per vector (16: its AVX-512 kernels, 8: AVX2 / default).
 * Needs D >= lanes; returns -1 for bad arguments (lanes not 8 or 16, D < lanes, NULL x / out, delta without sum_out). */
int kt_rms_norm(int64_t T, int64_t D, const float* x, int64_t x_stride, const float* delta, int64_t delta_stride,
                float* sum_out, int64_t sum_stride, const float* weight, float eps, int lanes, float* out,
                int64_t out_stride);

/* Rotary embedding of T x H rows of 2*half float32 on the calling thread: with x1[i], x2[i] = x[2i], x[2i+1]
 * (interleaved) or x[i], x[half+i], out[i] = x1 cos[i] - x2 sin[i] and out[half+i] = x2 cos[i] + x1 sin[i], each
 * product rounded before the add (torch's separate ops; ktrun.models.layers.Rope.apply). cos / sin: (T, half) rows
 * cs_stride apart; strides in floats; out must not overlap x. Returns -1 for bad arguments. */
int kt_rope(int64_t T, int64_t H, int64_t half, const float* x, int64_t x_stride_t, int64_t x_stride_h,
            const float* cos, const float* sin, int64_t cs_stride, int interleaved, float* out, int64_t out_stride_t,
            int64_t out_stride_h);

/* MLA's absorbed decode attention for one query row per head over one request's latent cache. The cache is n_runs
 * runs of run_len[r] rows, row j of run r at runs[r] + j * row_stride (floats), each row [c (R) | k_rot (dr)];
 * S = sum of run_len, positions in run order:
 *   s[h, j] = (q_lat[h] . c_j + q_rot[h] . k_rot_j) * scale, p[h] = softmax_j(s[h]), out[h] = sum_j p[h, j] c_j
 * q_lat rows (R) q_lat_stride apart, q_rot rows (dr) q_rot_stride apart, out rows (R) out_stride apart, h < nh.
 * ctx NULL: on the calling thread; else on ctx's pool (heads split between its workers, the caller one of them),
 * waiting for any job in flight first and returning when done. One summation order per head on every ISA and any
 * split (kernels/src/mla_attend.cpp; S > 128: chunks of 128 positions merged in chunk order): the same bits
 * everywhere, whatever the batch, the runs or the threads.
 * Needs R a multiple of 16 (>= 16), dr a multiple of 16 (0 allowed), S >= 1, row_stride >= R + dr; returns -1 for bad
 * arguments. */
int kt_mla_attend(kt_ctx* ctx, int64_t nh, int64_t R, int64_t dr, const float* q_lat, int64_t q_lat_stride,
                  const float* q_rot, int64_t q_rot_stride, float scale, int64_t n_runs, const float* const* runs,
                  const int64_t* run_len, int64_t row_stride, float* out, int64_t out_stride);

/* kt_mla_attend for m requests at once, in one job on ctx's pool (or the calling thread when ctx is NULL): request i
 * has its queries at q_lat + i * q_lat_req_stride (rows q_lat_stride apart; q_rot likewise), its cache rows in the
 * req_n_runs[i] runs that follow the earlier requests' runs in runs / run_len (all rows row_stride apart), and its
 * output at out + i * out_req_stride (rows out_stride apart). The (request, block of 8 heads) pairs are split between
 * the workers; each head gets exactly the bits kt_mla_attend gives it alone. Returns -1 for bad arguments. */
int kt_mla_attend_batch(kt_ctx* ctx, int64_t m, int64_t nh, int64_t R, int64_t dr, const float* q_lat,
                        int64_t q_lat_req_stride, int64_t q_lat_stride, const float* q_rot, int64_t q_rot_req_stride,
                        int64_t q_rot_stride, float scale, const int64_t* req_n_runs, const float* const* runs,
                        const int64_t* run_len, int64_t row_stride, float* out, int64_t out_req_stride,
                        int64_t out_stride);

/* The sigmoid router with group-limited top-k (DeepSeek-V3 "noaux_tc"; one group: MiniMax-M2) of T tokens on the
 * calling thread (the logits of a gate of 2^18 weights or more on ctx's pool when ctx is given): scores =
 * sigmoid(x W^T) ((T, E); x rows of K floats x_stride apart, W (E, K) rows w_stride elements apart, of w_dtype KT_F32
 * or KT_BF16 (ABI 25: widened exactly, the bits of its float32 copy), K a multiple of 16), choice = scores + bias
 * (bias (E,) or NULL); per token the topk_group of n_group groups (E / n_group experts each) with the best sum of
 * their two best choices are kept, ids[t] = the top_k best choices inside them (best first, ties to the lower
 * index), weights[t] = scores at ids, divided by their sum + 1e-20 when norm, times scaling. ids (T, top_k) int64,
 * weights (T, top_k) float32. Logits in float_dots' fixed order (kernels/src/mla_attend.h): the same bits on every
 * ISA, whatever T. Returns -1 for bad arguments. */
int kt_route_sigmoid(kt_ctx* ctx, int64_t T, int64_t E, int64_t K, const float* x, int64_t x_stride, const void* w,
                     int w_dtype, int64_t w_stride, const float* bias, int64_t n_group, int64_t topk_group,
                     int64_t top_k, int norm, float scaling, int64_t* ids, float* weights);

/* GQA / MQA attention of m query rows (entries), each over its own cache rows, in one job on ctx's pool (or the
 * calling thread when ctx is NULL). Entry e: query heads h < nkv * rep at q + e * q_entry_stride + h * q_head_stride
 * (hd floats each; head h reads kv head h / rep); its positions are its entry_n_runs[e] runs, taken in order from the
 * flat lists (run r: run_len[r] positions; position i's keys at k_runs[r] + i * k_row_stride, nkv heads of hd floats,
 * values at v_runs[r] + i * v_row_stride, nkv heads of vd floats). For each head: s_j = (q . k_j) * scale, p =
 * softmax(s), out = sum_j p_j v_j, written at out + e * out_entry_stride + h * out_head_stride (vd floats). hd, vd
 * multiples of 16. Numerics as kt_mla_attend (one fixed order on every ISA): a head's result depends only on its
 * query row and its positions, not on the batch, the runs, the other heads or the threads. Returns -1 for bad
 * arguments. */
int kt_gqa_attend_batch(kt_ctx* ctx, int64_t m, int64_t nkv, int64_t rep, int64_t hd, int64_t vd, const float* q,
                        int64_t q_entry_stride, int64_t q_head_stride, float scale, const int64_t* entry_n_runs,
                        const float* const* k_runs, const float* const* v_runs, const int64_t* run_len,
                        int64_t k_row_stride, int64_t v_row_stride, float* out, int64_t out_entry_stride,
                        int64_t out_head_stride);

/* kt_gqa_decode's arguments: one GQA layer's new rows (decode rows, a speculative verify's, a short chunk's) after
 * their q / k / v projections, and the requests' paged KV caches. Strides in floats. */
typedef struct kt_gqa_decode_args {
    int64_t nh, nkv, hd, vd;            /* query heads, kv heads (nh a multiple), key / value head dims (multiples of 16) */
    int64_t T;                          /* new rows */
    const float* q; int64_t q_stride;   /* row t: nh heads of hd at q + t * q_stride */
    const float* k; int64_t k_stride;   /* row t: nkv heads of hd */
    const float* v; int64_t v_stride;   /* row t: nkv heads of vd */
    /* RMSNorm of q and k before RoPE, as kt_rms_norm: norm 0 none, 1 per head (q_norm / k_norm: hd weights), 2 over
     * the whole projection (nh * hd and nkv * hd weights); lanes and eps as kt_rms_norm's */
    int32_t norm, lanes; float eps;
    const float* q_norm; const float* k_norm;
    /* RoPE (kt_rope) of the first 2 * rope_half dims of every head (the rest pass through), with row t's cos / sin
     * (rope_half floats) at cos + t * cs_stride, sin + t * cs_stride; rope_half 0: none */
    int64_t rope_half; int32_t interleaved; const float* cos; const float* sin; int64_t cs_stride;
    /* m requests: request r's rows are [row0[r], row0[r + 1]) at positions start[r], start[r] + 1, ...; position p is
     * slot p % block_size of block tables[table0[r] + p / block_size]. Block b's slot i holds that position's keys
     * at k_cache + b * k_block_stride + i * k_row_stride (nkv heads of hd contiguous), its values likewise. */
    int64_t m; const int64_t* row0; const int64_t* start; const int64_t* table0; const int64_t* tables;
    int64_t block_size;
    float* k_cache; int64_t k_block_stride, k_row_stride;
    float* v_cache; int64_t v_block_stride, v_row_stride;
    float scale; int64_t window;        /* window > 0: a row at position p sees positions > p - window only */
    float* out; int64_t out_stride;     /* row t: nh heads of vd */
} kt_gqa_decode_args;

/* A GQA layer's new rows in one call: each row's q and k normed and roped (the bits of kt_rms_norm and kt_rope), its
 * k and v written into its request's cache slot, then every row attends over its causal (windowed) prefix, as
 * kt_gqa_attend_batch (one job on ctx's pool, or the calling thread when ctx is NULL): a row's result has the bits
 * of that token decoded alone. Returns -1 for bad arguments (kt_last_error says which). */
int kt_gqa_decode(kt_ctx* ctx, const kt_gqa_decode_args* args);

/* kt_gqa_layer's arguments: a GQA layer's attention for its new rows from its normed input x to o_proj's output,
 * every Linear already added to ctx (kt_add_linear*). Strides in floats. */
typedef struct kt_gqa_layer_args {
    kt_gqa_decode_args attn;            /* the attention as kt_gqa_decode's; its q, k, v and out (and their strides)
                                           are ignored: the projections and the attention output are this call's */
    const float* x; int64_t x_stride;   /* (T, K): the Linears' input rows */
    int32_t q_id, k_id, v_id, o_id;     /* q_proj (nh * hd outputs), k_proj (nkv * hd), v_proj (nkv * vd): one job on
                                           x (the same K and group); o_proj (nh * vd inputs) */
    const float* q_bias; const float* k_bias; const float* v_bias; const float* o_bias;   /* NULL: none */
    float* out; int64_t out_stride; int64_t n_out;   /* o_proj's output rows (T, n_out): n_out its N */
} kt_gqa_layer_args;

/* A GQA layer's new rows (decode, a speculative verify) from x to o_proj's output in one call, on ctx's pool: the
 * q / k / v Linears' job, each bias added after it (a float32 add), kt_gqa_decode (norms, RoPE, the cache write,
 * the attention), o_proj's job and its bias: the bits of those calls made one after another. Returns -1 for bad
 * arguments (kt_last_error says which). */
int kt_gqa_layer(kt_ctx* ctx, const kt_gqa_layer_args* args);

/* kt_prompt_attend's arguments: the causal attention of a request's n new rows (a prompt or a prompt's chunk) over
 * its positions 0 .. start + n - 1. Query row t (position start + t), head h: q + t * q_row + h * q_head (dk floats);
 * it reads kv head h / (nh / nkv). Position j's key for kv head g is k + j * k_row + g * k_head (dk1 floats), then,
 * when k2 is given, k2 + j * k2_row + g * k2_head (dk - dk1 floats; k2_head may be 0: MLA's roped key shared by every
 * head); its value v + j * v_row + g * v_head (dv floats). Strides in floats. */
typedef struct kt_prompt_attend_args {
    int64_t n, nh, nkv, dk, dk1, dv;   /* rows, query heads, kv heads (nh % nkv == 0), key width (dk1 == dk without k2),
                                          value width; dv a multiple of 16 */
    int64_t start;                     /* position of row 0 */
    int64_t window;                    /* 0: every earlier position; w: positions p - w + 1 .. p (sliding window) */
    const float* q;
    int64_t q_row, q_head;
    const float* k;
    int64_t k_row, k_head;
    const float* k2;                   /* NULL: the keys are k's dk floats */
    int64_t k2_row, k2_head;
    const float* v;
    int64_t v_row, v_head;
    const float* sinks;                /* (nh,) per-head sink logits joining each softmax's denominator, or NULL */
    float scale;
    float* out;                        /* (n, nh, dv): out + t * out_row + h * out_head */
    int64_t out_row, out_head;
} kt_prompt_attend_args;

/* out[t, h] = sum_j p_j v_j, p = softmax_j(q[t, h] . key_j * scale) over the positions j the row sees (j <= its
 * position, inside its window), in one job on ctx's pool (or the calling thread when ctx is NULL). Numerics: each
 * dot product in element order as fused multiply-adds, the softmax's sum and the value sums in position order, one
 * division per output: the same bits on every ISA (the baseline copy is the scalar twin), whatever the threads, and
 * a row's result depends only on its own query and the keys and values it sees. Returns -1 for bad arguments
 * (kt_last_error says which). */
int kt_prompt_attend(kt_ctx* ctx, const kt_prompt_attend_args* args);

/* kt_mla_decode's arguments: one MLA layer (DeepSeek-V2/V3, Kimi-K2, GLM-5) for its new rows, every Linear already
 * added to ctx (kt_add_linear*) and kv_b in the absorbed form (ktrun.ops.kernel_linear.AbsorbedKvB). Strides in
 * floats. */
typedef struct kt_mla_decode_args {
    int64_t T, nh, dn, dr, dv, R, q_lora;   /* rows, heads, nope / rope / value head dims, latent rank, q_lora_rank
                                               (0: q_proj straight from x) */
    int64_t q_b_k;                          /* the inputs q_b was added with: q_lora, or more (zeros after q_lora) */
    const float* x; int64_t x_stride;       /* (T, hidden) */
    int32_t q_a_id, kv_a_id, q_b_id, o_id;  /* q_a_proj (q_proj when q_lora is 0), kv_a_proj_with_mqa, q_b_proj
                                               (unused when q_lora is 0), o_proj */
    int32_t uk_id, kv_b_id;                 /* W_uk (nh * R, dn) transposed from kv_b, kv_b itself (W_uv's rows) */
    int64_t uk_group; const float* uk_scale;   /* W_uk's inputs: row group g (uk_group rows) reads q_nope of its head
                                                  times uk_scale[g] (nh * R / uk_group rows of dn) */
    const float* q_a_norm; const float* kv_a_norm; float eps; int32_t lanes;   /* kt_rms_norm's (q_a_norm unused
                                                                                  when q_lora is 0) */
    const float* cos; const float* sin; int64_t cs_stride; int32_t interleaved;   /* RoPE of dr dims, as kt_rope */
    int64_t m; const int64_t* row0; const int64_t* start; const int64_t* table0; const int64_t* tables;
    int64_t block_size;                     /* the requests, as kt_gqa_decode_args */
    float* cache; int64_t block_stride, row_stride;   /* latent rows [c (R) | k_rot (dr)] */
    float scale;
    float* out; int64_t out_stride;         /* (T, o_proj's outputs) */
} kt_mla_decode_args;

/* An MLA layer's new rows in one call, the steps ktrun.models.attention.mla_attention takes for them on the kernels,
 * each with the bits it has there: q_a + kv_a (one Linear job), q_a's norm, q_b's job (while the latent row
 * [norm(c) | rope(k_rot)] of each row is written into its request's cache slot), W_uk's grouped job (while q's rope
 * half is roped), every row's absorbed attention over its causal prefix (kt_mla_attend_batch's job), W_uv's grouped
 * job and o_proj's job. Returns -1 for bad arguments or a Linear's error (kt_last_error says which). */
int kt_mla_decode(kt_ctx* ctx, const kt_mla_decode_args* args);

/* kt_moe_decode's arguments: the second half of a decoder layer for a few rows (decode, a speculative verify), its
 * routed experts (and a fused shared expert) added to ctx (kt_add_layer*). Strides in floats. */
typedef struct kt_moe_decode_args {
    int64_t T, H;
    const float* x; int64_t x_stride;           /* the residual stream before the attention's output is added */
    const float* delta; int64_t delta_stride;   /* the attention's output */
    const float* norm; const float* next_norm; float eps; int32_t lanes;   /* post-attention and next RMSNorm (kt_rms_norm) */
    int32_t router;                             /* 0: kt_route_sigmoid, 1: kt_route_softmax, 2: dense (a dense
                                                   MLP as a one-expert layer: E, top_k, groups 1, gate NULL) */
    const void* gate; int64_t E; const float* bias;    /* (E, H) gate, (E,) correction bias or NULL (sigmoid only) */
    int32_t gate_dtype;                         /* ABI 25: the gate's KT_F32 or KT_BF16 (the routers') */
    int64_t n_group, topk_group, top_k; int32_t renorm; float scaling;
    int32_t layer, shared;                      /* the routed layer's id; the fused shared expert's layer id or -1 */
    int32_t finish;                             /* 1: wait and finish the layer; 0: return with the job in flight */
    float* x_out; float* h_out;                 /* (T, H) contiguous: x + delta + experts, and its next norm (finish
                                                   0: x + delta and its post-attention norm, the job's input) */
    float* e_out;                               /* (T, H) contiguous: the experts' sum (NULL with finish 1: scratch) */
    int64_t* ids; float* weights;               /* (T, top_k) out: the router's choice */
    double wait_s;                              /* out: seconds spent waiting for the experts' job */
} kt_moe_decode_args;

/* A MoE layer's rows in one call, the steps of ktrun.models.model.MoEModel for them on the kernels, each with the bits
 * it has there: s = x + delta, h = norm(s) (kt_rms_norm), the router (kt_route_sigmoid / kt_route_softmax on ctx's
 * pool), the experts' job (kt_submit / kt_submit_shared) into e, x_out = s + e and h_out = next_norm(x_out). With
 * finish 0 it returns once the job is submitted (x_out = s, h_out = h, e_out filled by the job: kt_sync, or the next
 * submit, waits for it), for a caller with more to add to e (a shared expert outside the job). Router 2 (dense): a
 * dense layer's MLP registered as one-expert layer `layer`, no gate: every row's expert 0 at weight 1 (ids 0 and
 * weights 1 written out). Returns -1 for bad arguments (kt_last_error says which). */
int kt_moe_decode(kt_ctx* ctx, kt_moe_decode_args* args);

/* One layer of kt_decode_layers: its attention, a kt_gqa_layer block (attn) or a kt_mla_decode block (mla, attn
 * NULL), on attn_ctx (constants and the layer's caches and window set by the caller; the rows fields, x and out set
 * by the call), then its MoE half's kt_moe_decode block (constants set by the caller, finish 1; T, x, delta, x_out
 * and h_out set by the call) on moe_ctx. */
typedef struct kt_decode_layer {
    kt_ctx* attn_ctx; kt_gqa_layer_args* attn; kt_mla_decode_args* mla;
    kt_ctx* moe_ctx; kt_moe_decode_args* moe;
} kt_decode_layer;

typedef struct kt_decode_layers_args {
    int64_t T, H;                       /* rows, hidden size */
    const float* x; const float* h;     /* (T, H) contiguous: the residual stream and layer 0's normed input */
    const kt_gqa_decode_args* rows;     /* the step's rows as every layer's attention reads them: T, rope_half
                                           (GQA), interleaved, cos, sin, cs_stride, m, row0, start, table0, tables
                                           (the rest of it is ignored) */
    int32_t n_layers; const kt_decode_layer* layers;
    float* x_out; float* h_out;         /* (T, H) contiguous: the residual stream after the last layer and its next
                                           norm (the last kt_moe_decode block's next_norm: the final norm) */
    double attn_s, moe_s, wait_s;       /* out: seconds in the attention calls, in the MoE calls, waiting for experts */
    /* ABI 23: the output head after the last layer (head_kind 0: none), logits (T, head_n) contiguous = h_out W^T:
       head_kind 1: kt_float_linear on head_ctx (NULL: the calling thread; head_w (head_n, H) of head_w_dtype, row stride head_w_stride);
       head_kind 2: the dense Linear head_id of head_ctx (kt_linear_submit + kt_sync; its K is H). The same call the
       caller would make after this one, so the same bits. */
    int32_t head_kind, head_id; kt_ctx* head_ctx; const void* head_w; int32_t head_w_dtype; int64_t head_w_stride;
    int64_t head_n; float* logits;
    double head_s;                      /* out: seconds in the head */
    /* ABI 25: the step's first two steps in the call too. tokens (T) given: x is ignored and x = their rows of embed
       (embed_rows, H) of embed_dtype KT_F32 or KT_BF16 (widened exactly: F.embedding's rows as float32), row stride
       embed_stride elements; a token outside [0, embed_rows) is an error before anything is written. norm0 given: h
       is ignored and h = kt_rms_norm(x, norm0, eps, lanes) (layer 0's input norm). */
    const int64_t* tokens; const void* embed; int32_t embed_dtype; int64_t embed_rows, embed_stride;
    const float* norm0; float eps; int32_t lanes;
    /* ABI 26: a multi-token-prediction block's first steps (DeepSeek-V3's MTP layer, ktrun.mtp), with tokens:
       mtp_hidden (T, H) float32 contiguous given, the embedding rows e become x = eh_proj([enorm(e) | hnorm(hidden)]):
       each half kt_rms_norm(eps, lanes) into a (T, 2H) row, then the dense Linear mtp_eh_id of mtp_ctx (K = 2H,
       N = H; kt_linear_submit + kt_sync), before norm0 takes x. The calls ktrun.mtp.MtpHead.forward_batch makes,
       so the same bits. head_rows (head_T of them, each in [0, T)) given: the head runs on those rows of h_out
       alone, in that order, logits (head_T, head_n) (a drafter wants each request's last row only). */
    const float* mtp_hidden; const float* mtp_enorm; const float* mtp_hnorm; kt_ctx* mtp_ctx; int32_t mtp_eh_id;
    const int64_t* head_rows; int64_t head_T;
} kt_decode_layers_args;

/* A decode step's decoder layers in one call: for each layer delta = kt_gqa_layer(h) or kt_mla_decode(h), then
 * (x, h) = kt_moe_decode(x, delta), the calls the model makes one after another (the same bits), without returning
 * to the caller between them. Returns -1 for bad arguments or a failing layer (kt_last_error names the layer). */
int kt_decode_layers(kt_decode_layers_args* args);

/* The softmax router (DeepSeek-V2 greedy / group_limited_greedy, Qwen3-MoE, Mixtral) for T tokens x (T, K) float32
 * (row t at x + t * x_stride) and the gate w (E, K) (row stride w_stride) of w_dtype KT_F32 or KT_BF16, on the
 * calling thread (a large gate's logits on ctx's pool, as kt_route_sigmoid): scores = softmax(x W^T); with
 * topk_group < n_group only the topk_group groups of the best single score keep theirs (the others become 0); ids =
 * the top_k best scores (best first, ties to the lower index); weights = their scores, normalized to sum 1 when
 * norm, times scaling. ids (T, top_k) int64, weights (T, top_k) float32. Logits in float_dots' fixed order: the same
 * bits on every ISA, whatever T. Returns -1 for bad arguments. */
int kt_route_softmax(kt_ctx* ctx, int64_t T, int64_t E, int64_t K, const float* x, int64_t x_stride, const void* w,
                     int w_dtype, int64_t w_stride, int64_t n_group, int64_t topk_group, int64_t top_k, int norm,
                     float scaling, int64_t* ids, float* weights);

/* y = x W^T for T float32 rows x (T, K) (row t at x + t * x_stride) and N weight rows W (N, K) (row n at
 * w + n * w_stride elements) of w_dtype KT_F32 or KT_BF16 (widened exactly), into y (T, N) (row t at y + t * y_stride),
 * K a multiple of 16. On ctx's pool (W's rows split between its workers) when W has 2^18 elements or more, else on
 * the calling thread (ctx may be NULL). Each output in float_dots' fixed order: the same bits on every ISA, whatever
 * T, the rows around it or the thread count. Returns -1 for bad arguments. */
int kt_float_linear(kt_ctx* ctx, int64_t T, int64_t N, int64_t K, const float* x, int64_t x_stride, const void* w,
                    int w_dtype, int64_t w_stride, float* y, int64_t y_stride);

/* ktconvert's importance-weighted scale search (ktconvert/scale_search.py, search_scales; kernels/src/scale_search.cpp)
 * for R groups of L floats on the calling thread: group r is x + r * x_stride; its weights w + (r % w_rows) * L
 * (w NULL: uniform); `bits`-bit signed codes; trial scales peak / divisors[d] (n_div of them); the chosen scale is
 * rounded to scale_dtype (KT_F32, KT_BF16 or KT_F16), refit `refine` times, floored by the plain rule. Out: scales
 * (R,) float32, codes (R, L) int8 in [-2^(bits-1), 2^(bits-1) - 1]. Returns -1 for bad arguments. */
int kt_search_scales(int64_t R, int64_t L, const float* x, int64_t x_stride, const float* w, int64_t w_rows, int bits,
                     int scale_dtype, const float* divisors, int n_div, int refine, float* scales, int8_t* codes);

/* One block of ktconvert's GPTQ column loop (ktconvert/gpu/gptq.py, _quantize_columns; kernels/src/gptq_block.cpp) on
 * the calling thread: rows i = 0 .. B-1 of the transposed weight w (B, N) (row i at w + i * w_stride; read, not
 * written), u the block's (B, B) part of the upper Cholesky factor of H^-1 (row i at u + i * u_stride). Every `group`
 * rows a scale row: with search != 0 searched as kt_search_scales does (groups of the rows as updated, weighted by
 * hdiag (B,), the block's diag(H); divisors, refine, scale_dtype as there) and written to scales + (i / group) *
 * s_stride, else read from there. Each column's error updates the later rows: w_r = w_r - (u_ir e), rounded twice.
 * Out: codes (B, N) uint8 (c = clamp(rint(w / s) + 2^(bits-1), 0, 2^bits - 1)) and err (B, N) float32 (the column
 * errors (w - (c - Z) s) / u_ii the caller applies to the later rows). Returns -1 for bad arguments. */
int kt_gptq_block(int64_t B, int64_t N, const float* w, int64_t w_stride, const float* u, int64_t u_stride,
                  int64_t group, int search, const float* hdiag, int bits, int scale_dtype, const float* divisors,
                  int n_div, int refine, float* scales, int64_t s_stride, uint8_t* codes, int64_t codes_stride,
                  float* err, int64_t err_stride);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif
#endif
