// AVX-512 VNNI backend with AVX512_BF16 for the bf16 layout (compiled with the avx512 flags + -mavx512bf16).
#include <immintrin.h>
#include <cstring>

#include "cpu_features.h"

#define KT_AVX512_BF16 1
namespace kt {
namespace {
#include "isa_avx512.inc"
}  // namespace

extern const KernelTable kAvx512Bf16Table = {"avx512", "avx512 (int: vpdpbusd zmm; bf16 layout: vdpbf16ps)",
                                             qgemm<4>, qgemm<8>, bgemm, read_sum, peak, quantize_row, 0, nullptr};
extern const BGemmFn kAvx512Bf16Gemm = bgemm;
}  // namespace kt
