// GPU codes -> cpu-linear tiles (layouts/README.md "CPU dense Linears"; numpy reference: ktlayouts.cpu_linear.
// repack_gpu_codes), once per Linear at load, on the context's threads. Bit-exact: codes are moved, not requantized
// (the GPU zero point 2^(bits-1) is the tiles' zero point), fp16 scales widen exactly to f32.
//
// Tile bytes (README): tile[nb, kt] row r, byte 4c + j = code[n = 16 nb + c, k = 64 kt + 4 r + j]; int4 chunk h
// (64 bytes) holds row 2h in the low and row 2h+1 in the high nibbles, i.e. byte 4c + j = code[k = 64 kt + 8 h + j]
// | code[k + 4] << 4.
//
// Baseline ISA only (this file gets no ISA flags): the (K, N) byte transpose uses SSE2 unpacks, part of x86-64.
#include <emmintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../include/ktkernels.h"
#include "linear_engine.h"

namespace kt {

namespace {

// IEEE binary16 -> binary32, exact for every value (subnormals included; NaN payloads kept in the top bits).
float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f);   // mant * 2^-24: exact
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7F800000u | (mant << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct Repack {
    int n, k, bits, kx, z, n_groups, gpu_groups, glen;
    int kind;                   // KT_CODES_U8 or KT_CODES_PACKED_K
    const uint8_t* c8;          // KT_CODES_U8
    const uint32_t* words;      // KT_CODES_PACKED_K
    int64_t sk, sn;             // strides (bytes for U8, words for PACKED_K)
    const uint16_t* sc;
    int64_t ssg, ssn;
    uint8_t* q;
    float* s;                   // f32 scales out, or
    uint16_t* s16;              // f16 scales out (the GPU's bits, moved)
    size_t q_block, tile_bytes;

    // code (k, n) of the GPU matrix, zero point for the padding
    int code(int kk, int nn) const {
        if (kk >= k || nn >= n) return z;
        if (kind == KT_CODES_U8) return c8[kk * sk + nn * sn];
        const int f = 32 / bits;
        return (int)((words[(int64_t)(kk / f) * sk + nn * sn] >> (bits * (kk % f))) & ((1u << bits) - 1));
    }

    // Any strides and the padded edges: element by element.
    uint8_t generic_tile(int nb, int kt, uint8_t* t) const {
        uint8_t all = 0;
        for (int r = 0; r < 16; ++r)
            for (int c = 0; c < 16; ++c)
                for (int j = 0; j < 4; ++j) {
                    const int kk = 64 * kt + 4 * r + j, nn = 16 * nb + c;
                    const uint8_t v = (uint8_t)code(kk, nn);
                    all |= v;
                    if (bits == 8) t[r * 64 + 4 * c + j] = v;
                    else if (r % 2 == 0) t[(r / 2) * 64 + 4 * c + j] = v;
                    else t[(r / 2) * 64 + 4 * c + j] |= (uint8_t)(v << 4);
                }
        return all;
    }

    // U8 codes (K, N) with unit column stride: 4 rows of 16 bytes interleave into one 64-byte tile row
    // (out[4c + j] = row_j[c]), punpck{l,h}bw then punpck{l,h}wd.
    uint8_t kn_tile(int nb, int kt, uint8_t* t) const {
        const uint8_t* base = c8 + (int64_t)(64 * kt) * sk + 16 * nb;
        auto row = [&](int kk) { return _mm_loadu_si128((const __m128i*)(base + kk * sk)); };
        __m128i all = _mm_setzero_si128();
        for (int r = 0; r < 16; ++r) {   // tile row r (int8) or chunk r/2 half (int4): K = 4r .. 4r+3 of the tile
            __m128i a[4];
            if (bits == 8) {
                for (int j = 0; j < 4; ++j) { a[j] = row(4 * r + j); all = _mm_or_si128(all, a[j]); }
            } else {
                if (r >= 8) break;   // chunk h = r: K 8h .. 8h+3 low nibbles, 8h+4 .. 8h+7 high
                for (int j = 0; j < 4; ++j) {
                    const __m128i lo = row(8 * r + j), hi = row(8 * r + 4 + j);
                    all = _mm_or_si128(all, _mm_or_si128(lo, hi));
                    a[j] = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));   // codes <= 15: no carry across bytes
                }
            }
            const __m128i t0 = _mm_unpacklo_epi8(a[0], a[1]), t1 = _mm_unpackhi_epi8(a[0], a[1]);
            const __m128i t2 = _mm_unpacklo_epi8(a[2], a[3]), t3 = _mm_unpackhi_epi8(a[2], a[3]);
            __m128i* o = (__m128i*)(t + r * 64);
            _mm_storeu_si128(o + 0, _mm_unpacklo_epi16(t0, t2));
            _mm_storeu_si128(o + 1, _mm_unpackhi_epi16(t0, t2));
            _mm_storeu_si128(o + 2, _mm_unpacklo_epi16(t1, t3));
            _mm_storeu_si128(o + 3, _mm_unpackhi_epi16(t1, t3));
        }
        alignas(16) uint8_t b[16];
        _mm_store_si128((__m128i*)b, all);
        uint8_t m = 0;
        for (uint8_t v : b) m |= v;
        return m;
    }

