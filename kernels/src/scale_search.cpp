// kt_search_scales: ktconvert's importance-weighted scale search (ktconvert/scale_search.py, search_scales: the
// reference) for R groups of L values on the calling thread:
//   peak   = the group's signed largest magnitude
//   trials = t = peak / d for the given divisors d; for each, q = clamp(rint(x * (1 / t))) and the weighted
//            least-squares scale for those codes, s = sum(w x q) / sum(w q^2), scored by sum(w x q)^2 / sum(w q^2)
//            (the first best wins)
//   s      = the best trial's scale rounded to the stored dtype; its codes; `refine` least-squares refits (kept when
//            they lower sum w (x - s q)^2); floor: never worse than peak / qmin rounded (the layout's plain rule)
// Why in C: ktconvert's calibrated default spent three quarters of a conversion in this search through torch, ~30
// elementwise passes over memory per trial; here the group stays in registers (a 2048 x 7168 expert matrix in
// groups of 64: 0.7 s on 2 threads in torch; bench/bench_scale_search.py times both, bench/README.md has the numbers).
//
// Where the time goes, per group of 64 (the body keeps the order of operations above, so the bits): the chosen
// scales' codes take rint(x * (1 / s)) and divide only the vectors with a lane near a rounding boundary (rint_div16);
// the trials' lane sums are reduced 8 at a time (reduce8x16: the same additions as reduce16); the choice among the
// trials runs after all of them; the error sums that pick between the chosen scale, its refit and the floor are
// compared as tree sums with a bound (bounded_sum, decide_less), the sequential sums only near a tie. One thread,
// Intel Xeon (AMX host, 2 vCPUs), 2048 x 2048 at 4 bits in groups of 64, the library before these changes and
// after, alternated in one process: 66-70 ms -> 44-46 ms, the same bits (groups of 32: 84-96 -> 58-61 ms).
// Then (2048 x 7168 in groups of 64, 4 bits, importance weights, the same host, alternated in one process): the
// comparisons between equal scales (the refit or the floor equal to the chosen scale: equal errors) decided without
// the sequential sums, AVX-512 140 -> 123 ms; the AVX2 copy's vectors as two 256-bit halves with loads and stores by
// halves (it kept every 64-byte vector on the stack: slower than the scalar twin), AVX2 996 -> 160 ms; the same bits.
//
// Then (2048 x 7168 in groups of 128, 4 bits, importance weights, one thread, AMD EPYC Zen 4): the trials' codes by
// the multiply alone (no check for a lane near a half, no division: the reference takes the same product), their
// sums by fused multiply-adds, two trials per pass over the group, see bench/README.md.
//
// Numerics: sums of products in float (as the reference's; the trials' by fused multiply-adds, std::fma in the
// scalar twin), lane sums of 16 in a fixed order, the gain and the errors in double. The result can differ from the
// torch reference only where two trials' gains tie to the last bits (the reference sums in torch's order);
// tests/test_scale_search_kernel.py bounds that. The body
// (scale_search_body.inc) is compiled for AVX-512, AVX2 and the baseline ISA, chosen once (kt::vector_isa());
// the same IEEE operations in the same order give the same bits in each: the baseline copy is the scalar twin.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "../include/ktkernels.h"
#include "cpu_features.h"

