// AMX backend (compiled with the avx512 flags + -mamx-tile -mamx-int8): int8/int4 expert matmuls of many rows with
// TDPBSSD tiles; decode rows (few per expert) take the AVX-512 VNNI stream of kernel_body.inc, as do the bf16 layout
// and the probes (the tile peak probe excepted). The permission for tile data (ARCH_REQ_XCOMP_PERM) is requested
// once at load, in cpu_features.cpp.
//
// The tile kernel (qgemm_tiles) computes, bit for bit, what kernel_body.inc's spec says: per scale group g
//   acc = sum_{k in g} a_q[k] * (code[n, k] - Z)        (exact int32: the zero point folded into the weights)
//   y[n] = fma(float(acc), scale[n, g] * a_s[g], y[n])   in group order from y = 0
// Per call (one expert's view: n_blocks column blocks, m rows):
//   - the rows are copied once into tile order (a tile load reads 1 KiB contiguous; an expert's rows are scattered
//     tokens in the caller's buffer), kept per thread for the next call with the same ActRows::tag (gate and up, and
//     the next column blocks, of the same rows)
//   - column blocks two at a time, rows in chunks of kChunkRows; group outer: the group's weight codes expanded to
//     signed int8 (code - Z) once and its B tiles kept in tmm6 / tmm7 over every row tile of the chunk
//   - per row tile: its products into one of two accumulator sets, then the previous row tile's finish (vector work
//     the core runs while the tile unit works), then its accumulators stored.
// What bounds it: per tdpbssd (16 rows x 16 columns x 64 K) the finish is 16 vector rows of convert, multiply, fma
// (~2.1 cycles each on the AMX server, one core: ~34 cycles) against 16 cycles of tile work; the AVX-512 VNNI body
// needs 16 vpdpbusd more per 16 outputs and group.
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

// tmm 2r + j: C of row tile r (mt[r] rows) and column block j (16 int32); tmm 4 + r: A of row tile r (mt[r] rows x
// kstep bytes); tmm 6 + j: B of block j (kstep / 4 rows x 64 bytes). A row tile of 0 rows leaves its tiles unset.
void configure_tiles(int mt0, int mt1, int kstep) {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    const int mt[2] = {mt0, mt1};
    for (int r = 0; r < 2; ++r) {
        if (!mt[r]) continue;
        c.rows[2 * r] = c.rows[2 * r + 1] = (uint8_t)mt[r];
        c.colsb[2 * r] = c.colsb[2 * r + 1] = 64;
        c.rows[4 + r] = (uint8_t)mt[r];
        c.colsb[4 + r] = (uint16_t)kstep;
    }
    c.rows[6] = c.rows[7] = (uint8_t)(kstep / 4);
    c.colsb[6] = c.colsb[7] = 64;
    // as an asm reading the whole struct: GCC 12 took _tile_loadconfig(&c) for a read of its first byte only and
    // dropped the stores of the rows and columns computed in the loop (a SIGILL at the first tile instruction)
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

// Per-thread scratch that grows on demand (plain malloc: no std containers compiled with these flags).
struct Scratch { void* p; size_t n; };
thread_local Scratch t_scratch[3] = {{nullptr, 0}, {nullptr, 0}, {nullptr, 0}};
void* scratch(int which, size_t n) {
    Scratch& s = t_scratch[which];
    if (s.n < n) {
        free(s.p);
        s.p = aligned_alloc(64, (n + 63) / 64 * 64);
        s.n = s.p ? n : 0;
    }
    return s.p;
}

// Rows per chunk: its y (kChunkRows x 32 floats) accumulates in a local buffer on the stack.
constexpr int kChunkRows = 128;

// The m rows in tile order: A [row tile][K step][16 rows][kstep] int8 and the activation scales [row tile][group]
// [16 rows] float32. Rows past m up to the last whole tile are zero (tiles always take 16 rows; the finish writes
// only the m rows).
void pack_rows(const ActRows& a, int rows, int K, int kstep, int n_groups, int8_t* pa, float* pas) {
    const int n_steps = K / kstep;
    for (int i = 0; i < (rows + 15) / 16 * 16; ++i) {
        int8_t* dst = pa + (size_t)(i / 16) * 16 * K + (size_t)(i % 16) * kstep;
        float* ast = pas + (size_t)(i / 16) * 16 * n_groups + i % 16;
        if (i >= rows) {
            for (int s = 0; s < n_steps; ++s) memset(dst + (size_t)s * 16 * kstep, 0, kstep);
            for (int g = 0; g < n_groups; ++g) ast[16 * g] = 0.0f;
            continue;
        }
        const int8_t* src = a.q[i];
        if (kstep == 64)
            for (int s = 0; s < n_steps; ++s)
                _mm512_store_si512(dst + (size_t)s * 1024, _mm512_loadu_si512(src + (size_t)s * 64));
        else
            for (int s = 0; s < n_steps; ++s)
                _mm256_store_si256((__m256i*)(dst + (size_t)s * 16 * kstep),
                                   _mm256_loadu_si256((const __m256i*)(src + (size_t)s * kstep)));
        const float* sr = a.s[i];
        for (int g = 0; g < n_groups; ++g) ast[16 * g] = sr[g];
    }
}

// K step st (kstep K values) of column block nb, as a B tile of signed int8 (code - Z): kstep / 4 rows of 64 bytes.
template <int BITS>
inline void expand_step(const QView& w, int nb, int st, int kstep, int8_t* b) {
    const int r0 = st * kstep / 4, nr = kstep / 4;   // tile rows of the step (r0 even)
    const uint8_t* q = w.q + (size_t)nb * w.q_block_stride;
    if (BITS == 8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int r = 0; r < nr; ++r)
            _mm512_store_si512(b + 64 * r, _mm512_xor_si512(_mm512_loadu_si512(q + 64 * (r0 + r)), flip));
    } else {
        const __m512i eight = _mm512_set1_epi8(8);
        for (int c = 0; c < nr / 2; ++c) {   // chunk c: rows 2c (low nibbles), 2c + 1 (high)
            const uint8_t* src = q + 32 * r0 + 64 * c;
            _mm512_store_si512(b + 128 * c, _mm512_sub_epi8(Isa::load4_lo(src), eight));
            _mm512_store_si512(b + 128 * c + 64, _mm512_sub_epi8(Isa::load4_hi(src), eight));
        }
    }
}

