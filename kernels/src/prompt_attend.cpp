// kt_prompt_attend: a prompt's causal attention (GQA, MQA, MHA; sliding windows, sinks; MLA's expanded form through
// a key in two parts) on the kernels' pool, for prompts and prompt chunks of more than a few rows (ktrun.models.
// attention; decode rows take kt_gqa_attend_batch / kt_gqa_decode, whose bits match a token decoded alone).
// Why not torch's scaled_dot_product_attention: on 2 Zen 4 cores, Qwen3-30B-A3B's 32 / 4 heads of 128, it ran a
// 512-token prompt at 63-78 GFLOP/s of causal work (about 0.4 of what the FMA units allow), 20% of the prefill; it
// has no sinks and takes a materialized mask for a chunk after a cached prefix or a window. Here the rows are a
// vector's lanes (prompt_attend_body.inc): a kv head's query heads share each broadcast key element, the softmax
// is lane-wise, and the work splits into items of 32 rows taken from a counter (the causal rows' costs differ).
#include <algorithm>
#include <atomic>

#include "mla_attend.h"

namespace kt {

bool PromptAttend::set(const kt_prompt_attend_args& x, const char** why) {
    *why = "bad geometry (n, nh, nkv, dk, dk1, dv: nh a multiple of nkv, dv a multiple of 16, 0 < dk1 <= dk, dk1 == "
           "dk without k2)";
    if (x.n < 1 || x.nh < 1 || x.nkv < 1 || x.nh % x.nkv || x.dk < 1 || x.dk1 < 1 || x.dk1 > x.dk ||
        (!x.k2 && x.dk1 != x.dk) || (x.k2 && x.dk1 == x.dk) || x.dv < 16 || x.dv % 16 || x.dk > (1 << 16) ||
        x.dv > (1 << 16))
        return false;
    *why = "bad positions (start >= 0, window >= 0; positions below 2^24)";
    if (x.start < 0 || x.window < 0 || x.start + x.n > (1 << 24)) return false;
    *why = "missing q / k / v / out";
    if (!x.q || !x.k || !x.v || !x.out) return false;
    *why = "bad strides (rows and heads must not overlap: q_head >= dk, q_row >= nh * q_head, likewise k, v, out)";
    if (x.q_head < x.dk || x.q_row < x.nh * x.q_head || x.k_head < x.dk1 || x.k_row < x.nkv * x.k_head ||
        x.v_head < x.dv || x.v_row < x.nkv * x.v_head || x.out_head < x.dv || x.out_row < x.nh * x.out_head ||
        (x.k2 && (x.k2_head < 0 || (x.k2_head > 0 && x.k2_head < x.dk - x.dk1) ||
                  x.k2_row < std::max(x.dk - x.dk1, x.nkv * x.k2_head))))
        return false;
    static_cast<kt_prompt_attend_args&>(a) = x;
    a.rep = x.nh / x.nkv;
    blocks = (x.n * a.rep + kPromptItemRows - 1) / kPromptItemRows;
    next.store(0, std::memory_order_relaxed);
    return true;
}

void PromptAttend::run(int, int) const {
    // item t: kv head t / blocks, row block blocks - 1 - t % blocks (a head's latest positions, the most keys,
    // first): the workers take neighbouring blocks of one head at a time, so its keys and values are read from the
    // caches they share
    const int64_t total = blocks * a.nkv, rows = a.n * a.rep;
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < total;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
        const int64_t g = t / blocks, b = blocks - 1 - t % blocks;
        prompt_attend_rows(a, g, b * kPromptItemRows, std::min(rows, (b + 1) * kPromptItemRows));
    }
}

}  // namespace kt
