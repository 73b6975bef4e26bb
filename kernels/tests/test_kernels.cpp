// ctest: every backend this CPU supports against the scalar reference, on random packed int4/int8/bf16 layers
// (the layout only matters for addresses here; the Python tests check the numbers against ktlayouts/numpy).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ktkernels.h"

namespace {

struct RandomLayer {
    int E, H, I, bits, G;
    std::vector<uint8_t> gq, uq, dq;
    std::vector<float> gs, us, ds;
};

int round_up(int x, int m) { return (x + m - 1) / m * m; }

RandomLayer make_layer(int E, int H, int I, int bits, int G, std::mt19937& rng) {
    RandomLayer L{E, H, I, bits, G, {}, {}, {}, {}, {}, {}};
    const bool per_row = bits == 16 || G < 0;
    const int unit = per_row ? 64 : (G % 64 == 0 ? G : 64);
    const int kx = round_up(H, unit), hp = round_up(H, 16);
    const double tb = bits == 4 ? 0.5 : 1.0;       // bytes per code (bf16: 2 bytes per value, tiles 32 wide)
    const size_t gate_bytes = (size_t)(E * I * kx * (bits == 16 ? 2.0 : tb));
    const size_t down_bytes = (size_t)(E * hp * I * (bits == 16 ? 2.0 : tb));
    std::uniform_int_distribution<int> byte(0, 255);
    auto fill = [&](std::vector<uint8_t>& v, size_t n) {
        v.resize(n);
        for (auto& b : v) b = (uint8_t)byte(rng);
        if (bits == 16)   // keep bf16 values finite and moderate: exponent byte around 0x3c..0x3f
            for (size_t i = 1; i < n; i += 2) v[i] = (uint8_t)(0x3c + (v[i] & 3) + (v[i] & 0x80));
    };
    fill(L.gq, gate_bytes); fill(L.uq, gate_bytes); fill(L.dq, down_bytes);
    std::normal_distribution<float> nd(0.0f, 0.01f);
    const int ngx = per_row ? 1 : kx / G, ngd = per_row ? 1 : I / G;
    L.gs.resize((size_t)E * I * ngx); L.us.resize(L.gs.size()); L.ds.resize((size_t)E * hp * ngd);
    for (auto* v : {&L.gs, &L.us, &L.ds}) for (auto& s : *v) s = nd(rng);
    return L;
}

std::vector<float> run(const char* backend, const RandomLayer& L, int T, int k, const std::vector<float>& x,
                       const std::vector<int32_t>& ids, const std::vector<float>& w, int threads, int pools,
                       const uint8_t* skip = nullptr) {
    kt_ctx* ctx = kt_create(threads, pools, backend);
    if (!ctx) { std::printf("create %s: %s\n", backend, kt_last_error()); return {}; }
    const bool int_layout = L.bits != 16;
    kt_shard_piece p{L.gq.data(), int_layout ? L.gs.data() : nullptr, L.uq.data(), int_layout ? L.us.data() : nullptr,
                     L.dq.data(), int_layout ? L.ds.data() : nullptr, 0, L.I, 0, L.I, 0};
    std::vector<float> out((size_t)T * L.H, 0.0f);
    if (kt_add_layer(ctx, 0, L.E, L.H, L.I, L.bits, L.G, 1, &p) != 0 ||
        (skip ? kt_submit_masked(ctx, 0, T, x.data(), KT_F32, L.H, k, ids.data(), w.data(), out.data(), L.H, 0, skip)
              : kt_submit(ctx, 0, T, x.data(), KT_F32, L.H, k, ids.data(), w.data(), out.data(), L.H, 0)) != 0 ||
        kt_sync(ctx) != 0) {
        std::printf("%s: %s\n", backend, kt_last_error());
        out.clear();
    }
    kt_destroy(ctx);
    return out;
}

}  // namespace