// y += float(C) * (scale * a_s) for the first n rows of one accumulator's stored copy c (16 x 16 int32), row i with
// activation scale as[i].
inline void finish_tile(const int32_t* c, __m512 sv, const float* as, float* y, int ldy, int n) {
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) {
        if (i >= n) break;
        Isa::finish(y + (size_t)i * ldy, _mm512_load_si512(c + 16 * i), sv, as[i]);
    }
}

// Tile registers of the prefill kernel: two sets, used by alternate row tiles so one tile's loads and products run
// while the previous one's accumulators are stored and finished: set p has C tmm 2p (block 0) and 2p + 1 (block 1)
// and A tmm 4 + p; the block pair's B tiles of the current K step stay in tmm6 / tmm7 over all row tiles.
#define KT_ROW_TILE_PRODUCTS(C0, C1, AR)                                                   \
    do {                                                                                   \
        _tile_zero(C0);                                                                    \
        if (C2) _tile_zero(C1);                                                            \
        for (int s = 0; s < spg; ++s) {                                                    \
            if (reload_b) {                                                                \
                _tile_loadd(6, bg + (size_t)2 * s * 1024, 64);                             \
                if (C2) _tile_loadd(7, bg + (size_t)(2 * s + 1) * 1024, 64);              \
            }                                                                              \
            _tile_loadd(AR, a + (size_t)s * 16 * kstep, kstep);                            \
            _tile_dpbssd(C0, AR, 6);                                                       \
            if (C2) _tile_dpbssd(C1, AR, 7);                                               \
        }                                                                                  \
    } while (0)

template <int P, bool C2>
inline void row_tile_products(const int8_t* a, int spg, int kstep, const int8_t* bg, bool reload_b) {
    if (P == 0) KT_ROW_TILE_PRODUCTS(0, 1, 4);
    else KT_ROW_TILE_PRODUCTS(2, 3, 5);
}

template <int P, bool C2>
inline void row_tile_store(int32_t* c) {
    if (P == 0) {
        _tile_stored(0, c, 64);
        if (C2) _tile_stored(1, c + 256, 64);
    } else {
        _tile_stored(2, c, 64);
        if (C2) _tile_stored(3, c + 256, 64);
    }
}

// One row tile's group, stored and waiting for its finish.
struct Pending {
    const int32_t* c;   // 2 x 256 int32: block j at c + 256 j
    const float* sv;    // 2 x 16 block scales of its group
    const float* as;    // its 16 rows' activation scales at its group
    float* y;           // y of its row 0, block 0
    int mt;             // rows written
};

