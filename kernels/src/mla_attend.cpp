// kt_mla_attend: the core of MLA's absorbed decode attention for one query row per head over one request's latent
// cache (ktrun.models.attention, the absorbed form), on the context's pool (heads split) or the calling thread:
//   s[h, j]   = (q_lat[h] . c_j[:R] + q_rot[h] . c_j[R:R+dr]) * scale        (h < nh, j < S: every cached position)
//   p[h, :]   = softmax_j(s[h, :])
//   out[h, :] = sum_j p[h, j] c_j[:R]                                          (in position order)
// Why not torch: per MLA layer a decode step ran this as two small MKL GEMMs (128 x 576 x S and 128 x S x 512) plus
// a softmax, scale, cat, transpose and copy, ~300 us per layer with caches cold from the jobs around it, while the
// kernel pool waited; here it is one call (61 us on 2 threads for 128 heads x 33 positions).
//
// Numerics: one fixed order whatever the ISA. Every dot product keeps 16 lane sums (lane l adds the products of
// elements l, l+16, ... in order as fused multiply-adds: std::fma per lane in the baseline copy, the FMA
// instructions in the others; nothing else is contracted, see CMakeLists.txt) and ends with a fixed pairwise
// reduction of the lanes; the softmax's sum and the value sums run in position order. The body
// (mla_attend_body.inc: 16 floats per vector, vec16_native.inc's GCC vector type on AVX-512 and the baseline ISA,
// vec16_avx2.inc's two 256-bit halves on AVX2) is compiled three times, chosen once with the kernels' backend (isa()
// below); the same elementwise IEEE operations in the same order give the same bits in each: the baseline one is the
// scalar twin. Each copy has its own tiles (register budgets), which change no sum's order. The AVX2 copy on GCC's
// 64-byte vectors kept every vector in memory: AMD Zen 3, one thread, 128 heads x 512 positions 25.4 -> 2.2 ms,
// a 4096 x 2048 bf16 head for one token 11.5 -> 0.5 ms (1.5 GB/s: widening lane by lane) on the halves. Results depend
// only on the request's own query row and cache, not on the batch, the runs the cache is split into, the other heads
// or the thread count. float_dots (the router's logits, router.cpp) is the scores' dot product on its own.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <immintrin.h>
#include <string>
#include <vector>

#include "../include/ktkernels.h"
#include "cpu_features.h"
#include "mla_attend.h"

