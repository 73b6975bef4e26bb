// AVX2 backend with AVX-VNNI (compiled with -mavx2 -mfma -mavxvnni): vpdpbusd ymm (VEX), FP32 FMA for bf16.
#include <immintrin.h>
#include <cstring>

#include "cpu_features.h"

#define KT_AVX_VNNI 1
namespace kt {
namespace {
#include "isa_avx2.inc"
}  // namespace

extern const KernelTable kAvxVnniTable = {"avx2", "avx2 (int: vpdpbusd ymm, AVX-VNNI; bf16 layout: fp32 fma)",
                                          qgemm<4>, qgemm<8>, bgemm, read_sum, peak, quantize_row, 0, nullptr};
}  // namespace kt