template <bool C2>
inline void finish_pending(const Pending& p, int ldy) {
    finish_tile(p.c, _mm512_load_ps(p.sv), p.as, p.y, ldy, p.mt);
    if (C2) finish_tile(p.c + 256, _mm512_load_ps(p.sv + 16), p.as, p.y + 16, ldy, p.mt);
}

// The rows of one packed chunk x column blocks nb (and nb + 1 when C2), every group. Group outer: its K steps of
// both blocks expanded once into `stage`, then every row tile: its products, the previous row tile's finish (vector
// work the core runs while the tile unit works), its accumulators stored. y accumulates in a contiguous local
// buffer (the caller's rows, ldy floats apart, fall into few L1 sets) and is copied out at the end.
template <int BITS, typename ST, bool C2>
void block_pair(const QView& w, int nb, int n_groups, int spg, int kstep, const int8_t* abuf, const float* astab,
                int rows, int K, int8_t* stage, float* yout, int ldyout) {
    alignas(64) int32_t cbuf[2][2 * 256];
    alignas(64) float svbuf[2][32];
    alignas(64) float y[kChunkRows * 32];
    constexpr int ldy = 32;
    const int n_rt = (rows + 15) / 16;
    for (int i = 0; i < rows; ++i) {
        Isa::zero16(y + (size_t)i * ldy);
        if (C2) Isa::zero16(y + (size_t)i * ldy + 16);
    }
    TileScales<ST, C2 ? 2 : 1> scales(w, nb);
    Pending pend = {};
    bool have = false;
    int par = 0;
    for (int g = 0; g < n_groups; ++g) {
        int8_t* bg = stage + (size_t)(g & 1) * spg * 2048;   // step s, block j: bg + (2 s + j) 1024
        for (int s = 0; s < spg; ++s) {
            expand_step<BITS>(w, nb, g * spg + s, kstep, bg + (size_t)2 * s * 1024);
            if (C2) expand_step<BITS>(w, nb + 1, g * spg + s, kstep, bg + (size_t)(2 * s + 1) * 1024);
        }
        float* sv = svbuf[g & 1];
        _mm512_store_ps(sv, scales.get(0, g));
        if (C2) _mm512_store_ps(sv + 16, scales.get(1, g));
        const bool one_step = spg == 1;
        if (one_step) {
            _tile_loadd(6, bg, 64);
            if (C2) _tile_loadd(7, bg + 1024, 64);
        }
        for (int rt = 0; rt < n_rt; ++rt) {
            const int8_t* a = abuf + (size_t)rt * 16 * K + (size_t)g * spg * 16 * kstep;
            if (par == 0) row_tile_products<0, C2>(a, spg, kstep, bg, !one_step);
            else row_tile_products<1, C2>(a, spg, kstep, bg, !one_step);
            if (have) finish_pending<C2>(pend, ldy);
            int32_t* c = cbuf[par];
            if (par == 0) row_tile_store<0, C2>(c);
            else row_tile_store<1, C2>(c);
            par ^= 1;
            pend = {c, sv, astab + (size_t)rt * 16 * n_groups + 16 * g, y + (size_t)16 * rt * ldy,
                    rows - 16 * rt < 16 ? rows - 16 * rt : 16};
            have = true;
        }
    }
    if (have) finish_pending<C2>(pend, ldy);
    for (int i = 0; i < rows; ++i) {
        _mm512_storeu_ps(yout + (size_t)i * ldyout, _mm512_load_ps(y + 32 * i));
        if (C2) _mm512_storeu_ps(yout + (size_t)i * ldyout + 16, _mm512_load_ps(y + 32 * i + 16));
    }
}

// The rows a thread packed last: gate and up of one expert's rows (and the next column blocks of the same rows)
// take the same activations (ActRows::tag, nonzero, names them until the caller's next job).
struct PackCache { uint64_t tag; const void* rows; int m, K, kstep; };
thread_local PackCache t_pack = {0, nullptr, 0, 0, 0};