namespace {

namespace ref {
#include "vec16_native.inc"
constexpr int kLinRows = 4, kLinTokens = 4, kLinRowsOne = 8;   // a float Linear's tiles (mla_attend_body.inc linear_rows)
constexpr int kScoreHeads = 8, kValueHeads = 2, kValueVecs = 8;   // the attention's tiles (mla_attend_body.inc)
constexpr bool kScoreTile16 = false;   // the scalar twin scores one position at a time (the same bits)
constexpr int kPromptVecs = 1, kPromptKeys = 4, kPromptCols = 4;   // prompt_attend_body.inc's
inline v16 madd(v16 a, v16 b, v16 c) {
    for (int l = 0; l < 16; ++l) c[l] = std::fma(a[l], b[l], c[l]);
    return c;
}
#include "mla_attend_body.inc"
#include "prompt_attend_body.inc"
#include "silu_body.inc"
}  // namespace ref

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "vec16_avx2.inc"
// 16 ymm registers: a float Linear's 1 weight row x 4 tokens, 8 accumulators of one ymm pair each and the widened
// weight vector, the tokens' vectors read as the FMAs' memory operands (each widened bf16 weight used 4 times: 2 x 2
// widened each twice and loaded the tokens into registers, a bf16 head at 4 / 16 rows 150 / 555 -> 104-125 /
// 407-444 us on 2 Zen 3 cores); one token: 4 weight rows; the scores' 4 heads, 8 accumulators and the cache row's
// vector; the values' 2 heads x 3 vectors, 12 accumulators
constexpr int kLinRows = 1, kLinTokens = 4, kLinRowsOne = 4;
constexpr int kScoreHeads = 4, kValueHeads = 2, kValueVecs = 3;
constexpr bool kScoreTile16 = false;   // 16 accumulators of two ymm each would spill
// a prompt's 16 rows x 4 keys (8 ymm accumulators, the rows' 2 halves, the broadcast key); 16 rows x 4 value columns
constexpr int kPromptVecs = 1, kPromptKeys = 4, kPromptCols = 4;
inline v16 madd(v16 a, v16 b, v16 c) {
    return {(v8)_mm256_fmadd_ps((__m256)a.a, (__m256)b.a, (__m256)c.a),
            (v8)_mm256_fmadd_ps((__m256)a.b, (__m256)b.b, (__m256)c.b)};
}
#include "mla_attend_body.inc"
#include "prompt_attend_body.inc"
#include "silu_body.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {
#define KT_VEC16_AVX512 1   // vec16_native.inc: AVX-512 intrinsics where the generic code compiles badly
#include "vec16_native.inc"
#undef KT_VEC16_AVX512
constexpr int kLinRows = 4, kLinTokens = 4, kLinRowsOne = 8;   // 16 accumulators, 4 token vectors and a weight vector: 21 of 32 zmm
// values: 4 heads x 4 vectors (64 columns) a pass, 16 accumulators: each value vector loaded feeds 4 FMAs (2 x 8: 2),
// 8 loads and broadcasts per 16 FMAs (10). Intel Xeon (2 vCPUs), alternated: a Qwen3-shaped GQA row at 2048 positions
// 0.50 -> 0.42 ms (caches cold: 0.62 -> 0.55), a DeepSeek-V3-shaped MLA row (128 heads, R 512) 5.38 -> 4.32 ms; 8 x 2
// no better than 4 x 4. Each output's sum is the same whatever the tile.
constexpr int kScoreHeads = 8, kValueHeads = 4, kValueVecs = 4;   // 8 chains; 16 accumulators
constexpr bool kScoreTile16 = true;    // scores_tile: 16 accumulators, the query vectors and a cache row's: 25 of 32 zmm
// a prompt's 32 rows x 8 keys, 16 accumulators (each broadcast key element feeds 2 FMAs); 32 rows x 8 value columns
constexpr int kPromptVecs = 2, kPromptKeys = 8, kPromptCols = 8;
inline v16 madd(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#include "mla_attend_body.inc"
#include "prompt_attend_body.inc"
#include "silu_body.inc"
}  // namespace avx512
#pragma GCC pop_options

// the copy for the kernels' backend: kt::vector_isa() (cpu_features.h), also the tests' way to run the twins
int isa() { return kt::vector_isa(); }

using AttendFn = decltype(&ref::attend);
using AttendKvFn = decltype(&ref::attend_kv);
using DotsFn = decltype(&ref::dots);
const AttendFn kAttend[3] = {ref::attend, avx2::attend, avx512::attend};
const AttendKvFn kAttendKv[3] = {ref::attend_kv, avx2::attend_kv, avx512::attend_kv};
const DotsFn kDots[3] = {ref::dots, avx2::dots, avx512::dots};
using PartialFn = decltype(&ref::attend_partial);
using PartialKvFn = decltype(&ref::attend_kv_partial);
using MergeFn = decltype(&ref::merge_partials);
const PartialFn kPartial[3] = {ref::attend_partial, avx2::attend_partial, avx512::attend_partial};
const PartialKvFn kPartialKv[3] = {ref::attend_kv_partial, avx2::attend_kv_partial, avx512::attend_kv_partial};
const MergeFn kMerge[3] = {ref::merge_partials, avx2::merge_partials, avx512::merge_partials};
using LinearF32Fn = decltype(&ref::linear_rows<float>);
using LinearBf16Fn = decltype(&ref::linear_rows<uint16_t>);
const LinearF32Fn kLinearF32[3] = {ref::linear_rows<float>, avx2::linear_rows<float>, avx512::linear_rows<float>};
const LinearBf16Fn kLinearBf16[3] = {ref::linear_rows<uint16_t>, avx2::linear_rows<uint16_t>,
                                     avx512::linear_rows<uint16_t>};

using PromptRowsFn = decltype(&ref::prompt_rows);
const PromptRowsFn kPromptRows[3] = {ref::prompt_rows, avx2::prompt_rows, avx512::prompt_rows};
using SiluMulFn = decltype(&ref::silu_mul);
const SiluMulFn kSiluMul[3] = {ref::silu_mul, avx2::silu_mul, avx512::silu_mul};

constexpr int64_t kHeadBlock = 8;   // heads split between workers in blocks of the body's head tile

// The n chunks of one group (`heads` heads, weighted rows of `width`) on the calling thread, in order, merged into out
// (rows out_stride apart): chunk(c, o, m, l) writes chunk c's partial into the slots ChunkPlan lays out the same way,
// so the bits of the batch job's split
template <class Chunk>
void chunks_in_order(int64_t n, int64_t heads, int64_t width, Chunk chunk, float* out, int64_t out_stride) {
    thread_local std::vector<float> pm, pl, po, w;
    pm.resize((size_t)(n * heads));
    pl.resize((size_t)(n * heads));
    po.resize((size_t)(n * heads * width));
    w.resize((size_t)n);
    for (int64_t c = 0; c < n; ++c)
        chunk(c, po.data() + c * heads * width, pm.data() + c * heads, pl.data() + c * heads);
    kMerge[isa()](heads, width, n, pm.data(), pl.data(), heads, po.data(), heads * width, out, out_stride, w.data());
}

}  // namespace

