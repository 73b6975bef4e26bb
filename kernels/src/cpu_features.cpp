#include "cpu_features.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace kt {

static unsigned long long read_xcr0() {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static CpuFeatures detect() {
    CpuFeatures f;
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
    char vendor[13] = {};
    memcpy(vendor, &b, 4);
    memcpy(vendor + 4, &d, 4);
    memcpy(vendor + 8, &c, 4);
    f.amd = strcmp(vendor, "AuthenticAMD") == 0 || strcmp(vendor, "HygonGenuine") == 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave || !avx) return f;
    const unsigned long long xcr0 = read_xcr0();
    const bool os_avx = (xcr0 & 0x6) == 0x6;                 // SSE + AVX state
    const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM_Hi256, Hi16_ZMM
    const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG + XTILEDATA
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
    const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16), avx512bw = b & (1u << 30), avx512vl = b & (1u << 31);
    const bool avx512vnni = c & (1u << 11), amx_tile = d & (1u << 24), amx_int8 = d & (1u << 25);
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
    f.fma = fma && os_avx;
    f.avx2 = avx2 && os_avx && f.fma && f16c;   // the avx2 copies convert float16 scales by F16C (isa_avx2.inc)
    f.avx_vnni = f.avx2 && (a1 & (1u << 4));
    f.avx512 = f.avx2 && os_avx512 && avx512f && avx512bw && avx512vl && avx512vnni;
    f.avx512_bf16 = f.avx512 && (a1 & (1u << 5));
    f.amx = f.avx512 && os_amx && amx_tile && amx_int8;
    if (f.amx) {
        // Linux keeps the 8 KiB tile data state off until the process asks for it (ARCH_REQ_XCOMP_PERM).
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        f.amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return f;
}

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = detect();
    return f;
}

bool backend_supported(const std::string& name) {
    const CpuFeatures& f = cpu_features();
    if (name == "scalar") return true;
    if (name == "avx2") return f.avx2;
    if (name == "avx512") return f.avx512;
    if (name == "amx") return f.amx && f.amx_permitted;
    return false;
}

const KernelTable* select_backend(const std::string& requested) {
    std::string name = requested;
    if (name.empty()) {
        const char* env = std::getenv("KT_KERNEL_BACKEND");
        if (env && *env) name = env;
    }
    if (name.empty() || name == "auto") {
        for (const char* n : {"amx", "avx512", "avx2", "scalar"})
            if (backend_supported(n)) { name = n; break; }
    }
    if (name != "scalar" && name != "avx2" && name != "avx512" && name != "amx")
        throw std::runtime_error("unknown kernel backend '" + name + "' (KT_KERNEL_BACKEND): use scalar, avx2, avx512 or amx");
    if (!backend_supported(name)) {
        std::string why = name == "amx" && cpu_features().amx ? " (the kernel refused AMX tile data permission)" : "";
        throw std::runtime_error("kernel backend '" + name + "' is not supported by this CPU" + why);
    }
    const CpuFeatures& f = cpu_features();
    if (name == "scalar") return &kScalarTable;
    if (name == "avx2") return f.avx_vnni ? &kAvxVnniTable : &kAvx2Table;
    if (name == "avx512") return f.avx512_bf16 ? &kAvx512Bf16Table : &kAvx512Table;
    if (!f.avx512_bf16) return &kAmxFmaBf16Table;
    static const KernelTable amx = [] {   // AMX int tiles + the vdpbf16ps kernel of isa_avx512bf16.cpp
        KernelTable t = kAmxTable;
        t.bgemm = kAvx512Bf16Gemm;
        return t;
    }();
    return &amx;
}

namespace {
struct DecodePrefetch {
    bool nta;
    const char* name;
};
const DecodePrefetch& decode_prefetch() {
    static const DecodePrefetch chosen = [] {
        const char* env = std::getenv("KT_DECODE_PREFETCH");
        if (env && strcmp(env, "nta") == 0) return DecodePrefetch{true, "nta (KT_DECODE_PREFETCH)"};
        if (env && strcmp(env, "t1") == 0) return DecodePrefetch{false, "t1 (KT_DECODE_PREFETCH)"};
        if (env && *env)   // not a kernel's place to throw: the default, and the name says the value was ignored
            return cpu_features().amd ? DecodePrefetch{true, "nta (AMD default; KT_DECODE_PREFETCH not nta / t1)"}
                                      : DecodePrefetch{false, "t1 (non-AMD default; KT_DECODE_PREFETCH not nta / t1)"};
        return cpu_features().amd ? DecodePrefetch{true, "nta (AMD default)"}
                                  : DecodePrefetch{false, "t1 (non-AMD default)"};
    }();
    return chosen;
}
}  // namespace

bool decode_prefetch_nta() { return decode_prefetch().nta; }
const char* decode_prefetch_name() { return decode_prefetch().name; }

int vector_isa() {
    static const int chosen = [] {
        try {
            const std::string name = select_backend("")->name;
            return name == "scalar" ? 0 : name == "avx2" ? 1 : 2;
        } catch (const std::exception&) {
            return 0;
        }
    }();
    return chosen;
}

}  // namespace kt
