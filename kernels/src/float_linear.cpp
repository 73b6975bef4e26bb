// kt_float_linear: y = x W^T for float32 rows x and float32 or bfloat16 weights W (a model's output head, stored as
// the checkpoint's bf16), on the context's pool (W's rows split between the workers) or the calling thread.
// Why: the head of a CPU decode step was an MKL GEMM on a float32 copy of the bf16 head: the copy doubles the head's
// bytes (DeepSeek-V3's 129280 x 7168 head: 3.7 GB float32 against 1.85 GB stored, read every step), and each call
// woke torch's OpenMP team beside the kernel pool (a 16-row step's head on the default model: ~0.96 ms in the step
// against ~0.38 ms alone). Numerics: float_dots' fixed order per output (mla_attend_body.inc linear_rows), so a row's
// logits do not depend on the batch, T, the thread count or the ISA.
#include <algorithm>
#include <cstdint>

#include "../include/ktkernels.h"
#include "context.h"
#include "mla_attend.h"

namespace {

constexpr int64_t kSplitRows = 16;   // workers' row ranges start on whole 64-byte lines of y

}  // namespace

extern "C" int kt_float_linear(kt_ctx* ctx, int64_t T, int64_t N, int64_t K, const float* x, int64_t x_stride,
                               const void* w, int w_dtype, int64_t w_stride, float* y, int64_t y_stride) {
    if (T < 0 || N < 1 || K < 16 || K % 16 || !w || w_stride < K || (w_dtype != KT_F32 && w_dtype != KT_BF16) ||
        (T && (!x || x_stride < K || !y || y_stride < N)))
        return -1;
    if (T == 0) return 0;
    const bool bf16 = w_dtype == KT_BF16;
    if (!ctx || N * K < kt::kPoolMinFloats || ctx->engine.pool().n_threads() < 2) {
        kt::float_linear_rows(0, N, K, w, bf16, w_stride, x, x_stride, T, y, y_stride);
        return 0;
    }
    kt::ThreadPool& pool = ctx->engine.pool();
    pool.wait();   // the job in flight may be an earlier one's
    const int64_t blocks = (N + kSplitRows - 1) / kSplitRows;
    pool.launch([=](const kt::WorkerInfo& wi) {
        const int64_t n0 = std::min(N, blocks * wi.index / wi.n_threads * kSplitRows);
        const int64_t n1 = std::min(N, blocks * (wi.index + 1) / wi.n_threads * kSplitRows);
        if (n1 > n0) kt::float_linear_rows(n0, n1, K, w, bf16, w_stride, x, x_stride, T, y, y_stride);
    });
    pool.wait();
    return 0;
}
