// CPU feature detection (cpuid + the OS-enabled register state in XCR0) and the backend choice.
#pragma once
#include <string>

#include "kernel_types.h"

namespace kt {

struct CpuFeatures {
    bool avx2 = false, fma = false, avx512 = false /* F+BW+VL+VNNI */, avx512_bf16 = false, avx_vnni = false;
    bool amx = false;            // AMX-TILE + AMX-INT8 in cpuid and tile state enabled in XCR0
    bool amx_permitted = false;  // the kernel granted XTILEDATA (arch_prctl ARCH_REQ_XCOMP_PERM)
    bool amd = false;            // vendor AuthenticAMD / HygonGenuine (decode_prefetch_nta's default)
};

const CpuFeatures& cpu_features();
bool backend_supported(const std::string& name);
// name empty: env KT_KERNEL_BACKEND, else the best supported. Throws std::runtime_error if unknown/unsupported.
const KernelTable* select_backend(const std::string& name);
// Which copy of a body compiled per vector ISA (GCC target regions: mla_attend.cpp, scale_search.cpp) runs, chosen
// once with the kernels' backend (select_backend("")): 0 the baseline for scalar, 1 AVX2 for avx2, 2 AVX-512 for
// avx512 and amx (both imply AVX-512). An unknown or unsupported KT_KERNEL_BACKEND (which no kernel context accepts
// either) takes the baseline. The baseline copy is the SIMD copies' scalar twin.
int vector_isa();

// How the decode-shaped weight streams (kernel_body.inc's ONCE tiles: every weight line used once) prefetch ahead:
// true non-temporally (prefetchnta), false into L2 (prefetcht1, as prefill). Chosen once: env KT_DECODE_PREFETCH
// "nta" or "t1", else by vendor: nta on AMD, t1 elsewhere. Why by vendor, measured in one process, the two builds
// alternated: on Zen 4 nta took 4.7-5.2% off the bench models' decode steps (the stream no longer evicts what the
// step reads again); on an Intel Xeon (family 6 model 207, AVX-512, 2 vCPUs) nta nearly halved the decode rate
// (Qwen3-30B-A3B-shaped tg32 229 tok/s with t1 against 125 with nta): there prefetchnta fills only L1, without the
// L2 fill the stream's distance needs.
bool decode_prefetch_nta();
const char* decode_prefetch_name();   // "nta (AMD default)", "t1 (KT_DECODE_PREFETCH)", ...

// Per-ISA tables, each defined in its own file compiled with that ISA's flags (only used when supported).
extern const KernelTable kScalarTable;
extern const KernelTable kAvx2Table;
extern const KernelTable kAvxVnniTable;
extern const KernelTable kAvx512Table;
extern const KernelTable kAvx512Bf16Table;   // avx512 with vdpbf16ps for the bf16 layout
extern const KernelTable kAmxTable;           // bgemm filled in from kAvx512Bf16Gemm
extern const BGemmFn kAvx512Bf16Gemm;
extern const KernelTable kAmxFmaBf16Table;   // AMX int kernels, bf16 layout via FP32 FMA (no AVX512_BF16)

}  // namespace kt
