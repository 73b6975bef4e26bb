// kt_gptq_block: the inside of one block of GPTQ's column loop (ktconvert/gpu/gptq.py, _quantize_columns: the
// reference), on the calling thread. For the block's rows i = 0 .. B-1 of the transposed weight (K, N) in processing
// order, column by column:
//   at a group's first row: the group's scales, searched (kt_search_scales on the group's rows as updated so far,
//                           weighted by diag(H)) or given (two-level fixed scales, one per-row scale)
//   codes  c = clamp(rint(w_i / s) + Z, 0, 2^b - 1)         (s = 1 where the group's scale is 0)
//   error  e = (w_i - (c - Z) s) / U_ii
//   update w_r = w_r - (U_ir e) for the block's later rows r (the product rounded, then the subtraction)
// The update of the rows after the block (one matrix product with the errors) stays with the caller.
// Why in C: the reference runs ~10 torch ops per column (a rank-1 update of up to 127 rows of N floats among them);
// py-spy put the column loop at ~40% of GPTQ's time on a 7168 x 2048 routed-expert down_proj. Here every output row
// is independent, so the block is done kChunk outputs at a time, the chunk's rows copied together (the weight's rows
// are N floats apart, a multiple of 4 KB for N = 7168: the same cache sets) and updated in L1.
// Numerics: the reference's operations in its order per value, so the codes, scales and errors are the reference's bit
// for bit (tests/test_gptq_kernel.py), on every ISA. (The reference used torch's addr_ for the update before: it fuses
// the multiply-add in its vector loop and not in its remainder, which depends on torch's CPU capability; a product
// and a subtraction give the same bits everywhere.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../include/ktkernels.h"
#include "cpu_features.h"

namespace {

constexpr int64_t kChunk = 64;                    // outputs per pass: B rows x 64 floats (32 KB at B = 128) in L1
constexpr float kRounder = 1.5f * 8388608.0f;     // 1.5 x 2^23: (x + it) - it rounds a float to an integer

struct GptqBlock {
    int64_t B, N;
    const float* w;
    int64_t w_stride;
    const float* u;
    int64_t u_stride;
    int64_t group;
    int search;
    const float* hdiag;
    int bits, scale_dtype;
    const float* divisors;
    int n_div, refine;
    float* scales;
    int64_t s_stride;
    uint8_t* codes;
    int64_t codes_stride;
    float* err;
    int64_t err_stride;
};

namespace ref {
#include "gptq_block_body.inc"
}  // namespace ref

#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
#include "gptq_block_body.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {
#include "gptq_block_body.inc"
}  // namespace avx512
#pragma GCC pop_options

using BlockFn = decltype(&ref::gptq_block);
const BlockFn kBlock[3] = {ref::gptq_block, avx2::gptq_block, avx512::gptq_block};

}  // namespace

extern "C" int kt_gptq_block(int64_t B, int64_t N, const float* w, int64_t w_stride, const float* u, int64_t u_stride,
                             int64_t group, int search, const float* hdiag, int bits, int scale_dtype,
                             const float* divisors, int n_div, int refine, float* scales, int64_t s_stride,
                             uint8_t* codes, int64_t codes_stride, float* err, int64_t err_stride) {
    if (B <= 0 || N <= 0 || !w || w_stride < N || !u || u_stride < B || group <= 0 || bits < 2 || bits > 8 ||
        !scales || s_stride < N || !codes || codes_stride < N || !err || err_stride < N ||
        (search && (!hdiag || !divisors || n_div <= 0 || refine < 0 ||
                    (scale_dtype != KT_F32 && scale_dtype != KT_BF16 && scale_dtype != KT_F16))))
        return -1;
    for (int d = 0; search && d < n_div; ++d)
        if (!(divisors[d] != 0.0f) || !std::isfinite(divisors[d])) return -1;
    try {
        kBlock[kt::vector_isa()](GptqBlock{B, N, w, w_stride, u, u_stride, group, search, hdiag, bits,
                                           scale_dtype, divisors, n_div, refine, scales, s_stride, codes, codes_stride,
                                           err, err_stride});
    } catch (const std::bad_alloc&) {
        return -1;
    }
    return 0;
}
