// kt_gqa_decode: a GQA layer's new rows after their q / k / v projections, in one call (ktrun.models.attention's
// decode path for Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2, ...):
//   q_t, k_t = rope(norm(q_t)), rope(norm(k_t))       on the calling thread: kt_rms_norm's and kt_rope's bits
//   cache[request, position] = k_t, v_t               the request's paged cache, through its block table
//   out_t = attention(q_t, positions <= p_t)          kt_gqa_attend_batch's job (GqaAttendBatch), on the pool
// Why: per layer the same work was ~10 torch ops and 4 library calls with Python between them (the norms, RoPE, the
// cache write's slicing, each row's cache runs turned into pointer lists): ~170 us of a Qwen3-shaped layer's 530 us
// of attention at decode, on a 2-core machine, while the pool waited. Here it is one ctypes call.
//
// kt_gqa_layer adds the layer's Linears around it, the sequence ktrun.models.attention.gqa_attention runs for decode
// rows on the kernels: [q + k + v] one Linear job on x, each bias added after it; kt_gqa_decode's steps; [o_proj]
// into out, its bias added. Why: those were three library calls and ~20 Python frames, ctypes argument blocks and
// output tensors per layer, ~250 us of a Qwen3-30B-A3B-shaped layer's ~700 us of attention on a 2-core Zen 3 while
// the pool waited (docs/decode-step.md).
//
// Numerics: the same float32 operations as the separate calls (the norm and RoPE are those functions; the attention
// is GqaAttendBatch over the same positions in the same order), so every row keeps the bits of its token decoded
// alone, on every ISA and any split (tests/test_kernels_gqa_decode.py checks them against the separate calls).
#include <algorithm>
#include <cstring>

#include "../include/ktkernels.h"
#include "context.h"
#include "mla_attend.h"

