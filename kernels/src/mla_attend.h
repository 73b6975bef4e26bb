// kt_mla_attend's job (mla_attend.cpp): checked arguments, the cache rows in position order, the heads' split.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "../include/ktkernels.h"

namespace kt {

// Positions per chunk of a long cache: attention over S > kAttendChunk positions runs chunk by chunk (each chunk's
// partial maximum, exp sum and weighted values, merged in chunk order: mla_attend_body.inc), the chunks of a batch
// job split between the workers. Fixed, so a row's bits depend on its own S only, not on the threads or the batch.
constexpr int64_t kAttendChunk = 128;

inline int64_t attend_chunks(int64_t S) { return S > kAttendChunk ? (S + kAttendChunk - 1) / kAttendChunk : 1; }

// A batch job's items: group g (a request's block of heads, an entry's kv head) runs as chunks(g) items, one per
// chunk of its positions; a group of several chunks keeps partial slots (per chunk: `heads` maxima, exp sums and
// weighted rows of `width` floats) and a completion count: the worker that finishes its last chunk merges it.
struct ChunkPlan {
    std::vector<int64_t> first_item;        // (groups + 1): each group's first item
    std::vector<int64_t> part0;             // (groups + 1): each chunked group's first (chunk, head) slot
    mutable std::vector<float> pm, pl, po;  // the slots: maxima, exp sums, weighted rows
    std::unique_ptr<std::atomic<int>[]> done;
    int64_t capacity = 0, heads = 0, width = 0;

    // groups of `heads` heads and rows of `width`; S_of(g): group g's positions
    template <class SOf>
    void plan(int64_t groups, int64_t heads_, int64_t width_, SOf S_of) {
        heads = heads_;
        width = width_;
        first_item.assign((size_t)groups + 1, 0);
        part0.assign((size_t)groups + 1, 0);
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t n = attend_chunks(S_of(g));
            first_item[g + 1] = first_item[g] + n;
            part0[g + 1] = part0[g] + (n > 1 ? n * heads : 0);
        }
        pm.resize((size_t)part0[groups]);
        pl.resize((size_t)part0[groups]);
        po.resize((size_t)(part0[groups] * width));
        if (capacity < groups) {
            done.reset(new std::atomic<int>[(size_t)groups]);
            capacity = groups;
        }
        for (int64_t g = 0; g < groups; ++g) done[g].store(0, std::memory_order_relaxed);
    }
    // worker `index` of n: its items [t0, t1)
    void items(int index, int n, int64_t* t0, int64_t* t1) const {
        const int64_t total = first_item.back();
        *t0 = total * index / n;
        *t1 = total * (index + 1) / n;
    }
    int64_t group_of(int64_t t) const {
        return std::upper_bound(first_item.begin(), first_item.end(), t) - first_item.begin() - 1;
    }
    int64_t chunks(int64_t g) const { return first_item[g + 1] - first_item[g]; }
    float* m(int64_t g, int64_t c) const { return pm.data() + part0[g] + c * heads; }
    float* l(int64_t g, int64_t c) const { return pl.data() + part0[g] + c * heads; }
    float* o(int64_t g, int64_t c) const { return po.data() + (part0[g] + c * heads) * width; }
    // chunk finished in group g: true for the one call that finished its last
    bool last(int64_t g) const { return done[g].fetch_add(1, std::memory_order_acq_rel) + 1 == chunks(g); }
    // group g's chunks merged into its heads' rows of out (rows out_stride apart), chunk order
    void merge(int64_t g, int64_t nh, float* out, int64_t out_stride) const;
};

struct MlaAttend {
    int64_t nh = 0, R = 0, dr = 0, S = 0;
    const float* q_lat = nullptr;
    const float* q_rot = nullptr;
    int64_t q_lat_stride = 0, q_rot_stride = 0, out_stride = 0;
    float scale = 0.0f;
    float* out = nullptr;
    std::vector<const float*> rows;   // (S): row j of the cache