namespace kt {

bool MlaAttend::set(int64_t nh_, int64_t R_, int64_t dr_, const float* q_lat_, int64_t q_lat_stride_,
                    const float* q_rot_, int64_t q_rot_stride_, float scale_, int64_t n_runs, const float* const* runs,
                    const int64_t* run_len, int64_t row_stride, float* out_, int64_t out_stride_) {
    if (nh_ < 1 || R_ < 16 || R_ % 16 || dr_ < 0 || dr_ % 16 || n_runs < 1 || !q_lat_ || (dr_ && !q_rot_) || !runs ||
        !run_len || !out_ || row_stride < R_ + dr_)
        return false;
    int64_t n = 0;
    for (int64_t r = 0; r < n_runs; ++r) {
        if (run_len[r] < 0 || (run_len[r] && !runs[r])) return false;
        n += run_len[r];
    }
    if (n < 1) return false;
    rows.resize((size_t)n);
    for (int64_t r = 0, j = 0; r < n_runs; ++r)
        for (int64_t i = 0; i < run_len[r]; ++i) rows[j++] = runs[r] + i * row_stride;
    nh = nh_; R = R_; dr = dr_; S = n; q_lat = q_lat_; q_lat_stride = q_lat_stride_; q_rot = q_rot_;
    q_rot_stride = q_rot_stride_; scale = scale_; out = out_; out_stride = out_stride_;
    return true;
}

void MlaAttend::run(int index, int n) const {
    const int64_t blocks = (nh + kHeadBlock - 1) / kHeadBlock;
    heads(std::min(nh, blocks * index / n * kHeadBlock), std::min(nh, blocks * (index + 1) / n * kHeadBlock));
}

void MlaAttend::heads(int64_t h0, int64_t h1) const {
    if (h1 <= h0) return;
    const int64_t nb = h1 - h0, n = attend_chunks(S);
    float* dst = out + h0 * out_stride;
    if (n == 1) {
        thread_local std::vector<float> s;
        if (s.size() < (size_t)(nb * S)) s.resize((size_t)(nb * S));
        kAttend[isa()](nb, R, dr, q_lat + h0 * q_lat_stride, q_lat_stride, q_rot + h0 * q_rot_stride, q_rot_stride,
                       scale, rows.data(), S, dst, out_stride, s.data());
        return;
    }
    chunks_in_order(n, nb, R, [&](int64_t c, float* o, float* m, float* l) { chunk(h0, h1, c, o, m, l); }, dst,
                    out_stride);
}

void MlaAttend::chunk(int64_t h0, int64_t h1, int64_t c, float* o, float* m, float* l) const {
    const int64_t j0 = c * kAttendChunk, Sc = std::min(S, j0 + kAttendChunk) - j0;
    thread_local std::vector<float> s;
    if (s.size() < (size_t)((h1 - h0) * Sc)) s.resize((size_t)((h1 - h0) * Sc));
    kPartial[isa()](h1 - h0, R, dr, q_lat + h0 * q_lat_stride, q_lat_stride, q_rot + h0 * q_rot_stride, q_rot_stride,
                    scale, rows.data() + j0, Sc, o, R, m, l, s.data());
}

void ChunkPlan::merge(int64_t g, int64_t nh, float* out, int64_t out_stride) const {
    thread_local std::vector<float> w;
    w.resize((size_t)chunks(g));
    kMerge[isa()](nh, width, chunks(g), m(g, 0), l(g, 0), heads, o(g, 0), heads * width, out, out_stride, w.data());
}

bool MlaAttendBatch::set(int64_t m, int64_t nh, int64_t R, int64_t dr, const float* q_lat, int64_t q_lat_req_stride,
                         int64_t q_lat_stride, const float* q_rot, int64_t q_rot_req_stride, int64_t q_rot_stride,
                         float scale, const int64_t* req_n_runs, const float* const* runs, const int64_t* run_len,
                         int64_t row_stride, float* out, int64_t out_req_stride, int64_t out_stride) {
    if (m < 1 || nh < 1 || !req_n_runs || !runs || !run_len) return false;
    if ((int64_t)reqs.size() < m) reqs.resize((size_t)m);
    first_block.assign((size_t)m + 1, 0);
    const int64_t blocks = (nh + kHeadBlock - 1) / kHeadBlock;
    for (int64_t i = 0, r = 0; i < m; r += req_n_runs[i], ++i) {
        if (req_n_runs[i] < 1) return false;
        if (!reqs[i].set(nh, R, dr, q_lat + i * q_lat_req_stride, q_lat_stride,
                         q_rot ? q_rot + i * q_rot_req_stride : nullptr, q_rot_stride, scale, req_n_runs[i],
                         runs + r, run_len + r, row_stride, out + i * out_req_stride, out_stride))
            return false;
        first_block[i + 1] = first_block[i] + blocks;
    }
    first_block.resize((size_t)m + 1);
    chunks.plan(first_block[m], kHeadBlock, R, [&](int64_t g) { return reqs[(size_t)(g / blocks)].S; });
    return true;
}

void MlaAttendBatch::run(int index, int n) const {
    int64_t t0, t1;
    chunks.items(index, n, &t0, &t1);
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = chunks.group_of(t), c = t - chunks.first_item[g];
        const int64_t i = std::upper_bound(first_block.begin(), first_block.end(), g) - first_block.begin() - 1;
        const MlaAttend& req = reqs[(size_t)i];
        const int64_t h0 = (g - first_block[i]) * kHeadBlock, h1 = std::min(req.nh, h0 + kHeadBlock);
        if (chunks.chunks(g) == 1) {
            req.heads(h0, h1);
        } else {
            req.chunk(h0, h1, c, chunks.o(g, c), chunks.m(g, c), chunks.l(g, c));
            if (chunks.last(g)) chunks.merge(g, h1 - h0, req.out + h0 * req.out_stride, req.out_stride);
        }
    }
}

