// kt_rms_norm: float32 RMSNorm of decode-sized rows on the calling thread, bit-identical to torch's CPU float32
// F.rms_norm (its composite: pow(x, 2).mean(-1) + eps, rsqrt, x * r, * w), optionally after a residual add.
//
// Why in C: a decode step runs 13 norms; torch's composite is 8 aten ops each, and right after a kernel job has
// streamed hundreds of MB through the caches each op's dispatch took ~7-15 us (53-114 us per norm, 10 us hot), while
// the pool idled. Here one call does the row's ~10k float ops.
//
// Bit-identity: every step is the float32 operation torch does, in torch's order. The elementwise steps are exact
// whatever the order; the sum of squares follows torch's cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp,
// vectorized_inner_sum -> row_sum -> multi_row_sum) for a contiguous row of D >= `lanes` floats: `lanes` = the float
// count of torch's Vectorized<float> (16 with its AVX-512 kernels, 8 with AVX2 / default), the row read as vectors
// of `lanes`, 4 interleaved vector accumulators (ilp) cascaded over 4 levels of 2^level_power vectors each, the
// leftover vectors into accumulator 0, the accumulators summed 1..3 into 0, then the tail floats summed from 0 and
// the lanes added to that in order. The caller (ktrun.models.layers) passes torch's width and checks the result
// against torch once per process. Plain C++ with no ISA flags and no FMA contraction (CMakeLists.txt: the products
// x*x and x*r are rounded before the adds, as torch's separate ops round them), so there is no SIMD path to twin.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../include/ktkernels.h"

namespace {

constexpr int kIlp = 4;        // row_sum's ilp_factor
constexpr int kLevels = 4;     // multi_row_sum's num_levels

int64_t ceil_log2(int64_t x) {  // c10 CeilLog2: 1 for x <= 2, else bit width of x - 1
    if (x <= 2) return 1;
    int64_t b = 0;
    for (uint64_t v = uint64_t(x - 1); v; v >>= 1) ++b;
    return b;
}

// torch's vectorized_inner_sum of x[e]^2 (each square rounded to float32 first, as pow(x, 2) stores it), D >= L.
// L lanes as fixed-size arrays: plain C++ the compiler vectorizes lane-wise (each lane is its own chain of adds).
template <int L>
float cascade_sum_sq(const float* x, int64_t D) {
    const int64_t n_vec = D / L, n_ilp = n_vec / kIlp;
    const int64_t level_power = std::max<int64_t>(4, ceil_log2(n_ilp) / kLevels);
    const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
    float acc[kLevels][kIlp][L] = {};
    auto add_vec = [](float (&a)[L], const float* v) {
        for (int l = 0; l < L; ++l) {
            const float q = v[l] * v[l];
            a[l] += q;
        }
    };
    int64_t i = 0;
    while (i + level_step <= n_ilp) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], x + (i * kIlp + k) * L);
        for (int j = 1; j < kLevels; ++j) {
            for (int k = 0; k < kIlp; ++k)
                for (int l = 0; l < L; ++l) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < n_ilp; ++i)
        for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], x + (i * kIlp + k) * L);
    for (int j = 1; j < kLevels; ++j)
        for (int k = 0; k < kIlp; ++k)
            for (int l = 0; l < L; ++l) acc[0][k][l] += acc[j][k][l];
    float* p0 = acc[0][0];
    for (int64_t v = n_ilp * kIlp; v < n_vec; ++v) add_vec(acc[0][0], x + v * L);   // leftover vectors
    for (int k = 1; k < kIlp; ++k)
        for (int l = 0; l < L; ++l) p0[l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = n_vec * L; e < D; ++e) {      // the tail floats, then the lanes in order
        const float q = x[e] * x[e];
        total += q;
    }
    for (int l = 0; l < L; ++l) total += p0[l];
    return total;
}

}  // namespace

extern "C" int kt_rms_norm(int64_t T, int64_t D, const float* x, int64_t x_stride, const float* delta,
                           int64_t delta_stride, float* sum_out, int64_t sum_stride, const float* weight, float eps,
                           int lanes, float* out, int64_t out_stride) {
    if ((lanes != 8 && lanes != 16) || D < lanes || T < 0 || !x || !out || (delta && !sum_out)) return -1;
    for (int64_t t = 0; t < T; ++t) {
        const float* xr = x + t * x_stride;
        if (delta) {           // x + delta, rounded, is the row that is normed (and written to sum_out)
            const float* dr = delta + t * delta_stride;
            float* s = sum_out + t * sum_stride;
            for (int64_t e = 0; e < D; ++e) s[e] = xr[e] + dr[e];
            xr = s;
        }
        const float sum = lanes == 8 ? cascade_sum_sq<8>(xr, D) : cascade_sum_sq<16>(xr, D);
        const float r = 1.0f / std::sqrt(sum / float(D) + eps);
        float* o = out + t * out_stride;
        if (weight)
            for (int64_t e = 0; e < D; ++e) o[e] = (xr[e] * r) * weight[e];
        else
            for (int64_t e = 0; e < D; ++e) o[e] = xr[e] * r;
    }
    return 0;
}
