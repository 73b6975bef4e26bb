// kt_rope: rotary position embedding of float32 (T, heads, 2*half) rows on the calling thread, bit-identical to
// ktrun.models.layers.Rope.apply's torch ops (x1 * cos - x2 * sin, x2 * cos + x1 * sin, concatenated): each product
// is rounded before the add, as torch's separate ops round it, so this file is built without FMA contraction
// (CMakeLists.txt). A decode step ropes MLA's (1, 128, 64) query and (1, 1, 64) key per layer; torch's version is
// ~11 aten ops (slices, broadcasts, 4 muls, sub, add, cat), ~65 us each in a decode step with cold caches.
#include <cstdint>

#include "../include/ktkernels.h"

extern "C" int kt_rope(int64_t T, int64_t H, int64_t half, const float* x, int64_t x_stride_t, int64_t x_stride_h,
                       const float* cos, const float* sin, int64_t cs_stride, int interleaved, float* out,
                       int64_t out_stride_t, int64_t out_stride_h) {
    if (T < 0 || H < 0 || half < 1 || !x || !cos || !sin || !out) return -1;
    const int64_t step = interleaved ? 2 : 1, second = interleaved ? 1 : half;   // x1[i] = x[i*step], x2 = +second
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cos + t * cs_stride;
        const float* s = sin + t * cs_stride;
        for (int64_t h = 0; h < H; ++h) {
            const float* xr = x + t * x_stride_t + h * x_stride_h;
            float* o = out + t * out_stride_t + h * out_stride_h;
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = xr[i * step], x2 = xr[i * step + second];
                const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
                o[i] = a - b;
                o[half + i] = d + e;
            }
        }
    }
    return 0;
}
