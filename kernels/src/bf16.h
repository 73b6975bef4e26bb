// bfloat16 <-> float32 for the shared (ISA-independent) files. Not for the isa_*.cpp files: they keep their code in
// an anonymous namespace of their own (README "One library for every x86-64 CPU"), so no copy compiled with their
// flags can stand in for these.
#pragma once
#include <cstdint>
#include <cstring>

namespace kt {

inline float bf16_to_f32(uint16_t b) {   // exact: a bfloat16 is a float32's high half
    const uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

}  // namespace kt
