// kt_mla_decode: an MLA layer's new rows (decode, a speculative verify) in one call, from x to o_proj's output: the
// sequence ktrun.models.attention.mla_attention runs for them on the kernels (the absorbed form, kv_b on the Linear
// op), with the same Linear jobs, the same glue functions and the same attention job, so every output and cache slot
// keeps its bits (tests/test_kernels_mla_decode.py compares them with that path):
//   [q_a + kv_a]          one Linear job on x (q_lora 0: q_proj's job, then kv_a's)
//   q_resid = norm(q_a)   kt_rms_norm                       then q_b's job starts, and while it runs:
//   latent row            [norm(c) | rope(k_rot)] of each row into its request's cache slot (kt_rms_norm, kt_rope)
//   [W_uk grouped]        q_lat from q_nope (AbsorbedKvB's input scales)   while it runs: q's rope half roped
//   [attention]           each row over its causal prefix, kt_mla_attend_batch's job (MlaAttendBatch)
//   [W_uv grouped]        the values from the latent output
//   [o_proj]              into out
// Why: between these seven jobs a decode step ran ~25 torch ops and ctypes calls per layer, ~170 us of Python on
// the embedded default model's 1.3 ms step (4 layers), while the pool waited.
#include <algorithm>

#include "../include/ktkernels.h"
#include "context.h"
#include "mla_decode.h"

