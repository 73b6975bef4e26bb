// AVX-512 VNNI backend (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mfma); bf16 layout by FP32 FMA.
#include <immintrin.h>
#include <cstring>

#include "cpu_features.h"

namespace kt {
namespace {
#include "isa_avx512.inc"
}  // namespace

extern const KernelTable kAvx512Table = {"avx512", "avx512 (int: vpdpbusd zmm; bf16 layout: fp32 fma)",
                                         qgemm<4>, qgemm<8>, bgemm, read_sum, peak, quantize_row, 0, nullptr};
}  // namespace kt
