// The AVX-512 VNNI qgemm body (kernels/src/kernel_body.inc, the one the avx512 and amx backends run for decode
// rows), or with -DKT_HOT_AVX2 the avx2 backend's, on one matrix hot in L2, one thread: its compute rate in weight
// bytes per second, to set against the memory read bandwidth of one thread (bench_qgemm_hot.py builds and runs
// this; it is not part of the library).
// Codes are random, scales 1.0 (float16) or two-level records with d = 1.0; the numbers do not depend on them.
// Prints `name: value unit` lines: per rows m, GB/s of codes + scales for int4 f16 g64, int4 sub6 g32 (both
// 4.25 bits/weight), int8 f16 g32, timed alternately, best of the rounds, and the int8 operations per second (2 per
// weight and row).
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel_types.h"

namespace kt {
// The library's decode prefetch hint (cpu_features.cpp) without linking it: KT_DECODE_PREFETCH=nta, else t1. The
// matrix here is hot in L2, where the hint does not move the rate much; the library picks nta on AMD.
bool decode_prefetch_nta() {
    const char* env = std::getenv("KT_DECODE_PREFETCH");
    return env && std::strcmp(env, "nta") == 0;
}
namespace {
#ifdef KT_HOT_AVX2
#include "isa_avx2.inc"   // the avx2 backend's body (vpmaddubsw + vpmaddwd, F16C scales)
#else
#include "isa_avx512.inc"
#endif
}  // namespace

struct Case { const char* name; QView w; int bits, n_blocks; double bytes; };

void run(int m, int K, int NB, int rounds) {
    std::vector<uint8_t> q((size_t)NB * 16 * K);                      // int8: NB/2 blocks; int4: NB blocks
    for (auto& b : q) b = (uint8_t)rand();
    std::vector<uint16_t> s64((size_t)NB * (K / 64) * 16, 0x3c00), s32((size_t)NB * (K / 32) * 16, 0x3c00);
    std::vector<uint8_t> rec((size_t)NB * (K / 32) * 16);            // two-level records, d = 1.0
    for (size_t i = 0; i < rec.size(); ++i) rec[i] = (uint8_t)rand();
    for (size_t r = 0; r < rec.size(); r += 128)
        for (int c = 0; c < 16; ++c) { rec[r + 64 + 2 * c] = 0x00; rec[r + 65 + 2 * c] = 0x3c; }
    std::vector<int8_t> aq((size_t)m * K);
    for (auto& v : aq) v = (int8_t)(rand() % 255 - 127);
    std::vector<float> as((size_t)m * K / 32, 0.01f);
    std::vector<int32_t> sum((size_t)m * K / 32, 3);
    std::vector<const int8_t*> pq(m);
    std::vector<const float*> ps(m);
    std::vector<const int32_t*> pu(m);
    for (int i = 0; i < m; ++i) {
        pq[i] = aq.data() + (size_t)i * K; ps[i] = as.data() + (size_t)i * K / 32; pu[i] = sum.data() + (size_t)i * K / 32;
    }
    const ActRows a{pq.data(), ps.data(), pu.data(), 0};
    std::vector<float> y((size_t)m * NB * 16);
    const double w4 = (double)NB * 16 * K;                           // int4 weights; int8 runs half the blocks
    Case cases[] = {
        {"int4_f16_g64", {q.data(), s64.data(), (size_t)K / 2 * 16, (size_t)(K / 64) * 16, K / 4, 16, kScaleF16}, 4, NB,
         w4 * (0.5 + 2.0 / 64)},
        {"int4_sub6_g32", {q.data(), rec.data(), (size_t)K / 2 * 16, (size_t)(K / 32) * 16, K / 4, 8, kScaleSub6}, 4, NB,
         w4 * (0.5 + 1.0 / 32)},
        {"int8_f16_g32", {q.data(), s32.data(), (size_t)K * 16, (size_t)(K / 32) * 16, K / 4, 8, kScaleF16}, 8, NB / 2,
         w4 / 2 * (1.0 + 2.0 / 32)},
    };
    double best[3] = {1e30, 1e30, 1e30};
    const int iters = std::max(4, 400 / m);
    for (int r = 0; r < rounds; ++r)
        for (int c = 0; c < 3; ++c) {
            const Case& k = cases[c];
            const auto t0 = std::chrono::steady_clock::now();
            for (int it = 0; it < iters; ++it)
                (k.bits == 4 ? qgemm<4> : qgemm<8>)(k.w, k.n_blocks, a, m, y.data(), NB * 16);
            best[c] = std::min(best[c], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters);
        }
    for (int c = 0; c < 3; ++c) {
        std::printf("qgemm_hot_%s_T%d: %.1f GB/s\n", cases[c].name, m, cases[c].bytes / best[c] / 1e9);
        const double weights = cases[c].bits == 4 ? w4 : w4 / 2;
        std::printf("qgemm_hot_%s_T%d_compute: %.1f GOP/s\n", cases[c].name, m, 2.0 * weights * m / best[c] / 1e9);
    }
    std::printf("qgemm_hot_T%d_sub6_g32_vs_f16_g64: %.3f x time\n", m, best[1] / best[0]);
}

}  // namespace kt

int main(int argc, char** argv) {
    const int K = 7168, NB = argc > 1 ? atoi(argv[1]) : 8;   // 8 blocks: 0.93 MB of int4 codes, in a 2 MB L2
    const int rounds = argc > 2 ? atoi(argv[2]) : 7;
    for (int i = 3; i < argc; ++i) kt::run(atoi(argv[i]), K, NB, rounds);
    if (argc <= 3)
        for (int m : {1, 2, 4, 8}) kt::run(m, K, NB, rounds);
    fflush(stdout);
    return 0;
}
