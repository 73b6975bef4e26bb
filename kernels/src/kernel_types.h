// Plain-data types shared by the driver (baseline ISA) and the per-ISA kernel files.
// POD only, no inline functions: every ISA file keeps its code in an anonymous namespace so no function compiled
// with AVX-512 flags can be merged (COMDAT) into code that runs on an older CPU.
#pragma once
#include <cstddef>
#include <cstdint>

#include "scale_types.h"

namespace kt {

// A column-block range of one expert's packed int matrix (cpu-expert-int8/int4), possibly a K sub-range.
struct QView {
    const uint8_t* q;        // tile (block 0, k-tile 0) of the view
    const void* s;           // scales (block 0, group 0) of the view: 16 scales per (block, group), of s_type
    size_t q_block_stride;   // bytes between column blocks: K_tiles_full * tile_bytes
    size_t s_block_stride;   // scales (elements, not bytes) between column blocks: n_groups_full * 16 (two-level
                             // records: 1-byte elements, 128-byte records of 8 groups; views start on a record)
    int n_rows4;             // K of the view / 4 (tile rows of 4 K values)
    int group_rows;          // rows per scale group: G / 4 (the whole view for per-row scales)
    int s_type;              // ScaleType (scale_types.h): f32, bf16, f16 or two-level (sub6)
};

// Quantized activations of m rows (tokens), each row indexed by the view's K (k = 0 at the view's first K).
struct ActRows {
    const int8_t* const* q;     // q[i]: K int8 values
    const float* const* s;      // s[i][g]: activation scale of group g
    const int32_t* const* sum;  // sum[i][g]: sum of q over group g
    uint64_t tag;               // nonzero: names these rows' values until the next job (a kernel may keep a copy of
                                // them in its own order between calls with the same tag); 0: no such promise
};

// A column-block range of one expert's bf16 matrix (cpu-expert-bf16).
struct BView {
    const uint8_t* q;        // tile (block 0, k-tile 0): 16 rows x 16 columns x 2 bf16
    size_t q_block_stride;   // bytes between column blocks
    int n_rows2;             // K of the view / 2
};

// y[i * ldy + c], i < m, c < n_blocks * 16: overwritten (not accumulated).
typedef void (*QGemmFn)(const QView& w, int n_blocks, const ActRows& a, int m, float* y, int ldy);
typedef void (*BGemmFn)(const BView& w, int n_blocks, const uint16_t* const* a, int m, float* y, int ldy);
// Sums the buffer (so the loads cannot be removed); used to measure read bandwidth.
typedef uint64_t (*ReadFn)(const void* p, size_t bytes);
// Runs a register-only int8 dot-product loop for `iters` iterations; returns int8 ops done (2 per MAC).
typedef double (*PeakFn)(int64_t iters);
// layouts/README.md activation quantization of one row: per group of glen values a_s = max|v| / 127,
// a_q = rint(v / a_s) in [-127, 127] and sum(a_q); v has len values, zero past n_valid. Exact in every backend.
typedef void (*QuantRowFn)(const float* v, int n_valid, int len, int glen, int8_t* q, float* s, int32_t* sum);
// The reference (isa_scalar.cpp, baseline ISA).
void quantize_row_ref(const float* v, int n_valid, int len, int glen, int8_t* q, float* s, int32_t* sum);

struct KernelTable {
    const char* name;        // "scalar", "avx2", "avx512", "amx"
    const char* detail;
    QGemmFn qgemm4;          // cpu-expert-int4
    QGemmFn qgemm8;          // cpu-expert-int8
    BGemmFn bgemm;           // cpu-expert-bf16
    ReadFn read_sum;
    PeakFn peak;
    QuantRowFn quantize_row;
    int thread_setup_amx;    // workers must configure AMX tiles (permission requested at load)
    PeakFn tile_peak;        // the AMX tile unit's int8 peak (tdpbssd on tile registers), null without tiles
};

// Token rows above this count per expert take the blocked (prefill) loop; at or below it the streaming (decode) loop.
constexpr int kDecodeMaxRows = 8;
// Prefill column chunks (the Linear and MoE engines' work items) are whole multiples of this many blocks, so every
// backend's prefill tile (Isa::NRP blocks; kernel_body.inc asserts that it divides this) covers a chunk without
// one-block remainders.
constexpr int kPrefillChunkQuantum = 4;

}  // namespace kt