    // U8 codes with unit K stride ((N, K) rows): each column's 64 codes are contiguous.
    uint8_t nk_tile(int nb, int kt, uint8_t* t) const {
        uint8_t all = 0;
        for (int c = 0; c < 16; ++c) {
            const uint8_t* col = c8 + (int64_t)(16 * nb + c) * sn + 64 * kt;
            for (int i = 0; i < 64; ++i) all |= col[i];
            if (bits == 8)
                for (int r = 0; r < 16; ++r) memcpy(t + r * 64 + 4 * c, col + 4 * r, 4);
            else
                for (int h = 0; h < 8; ++h)
                    for (int j = 0; j < 4; ++j) t[h * 64 + 4 * c + j] = (uint8_t)(col[8 * h + j] | (col[8 * h + 4 + j] << 4));
        }
        return all;
    }

    // int4 word (8 K of one column, nibble i = K 8h + i) -> its 4 tile bytes: byte j = K j (low) | K j+4 (high).
    static uint32_t chunk_word(uint32_t w) {
        const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;       // bytes: K 0,2,4,6 / K 1,3,5,7
        const uint32_t a = lo | ((lo >> 16) << 4), b = hi | ((hi >> 16) << 4);   // bytes: (K0|K4, K2|K6), (K1|K5, K3|K7)
        return (a & 0xFFu) | ((b & 0xFFu) << 8) | ((a & 0xFF00u) << 8) | ((b & 0xFF00u) << 16);
    }

    // Codes packed along K in little-endian 32-bit words (gptq qweight, compressed-tensors weight_packed).
    // int8: a word is 4 consecutive K of one column = one 32-bit word of a tile row. int4: a word is the 8 K of one
    // chunk's column c (chunk_word).
    void packed_tile(int nb, int kt, uint8_t* t) const {
        if (sn == 1) {   // gptq (K/f, N): one tile row / chunk = 16 consecutive words of one word row
            const uint32_t* base = words + 16 * nb;
            for (int r = 0; r < (bits == 8 ? 16 : 8); ++r) {
                const uint32_t* row = base + (int64_t)((bits == 8 ? 16 : 8) * kt + r) * sk;
                if (bits == 8) { memcpy(t + r * 64, row, 64); continue; }
                uint32_t out[16];
                for (int c = 0; c < 16; ++c) out[c] = chunk_word(row[c]);
                memcpy(t + r * 64, out, 64);
            }
            return;
        }
        for (int c = 0; c < 16; ++c) {
            const uint32_t* col = words + (int64_t)(16 * nb + c) * sn;
            for (int r = 0; r < (bits == 8 ? 16 : 8); ++r) {
                const uint32_t w = col[(int64_t)((bits == 8 ? 16 : 8) * kt + r) * sk];
                const uint32_t out = bits == 8 ? w : chunk_word(w);
                memcpy(t + r * 64 + 4 * c, &out, 4);
            }
        }
    }

    uint8_t tile(int nb, int kt) const {
        uint8_t* t = q + (size_t)nb * q_block + (size_t)kt * tile_bytes;
        if (16 * nb + 16 > n || 64 * kt + 64 > k) return generic_tile(nb, kt, t);
        if (kind == KT_CODES_PACKED_K) { packed_tile(nb, kt, t); return 0; }
        if (sn == 1) return kn_tile(nb, kt, t);
        if (sk == 1) return nk_tile(nb, kt, t);
        return generic_tile(nb, kt, t);
    }

