// ctest: the dense Linear op and the GPU-code repack.
//  1. kt_linear_repack from (K, N) bytes, (N, K) bytes, gptq words (K/f, N) and compressed-tensors words (N, K/f)
//     gives the tile bytes of the README formula (written out here independently) and exactly widened scales.
//  2. Every backend this CPU supports computes the same bits as the scalar reference (int paths are exact), for
//     decode and prefill token counts, one Linear at a time and two sharing one input, and is close to a double
//     matmul of the dequantized weights.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ktkernels.h"

namespace {

int round_up(int x, int m) { return (x + m - 1) / m * m; }

struct Geometry {
    int n, k, bits, G, kx, glen, ng, nb;
    Geometry(int n_, int k_, int bits_, int G_) : n(n_), k(k_), bits(bits_), G(G_) {
        kx = round_up(k, G > 0 && G % 64 == 0 ? G : 64);
        glen = G < 0 ? kx : G;
        ng = kx / glen;
        nb = round_up(n, 16) / 16;
    }
    size_t q_bytes() const { return (size_t)nb * (kx / 64) * (bits == 4 ? 512 : 1024); }
    size_t s_floats() const { return (size_t)nb * ng * 16; }
};

// README: tile[nb, kt] row r, byte 4c + j = code[16 nb + c, 64 kt + 4 r + j]; int4 rows 2h / 2h+1 share chunk h as
// low / high nibbles. codes_kn: (K, N); padding code Z.
std::vector<uint8_t> reference_tiles(const Geometry& g, const std::vector<uint8_t>& codes_kn) {
    const int z = 1 << (g.bits - 1);
    std::vector<uint8_t> q(g.q_bytes(), 0);
    const size_t tb = g.bits == 4 ? 512 : 1024;
    for (int nn = 0; nn < g.nb * 16; ++nn)
        for (int kk = 0; kk < g.kx; ++kk) {
            const int code = nn < g.n && kk < g.k ? codes_kn[(size_t)kk * g.n + nn] : z;
            const int nb = nn / 16, c = nn % 16, kt = kk / 64, r = (kk % 64) / 4, j = kk % 4;
            uint8_t* tile = q.data() + ((size_t)nb * (g.kx / 64) + kt) * tb;
            if (g.bits == 8) tile[r * 64 + 4 * c + j] = (uint8_t)code;
            else tile[(r / 2) * 64 + 4 * c + j] |= (uint8_t)(r % 2 ? code << 4 : code);
        }
    return q;
}

float half_ref(uint16_t h) {   // ldexp formulation (not the library's bit manipulation)
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? std::ldexp((float)m, -24) : std::ldexp((float)(m + 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}

struct Gpu {   // one random GPU-quantized Linear, in every code container the repack reads
    Geometry g;
    std::vector<uint8_t> kn, nk;        // (K, N), (N, K) bytes
    std::vector<uint32_t> gptq, ct;     // (K/f, N), (N, K/f) words
    std::vector<uint16_t> scales;       // (K/G, N) f16
    Gpu(const Geometry& geom, std::mt19937& rng) : g(geom) {
        const int f = 32 / g.bits, gg = g.G < 0 ? 1 : g.k / g.G;
        kn.resize((size_t)g.k * g.n); nk.resize(kn.size());
        gptq.assign((size_t)g.k / f * g.n, 0); ct.assign(gptq.size(), 0);
        for (int kk = 0; kk < g.k; ++kk)
            for (int nn = 0; nn < g.n; ++nn) {
                const uint32_t c = rng() & ((1u << g.bits) - 1);
                kn[(size_t)kk * g.n + nn] = nk[(size_t)nn * g.k + kk] = (uint8_t)c;
                gptq[(size_t)(kk / f) * g.n + nn] |= c << (g.bits * (kk % f));
                ct[(size_t)nn * (g.k / f) + kk / f] |= c << (g.bits * (kk % f));
            }
        scales.resize((size_t)gg * g.n);
        for (auto& s : scales) s = (uint16_t)(((rng() % 8 + 8) << 10) | (rng() & 1023) | (rng() & 0x8000));  // ~2^-7..1
    }
};

struct Packed { std::vector<uint8_t> q; std::vector<float> s; };

bool repack(kt_ctx* ctx, const Gpu& w, int kind, const void* codes, int64_t sk, int64_t sn, Packed& out) {
    out.q.assign(w.g.q_bytes(), 0xAB);
    out.s.assign(w.g.s_floats(), -1.0f);
    if (kt_linear_repack(ctx, w.g.n, w.g.k, w.g.bits, w.g.G, codes, kind, sk, sn, w.scales.data(), w.g.n, 1,
                         out.q.data(), out.s.data()) != 0) {
        std::printf("repack: %s\n", kt_last_error());
        return false;
    }
    return true;
}

int check_repack(kt_ctx* ctx, const Gpu& w, Packed& packed) {
    const Geometry& g = w.g;
    const int f = 32 / g.bits, gg = g.G < 0 ? 1 : g.k / g.G;
    const std::vector<uint8_t> want = reference_tiles(g, w.kn);
    std::vector<float> want_s(g.s_floats(), 0.0f);
    for (int b = 0; b < g.nb; ++b)
        for (int q = 0; q < gg; ++q)
            for (int c = 0; c < 16 && b * 16 + c < g.n; ++c) want_s[((size_t)b * g.ng + q) * 16 + c] = half_ref(w.scales[(size_t)q * g.n + b * 16 + c]);
    struct Src { const char* name; int kind; const void* p; int64_t sk, sn; } srcs[] = {
        {"u8 (K,N)", KT_CODES_U8, w.kn.data(), g.n, 1}, {"u8 (N,K)", KT_CODES_U8, w.nk.data(), 1, g.k},
        {"gptq words", KT_CODES_PACKED_K, w.gptq.data(), g.n, 1}, {"ct words", KT_CODES_PACKED_K, w.ct.data(), 1, g.k / f}};
    int failures = 0;
    for (const Src& s : srcs) {
        Packed p;
        const bool ok = repack(ctx, w, s.kind, s.p, s.sk, s.sn, p) && p.q == want &&
                        memcmp(p.s.data(), want_s.data(), want_s.size() * 4) == 0;
        std::printf("%s repack %-10s int%d G=%d N=%d K=%d\n", ok ? "ok  " : "FAIL", s.name, g.bits, g.G, g.n, g.k);
        failures += !ok;
        if (ok) packed = p;
    }
    return failures;
}

// y (T, N) for the given linears sharing x (one submit), each into its own slice of one wide output row.
std::vector<float> run_linears(const char* backend, const std::vector<const Packed*>& ws, const Geometry& g, int T,
                               const std::vector<float>& x) {
    kt_ctx* ctx = kt_create(2, 1, backend);
    if (!ctx) { std::printf("create %s: %s\n", backend, kt_last_error()); return {}; }
    const int L = (int)ws.size(), width = L * g.n + 3;   // + 3: outputs are row views into a wider buffer
    std::vector<float> out((size_t)T * width, 7.0f);
    std::vector<int32_t> ids;
    std::vector<float*> outs;
    std::vector<int64_t> strides;
    bool ok = true;
    for (int i = 0; i < L; ++i) {
        ok = ok && kt_add_linear(ctx, 10 + i, g.n, g.k, g.bits, g.G, ws[i]->q.data(), ws[i]->s.data()) == 0;
        ids.push_back(10 + i);
        outs.push_back(out.data() + i * g.n);
        strides.push_back(width);
    }
    ok = ok && kt_linear_submit(ctx, L, ids.data(), T, x.data(), KT_F32, g.k, outs.data(), strides.data()) == 0 &&
         kt_sync(ctx) == 0;
    if (!ok) { std::printf("%s: %s\n", backend, kt_last_error()); out.clear(); }
    kt_destroy(ctx);
    return out;
}

}  // namespace

int main() {
    std::mt19937 rng(77);
    int failures = 0;
    kt_ctx* ctx = kt_create(2, 1, "scalar");
    struct Case { int n, k, bits, G; };
    // N 72 / 40: a partial last column block; K 96 with G 32 / -1: K_pad 128; K 256 with G 128: two groups
    const Case cases[] = {{72, 96, 4, 32}, {40, 256, 4, 128}, {72, 96, 8, -1}, {48, 192, 8, 64}, {40, 128, 4, -1}};
    for (const Case& c : cases) {
        const Geometry g(c.n, c.k, c.bits, c.G);
        const Gpu a(g, rng), b(g, rng);
        Packed pa, pb;
        failures += check_repack(ctx, a, pa) + check_repack(ctx, b, pb);
        for (int T : {1, 3, 8, 9, 40}) {
            std::vector<float> x((size_t)T * g.k);
            std::normal_distribution<float> nd;
            for (auto& v : x) v = nd(rng);
            const std::vector<float> ref = run_linears("scalar", {&pa, &pb}, g, T, x);
            // double matmul of the dequantized weights (activation int8 rounding: a few % of max |y| at most)
            double err = 0, mag = 1e-30;
            const int width = 2 * g.n + 3;
            for (int t = 0; t < T && !ref.empty(); ++t)
                for (int li = 0; li < 2; ++li)
                    for (int nn = 0; nn < g.n; ++nn) {
                        const Gpu& w = li ? b : a;
                        double acc = 0;
                        for (int kk = 0; kk < g.k; ++kk)
                            acc += (double)x[(size_t)t * g.k + kk] * ((int)w.kn[(size_t)kk * g.n + nn] - (1 << (g.bits - 1))) *
                                   half_ref(w.scales[(size_t)(g.G < 0 ? 0 : kk / g.G) * g.n + nn]);
                        err = std::fmax(err, std::fabs(ref[(size_t)t * width + li * g.n + nn] - acc));
                        mag = std::fmax(mag, std::fabs(acc));
                    }
            const bool pad_ok = !ref.empty() && ref[2 * g.n] == 7.0f && ref[(size_t)(T - 1) * width + 2 * g.n + 2] == 7.0f;
            const bool ok = !ref.empty() && err <= 0.03 * mag && pad_ok;
            std::printf("%s scalar vs double int%d G=%d T=%d err=%.3g of %.3g%s\n", ok ? "ok  " : "FAIL", g.bits, g.G,
                        T, err, mag, pad_ok ? "" : " (wrote past N)");
            failures += !ok;
            for (const char* be : {"avx2", "avx512", "amx"}) {
                if (!kt_backend_supported(be)) { std::printf("SKIP %s: not supported by this CPU\n", be); continue; }
                const std::vector<float> got = run_linears(be, {&pa, &pb}, g, T, x);
                const std::vector<float> one = run_linears(be, {&pb}, g, T, x);   // alone, not fused
                bool same_one = one.size() == (size_t)T * (g.n + 3);
                for (int t = 0; same_one && t < T; ++t)
                    same_one = memcmp(one.data() + (size_t)t * (g.n + 3), got.data() + (size_t)t * width + g.n, 4 * g.n) == 0;
                const bool ok2 = got.size() == ref.size() && memcmp(got.data(), ref.data(), 4 * ref.size()) == 0 && same_one;
                std::printf("%s %s == scalar (bit-identical), fused == alone: int%d G=%d T=%d\n", ok2 ? "ok  " : "FAIL", be,
                            g.bits, g.G, T);
                failures += !ok2;
            }
        }
    }
    kt_destroy(ctx);
    return failures ? 1 : 0;
}