bool GqaAttendBatch::set(int64_t m_, int64_t nkv_, int64_t rep_, int64_t hd_, int64_t vd_, const float* q_,
                         int64_t q_entry_stride_, int64_t q_head_stride_, float scale_, const int64_t* entry_n_runs,
                         const float* const* k_runs, const float* const* v_runs, const int64_t* run_len,
                         int64_t k_row_stride, int64_t v_row_stride, float* out_, int64_t out_entry_stride_,
                         int64_t out_head_stride_) {
    if (m_ < 1 || nkv_ < 1 || rep_ < 1 || hd_ < 16 || hd_ % 16 || vd_ < 16 || vd_ % 16 || !q_ || !out_ ||
        !entry_n_runs || !k_runs || !v_runs || !run_len || q_head_stride_ < hd_ || out_head_stride_ < vd_ ||
        k_row_stride < nkv_ * hd_ || v_row_stride < nkv_ * vd_)
        return false;
    krows.clear();
    vrows.clear();
    first_row.assign((size_t)m_ + 1, 0);
    for (int64_t e = 0, r = 0; e < m_; ++e) {
        if (entry_n_runs[e] < 1) return false;
        for (int64_t end = r + entry_n_runs[e]; r < end; ++r) {
            if (run_len[r] < 0 || (run_len[r] && (!k_runs[r] || !v_runs[r]))) return false;
            for (int64_t i = 0; i < run_len[r]; ++i) {
                krows.push_back(k_runs[r] + i * k_row_stride);
                vrows.push_back(v_runs[r] + i * v_row_stride);
            }
        }
        first_row[e + 1] = (int64_t)krows.size();
        if (first_row[e + 1] == first_row[e]) return false;   // an entry sees at least its own position
    }
    return set_filled(m_, nkv_, rep_, hd_, vd_, q_, q_entry_stride_, q_head_stride_, scale_, out_, out_entry_stride_,
                      out_head_stride_);
}

bool GqaAttendBatch::set_filled(int64_t m_, int64_t nkv_, int64_t rep_, int64_t hd_, int64_t vd_, const float* q_,
                                int64_t q_entry_stride_, int64_t q_head_stride_, float scale_, float* out_,
                                int64_t out_entry_stride_, int64_t out_head_stride_) {
    if (m_ < 1 || nkv_ < 1 || rep_ < 1 || hd_ < 16 || hd_ % 16 || vd_ < 16 || vd_ % 16 || !q_ || !out_ ||
        q_head_stride_ < hd_ || out_head_stride_ < vd_ || (int64_t)first_row.size() != m_ + 1)
        return false;
    for (int64_t e = 0; e < m_; ++e)
        if (first_row[e + 1] <= first_row[e]) return false;   // an entry sees at least its own position
    m = m_; nkv = nkv_; rep = rep_; hd = hd_; vd = vd_; q = q_; q_entry_stride = q_entry_stride_;
    q_head_stride = q_head_stride_; scale = scale_; out = out_; out_entry_stride = out_entry_stride_;
    out_head_stride = out_head_stride_;
    chunks.plan(m * nkv, rep, vd, [&](int64_t g) { return first_row[g / nkv + 1] - first_row[g / nkv]; });
    return true;
}

