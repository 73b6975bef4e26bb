// Scale dtypes of the cpu-expert int layouts (layouts/README.md): float32 (layout version 1), float16 or bfloat16
// (version 2). The kernels read 16 scales of one (column block, group) at a time; every backend turns them into
// float32 exactly (all three convert to float32 without rounding), so the int paths stay bit-identical to the scalar
// twin whatever the scale dtype. The one place a scale vector is loaded is Isa::load_scales (per ISA, used by
// kernel_body.inc's finish step, the AMX path and the scalar reference through scale_to_f32 below).
#pragma once
#include <cstdint>
#include <cstring>

namespace kt {

enum ScaleType : int { kScaleF32 = 0, kScaleBF16 = 1, kScaleF16 = 2 };   // the ABI's KT_F32 / KT_BF16 / KT_F16

// Tag types of the 16-bit storage (bit patterns), so templates can tell the three apart.
struct ScaleBF16 { uint16_t bits; };
struct ScaleF16 { uint16_t bits; };

inline constexpr int scale_bytes(int type) { return type == kScaleF32 ? 4 : 2; }

namespace {
// float16 -> float32, exactly, for finite values (scales are finite): normal halves re-bias the exponent (integer
// ops only), subnormal ones (exponent 0) are mantissa * 2^-24, an exact product of normal floats. The vector backends
// build the same bits (AVX-512 with the hardware conversion, AVX2 with these integer steps).
inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h & 0x7C00, mant = h & 0x03FF;
    float f;
    if (exp == 0) {
        f = (float)mant * 5.9604644775390625e-08f;   // 2^-24
    } else {
        const uint32_t u = (((uint32_t)(h & 0x7FFF)) << 13) + (112u << 23);
        memcpy(&f, &u, 4);
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

inline float bf16_bits_to_f32_scale(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Scale i of a scale array of `type` (the scalar reference's load).
inline float scale_to_f32(const void* s, int type, size_t i) {
    if (type == kScaleF32) {
        float f;
        memcpy(&f, (const uint8_t*)s + 4 * i, 4);
        return f;
    }
    uint16_t b;
    memcpy(&b, (const uint8_t*)s + 2 * i, 2);
    return type == kScaleF16 ? f16_bits_to_f32(b) : bf16_bits_to_f32_scale(b);
}
}  // namespace

}  // namespace kt