namespace kt {

bool MlaDecode::run(kt_ctx* ctx, const kt_mla_decode_args& a, const char** why) {
    *why = "bad geometry (T, nh, dn, dr, dv, R, q_lora, m)";
    if (a.T < 1 || a.nh < 1 || a.dn < 16 || a.dn % 16 || a.dr < 2 || a.dr % 16 || a.dv < 16 || a.dv % 16 ||
        a.R < 16 || a.R % 16 || a.q_lora < 0 || a.m < 1 || a.m > a.T)
        return false;
    *why = "missing x / out / norm weights / rope tables / request arrays / cache / W_uk scales";
    if (!a.x || !a.out || !a.kv_a_norm || (a.q_lora && !a.q_a_norm) || !a.cos || !a.sin || !a.row0 || !a.start ||
        !a.table0 || !a.tables || !a.cache || !a.uk_scale)
        return false;
    *why = "bad lanes, q_b inputs, W_uk group, strides or block size";
    if ((a.lanes != 8 && a.lanes != 16) || a.R < a.lanes || (a.q_lora && (a.q_lora < a.lanes || a.q_b_k < a.q_lora)) ||
        a.uk_group < 1 || a.R % a.uk_group || a.block_size < 1 || a.row_stride < a.R + a.dr ||
        a.block_stride < a.block_size * a.row_stride)
        return false;
    *why = "bad request rows (row0 must run from 0 to T, each request at least one row)";
    if (!request_rows_ok(a.m, a.T, a.row0, a.start)) return false;

    ThreadPool& pool = ctx->engine.pool();
    LinearEngine& lin = ctx->linear;
    const int T = (int)a.T;
    const int64_t nh = a.nh, dn = a.dn, dr = a.dr, R = a.R, dq = dn + dr, lat = R + dr;
    auto slot = [&](int64_t r, int64_t p) {   // request r's cache row at position p
        return paged_row(a.cache, a.tables, a.table0, r, p, a.block_size, a.block_stride, a.row_stride);
    };

    // q_a and kv_a (one job: x quantized once), or q_proj's job then kv_a's
    q.resize((size_t)(T * nh * dq));
    ckv.resize((size_t)(T * lat));
    float* ckv_p = ckv.data();
    if (a.q_lora) {
        qa.resize((size_t)(T * a.q_lora));
        const int ids[2] = {a.q_a_id, a.kv_a_id};
        float* outs[2] = {qa.data(), ckv_p};
        const int64_t strides[2] = {a.q_lora, lat};
        lin.submit(2, ids, T, a.x, KT_F32, a.x_stride, outs, strides);
        lin.sync();
        q_resid.assign((size_t)(T * a.q_b_k), 0.0f);   // padded inputs of q_b stay 0 (ktrun pads them so)
        kt_rms_norm(T, a.q_lora, qa.data(), a.q_lora, nullptr, 0, nullptr, 0, a.q_a_norm, a.eps, a.lanes,
                    q_resid.data(), a.q_b_k);
        const int qb[1] = {a.q_b_id};
        float* qo[1] = {q.data()};
        const int64_t qs[1] = {nh * dq};
        lin.submit(1, qb, T, q_resid.data(), KT_F32, a.q_b_k, qo, qs);   // runs while the latent rows are written
    } else {
        const int qp[1] = {a.q_a_id}, kv[1] = {a.kv_a_id};
        float* qo[1] = {q.data()};
        float* ko[1] = {ckv_p};
        const int64_t qs[1] = {nh * dq}, ks[1] = {lat};
        lin.submit(1, qp, T, a.x, KT_F32, a.x_stride, qo, qs);
        lin.sync();
        lin.submit(1, kv, T, a.x, KT_F32, a.x_stride, ko, ks);
        lin.sync();
    }
    // each row's latent [norm(c) | rope(k_rot)] straight into its cache slot
    for (int64_t r = 0; r < a.m; ++r)
        for (int64_t t = a.row0[r]; t < a.row0[r + 1]; ++t) {
            float* dst = slot(r, a.start[r] + (t - a.row0[r]));
            const float* src = ckv_p + t * lat;
            kt_rms_norm(1, R, src, R, nullptr, 0, nullptr, 0, a.kv_a_norm, a.eps, a.lanes, dst, R);
            kt_rope(1, 1, dr / 2, src + R, dr, dr, a.cos + t * a.cs_stride, a.sin + t * a.cs_stride, a.cs_stride,
                    a.interleaved, dst + R, dr, dr);
        }
    lin.sync();   // q_b

    // W_uk: q_lat (T, nh * R / G, G) from q_nope, head h's groups reading q[t, h, :dn] times their input scales
    const int64_t G = a.uk_group, ng = R / G;
    q_lat.resize((size_t)(T * nh * R));
    lin.submit_grouped(a.uk_id, (int)(nh * ng), 0, (int)G, (int)G, T, q.data(), KT_F32, nh * dq, dq, q_lat.data(),
                       nh * R, G, (int)ng, a.uk_scale);
    q_rot.resize((size_t)(T * nh * dr));   // while it runs: q's rope half, (T, nh, dr)
    kt_rope(T, nh, dr / 2, q.data() + dn, nh * dq, dq, a.cos, a.sin, a.cs_stride, a.interleaved, q_rot.data(),
            nh * dr, dr);
    lin.sync();

    // every row over its causal prefix: one run per block
    runs.clear();
    run_len.clear();
    row_runs.assign((size_t)T, 0);
    for (int64_t r = 0; r < a.m; ++r)
        for (int64_t t = a.row0[r]; t < a.row0[r + 1]; ++t) {
            const int64_t S = a.start[r] + (t - a.row0[r]) + 1;
            for (int64_t p = 0; p < S; p += a.block_size) {
                runs.push_back(slot(r, p));
                run_len.push_back(std::min(a.block_size, S - p));
                ++row_runs[t];
            }
        }
    out_lat.resize((size_t)(T * nh * R));
    pool.wait();
    MlaAttendBatch& attend = ctx->attend_batch;
    *why = "bad attention arguments";
    if (!attend.set(T, nh, R, dr, q_lat.data(), nh * R, R, q_rot.data(), nh * dr, dr, a.scale, row_runs.data(),
                    runs.data(), run_len.data(), a.row_stride, out_lat.data(), nh * R, R))
        return false;
    pool.launch([&attend](const WorkerInfo& w) { attend.run(w.index, w.n_threads); });
    pool.wait();

    // W_uv: o (T, nh, dv) from kv_b's value rows, then o_proj into out
    o.resize((size_t)(T * nh * a.dv));
    lin.submit_grouped(a.kv_b_id, (int)nh, (int)dn, (int)(dn + a.dv), (int)a.dv, T, out_lat.data(), KT_F32, nh * R, R,
                       o.data(), nh * a.dv, a.dv);
    lin.sync();
    const int op[1] = {a.o_id};
    float* oo[1] = {a.out};
    const int64_t os[1] = {a.out_stride};
    lin.submit(1, op, T, o.data(), KT_F32, nh * a.dv, oo, os);
    lin.sync();
    return true;
}

}  // namespace kt
