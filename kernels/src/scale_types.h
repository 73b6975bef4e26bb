// Scale dtypes of the cpu-expert int layouts (layouts/README.md): float32 (layout version 1), float16 or bfloat16
// (version 2), two-level records (version 3, int4 group 32: a float16 super-scale d per 8 groups and a signed 6-bit
// sub-scale q per group, scale = d * q). The kernels read 16 scales of one (column block, group) at a time; every
// backend turns them into float32 exactly (the three dtypes convert to float32 without rounding, and d * q has at
// most 11 + 6 significant bits, so its float32 product is exact), so the int paths stay bit-identical to the scalar
// twin whatever the scale dtype. The one place a scale vector is loaded is Isa::load_scales (per ISA, used by
// kernel_body.inc's finish step, the AMX path and the scalar reference through scale_to_f32 below); two-level records
// are decoded once per super-block by Isa::decode_sub6 into 8 x 16 float32 scales.
#pragma once
#include <cstdint>
#include <cstring>

namespace kt {

enum ScaleType : int { kScaleF32 = 0, kScaleBF16 = 1, kScaleF16 = 2, kScaleSub6 = 3 };   // KT_F32 / KT_BF16 / KT_F16 / KT_SUB6

// Tag types of the 16-bit storage (bit patterns), so templates can tell the three apart.
struct ScaleBF16 { uint16_t bits; };
struct ScaleF16 { uint16_t bits; };
// Two-level records, addressed in bytes: a (block, group) "element" is 1 byte, so a super-block of 8 groups x 16
// columns is one 128-byte record: bytes 0-63 ql (byte 16 (j % 4) + c: bits 4 (j / 4) .. +3 = low 4 bits of u(j, c)),
// 64-95 the 16 columns' d (float16), 96-127 qh (byte 16 (j / 4) + c: bits 2 (j % 4), +1 = bits 4-5 of u(j, c)),
// u = q & 63 (two's complement), j the group in the super-block (layouts/README.md).
struct ScaleSub6 { uint8_t byte; };
constexpr int kSub6Groups = 8, kSub6RecordBytes = 128, kSub6GroupSize = 32;

inline constexpr int scale_bytes(int type) { return type == kScaleF32 ? 4 : type == kScaleSub6 ? 1 : 2; }

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

// Scale of group j (of the record's 8) and column c of a two-level record: f32(d[c]) * q(j, c), an exact product.
inline float sub6_scale(const uint8_t* rec, int j, int c) {
    const int lo = (rec[16 * (j & 3) + c] >> (4 * (j >> 2))) & 15;
    const int hi = (rec[96 + 16 * (j >> 2) + c] >> (2 * (j & 3))) & 3;
    const int u = lo | (hi << 4);
    uint16_t d;
    memcpy(&d, rec + 64 + 2 * c, 2);
    return f16_bits_to_f32(d) * (float)(u >= 32 ? u - 64 : u);
}

// Scale i of a scale array of `type` (the scalar reference's load). Two-level records: i = 16 * group + column of
// the (block, group) elements, so the record is at byte i rounded down to 128.
inline float scale_to_f32(const void* s, int type, size_t i) {
    if (type == kScaleSub6)
        return sub6_scale((const uint8_t*)s + (i & ~(size_t)(kSub6RecordBytes - 1)), (int)((i >> 4) & 7), (int)(i & 15));
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