template <int BITS, typename ST>
void qgemm_tiles(const QView& w, int n_blocks, const ActRows& a, int m, float* y, int ldy) {
    constexpr int kGroupRows = fixed_group_rows((const ST*)nullptr);
    const int K = w.n_rows4 * 4, glen = (kGroupRows ? kGroupRows : w.group_rows) * 4;
    const int kstep = glen < 64 ? glen : 64, n_groups = K / glen, spg = glen / kstep;
    const int rows_pad = (m + 15) / 16 * 16;
    int8_t* abuf = (int8_t*)scratch(0, (size_t)rows_pad * K);
    int8_t* stage = (int8_t*)scratch(1, (size_t)2 * spg * 2048);
    float* astab = (float*)scratch(2, (size_t)rows_pad * n_groups * sizeof(float));
    if (K % 64 || glen % kstep || !abuf || !stage || !astab) {
        t_pack = {0, nullptr, 0, 0, 0};   // a failed allocation dropped the buffers
        qgemm<BITS>(w, n_blocks, a, m, y, ldy);
        return;
    }
    PackCache& pc = t_pack;
    if (!(a.tag && pc.tag == a.tag && pc.rows == a.q && pc.m == m && pc.K == K && pc.kstep == kstep)) {
        pack_rows(a, m, K, kstep, n_groups, abuf, astab);
        pc = {a.tag, a.q, m, K, kstep};
    }
    configure_tiles(16, 16, kstep);
    for (int c0 = 0; c0 < m; c0 += kChunkRows) {
        const int rows = m - c0 < kChunkRows ? m - c0 : kChunkRows;
        const int8_t* ac = abuf + (size_t)c0 * K;
        const float* asc = astab + (size_t)c0 * n_groups;
        float* yc = y + (size_t)c0 * ldy;
        int nb = 0;
        for (; nb + 2 <= n_blocks; nb += 2)
            block_pair<BITS, ST, true>(w, nb, n_groups, spg, kstep, ac, asc, rows, K, stage, yc + nb * 16, ldy);
        if (nb < n_blocks)
            block_pair<BITS, ST, false>(w, nb, n_groups, spg, kstep, ac, asc, rows, K, stage, yc + nb * 16, ldy);
    }
    _tile_release();
}

// Up to this many rows the AVX-512 VNNI stream of kernel_body.inc runs instead of the tiles (bit-identical: both
// follow the scalar spec). A decode row reads each weight once, and the stream keeps up with memory where
// expanding and storing tiles per row would not.
template <int BITS>
constexpr int kVnniMaxRows = BITS == 4 ? kDecodeMaxRows : 2;

template <int BITS>
void qgemm_amx(const QView& w, int n_blocks, const ActRows& a, int m, float* y, int ldy) {
    if (m <= kVnniMaxRows<BITS>) { qgemm<BITS>(w, n_blocks, a, m, y, ldy); return; }
    if (w.s_type == kScaleF16) qgemm_tiles<BITS, ScaleF16>(w, n_blocks, a, m, y, ldy);
    else if (w.s_type == kScaleBF16) qgemm_tiles<BITS, ScaleBF16>(w, n_blocks, a, m, y, ldy);
    else if (BITS == 4 && w.s_type == kScaleSub6) qgemm_tiles<BITS, ScaleSub6>(w, n_blocks, a, m, y, ldy);
    else qgemm_tiles<BITS, float>(w, n_blocks, a, m, y, ldy);
}

// Four independent tdpbssd chains (16 x 16 x 64 each) on tile registers only: the tile unit's int8 limit of one
// core, int8 ops (2 per MAC).
double tile_peak(int64_t iters) {
    alignas(64) static const int8_t ones[1024] = {1};
    configure_tiles(16, 16, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    for (int64_t it = 0; it < iters; ++it) {
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    alignas(64) int32_t sink[256];
    _tile_stored(0, sink, 64);
    _tile_release();
    volatile int32_t keep = sink[0];
    (void)keep;
    return (double)iters * 4 * 16 * 16 * 64 * 2;
}

}  // namespace

extern const BGemmFn kAvx512Bf16Gemm;
extern const KernelTable kAmxTable = {"amx", "amx (int: tdpbssd tiles; bf16 layout: vdpbf16ps)",
                                      qgemm_amx<4>, qgemm_amx<8>, nullptr, read_sum, peak, quantize_row, 1, tile_peak};
extern const KernelTable kAmxFmaBf16Table = {"amx", "amx (int: tdpbssd tiles; bf16 layout: fp32 fma)",
                                             qgemm_amx<4>, qgemm_amx<8>, bgemm, read_sum, peak, quantize_row, 1,
                                             tile_peak};
}  // namespace kt