int main() {
    std::mt19937 rng(1234);
    int failures = 0;
    struct Case { int bits, G, T, k; };
    // rows per expert (E = 6): ~1-2 (decode, split chains), ~26 (prefill tiles + tails), ~6 (decode with prefetch)
    const Case cases[] = {{4, 32, 1, 2}, {8, 64, 3, 4}, {4, 128, 20, 8}, {8, -1, 9, 1}, {16, -1, 5, 3},
                          {8, 128, 6, 6}, {4, -1, 7, 5}};
    for (const Case& c : cases) {
        const int E = 6, H = 96, I = c.G == 128 ? 256 : 128;
        RandomLayer L = make_layer(E, H, I, c.bits, c.G, rng);
        std::vector<float> x((size_t)c.T * H), w((size_t)c.T * c.k);
        std::vector<int32_t> ids((size_t)c.T * c.k);
        std::normal_distribution<float> nd;
        for (auto& v : x) v = nd(rng);
        for (auto& v : w) v = std::fabs(nd(rng));
        for (auto& v : ids) v = (int32_t)(rng() % E);
        const std::vector<float> ref = run("scalar", L, c.T, c.k, x, ids, w, 1, 1);
        for (const char* b : {"avx2", "avx512", "amx"}) {
            if (!kt_backend_supported(b)) { std::printf("SKIP %s: not supported by this CPU\n", b); continue; }
            const std::vector<float> got = run(b, L, c.T, c.k, x, ids, w, 2, 1);
            double err = 0, mag = 1e-30;
            for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
                err = std::fmax(err, std::fabs(got[i] - ref[i]));
                mag = std::fmax(mag, std::fabs(ref[i]));
            }
            const bool ok = got.size() == ref.size() && !ref.empty() && err <= 2e-3 * mag;
            std::printf("%s %s bits=%d G=%d T=%d k=%d max_err=%.3g (max |ref| %.3g)\n", ok ? "ok  " : "FAIL", b,
                        c.bits, c.G, c.T, c.k, err, mag);
            failures += !ok;
        }
    }
    // The expert mask (kt_submit_masked): skipped experts count exactly as ids of -1, bit for bit, on every backend
    // (all of them, scalar included); a mask skipping every routed expert leaves out = 0.
    for (const Case& c : {Case{4, 32, 5, 3}, Case{8, -1, 12, 4}, Case{16, -1, 3, 2}}) {
        const int E = 6, H = 96, I = 128;
        RandomLayer L = make_layer(E, H, I, c.bits, c.G, rng);
        std::vector<float> x((size_t)c.T * H), w((size_t)c.T * c.k);
        std::vector<int32_t> ids((size_t)c.T * c.k);
        std::normal_distribution<float> nd;
        for (auto& v : x) v = nd(rng);
        for (auto& v : w) v = std::fabs(nd(rng));
        for (auto& v : ids) v = (int32_t)(rng() % E);
        const uint8_t skip[E] = {1, 0, 0, 1, 0, 1}, all[E] = {1, 1, 1, 1, 1, 1};
        std::vector<int32_t> cut = ids;
        for (auto& v : cut) if (skip[v]) v = -1;
        for (const char* b : {"scalar", "avx2", "avx512", "amx"}) {
            if (!kt_backend_supported(b)) { std::printf("SKIP mask %s: not supported by this CPU\n", b); continue; }
            const std::vector<float> want = run(b, L, c.T, c.k, x, cut, w, 2, 1);
            const std::vector<float> got = run(b, L, c.T, c.k, x, ids, w, 2, 1, skip);
            const std::vector<float> none = run(b, L, c.T, c.k, x, ids, w, 2, 1, all);
            bool ok = !want.empty() && got == want && none.size() == want.size();
            for (float v : none) ok = ok && v == 0.0f;
            std::printf("%s mask %s bits=%d G=%d T=%d k=%d\n", ok ? "ok  " : "FAIL", b, c.bits, c.G, c.T, c.k);
            failures += !ok;
        }
    }
    return failures ? 1 : 0;
}
