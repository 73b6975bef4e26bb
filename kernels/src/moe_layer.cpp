// Layer registration: validates the shard pieces handed in by the binding against the layout geometry
// (layouts/README.md, expert_shards.py) and derives every stride the kernels need.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>

#include "moe_engine.h"

namespace kt {

namespace {
int round_up(int x, int m) { return (x + m - 1) / m * m; }
}  // namespace

void MoEEngine::add_layer(int id, int E, int H, int I_pad, int bits, int G, int n_pieces, const kt_shard_piece* pcs,
                          int scale_dtype) {
    auto bad = [&](const std::string& m) { throw std::invalid_argument("layer " + std::to_string(id) + ": " + m); };
    if (pool_->busy()) pool_->wait();
    if (E < 1 || H < 1 || I_pad < 1) bad("n_experts, hidden and intermediate_pad must be >= 1");
    if (bits != 4 && bits != 8 && bits != 16) bad("bits must be 4, 8 or 16 (bf16), got " + std::to_string(bits));
    const bool per_row = bits == 16 || G == -1;
    if (bits != 16 && !(G == -1 || G == 32 || (G > 0 && G % 64 == 0)))
        bad("group size " + std::to_string(G) + " is not supported: use 32, a multiple of 64, or -1 (per row)");
    if (scale_dtype != kScaleF32 && scale_dtype != kScaleF16 && scale_dtype != kScaleBF16 && scale_dtype != kScaleSub6)
        bad("scale dtype " + std::to_string(scale_dtype) + " is not KT_F32, KT_F16, KT_BF16 or KT_SUB6");
    const bool two_level = bits != 16 && scale_dtype == kScaleSub6;
    if (two_level && (bits != 4 || G != 32))
        bad("two-level scales (KT_SUB6) need int4 with group 32, got " + std::to_string(bits) + "-bit group " + std::to_string(G));
    // K unit: whole tiles and groups (and super-blocks of 8 groups for two-level scales)
    const int unit = per_row ? 64 : std::lcm(64, two_level ? kSub6Groups * G : G);
    if (I_pad % unit) bad("intermediate_pad " + std::to_string(I_pad) + " is not a multiple of the unit " + std::to_string(unit));
    if (n_pieces < 1 || !pcs) bad("needs at least one shard piece");
    Layer L;
    L.n_experts = E; L.hidden = H; L.inter_pad = I_pad; L.bits = bits; L.group = G;
    L.s_type = scale_dtype; L.s_bytes = scale_bytes(scale_dtype);
    L.kx = round_up(H, per_row ? 64 : unit);
    L.kx_glen = per_row ? L.kx : G;
    L.down_blocks = round_up(H, 16) / 16;
    const size_t TB = bits == 4 ? 512 : 1024;
    const int ktile = bits == 16 ? 32 : 64;   // K per tile
    std::vector<std::pair<int, int>> covered;
    for (int i = 0; i < n_pieces; ++i) {
        const kt_shard_piece& s = pcs[i];
        const std::string where = "shard piece " + std::to_string(i) + " [" + std::to_string(s.i0) + ", " +
                                  std::to_string(s.i1) + ") rows [" + std::to_string(s.r0) + ", " + std::to_string(s.r1) + ")";
        if (s.i0 < 0 || s.i1 > I_pad || s.i0 >= s.i1 || s.i0 % unit || s.i1 % unit)
            bad(where + ": shard range must lie in [0, intermediate_pad) on multiples of " + std::to_string(unit));
        const int width = s.i1 - s.i0;
        if (s.r0 < 0 || s.r1 > width || s.r0 >= s.r1 || s.r0 % unit || s.r1 % unit)
            bad(where + ": piece rows must lie in [0, i1 - i0) on multiples of " + std::to_string(unit));
        if (s.pool < 0 || s.pool >= pool_->n_pools())
            bad(where + ": pool " + std::to_string(s.pool) + " out of range (" + std::to_string(pool_->n_pools()) + " sub-pools)");
        if (!s.gate_q || !s.up_q || !s.down_q || (bits != 16 && (!s.gate_s || !s.up_s || !s.down_s)))
            bad(where + ": missing weight or scale pointer");
        Piece p;
        p.gq = (const uint8_t*)s.gate_q; p.uq = (const uint8_t*)s.up_q; p.dq = (const uint8_t*)s.down_q;
        p.gs = (const uint8_t*)s.gate_s; p.us = (const uint8_t*)s.up_s; p.ds = (const uint8_t*)s.down_s;
        p.width = width; p.r0 = s.r0; p.r1 = s.r1; p.pool = s.pool; p.row0 = s.i0 + s.r0;
        const int ngx = L.kx / L.kx_glen;
        p.g_block_q = (size_t)(L.kx / ktile) * TB;
        p.g_expert_q = (size_t)(width / 16) * p.g_block_q;
        p.g_block_s = (size_t)ngx * 16;
        p.g_expert_s = (size_t)(width / 16) * p.g_block_s;
        const int ngd = per_row ? 1 : width / G;
        p.d_block_q = (size_t)(width / ktile) * TB;
        p.d_expert_q = (size_t)L.down_blocks * p.d_block_q;
        p.d_block_s = (size_t)ngd * 16;
        p.d_expert_s = (size_t)L.down_blocks * p.d_block_s;
        p.d_glen = per_row ? p.cols() : G;
        p.d_g0 = per_row ? 0 : s.r0 / G;
        L.pieces.push_back(p);
        covered.emplace_back(s.i0 + s.r0, s.i0 + s.r1);
    }
    std::sort(covered.begin(), covered.end());
    int at = 0;
    for (auto& c : covered) {
        if (c.first != at) bad("shard pieces must cover [0, intermediate_pad) exactly once; gap or overlap at row " + std::to_string(std::min(at, c.first)));
        at = c.second;
    }
    if (at != I_pad) bad("shard pieces must cover [0, intermediate_pad) exactly once; they end at row " + std::to_string(at) + ", intermediate_pad is " + std::to_string(I_pad));
    layers_[id] = std::move(L);
}

void MoEEngine::set_activation(int id, const Activation& act) {
    auto bad = [&](const std::string& m) { throw std::invalid_argument("layer " + std::to_string(id) + ": " + m); };
    if (pool_->busy()) pool_->wait();
    auto it = layers_.find(id);
    if (it == layers_.end()) bad("not registered (kt_add_layer first)");
    if (act.kind != kActSilu && act.kind != kActSwigluClamped && act.kind != kActSiluClamped)
        bad("activation " + std::to_string(act.kind) +
            " is not KT_ACT_SILU, KT_ACT_SWIGLU_CLAMPED or KT_ACT_SILU_CLAMPED");
    if (act.kind == kActSwigluClamped && !(act.limit > 0.0f && std::isfinite(act.alpha)))
        bad("the clamped SwiGLU needs limit > 0 and a finite alpha");
    if (act.kind == kActSiluClamped && !(act.limit > 0.0f))
        bad("the clamped SiLU gate needs limit > 0");
    if ((act.gate_bias == nullptr) != (act.up_bias == nullptr)) bad("gate and up biases come together");
    it->second.act = act;
}

}  // namespace kt