void GqaAttendBatch::run(int index, int n) const {
    int64_t t0, t1;
    chunks.items(index, n, &t0, &t1);
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = chunks.group_of(t), c = t - chunks.first_item[g], e = g / nkv, kv = g % nkv;
        if (chunks.chunks(g) == 1) {
            pair(e, kv);
        } else {
            chunk(e, kv, c, chunks.o(g, c), chunks.m(g, c), chunks.l(g, c));
            if (chunks.last(g))
                chunks.merge(g, rep, out + e * out_entry_stride + kv * rep * out_head_stride, out_head_stride);
        }
    }
}

void GqaAttendBatch::pair(int64_t e, int64_t g) const {
    const int64_t r0 = first_row[e], S = first_row[e + 1] - r0, n = attend_chunks(S), h0 = g * rep;
    float* dst = out + e * out_entry_stride + h0 * out_head_stride;
    if (n > 1) {
        chunks_in_order(n, rep, vd, [&](int64_t c, float* o, float* m_, float* l) { chunk(e, g, c, o, m_, l); }, dst,
                        out_head_stride);
        return;
    }
    thread_local std::vector<const float*> kr, vr;
    thread_local std::vector<float> s;
    kr.resize((size_t)S);
    vr.resize((size_t)S);
    if (s.size() < (size_t)(rep * S)) s.resize((size_t)(rep * S));
    for (int64_t j = 0; j < S; ++j) {   // kv head g's slice of each position's row
        kr[j] = krows[r0 + j] + g * hd;
        vr[j] = vrows[r0 + j] + g * vd;
    }
    kAttendKv[isa()](rep, hd, vd, q + e * q_entry_stride + h0 * q_head_stride, q_head_stride, scale, kr.data(),
                     vr.data(), S, dst, out_head_stride, s.data());
}

void GqaAttendBatch::chunk(int64_t e, int64_t g, int64_t c, float* o, float* m_, float* l) const {
    const int64_t r0 = first_row[e], S = first_row[e + 1] - r0;
    const int64_t j0 = c * kAttendChunk, Sc = std::min(S, j0 + kAttendChunk) - j0, h0 = g * rep;
    thread_local std::vector<const float*> kr, vr;
    thread_local std::vector<float> s;
    kr.resize((size_t)Sc);
    vr.resize((size_t)Sc);
    if (s.size() < (size_t)(rep * Sc)) s.resize((size_t)(rep * Sc));
    for (int64_t j = 0; j < Sc; ++j) {
        kr[j] = krows[r0 + j0 + j] + g * hd;
        vr[j] = vrows[r0 + j0 + j] + g * vd;
    }
    kPartialKv[isa()](rep, hd, vd, q + e * q_entry_stride + h0 * q_head_stride, q_head_stride, scale, kr.data(),
                      vr.data(), Sc, o, vd, m_, l, s.data());
}

void float_dots(int64_t n, int64_t K, const float* a, int64_t a_stride, const float* const* rows, int64_t S,
                float scale, float* out) {
    kDots[isa()](n, K, a, a_stride, rows, S, scale, out);
}

void float_linear_rows(int64_t n0, int64_t n1, int64_t K, const void* w, bool w_bf16, int64_t w_stride,
                       const float* x, int64_t x_stride, int64_t T, float* y, int64_t y_stride) {
    if (w_bf16)
        kLinearBf16[isa()](n0, n1, K, (const uint16_t*)w, w_stride, x, x_stride, T, y, y_stride);
    else
        kLinearF32[isa()](n0, n1, K, (const float*)w, w_stride, x, x_stride, T, y, y_stride);
}

}  // namespace kt

namespace kt {

void prompt_attend_rows(const PromptGeom& a, int64_t g, int64_t r0, int64_t r1) { kPromptRows[isa()](a, g, r0, r1); }

void silu_mul(int64_t n, const float* g, const float* u, float* h) { kSiluMul[isa()](n, g, u, h); }

}  // namespace kt