namespace {

typedef double v8d __attribute__((vector_size(64)));

inline float scalar_rint(float v) { return std::nearbyint(v); }   // the default rounding mode: to nearest even

inline float round_scale(float s, int dtype) {
    if (dtype == KT_F16) {                 // clamped to float16's finite range, then rounded to nearest even
        s = std::min(std::max(s, -65504.0f), 65504.0f);
        return (float)(_Float16)s;
    }
    if (dtype == KT_BF16) {                // nearest even on the upper 16 bits (no NaN reaches here)
        uint32_t u;
        memcpy(&u, &s, 4);
        u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        memcpy(&s, &u, 4);
    }
    return s;
}

namespace ref {
#include "vec16_native.inc"
#include "scale_search_native.inc"
inline v16 rint16(v16 v) {
    for (int l = 0; l < 16; ++l) v[l] = std::nearbyint(v[l]);
    return v;
}
inline bool all_le16(v16 v, float b) {
    bool ok = true;
    for (int l = 0; l < 16; ++l) ok &= v[l] <= b;
    return ok;
}
inline v16 clamp16(v16 v, float lo, float hi) {              // v < lo ? lo : v, then v > hi ? hi : v (NaN stays)
    for (int l = 0; l < 16; ++l) {
        v[l] = v[l] < lo ? lo : v[l];
        v[l] = v[l] > hi ? hi : v[l];
    }
    return v;
}
inline v16 fma16(v16 a, v16 b, v16 c) {                     // a b + c, one rounding
    for (int l = 0; l < 16; ++l) a[l] = std::fma(a[l], b[l], c[l]);
    return a;
}
#include "scale_search_body.inc"
}  // namespace ref

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "vec16_avx2.inc"
// v8d as two 256-bit halves too
typedef double v4d __attribute__((vector_size(32)));
struct v8d {
    v4d a, b;
};
inline v8d operator+(v8d x, v8d y) { return {x.a + y.a, x.b + y.b}; }
inline v8d operator*(v8d x, v8d y) { return {x.a * y.a, x.b * y.b}; }
inline v8d load8d(const double* p) { return {(v4d)_mm256_loadu_pd(p), (v4d)_mm256_loadu_pd(p + 4)}; }
inline void store8d(double* p, v8d v) {
    _mm256_storeu_pd(p, (__m256d)v.a);
    _mm256_storeu_pd(p + 4, (__m256d)v.b);
}
inline void reduce8x16(const float* lanes, float* out) {   // reduce16 of each: the same additions
    for (int m = 0; m < 8; ++m) out[m] = reduce16(load16(lanes + 16 * m));
}
inline v16 abs16(v16 v) { return {(v8)((v8i)v.a & 0x7FFFFFFF), (v8)((v8i)v.b & 0x7FFFFFFF)}; }
// max_ps(a, b) is a > b ? a : b and min_ps(a, b) a < b ? a : b (NaN included): native's selects
inline v16 max16(v16 v, v16 m) {
    return {(v8)_mm256_max_ps((__m256)v.a, (__m256)m.a), (v8)_mm256_max_ps((__m256)v.b, (__m256)m.b)};
}
inline v16 min16(v16 v, v16 m) {
    return {(v8)_mm256_min_ps((__m256)v.a, (__m256)m.a), (v8)_mm256_min_ps((__m256)v.b, (__m256)m.b)};
}
inline float lane16(v16 v, int l) { return l < 8 ? v.a[l] : v.b[l - 8]; }
inline v4d widen4(v4 v) { return __builtin_convertvector(v, v4d); }
inline v8d widen_lo(v16 v) {
    return {widen4(__builtin_shufflevector(v.a, v.a, 0, 1, 2, 3)), widen4(__builtin_shufflevector(v.a, v.a, 4, 5, 6, 7))};
}
inline v8d widen_hi(v16 v) {
    return {widen4(__builtin_shufflevector(v.b, v.b, 0, 1, 2, 3)), widen4(__builtin_shufflevector(v.b, v.b, 4, 5, 6, 7))};
}
inline v8d abs8d(v8d v) { return {v.a < v4d{} ? -v.a : v.a, v.b < v4d{} ? -v.b : v.b}; }
inline double lane8d(v8d v, int l) { return l < 4 ? v.a[l] : v.b[l - 4]; }

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
inline v16 rint16(v16 v) { return {(v8)_mm256_round_ps((__m256)v.a, kRound), (v8)_mm256_round_ps((__m256)v.b, kRound)}; }
inline bool all_le16(v16 v, float b) {
    const __m256 bv = _mm256_set1_ps(b);
    const __m256 ok = _mm256_and_ps(_mm256_cmp_ps((__m256)v.a, bv, _CMP_LE_OQ), _mm256_cmp_ps((__m256)v.b, bv, _CMP_LE_OQ));
    return _mm256_movemask_ps(ok) == 0xFF;
}
inline v16 clamp16(v16 v, float lo, float hi) {     // min_ps(hi, max_ps(lo, v)): native's v < lo ? lo : v, v > hi ? hi : v
    const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
    return {(v8)_mm256_min_ps(h, _mm256_max_ps(l, (__m256)v.a)), (v8)_mm256_min_ps(h, _mm256_max_ps(l, (__m256)v.b))};
}
inline v16 fma16(v16 a, v16 b, v16 c) {
    return {(v8)_mm256_fmadd_ps((__m256)a.a, (__m256)b.a, (__m256)c.a), (v8)_mm256_fmadd_ps((__m256)a.b, (__m256)b.b, (__m256)c.b)};
}
#include "scale_search_body.inc"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
#include "vec16_native.inc"
#include "scale_search_native.inc"
inline v16 rint16(v16 v) {
    return (v16)_mm512_roundscale_ps((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline bool all_le16(v16 v, float b) {
    return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(b), _CMP_LE_OQ) == 0xFFFF;
}
inline v16 clamp16(v16 v, float lo, float hi) {              // as avx2::clamp16
    return (v16)_mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), (__m512)v));
}
inline v16 fma16(v16 a, v16 b, v16 c) { return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c); }
#include "scale_search_body.inc"
}  // namespace avx512
#pragma GCC pop_options

using SearchFn = decltype(&ref::search);
const SearchFn kSearch[3] = {ref::search, avx2::search, avx512::search};

}  // namespace

extern "C" int kt_search_scales(int64_t R, int64_t L, const float* x, int64_t x_stride, const float* w,
                                int64_t w_rows, int bits, int scale_dtype, const float* divisors, int n_div,
                                int refine, float* scales, int8_t* codes) {
    if (R < 0 || L <= 0 || x_stride < L || !x || (w && w_rows <= 0) || bits < 2 || bits > 8 || n_div <= 0 ||
        !divisors || refine < 0 || !scales || !codes ||
        (scale_dtype != KT_F32 && scale_dtype != KT_BF16 && scale_dtype != KT_F16))
        return -1;
    for (int d = 0; d < n_div; ++d)
        if (!(divisors[d] != 0.0f) || !std::isfinite(divisors[d])) return -1;
    kSearch[kt::vector_isa()](R, L, x, x_stride, w, w_rows, bits, scale_dtype, divisors, n_div, refine, scales, codes);
    return 0;
}
