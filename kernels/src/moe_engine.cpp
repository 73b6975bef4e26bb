#include "moe_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "bf16.h"
#include "cpu_features.h"
#include "mla_attend.h"   // silu_mul

namespace kt {

namespace {

int env_int(const char* name, int fallback) {
    const char* v = std::getenv(name);
    return (v && *v) ? std::atoi(v) : fallback;
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double thread_cpu_s() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

uint16_t f32_to_bf16(float f) {   // round to nearest even, as ktlayouts.f32_to_bf16_bits
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

MoEEngine::MoEEngine(int n_threads, int n_pools, const std::string& backend) {
    table_ = select_backend(backend);
    const std::vector<std::vector<int>> nodes = numa_node_cpus();
    int n_cpus = 0;
    for (auto& n : nodes) n_cpus += (int)n.size();
    if (n_pools <= 0) n_pools = env_int("KT_NUMA_POOLS", (int)nodes.size());
    if (n_threads <= 0) n_threads = std::max(n_cpus, n_pools);
    pool_.reset(new ThreadPool(n_threads, n_pools));
    next1_.reset(new std::atomic<int>[n_pools]);
    next2_.reset(new std::atomic<int>[n_pools]);
    scratch_.resize(n_threads);
    profile_.assign((size_t)n_threads * kProfilePhases, 0.0);
}

MoEEngine::~MoEEngine() { pool_->wait(); }

QView MoEEngine::gate_view(const Layer& L, const Piece& p, const uint8_t* q, const uint8_t* s, int e, int nb) const {
    QView v;
    v.q = q + e * p.g_expert_q + nb * p.g_block_q;
    v.s = s + (e * p.g_expert_s + nb * p.g_block_s) * L.s_bytes;
    v.s_type = L.s_type;
    v.q_block_stride = p.g_block_q;
    v.s_block_stride = p.g_block_s;
    v.n_rows4 = L.kx / 4;
    v.group_rows = L.kx_glen / 4;
    return v;
}

void MoEEngine::run(const WorkerInfo& w) {
    const int n = w.n_threads, p = w.pool;
    double* prof = profile_.data() + (size_t)w.index * kProfilePhases;
    double t_last = now_s();
    prof[0] = 0.0;
    const double start_delay = t_last - launch_time_, cpu0 = thread_cpu_s();
    auto mark = [&](int phase) { const double t = now_s(); prof[phase] = t - t_last; t_last = t; };
    if (!x_ready_) {
        for (int pi = 0; pi < n_parts_; ++pi)
            if (parts_[pi].own_x)
                for (int t = (int)((int64_t)T_ * w.index / n); t < (int)((int64_t)T_ * (w.index + 1) / n); ++t)
                    quantize_x(parts_[pi], t, w.index);
        mark(0);
        pool_->global_barrier();
    }
    mark(1);
    for (int i; (i = next1_[p].fetch_add(1)) < (int)items1_[p].size();) {
        const Item& it = items1_[p][i];
        gate_up(it, w.index);
        // acq_rel: the last finisher sees every other worker's h rows of this (piece, slot)
        const Part& P = parts_[it.part];
        if (remaining_[P.remaining0 + (size_t)it.piece * P.slots.size() + it.slot].fetch_sub(1, std::memory_order_acq_rel) == 1)
            quantize_h(it);
    }
    mark(2);
    pool_->pool_barrier(p);
    mark(3);
    for (int i; (i = next2_[p].fetch_add(1)) < (int)items2_[p].size();) down(items2_[p][i], p, w.index);
    mark(4);
    prof[5] = prof[6] = 0.0;
    prof[7] = start_delay;
    struct CpuTime {   // CPU time this worker actually got during the job (the cores are shared)
        double* slot; double t0;
        ~CpuTime() { *slot = thread_cpu_s() - t0; }
    } cpu_time{prof + 8, cpu0};
    if (pool_->n_pools() == 1) return;
    pool_->global_barrier();
    mark(5);
    const int H = L_->hidden;
    const int c0 = (int)((int64_t)H * w.index / n), c1 = (int)((int64_t)H * (w.index + 1) / n);
    for (int t = 0; t < T_; ++t) {
        float* o = out_ + t * out_stride_;
        for (int c = c0; c < c1; ++c) {
            float v = accumulate_ ? o[c] : 0.0f;
            for (auto& part : partial_) v += part[(size_t)t * H + c];
            o[c] = v;
        }
    }
    mark(6);
}

void MoEEngine::quantize_x(Part& P, int t, int worker) {
    const Layer& L = *P.L;
    const int H = L.hidden;
    const char* row = (const char*)x_ + (size_t)t * x_stride_ * (x_dtype_ == KT_F32 ? 4 : 2);
    if (L.bits == 16) {
        uint16_t* xb = P.xb.data() + (size_t)t * L.kx;
        for (int k = 0; k < L.kx; ++k)
            xb[k] = k >= H ? 0 : x_dtype_ == KT_BF16 ? ((const uint16_t*)row)[k] : f32_to_bf16(((const float*)row)[k]);
        return;
    }
    const float* v = (const float*)row;
    if (x_dtype_ == KT_BF16) {
        float* tmp = scratch_[worker].data();
        for (int k = 0; k < H; ++k) tmp[k] = bf16_to_f32(((const uint16_t*)row)[k]);
        v = tmp;
    }
    const int ngx = L.kx / L.kx_glen;
    table_->quantize_row(v, H, L.kx, L.kx_glen, P.xq.data() + (size_t)t * L.kx, P.xs.data() + (size_t)t * ngx,
                 P.xsum.data() + (size_t)t * ngx);
}

void MoEEngine::gate_up(const Item& it, int worker) {
    Part& X = parts_[it.part];
    const Layer& L = *X.L;
    const Piece& P = L.pieces[it.piece];
    const Slot& S = X.slots[it.slot];
    const int ldy = it.nbn * 16, e = S.expert;
    float* yg = scratch_[worker].data();
    float* yu = yg + (size_t)S.m * ldy;
    if (L.bits == 16) {
        const BView g{P.gq + e * P.g_expert_q + it.nb0 * P.g_block_q, P.g_block_q, L.kx / 2};
        const BView u{P.uq + e * P.g_expert_q + it.nb0 * P.g_block_q, P.g_block_q, L.kx / 2};
        table_->bgemm(g, it.nbn, X.xb_rows.data() + S.row0, S.m, yg, ldy);
        table_->bgemm(u, it.nbn, X.xb_rows.data() + S.row0, S.m, yu, ldy);
    } else {
        const ActRows a{X.xq_rows.data() + S.row0, X.xs_rows.data() + S.row0, X.xsum_rows.data() + S.row0,
                        job_tag_ + ((uint64_t)it.part << 22) + (uint64_t)it.slot + 1};
        const QGemmFn fn = L.bits == 8 ? table_->qgemm8 : table_->qgemm4;
        fn(gate_view(L, P, P.gq, P.gs, e, it.nb0), it.nbn, a, S.m, yg, ldy);
        fn(gate_view(L, P, P.uq, P.us, e, it.nb0), it.nbn, a, S.m, yu, ldy);
    }
    const int cols = P.cols();
    for (int i = 0; i < S.m; ++i) {
        float* h = X.pbuf[it.piece].h.data() + (size_t)(S.row0 + i) * cols + (it.nb0 * 16 - P.r0);
        const float* g = yg + (size_t)i * ldy;
        const float* u = yu + (size_t)i * ldy;
        const Activation& act = L.act;
        if (act.kind == kActSilu && !act.gate_bias) {
            silu_mul(ldy, g, u, h);                       // silu(g) * u, 16 at a time (silu_body.inc)
        } else {
            const size_t at = (size_t)e * L.inter_pad + P.row0 + (it.nb0 * 16 - P.r0);   // this item's first row
            const float* bg = act.gate_bias ? act.gate_bias + at : nullptr;
            const float* bu = act.up_bias ? act.up_bias + at : nullptr;
            for (int c = 0; c < ldy; ++c)
                h[c] = activate(act, g[c] + (bg ? bg[c] : 0.0f), u[c] + (bu ? bu[c] : 0.0f));
        }
    }
}

void MoEEngine::quantize_h(const Item& it) {
    Part& X = parts_[it.part];
    const Piece& P = X.L->pieces[it.piece];
    const Slot& S = X.slots[it.slot];
    PieceBuf& B = X.pbuf[it.piece];
    const int cols = P.cols();
    for (int r = S.row0; r < S.row0 + S.m; ++r) {
        const float* h = B.h.data() + (size_t)r * cols;
        if (X.L->bits == 16) {
            for (int c = 0; c < cols; ++c) B.hb[(size_t)r * cols + c] = f32_to_bf16(h[c]);
        } else {
            const int ng = cols / P.d_glen;
            table_->quantize_row(h, cols, cols, P.d_glen, B.hq.data() + (size_t)r * cols, B.hs.data() + (size_t)r * ng,
                         B.hsum.data() + (size_t)r * ng);
        }
    }
}

void MoEEngine::down(const Item& it, int pool, int worker) {
    const int H = L_->hidden, c0 = it.nb0 * 16, nc = std::min(it.nbn * 16, H - c0);
    const bool direct = pool_->n_pools() == 1;
    float* dst = direct ? out_ : partial_[pool].data();
    const int64_t ld = direct ? out_stride_ : H;
    if (!(direct && accumulate_))
        for (int t = 0; t < T_; ++t) memset(dst + t * ld + c0, 0, sizeof(float) * nc);
    // the routed experts in ascending order, then the shared expert: each column's sum in one fixed order
    for (int pi = 0; pi < n_parts_; ++pi) down_part(parts_[pi], it, pool, dst, ld, scratch_[worker].data());
}

// One part's experts added into dst for the item's output columns.
void MoEEngine::down_part(const Part& X, const Item& it, int pool, float* dst, int64_t ld, float* y) {
    const Layer& L = *X.L;
    const int H = L.hidden, c0 = it.nb0 * 16, nc = std::min(it.nbn * 16, H - c0), ldy = it.nbn * 16;
    for (int pi = 0; pi < (int)L.pieces.size(); ++pi) {
        const Piece& P = L.pieces[pi];
        if (P.pool != pool) continue;
        const PieceBuf& B = X.pbuf[pi];
        for (const Slot& S : X.slots) {
            const size_t eq = S.expert * P.d_expert_q + it.nb0 * P.d_block_q;
            if (L.bits == 16) {
                const BView v{P.dq + eq + (size_t)(P.r0 / 32) * 1024, P.d_block_q, P.cols() / 2};
                table_->bgemm(v, it.nbn, B.b_rows.data() + S.row0, S.m, y, ldy);
            } else {
                QView v;
                v.q = P.dq + eq + (size_t)(P.r0 / 64) * (L.bits == 8 ? 1024 : 512);
                v.s = P.ds + (S.expert * P.d_expert_s + it.nb0 * P.d_block_s + (size_t)P.d_g0 * 16) * L.s_bytes;
                v.s_type = L.s_type;
                v.q_block_stride = P.d_block_q;
                v.s_block_stride = P.d_block_s;
                v.n_rows4 = P.cols() / 4;
                v.group_rows = P.d_glen / 4;
                const ActRows a{B.q_rows.data() + S.row0, B.s_rows.data() + S.row0, B.sum_rows.data() + S.row0, 0};
                (L.bits == 8 ? table_->qgemm8 : table_->qgemm4)(v, it.nbn, a, S.m, y, ldy);
            }
            // the down bias once per (token, expert): by the piece holding the first intermediate row
            const float* bd = (L.act.down_bias && P.row0 == 0) ? L.act.down_bias + (size_t)S.expert * H + c0 : nullptr;
            for (int i = 0; i < S.m; ++i) {
                const int r = S.row0 + i;
                float* d = dst + X.tok[r] * ld + c0;
                const float w = X.wt[r];
                const float* yy = y + (size_t)i * ldy;
                if (bd) {
                    for (int c = 0; c < nc; ++c) d[c] += w * (yy[c] + bd[c]);
                } else {
                    for (int c = 0; c < nc; ++c) d[c] += w * yy[c];
                }
            }
        }
    }
}

}  // namespace kt
