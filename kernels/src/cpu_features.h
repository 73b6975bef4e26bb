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