namespace kt {

namespace {

// Norm (mode 1: each of `heads` heads of hd floats, mode 2: the whole row) then RoPE of one row x (heads, hd) into
// dst (heads, hd contiguous); scratch holds the normed row.
void norm_rope_row(const kt_gqa_decode_args& a, int64_t t, int64_t heads, const float* x, const float* norm_w,
                   std::vector<float>& scratch, float* dst) {
    const int64_t hd = a.hd, n = heads * hd;
    const float* src = x;
    if (a.norm) {
        scratch.resize((size_t)n);
        const int64_t rows = a.norm == 1 ? heads : 1, d = a.norm == 1 ? hd : n;   // per head, or the whole row
        kt_rms_norm(rows, d, x, d, nullptr, 0, nullptr, 0, norm_w, a.eps, a.lanes, scratch.data(), d);
        src = scratch.data();
    }
    if (a.rope_half == 0) {
        if (dst != src) std::memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    kt_rope(1, heads, a.rope_half, src, n, hd, a.cos + t * a.cs_stride, a.sin + t * a.cs_stride, a.cs_stride,
            a.interleaved, dst, n, hd);
    const int64_t rot = 2 * a.rope_half;
    if (rot < hd)   // partial rotary: the other dims pass through
        for (int64_t h = 0; h < heads; ++h)
            std::memcpy(dst + h * hd + rot, src + h * hd + rot, (size_t)(hd - rot) * sizeof(float));
}

}  // namespace

bool GqaDecode::set(const kt_gqa_decode_args& a, const char** why) {
    *why = "bad geometry (nh, nkv, hd, vd, T, m)";
    if (a.nh < 1 || a.nkv < 1 || a.nh % a.nkv || a.hd < 16 || a.hd % 16 || a.vd < 16 || a.vd % 16 || a.T < 1 ||
        a.m < 1 || a.m > a.T)
        return false;
    *why = "missing q / k / v / out / request arrays";
    if (!a.q || !a.k || !a.v || !a.out || !a.row0 || !a.start || !a.table0 || !a.tables || !a.k_cache || !a.v_cache)
        return false;
    *why = "bad norm (mode, lanes, weights)";
    if (a.norm < 0 || a.norm > 2 || (a.norm && ((a.lanes != 8 && a.lanes != 16) || !a.q_norm || !a.k_norm ||
                                                a.hd < a.lanes)))
        return false;
    *why = "bad rope (rope_half, cos, sin)";
    if (a.rope_half < 0 || 2 * a.rope_half > a.hd || (a.rope_half && (!a.cos || !a.sin)))
        return false;
    *why = "bad strides or block size";
    if (a.q_stride < a.nh * a.hd || a.k_stride < a.nkv * a.hd || a.v_stride < a.nkv * a.vd ||
        a.out_stride < a.nh * a.vd || a.block_size < 1 || a.k_row_stride < a.nkv * a.hd ||
        a.v_row_stride < a.nkv * a.vd || a.window < 0)
        return false;
    *why = "bad request rows (row0 must run from 0 to T, each request at least one row)";
    if (!request_rows_ok(a.m, a.T, a.row0, a.start)) return false;
    auto k_row = [&](int64_t r, int64_t p) {
        return paged_row(a.k_cache, a.tables, a.table0, r, p, a.block_size, a.k_block_stride, a.k_row_stride);
    };
    auto v_row = [&](int64_t r, int64_t p) {
        return paged_row(a.v_cache, a.tables, a.table0, r, p, a.block_size, a.v_block_stride, a.v_row_stride);
    };

    // q: normed and roped into q_ready; k: straight into its cache slot; v: copied there
    q_ready.resize((size_t)(a.T * a.nh * a.hd));
    for (int64_t r = 0; r < a.m; ++r)
        for (int64_t t = a.row0[r]; t < a.row0[r + 1]; ++t) {
            const int64_t p = a.start[r] + (t - a.row0[r]);
            norm_rope_row(a, t, a.nh, a.q + t * a.q_stride, a.q_norm, normed, q_ready.data() + t * a.nh * a.hd);
            norm_rope_row(a, t, a.nkv, a.k + t * a.k_stride, a.k_norm, normed, k_row(r, p));
            std::memcpy(v_row(r, p), a.v + t * a.v_stride, (size_t)(a.nkv * a.vd) * sizeof(float));
        }
    // each row's positions, in order: [max(0, p - window + 1), p]
    attend.krows.clear();
    attend.vrows.clear();
    attend.first_row.assign((size_t)a.T + 1, 0);
    for (int64_t r = 0; r < a.m; ++r)
        for (int64_t t = a.row0[r]; t < a.row0[r + 1]; ++t) {
            const int64_t p = a.start[r] + (t - a.row0[r]);
            for (int64_t j = a.window ? std::max<int64_t>(0, p - a.window + 1) : 0; j <= p; ++j) {
                attend.krows.push_back(k_row(r, j));
                attend.vrows.push_back(v_row(r, j));
            }
            attend.first_row[t + 1] = (int64_t)attend.krows.size();
        }
    *why = "bad attention arguments";
    return attend.set_filled(a.T, a.nkv, a.nh / a.nkv, a.hd, a.vd, q_ready.data(), a.nh * a.hd, a.hd, a.scale, a.out,
                             a.out_stride, a.vd);
}

namespace {

// rows (T, n) with row stride ld: y += b (torch's y + b: one float32 add per element)
void add_bias(float* y, int64_t T, int64_t n, int64_t ld, const float* b) {
    if (!b) return;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < n; ++j) y[t * ld + j] += b[j];
}

}  // namespace

bool GqaDecode::run_layer(kt_ctx* ctx, const kt_gqa_layer_args& a, const char** why) {
    const kt_gqa_decode_args& g = a.attn;
    *why = "bad geometry (T, nh, nkv, hd, vd)";
    if (g.T < 1 || g.T > (1 << 20) || g.nh < 1 || g.nkv < 1 || g.hd < 16 || g.vd < 16) return false;
    *why = "missing x / out, or out_stride < n_out";
    if (!a.x || !a.out || a.n_out < 1 || a.out_stride < a.n_out) return false;
    LinearEngine& lin = ctx->linear;
    const int64_t nq = g.nh * g.hd, nk = g.nkv * g.hd, nv = g.nkv * g.vd, no = g.nh * g.vd;
    const Linear *lq = lin.find(a.q_id), *lk = lin.find(a.k_id), *lv = lin.find(a.v_id), *lo = lin.find(a.o_id);
    *why = "a q / k / v / o Linear id was not added";
    if (!lq || !lk || !lv || !lo) return false;
    *why = "Linear shapes do not match the heads (q N = nh * hd, k N = nkv * hd, v N = nkv * vd, o K = nh * vd, "
           "o N = n_out)";
    if (lq->n != nq || lk->n != nk || lv->n != nv || lo->k != no || lo->n != a.n_out) return false;
    const int T = (int)g.T;
    q.resize((size_t)(T * nq));
    k.resize((size_t)(T * nk));
    v.resize((size_t)(T * nv));
    o.resize((size_t)(T * no));
    const int ids[3] = {a.q_id, a.k_id, a.v_id};
    float* outs[3] = {q.data(), k.data(), v.data()};
    const int64_t strides[3] = {nq, nk, nv};
    lin.submit(3, ids, T, a.x, KT_F32, a.x_stride, outs, strides);   // throws for K / group mismatches
    lin.sync();
    add_bias(q.data(), T, nq, nq, a.q_bias);
    add_bias(k.data(), T, nk, nk, a.k_bias);
    add_bias(v.data(), T, nv, nv, a.v_bias);
    kt_gqa_decode_args d = g;
    d.q = q.data(); d.q_stride = nq;
    d.k = k.data(); d.k_stride = nk;
    d.v = v.data(); d.v_stride = nv;
    d.out = o.data(); d.out_stride = no;
    if (!set(d, why)) return false;
    ThreadPool& pool = ctx->engine.pool();
    pool.launch([this](const WorkerInfo& w) { run(w.index, w.n_threads); });
    pool.wait();
    const int op[1] = {a.o_id};
    float* oo[1] = {a.out};
    const int64_t os[1] = {a.out_stride};
    lin.submit(1, op, T, o.data(), KT_F32, no, oo, os);
    lin.sync();
    add_bias(a.out, T, a.n_out, a.out_stride, a.o_bias);
    return true;
}

bool request_rows_ok(int64_t m, int64_t T, const int64_t* row0, const int64_t* start) {
    if (row0[0] != 0 || row0[m] != T) return false;
    for (int64_t r = 0; r < m; ++r)
        if (row0[r + 1] <= row0[r] || start[r] < 0) return false;
    return true;
}

}  // namespace kt
