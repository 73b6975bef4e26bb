// kt_ctx (ktkernels.h's opaque context): one pool and one backend table for every op (the MoE engine owns them; the
// linear engine borrows them), and the attention jobs' slots on that pool. c_api.cpp makes it; router.cpp borrows
// its pool.
#pragma once
#include <string>

#include "linear_engine.h"
#include "mla_attend.h"
#include "mla_decode.h"
#include "moe_engine.h"

struct kt_ctx {
    kt::MoEEngine engine;
    kt::LinearEngine linear;
    kt::MlaAttend attend;              // kt_mla_attend's job on this pool
    kt::MlaAttendBatch attend_batch;   // kt_mla_attend_batch's
    kt::GqaAttendBatch gqa_batch;      // kt_gqa_attend_batch's
    kt::GqaDecode gqa_decode;          // kt_gqa_decode's
    kt::PromptAttend prompt;           // kt_prompt_attend's
    kt::MlaDecode mla_decode;          // kt_mla_decode's buffers
    kt_ctx(int n_threads, int n_pools, const std::string& backend)
        : engine(n_threads, n_pools, backend), linear(engine.pool(), engine.table()) {}
};
