// Scalar reference backend: the spec of layouts/README.md in plain C++, read straight from the packed bytes.
// The SIMD backends compute the same integer dots and the same float operations in the same order.
#include <cmath>
#include <cstring>

#include "cpu_features.h"

namespace kt {
namespace {

// Code of column c (0..15) of block nb at K index k of the view (int8 or int4 tile layout).
template <int BITS>
inline int code_at(const QView& w, int nb, int c, int k) {
    const int r = k / 4, j = k % 4, kt = r / 16, rr = r % 16;
    const uint8_t* tile = w.q + (size_t)nb * w.q_block_stride + (size_t)kt * (BITS == 8 ? 1024 : 512);
    if (BITS == 8) return tile[rr * 64 + 4 * c + j];
    const uint8_t byte = tile[(rr / 2) * 64 + 4 * c + j];
    return (rr % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
}

template <int BITS>
void qgemm_ref(const QView& w, int n_blocks, const ActRows& a, int m, float* y, int ldy) {
    const int32_t Z = BITS == 8 ? 128 : 8;
    const int glen = w.group_rows * 4, n_groups = w.n_rows4 / w.group_rows;
    for (int i = 0; i < m; ++i)
        for (int nb = 0; nb < n_blocks; ++nb)
            for (int c = 0; c < 16; ++c) {
                float acc_f = 0.0f;
                for (int g = 0; g < n_groups; ++g) {
                    int32_t acc = 0;
                    for (int k = g * glen; k < (g + 1) * glen; ++k) acc += (int32_t)a.q[i][k] * code_at<BITS>(w, nb, c, k);
                    const float scale = scale_to_f32(w.s, w.s_type, (size_t)nb * w.s_block_stride + (size_t)g * 16 + c);
                    acc_f = std::fma((float)(acc - Z * a.sum[i][g]), scale * a.s[i][g], acc_f);
                }
                y[(size_t)i * ldy + nb * 16 + c] = acc_f;
            }
}

inline float bf16_to_f32(uint32_t bits) {
    const uint32_t u = bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// bf16 layout: acc = fma(w[2r], a[2r], acc); acc = fma(w[2r+1], a[2r+1], acc) over r.
void bgemm_ref(const BView& w, int n_blocks, const uint16_t* const* a, int m, float* y, int ldy) {
    for (int i = 0; i < m; ++i)
        for (int nb = 0; nb < n_blocks; ++nb)
            for (int c = 0; c < 16; ++c) {
                float acc = 0.0f;
                for (int r = 0; r < w.n_rows2; ++r) {
                    const uint8_t* row = w.q + (size_t)nb * w.q_block_stride + (size_t)(r / 16) * 1024 + (r % 16) * 64;
                    uint16_t we, wo;
                    memcpy(&we, row + 4 * c, 2);
                    memcpy(&wo, row + 4 * c + 2, 2);
                    acc = std::fma(bf16_to_f32(we), bf16_to_f32(a[i][2 * r]), acc);
                    acc = std::fma(bf16_to_f32(wo), bf16_to_f32(a[i][2 * r + 1]), acc);
                }
                y[(size_t)i * ldy + nb * 16 + c] = acc;
            }
}

uint64_t read_sum(const void* p, size_t bytes) {
    const uint64_t* v = (const uint64_t*)p;
    uint64_t s = 0;
    for (size_t i = 0; i < bytes / 8; ++i) s += v[i];
    return s;
}

double peak(int64_t iters) {
    int32_t acc[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    volatile int8_t wv = 3, xv = -2;
    const int32_t w = wv, x = xv;
    for (int64_t it = 0; it < iters; ++it)
        for (int i = 0; i < 8; ++i) acc[i] += w * (x + i);
    volatile int32_t sink = acc[0] + acc[7];
    (void)sink;
    return (double)iters * 8 * 2;
}

}  // namespace

// layouts/README.md "Activations": per group a_s = max|v| / 127, a_q = rint(v / a_s) in [-127, 127].
// v has `len` values (zero padded past n_valid), glen per group.
void quantize_row_ref(const float* v, int n_valid, int len, int glen, int8_t* q, float* s, int32_t* sum) {
    for (int g = 0; g < len / glen; ++g) {
        const int k0 = g * glen, k1 = k0 + glen;
        float amax = 0.0f;
        for (int k = k0; k < k1 && k < n_valid; ++k) amax = std::fmax(amax, std::fabs(v[k]));
        const float scale = amax / 127.0f;
        const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        int32_t total = 0;
        for (int k = k0; k < k1; ++k) {
            float r = k < n_valid ? std::nearbyint(v[k] * inv) : 0.0f;
            r = std::fmin(127.0f, std::fmax(-127.0f, r));
            q[k] = (int8_t)r;
            total += (int32_t)r;
        }
        s[g] = scale;
        sum[g] = total;
    }
}

extern const KernelTable kScalarTable = {"scalar", "scalar (reference)", qgemm_ref<4>, qgemm_ref<8>, bgemm_ref,
                                         read_sum, peak, quantize_row_ref, 0, nullptr};
}  // namespace kt
