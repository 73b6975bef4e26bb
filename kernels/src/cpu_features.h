// CPU feature detection (cpuid + the OS-enabled register state in XCR0) and the backend choice.
#pragma once
#include <string>

#include "kernel_types.h"

namespace kt {

struct CpuFeatures {
    bool avx2 = false, fma = false, avx512 = false /* F+BW+VL+VNNI */, avx512_bf16 = false, avx_vnni = false;
    bool amx = false;            // AMX-TILE + AMX-INT8 in cpuid and tile state enabled in XCR0
    bool amx_permitted = false;  // the kernel granted XTILEDATA (arch_prctl ARCH_REQ_XCOMP_PERM)
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
