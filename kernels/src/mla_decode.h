// kt_mla_decode's job (mla_decode.cpp): an MLA layer's decode rows from x to o_proj's output, its buffers kept
// between calls (the sizes of a decode step repeat).
#pragma once
#include <cstdint>
#include <vector>

#include "../include/ktkernels.h"

namespace kt {

struct MlaDecode {
    std::vector<float> qa, ckv, q_resid, q, q_lat, q_rot, out_lat, o;
    std::vector<const float*> runs;
    std::vector<int64_t> run_len, row_runs;
    // Runs the layer on ctx's engines; false with why for bad arguments (a Linear's own errors throw).
    bool run(kt_ctx* ctx, const kt_mla_decode_args& a, const char** why);
};

}  // namespace kt