    // Checks and keeps the arguments of kt_mla_attend (ktkernels.h); false for bad ones.
    bool set(int64_t nh, int64_t R, int64_t dr, const float* q_lat, int64_t q_lat_stride, const float* q_rot,
             int64_t q_rot_stride, float scale, int64_t n_runs, const float* const* runs, const int64_t* run_len,
             int64_t row_stride, float* out, int64_t out_stride);
    // Worker `index` of n computes its share of the heads (whole blocks of 8: each head's result is the same
    // whatever the split).
    void run(int index, int n) const;
    // Heads [h0, h1) on the calling thread (h0 a multiple of 8, or the whole range), chunk by chunk when S is long.
    void heads(int64_t h0, int64_t h1) const;
    // Chunk c's partial of heads [h0, h1): o (h1 - h0, R), m and l (h1 - h0)
    void chunk(int64_t h0, int64_t h1, int64_t c, float* o, float* m, float* l) const;
};

// kt_mla_attend_batch's job: one MlaAttend per request, the (request, block of 8 heads, chunk of positions) items
// split between the workers; every head computes exactly what kt_mla_attend computes for it alone.
struct MlaAttendBatch {
    std::vector<MlaAttend> reqs;
    std::vector<int64_t> first_block;   // (m + 1): the first (request, head block) group of each request
    ChunkPlan chunks;                   // the groups' items and partial slots

    bool set(int64_t m, int64_t nh, int64_t R, int64_t dr, const float* q_lat, int64_t q_lat_req_stride,
             int64_t q_lat_stride, const float* q_rot, int64_t q_rot_req_stride, int64_t q_rot_stride, float scale,
             const int64_t* req_n_runs, const float* const* runs, const int64_t* run_len, int64_t row_stride,
             float* out, int64_t out_req_stride, int64_t out_stride);
    void run(int index, int n) const;
};

// kt_gqa_attend_batch's job: m query rows (entries), each over its own cache rows; the (entry, kv head, chunk of
// positions) items split between the workers (the same bits whatever the split).
struct GqaAttendBatch {
    int64_t m = 0, nkv = 0, rep = 0, hd = 0, vd = 0;
    const float* q = nullptr;
    int64_t q_entry_stride = 0, q_head_stride = 0, out_entry_stride = 0, out_head_stride = 0;
    float scale = 0.0f;
    float* out = nullptr;
    std::vector<const float*> krows, vrows;   // every entry's positions, entry after entry: the kv-head-0 rows
    std::vector<int64_t> first_row;           // (m + 1): entry e's rows are [first_row[e], first_row[e + 1])
    ChunkPlan chunks;                         // the (entry, kv head) groups' items and partial slots

    bool set(int64_t m, int64_t nkv, int64_t rep, int64_t hd, int64_t vd, const float* q, int64_t q_entry_stride,
             int64_t q_head_stride, float scale, const int64_t* entry_n_runs, const float* const* k_runs,
             const float* const* v_runs, const int64_t* run_len, int64_t k_row_stride, int64_t v_row_stride,
             float* out, int64_t out_entry_stride, int64_t out_head_stride);
    // set's checks and geometry, the rows already filled in krows / vrows / first_row (kt_gqa_decode: from the
    // requests' block tables)
    bool set_filled(int64_t m, int64_t nkv, int64_t rep, int64_t hd, int64_t vd, const float* q, int64_t q_entry_stride,
                    int64_t q_head_stride, float scale, float* out, int64_t out_entry_stride, int64_t out_head_stride);
    void run(int index, int n) const;
    // entry e, kv head g on the calling thread (chunk by chunk when its cache is long)
    void pair(int64_t e, int64_t g) const;
    // chunk c's partial of entry e, kv head g: o (rep, vd), m and l (rep)
    void chunk(int64_t e, int64_t g, int64_t c, float* o, float* m, float* l) const;
};

// kt_prompt_attend's arguments as the body (prompt_attend_body.inc) reads them: rep = nh / nkv query heads per kv head
struct PromptGeom : kt_prompt_attend_args {
    int64_t rep = 0;
};

