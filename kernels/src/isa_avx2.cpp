// AVX2 backend without AVX-VNNI (compiled with -mavx2 -mfma): vpmaddubsw/vpmaddwd int8 dot, FP32 FMA for bf16.
#include <immintrin.h>
#include <cstring>

#include "cpu_features.h"

namespace kt {
namespace {
#include "isa_avx2.inc"
}  // namespace

extern const KernelTable kAvx2Table = {"avx2", "avx2 (int: vpmaddubsw+vpmaddwd; bf16 layout: fp32 fma)",
                                       qgemm<4>, qgemm<8>, bgemm, read_sum, peak, quantize_row, 0, nullptr};
}  // namespace kt