    // Column blocks [nb0, nb1): their K tiles, then their scales. Returns the OR of the U8 codes seen (int4 range
    // check). Sources with rows along N ((K, N) bytes, gptq words) go K outermost, so the blocks' columns are read as
    // whole cache lines and pages; sources with rows along K ((N, K) bytes, compressed-tensors words) go block by
    // block, each column one sequential stream.
    uint8_t blocks(int nb0, int nb1) const {
        uint8_t all = 0;
        if (sn == 1)
            for (int kt = 0; kt < kx / 64; ++kt)
                for (int nb = nb0; nb < nb1; ++nb) all |= tile(nb, kt);
        else
            for (int nb = nb0; nb < nb1; ++nb)
                for (int kt = 0; kt < kx / 64; ++kt) all |= tile(nb, kt);
        for (int nb = nb0; nb < nb1; ++nb) {
            const size_t at = (size_t)nb * n_groups * 16;
            for (int g = 0; g < n_groups; ++g)
                for (int c = 0; c < 16; ++c) {
                    const int nn = 16 * nb + c;
                    const uint16_t h = g < gpu_groups && nn < n ? sc[g * ssg + nn * ssn] : 0;   // padding: +0
                    if (s16) s16[at + g * 16 + c] = h;
                    else s[at + g * 16 + c] = half_to_float(h);
                }
        }
        return all;
    }
};

}  // namespace

void LinearEngine::repack(int n, int k, int bits, int group, const void* codes, int codes_kind, int64_t code_stride_k,
                          int64_t code_stride_n, const uint16_t* scales, int64_t scale_stride_g,
                          int64_t scale_stride_n, uint8_t* qweight, void* scales_out, int scales_dtype) {
    auto bad = [&](const std::string& m) {
        throw std::invalid_argument("repack (" + std::to_string(n) + ", " + std::to_string(k) + ") int" +
                                    std::to_string(bits) + " G=" + std::to_string(group) + ": " + m);
    };
    if (n < 1 || k < 1) bad("n and k must be >= 1");
    if (bits != 4 && bits != 8) bad("bits must be 4 or 8");
    if (!(group == -1 || group == 32 || (group > 0 && group % 64 == 0)))
        bad("group size is not supported: use 32, a multiple of 64, or -1 (per row)");
    if (group > 0 && k % group) bad("K is not a multiple of the group size (GPU layouts need whole groups)");
    if (codes_kind != KT_CODES_U8 && codes_kind != KT_CODES_PACKED_K) bad("codes_kind must be KT_CODES_U8 or KT_CODES_PACKED_K");
    if (scales_dtype != KT_F32 && scales_dtype != KT_F16) bad("output scales must be KT_F32 or KT_F16");
    if (codes_kind == KT_CODES_PACKED_K && k % (32 / bits)) bad("K is not a multiple of the codes per 32-bit word");
    if (!codes || !scales || !qweight || !scales_out) bad("null pointer");
    Repack R;
    R.n = n; R.k = k; R.bits = bits;
    const int unit = group > 0 && group % 64 == 0 ? group : 64;   // lcm(64, G); 64 for G = 32 and per row
    R.kx = (k + unit - 1) / unit * unit;
    R.z = 1 << (bits - 1);
    R.glen = group == -1 ? R.kx : group;
    R.n_groups = R.kx / R.glen;
    R.gpu_groups = group == -1 ? 1 : k / group;
    R.kind = codes_kind;
    R.c8 = (const uint8_t*)codes; R.words = (const uint32_t*)codes;
    R.sk = code_stride_k; R.sn = code_stride_n;
    R.sc = scales; R.ssg = scale_stride_g; R.ssn = scale_stride_n;
    R.q = qweight;
    R.s = scales_dtype == KT_F32 ? (float*)scales_out : nullptr;
    R.s16 = scales_dtype == KT_F16 ? (uint16_t*)scales_out : nullptr;
    R.tile_bytes = bits == 4 ? 512 : 1024;
    R.q_block = (size_t)(R.kx / 64) * R.tile_bytes;
    const int n_blocks = (n + 15) / 16;
    // Items of 16 column blocks: 256 columns = 4 cache lines of each (K, N) row per page visited.
    constexpr int kRepackBlocks = 16;
    std::atomic<int> next{0};
    std::atomic<unsigned> seen{0};
    pool_.launch([&](const WorkerInfo&) {
        unsigned all = 0;
        for (int i; (i = next.fetch_add(1)) * kRepackBlocks < n_blocks;)
            all |= R.blocks(i * kRepackBlocks, std::min(n_blocks, (i + 1) * kRepackBlocks));
        seen.fetch_or(all);
    });
    pool_.wait();
    if (bits == 4 && codes_kind == KT_CODES_U8 && (seen.load() & 0xF0u))
        bad("int4 codes must be in 0..15 (one code per byte), found a larger one");
}

}  // namespace kt