// Rows [r0, r1) of kv head g (row r: query row r / rep, head g * rep + r % rep) on the calling thread, in the
// kernels' ISA copy (mla_attend.cpp)
void prompt_attend_rows(const PromptGeom& a, int64_t g, int64_t r0, int64_t r1);

// h[c] = silu(g[c]) * u[c] = g / (1 + exp(-g)) * u for c < n (silu_body.inc), the backend's copy: the routed experts'
// SiLU gate (MoEEngine::gate_up); the same bits on every backend
void silu_mul(int64_t n, const float* g, const float* u, float* h);

// kt_prompt_attend's job (prompt_attend.cpp): items of kPromptItemRows rows of one kv head, the costliest (latest
// positions) first, taken by the workers from a shared counter; each row's bits are the same whoever computes it.
constexpr int64_t kPromptItemRows = 32;
struct PromptAttend {
    PromptGeom a;
    int64_t blocks = 0;                         // items per kv head
    mutable std::atomic<int64_t> next{0};       // the next item to take
    bool set(const kt_prompt_attend_args& args, const char** why);
    void run(int index, int n) const;
};

// The requests of a decode call (kt_gqa_decode_args, kt_mla_decode_args): request r's rows [row0[r], row0[r + 1])
// run from 0 to T, at least one each, at positions from start[r] >= 0.
bool request_rows_ok(int64_t m, int64_t T, const int64_t* row0, const int64_t* start);

// Position p of request r in a paged cache: slot p % block_size of block tables[table0[r] + p / block_size].
inline float* paged_row(float* base, const int64_t* tables, const int64_t* table0, int64_t r, int64_t p,
                        int64_t block_size, int64_t block_stride, int64_t row_stride) {
    return base + tables[table0[r] + p / block_size] * block_stride + (p % block_size) * row_stride;
}

// kt_gqa_decode's job (gqa_decode.cpp): the rows' q / k norm, RoPE and cache write on the calling thread (set), then
// the attention as a GqaAttendBatch over the positions the block tables give (run).
struct GqaDecode {
    GqaAttendBatch attend;
    std::vector<float> q_ready;   // (T, nh, hd): the normed, roped queries
    std::vector<float> normed;    // one row's normed q or k
    // Checks the arguments (false, with why, for bad ones), writes the cache, fills attend.
    bool set(const kt_gqa_decode_args& a, const char** why);
    void run(int index, int n) const { attend.run(index, n); }
    // kt_gqa_layer: the q / k / v job on x, set + run on the pool, o_proj's job (gqa_decode.cpp)
    std::vector<float> q, k, v, o;   // the projections (T, nh * hd), (T, nkv * hd), (T, nkv * vd); attention (T, nh * vd)
    bool run_layer(kt_ctx* ctx, const kt_gqa_layer_args& a, const char** why);
};

// out[h * S + j] = (a[h] . rows[j]) * scale for h < n, j < S (K a multiple of 16), in the same fixed order (16 lane
// sums, fused multiply-adds, a pairwise reduction) on every ISA, on the calling thread
void float_dots(int64_t n, int64_t K, const float* a, int64_t a_stride, const float* const* rows, int64_t S,
                float scale, float* out);

// float32 weights (rows x K) from which the routers' logits and kt_float_linear run on the context's pool (1 MiB:
// below it one thread reads them faster than a pool round trip costs)
constexpr int64_t kPoolMinFloats = 1 << 18;

// y[t * y_stride + n] = w[n] . x[t] for n0 <= n < n1, t < T (K a multiple of 16; w float32, or bfloat16 widened
// exactly when w_bf16; rows w_stride elements apart): float_dots' chain per output, so the same bits as it, on every
// ISA, whatever T and the rows asked; on the calling thread
void float_linear_rows(int64_t n0, int64_t n1, int64_t K, const void* w, bool w_bf16, int64_t w_stride,
                       const float* x, int64_t x_stride, int64_t T, float* y, int64_t y_stride);

}  // namespace kt
