// AMX backend (compiled with the avx512 flags + -mamx-tile -mamx-int8): int8/int4 expert matmuls with TDPBSUD
// (activations signed in A, weight codes unsigned in B, straight from the mapped file for int8; int4 tiles are
// expanded to int8 in registers into a 1 KiB tile buffer). The bf16 layout and the probes use the AVX-512 body.
// The permission for tile data (ARCH_REQ_XCOMP_PERM) is requested once at load, in cpu_features.cpp.
#include <immintrin.h>
#include <cstdlib>
#include <cstring>

#include "cpu_features.h"

namespace kt {
namespace {
#include "isa_avx512.inc"

struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// tmm0: C (mt x 16 int32), tmm1: A (mt rows x kbytes int8), tmm2: B (kbytes/4 rows x 64 bytes).
void configure_tiles(int mt, int kbytes) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    c.rows[0] = (uint8_t)mt; c.colsb[0] = 64;
    c.rows[1] = (uint8_t)mt; c.colsb[1] = (uint16_t)kbytes;
    c.rows[2] = (uint8_t)(kbytes / 4); c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

// Per-thread scratch that grows on demand (plain malloc: no std containers compiled with these flags).
struct Scratch { uint8_t* p; size_t n; };
thread_local Scratch t_abuf = {nullptr, 0};
uint8_t* scratch(size_t n) {
    if (t_abuf.n < n) {
        free(t_abuf.p);
        t_abuf.p = (uint8_t*)aligned_alloc(64, (n + 63) / 64 * 64);
        t_abuf.n = t_abuf.p ? n : 0;
    }
    return t_abuf.p;
}

template <int BITS, typename ST>
void qgemm_amx_st(const QView& w, int n_blocks, const ActRows& a, int m, float* y, int ldy) {
    constexpr int32_t Z = BITS == 8 ? 128 : 8;
    constexpr size_t TB = BITS == 8 ? 1024 : 512;
    const int K = w.n_rows4 * 4, glen = w.group_rows * 4, n_groups = K / glen;
    const int kstep = glen < 64 ? glen : 64;    // G = 32: half tiles (8 rows of B)
    uint8_t* abuf = scratch((size_t)16 * K);
    if (!abuf) { qgemm<BITS>(w, n_blocks, a, m, y, ldy); return; }
    alignas(64) uint8_t bbuf[1024];
    alignas(64) int32_t cbuf[16 * 16];
    for (int i0 = 0; i0 < m; i0 += 16) {
        const int mt = m - i0 < 16 ? m - i0 : 16;
        for (int i = 0; i < mt; ++i) memcpy(abuf + (size_t)i * K, a.q[i0 + i], K);   // A rows, stride K
        configure_tiles(mt, kstep);
        for (int nb = 0; nb < n_blocks; ++nb) {
            const uint8_t* qb = w.q + (size_t)nb * w.q_block_stride;
            TileScales<ST, 1> scales(w, nb);
            for (int i = 0; i < mt; ++i) Isa::zero16(y + (size_t)(i0 + i) * ldy + nb * 16);
            for (int g = 0; g < n_groups; ++g) {
                _tile_zero(0);
                for (int k = g * glen; k < (g + 1) * glen; k += kstep) {
                    const int kt = k / 64, r0 = (k % 64) / 4, nrows = kstep / 4;
                    _tile_loadd(1, abuf + k, K);
                    if (BITS == 8) {
                        _tile_loadd(2, qb + kt * TB + (size_t)r0 * 64, 64);
                    } else {
                        for (int r = r0; r < r0 + nrows; r += 2) {   // chunk r/2: rows r (low nibbles), r+1 (high)
                            const uint8_t* chunk = qb + kt * TB + (size_t)(r / 2) * 64;
                            _mm512_store_si512(bbuf + (r - r0) * 64, Isa::load4_lo(chunk));
                            _mm512_store_si512(bbuf + (r - r0 + 1) * 64, Isa::load4_hi(chunk));
                        }
                        _tile_loadd(2, bbuf, 64);
                    }
                    _tile_dpbsud(0, 1, 2);
                }
                _tile_stored(0, cbuf, 64);
                const Isa::S sv = scales.get(0, g);
                for (int i = 0; i < mt; ++i) {
                    const __m512i c = _mm512_sub_epi32(_mm512_load_si512(cbuf + 16 * i),
                                                       _mm512_set1_epi32(Z * a.sum[i0 + i][g]));
                    Isa::finish(y + (size_t)(i0 + i) * ldy + nb * 16, c, sv, a.s[i0 + i][g]);
                }
            }
        }
    }
    _tile_release();
}

// Up to this many rows the AVX-512 VNNI stream of kernel_body.inc runs instead of the tiles (bit-identical: both
// follow the scalar spec). A decode row reads each weight once: the tile path's int4 expansion through a buffer and
// per-(block, group) tile store cost more than the vpdpbusd stream, which keeps up with memory where the tiles do
// not (one thread, weights hot in L2, T=1: int4 15 GB/s tiles vs 32 GB/s VNNI; T=8 12.2 vs 12.6; int8 T=1 equal,
// T=4 tiles 9% faster).
template <int BITS>
constexpr int kVnniMaxRows = BITS == 4 ? kDecodeMaxRows : 2;

template <int BITS>
void qgemm_amx(const QView& w, int n_blocks, const ActRows& a, int m, float* y, int ldy) {
    if (m <= kVnniMaxRows<BITS>) { qgemm<BITS>(w, n_blocks, a, m, y, ldy); return; }
    if (w.s_type == kScaleF16) qgemm_amx_st<BITS, ScaleF16>(w, n_blocks, a, m, y, ldy);
    else if (w.s_type == kScaleBF16) qgemm_amx_st<BITS, ScaleBF16>(w, n_blocks, a, m, y, ldy);
    else if (BITS == 4 && w.s_type == kScaleSub6) qgemm_amx_st<BITS, ScaleSub6>(w, n_blocks, a, m, y, ldy);
    else qgemm_amx_st<BITS, float>(w, n_blocks, a, m, y, ldy);
}

}  // namespace

extern const BGemmFn kAvx512Bf16Gemm;
extern const KernelTable kAmxTable = {"amx", "amx (int: tdpbsud tiles; bf16 layout: vdpbf16ps)",
                                      qgemm_amx<4>, qgemm_amx<8>, nullptr, read_sum, peak, quantize_row, 1};
extern const KernelTable kAmxFmaBf16Table = {"amx", "amx (int: tdpbsud tiles; bf16 layout: fp32 fma)",
                                             qgemm_amx<4>, qgemm_amx<8>, bgemm, read_sum, peak, quantize_row, 1};
}  // namespace kt
