#include "linear_engine.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../include/ktkernels.h"
#include "bf16.h"
#include "scale_types.h"

namespace kt {

namespace {

int round_up(int x, int m) { return (x + m - 1) / m * m; }
int lcm64(int g) { return g % 64 == 0 ? g : 64; }   // lcm(64, G) for G = 32 or a multiple of 64

// Work items per thread the queue aims at: enough that a worker losing its core to another process (this machine
// is shared) costs little, few enough that the per-item cost (an atomic, a call) stays well under 1%.
constexpr int kItemsPerThread = 8;
constexpr int kMaxChunkBlocks = 8;   // column blocks (of 16) per item: 8 x 16 x K codes, one linear byte stream
// Decode (T <= kDecodeMaxRows: one pass over the weights, bandwidth-bound) takes fewer, longer streams: about
// kDecodeItemsPerThread items per thread of up to kMaxDecodeChunkBlocks blocks. Each item starts a new weight stream
// (the prefetchers ramp up again, the 8 KiB software prefetch runs past its end), and on 2 cores of Zen 4 (the
// Qwen3-30B-A3B-shaped decode step, whose q/k/v and o_proj jobs are 4-5 MB: 40 and 16 items of 8 blocks) 2 items
// per thread of up to 64 blocks, with the experts' gate/up items of up to 24 blocks (moe_job.cpp), took the step
// 3.6-4.8% less time, alternated in one process; the DeepSeek-V3-shaped step (larger Linears) did not change.
constexpr int kDecodeItemsPerThread = 2;
constexpr int kMaxDecodeChunkBlocks = 64;

}  // namespace

LinearEngine::LinearEngine(ThreadPool& pool, const KernelTable& table)
    : pool_(pool), table_(table), scratch_(pool.n_threads()) {}

LinearEngine::~LinearEngine() { pool_.wait(); }

void LinearEngine::add(int id, int n, int k, int bits, int group, const void* qweight, const void* scales,
                       int scale_dtype) {
    auto bad = [&](const std::string& m) { throw std::invalid_argument("linear " + std::to_string(id) + ": " + m); };
    if (n < 1 || k < 1) bad("n and k must be >= 1, got (" + std::to_string(n) + ", " + std::to_string(k) + ")");
    if (bits != 4 && bits != 8) bad("bits must be 4 or 8 (cpu-linear-int4/int8), got " + std::to_string(bits));
    if (!(group == -1 || group == 32 || (group > 0 && group % 64 == 0)))
        bad("group size " + std::to_string(group) + " is not supported: use 32, a multiple of 64, or -1 (per row)");
    if (!qweight || !scales) bad("missing qweight or scales pointer");
    if (scale_dtype != kScaleF32 && scale_dtype != kScaleF16)
        bad("scale dtype " + std::to_string(scale_dtype) + " is not KT_F32 or KT_F16");
    if (pool_.busy()) pool_.wait();   // a job in flight may read the entry being replaced
    Linear L;
    L.n = n; L.k = k; L.bits = bits; L.group = group;
    L.kx = round_up(k, group == -1 ? 64 : lcm64(group));
    L.glen = group == -1 ? L.kx : group;
    L.n_blocks = round_up(n, 16) / 16;
    L.q = (const uint8_t*)qweight;
    L.s = (const uint8_t*)scales;
    L.s_type = scale_dtype; L.s_bytes = scale_bytes(scale_dtype);
    L.q_block_stride = (size_t)(L.kx / 64) * (bits == 4 ? 512 : 1024);
    L.s_block_stride = (size_t)(L.kx / L.glen) * 16;
    linears_[id] = L;
}

void LinearEngine::submit(int n_linears, const int* ids, int T, const void* x, int x_dtype, int64_t x_stride,
                          float* const* outs, const int64_t* out_strides) {
    if (n_linears < 1 || !ids || !outs || !out_strides) throw std::invalid_argument("no linears to run");
    std::vector<const Linear*> job(n_linears);
    for (int i = 0; i < n_linears; ++i) {
        auto it = linears_.find(ids[i]);
        if (it == linears_.end()) throw std::invalid_argument("linear " + std::to_string(ids[i]) + " was not added");
        job[i] = &it->second;
        const Linear& L = *job[i];
        if (L.k != job[0]->k || L.group != job[0]->group)
            throw std::invalid_argument("linears sharing one input must have the same K and group size: linear " +
                                        std::to_string(ids[i]) + " has K=" + std::to_string(L.k) + " G=" +
                                        std::to_string(L.group) + ", linear " + std::to_string(ids[0]) + " K=" +
                                        std::to_string(job[0]->k) + " G=" + std::to_string(job[0]->group));
        if (T > 0 && (!outs[i] || out_strides[i] < L.n || out_strides[i] > (1 << 30)))
            throw std::invalid_argument("output " + std::to_string(i) + " of linear " + std::to_string(ids[i]) +
                                        ": null or row stride " + std::to_string(out_strides[i]) + " < N (" +
                                        std::to_string(L.n) + ")");
    }
    if (T < 0) throw std::invalid_argument("n_tokens must be >= 0");
    if (x_dtype != KT_F32 && x_dtype != KT_BF16) throw std::invalid_argument("x dtype must be f32 or bf16");
    if (T > 0 && (!x || x_stride < job[0]->k))
        throw std::invalid_argument("null x or row stride " + std::to_string(x_stride) + " < K (" +
                                    std::to_string(job[0]->k) + ")");
    pool_.wait();   // the previous job (this op's or the MoE op's) may still use the buffers below
    if (T == 0) return;
    job_ = std::move(job);
    outs_.assign(outs, outs + n_linears);
    out_strides_.assign(out_strides, out_strides + n_linears);
    T_ = T; x_ = x; x_dtype_ = x_dtype; x_stride_ = x_stride; n_groups_ = 0;
    job_tag_ = next_rows_tag_base();
    k_ = job_[0]->k; kx_ = job_[0]->kx; glen_ = job_[0]->glen;

    // Work items. Columns are split in chunks of column blocks (decode: each chunk is one weight stream read once
    // for all T rows; prefill: whole register tiles of blocks, reused from L2 by every row tile). With few column
    // chunks for the threads (small N, many tokens) the rows are split as well: the weights of such a Linear are
    // small, so reading them once per row chunk costs L2/L3 bandwidth, not memory bandwidth.
    const int nt = pool_.n_threads();
    int total_blocks = 0;
    for (const Linear* L : job_) total_blocks += L->n_blocks;
    const bool prefill = T > kDecodeMaxRows;
    int chunk = prefill ? std::max(1, std::min(kMaxChunkBlocks, total_blocks / (nt * kItemsPerThread)))
                        : std::max(1, std::min(kMaxDecodeChunkBlocks, total_blocks / (nt * kDecodeItemsPerThread)));
    if (prefill) chunk = std::max(kPrefillChunkQuantum, chunk / kPrefillChunkQuantum * kPrefillChunkQuantum);
    int col_items = 0;
    for (const Linear* L : job_) col_items += (L->n_blocks + chunk - 1) / chunk;
    int t_chunk = T;
    if (prefill && col_items < nt * kItemsPerThread / 2) {
        const int want = (nt * kItemsPerThread / 2 + col_items - 1) / col_items;   // row chunks per column chunk
        t_chunk = std::max(2 * kDecodeMaxRows, round_up((T + want - 1) / want, kDecodeMaxRows));
    }
    items_.clear();
    for (int li = 0; li < n_linears; ++li)
        for (int nb = 0; nb < job_[li]->n_blocks; nb += chunk)
            for (int t0 = 0; t0 < T; t0 += t_chunk)
                items_.push_back(Item{li, nb, std::min(chunk, job_[li]->n_blocks - nb), t0, std::min(t_chunk, T - t0), 0, 1});
    const size_t need = std::max((size_t)k_, (size_t)t_chunk * chunk * 16);
    for (auto& s : scratch_) if (s.size() < need) s.resize(need);
    start(T);
}

void LinearEngine::submit_grouped(int id, int n_groups, int row0, int row_step, int rows, int T, const void* x,
                                  int x_dtype, int64_t x_stride, int64_t x_group_stride, float* out,
                                  int64_t out_stride, int64_t out_group_stride, int x_group_div,
                                  const float* x_scale) {
    auto it = linears_.find(id);
    if (it == linears_.end()) throw std::invalid_argument("linear " + std::to_string(id) + " was not added");
    const Linear& L = it->second;
    auto bad = [&](const std::string& m) {
        throw std::invalid_argument("grouped submit of linear " + std::to_string(id) + ": " + m);
    };
    if (n_groups < 1 || rows < 16 || row0 < 0 || row_step < 0 || rows % 16 || row0 % 16 || row_step % 16)
        bad("n_groups >= 1 and row0, row_step, rows (>= 16) multiples of 16 expected, got n_groups=" +
            std::to_string(n_groups) + " row0=" + std::to_string(row0) + " row_step=" + std::to_string(row_step) +
            " rows=" + std::to_string(rows));
    if ((int64_t)row0 + (int64_t)(n_groups - 1) * row_step + rows > L.n)
        bad("the last group's rows end past N=" + std::to_string(L.n));
    if (T < 0) bad("n_tokens must be >= 0");
    if (x_dtype != KT_F32 && x_dtype != KT_BF16) bad("x dtype must be f32 or bf16");
    if (T > 0 && (!x || !out || x_stride < 0 || x_group_stride < 0 || out_stride < 0 || out_group_stride < 0))
        bad("null x / out or a negative stride");
    if (x_group_div < 1 || n_groups % x_group_div)
        bad("x_group_div " + std::to_string(x_group_div) + " must be >= 1 and divide n_groups " + std::to_string(n_groups));
    pool_.wait();   // the previous job (this op's or the MoE op's) may still use the buffers below
    if (T == 0) return;
    job_.assign(1, &L);
    outs_.assign(1, out);
    out_strides_.assign(1, out_stride);
    T_ = T; x_ = x; x_dtype_ = x_dtype; x_stride_ = x_stride; x_group_stride_ = x_group_stride;
    job_tag_ = next_rows_tag_base();
    out_group_stride_ = out_group_stride;
    n_groups_ = n_groups; g_block0_ = row0 / 16; g_block_step_ = row_step / 16;
    x_group_div_ = x_group_div; x_scale_ = x_scale;
    k_ = L.k; kx_ = L.kx; glen_ = L.glen;
    // Items, each for all T rows (decode: each weight block read once): groups of at most kMaxChunkBlocks blocks go
    // whole, several to an item (~kItemsPerThread items per thread): MLA's W_uk has 512 groups of 8 blocks of 1 KiB,
    // and an item per group spent more on the item than on its 8 KiB (0.31 of the bandwidth for the absorbed pair);
    // larger groups are cut in chunks of their blocks.
    const int blocks = rows / 16, nt = pool_.n_threads();
    const bool prefill = T > kDecodeMaxRows;
    items_.clear();
    if (blocks <= kMaxChunkBlocks) {
        const int per_item = std::max(1, n_groups / (nt * kItemsPerThread));
        for (int g = 0; g < n_groups; g += per_item)
            items_.push_back(Item{0, 0, blocks, 0, T, g, std::min(per_item, n_groups - g)});
    } else {
        int chunk = std::max(1, std::min({kMaxChunkBlocks, blocks * n_groups / (nt * kItemsPerThread)}));
        if (prefill) chunk = std::max(2, chunk & ~1);
        for (int g = 0; g < n_groups; ++g)
            for (int nb = 0; nb < blocks; nb += chunk)
                items_.push_back(Item{0, nb, std::min(chunk, blocks - nb), 0, T, g, 1});
    }
    const size_t need = (size_t)2 * k_;   // bf16 rows and scaled rows as f32; whole blocks: no partial-block scratch
    for (auto& s : scratch_) if (s.size() < need) s.resize(need);
    start(n_groups * T);
}

void LinearEngine::prepare_x(int n_rows) {
    n_rows_ = n_rows;
    const int ng = kx_ / glen_;
    xq_.resize((size_t)n_rows * kx_); xs_.resize((size_t)n_rows * ng); xsum_.resize((size_t)n_rows * ng);
    xq_rows_.resize(n_rows); xs_rows_.resize(n_rows); xsum_rows_.resize(n_rows);
    for (int r = 0; r < n_rows; ++r) {
        xq_rows_[r] = xq_.data() + (size_t)r * kx_;
        xs_rows_[r] = xs_.data() + (size_t)r * ng;
        xsum_rows_[r] = xsum_.data() + (size_t)r * ng;
    }
}

void LinearEngine::start(int n_rows) {
    prepare_x(n_rows);
    next_ = 0;
    // a few rows: quantize here, so the workers start on the weights at once (no phase 0, no barrier)
    x_ready_ = n_rows <= kDecodeMaxRows;
    if (x_ready_) for (int r = 0; r < n_rows; ++r) quantize_x(r, 0);
    pool_.launch([this](const WorkerInfo& w) { run(w); });
}

void LinearEngine::run(const WorkerInfo& w) {
    if (!x_ready_) {
        const int n = w.n_threads;
        for (int r = (int)((int64_t)n_rows_ * w.index / n); r < (int)((int64_t)n_rows_ * (w.index + 1) / n); ++r)
            quantize_x(r, w.index);
        pool_.global_barrier();
    }
    for (int i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < (int)items_.size();) compute(items_[i], w.index);
}

void LinearEngine::quantize_x(int r, int worker) {
    const int64_t elem = n_groups_ ? (int64_t)(r / T_ / x_group_div_) * x_group_stride_ + (int64_t)(r % T_) * x_stride_
                                   : (int64_t)r * x_stride_;
    const char* row = (const char*)x_ + (size_t)elem * (x_dtype_ == KT_F32 ? 4 : 2);
    const float* v = (const float*)row;
    float* tmp = scratch_[worker].data();
    if (x_dtype_ == KT_BF16) {
        for (int k = 0; k < k_; ++k) tmp[k] = bf16_to_f32(((const uint16_t*)row)[k]);
        v = tmp;
    }
    if (n_groups_ && x_scale_) {   // the group's input scaling, one float32 product per value (as torch would)
        const float* sc = x_scale_ + (size_t)(r / T_) * k_;
        // the scales of the group 4 rows on (MLA's W_uk: 2048 scaled rows of 128 per decode step, the scales 1 MB
        // of float32 read cold): its phase 0 went 111 / 147 -> 79 / 110 us per worker (medians, in decode steps)
        for (int k = 0; k < k_; k += 16) __builtin_prefetch(sc + 4 * (size_t)k_ + k, 0, 2);
        float* dst = tmp + k_;
        for (int k = 0; k < k_; ++k) dst[k] = v[k] * sc[k];
        v = dst;
    }
    const int ng = kx_ / glen_;
    table_.quantize_row(v, k_, kx_, glen_, xq_.data() + (size_t)r * kx_, xs_.data() + (size_t)r * ng,
                        xsum_.data() + (size_t)r * ng);
}

void LinearEngine::compute(const Item& it, int worker) {
    const Linear& L = *job_[it.lin];
    const int b0 = n_groups_ ? g_block0_ + it.g * g_block_step_ + it.nb0 : it.nb0;   // first column block
    QView v;
    v.q = L.q + (size_t)b0 * L.q_block_stride;
    v.s = L.s + (size_t)b0 * L.s_block_stride * L.s_bytes;
    v.q_block_stride = L.q_block_stride;
    v.s_block_stride = L.s_block_stride;
    v.n_rows4 = L.kx / 4;
    v.group_rows = L.glen / 4;
    v.s_type = L.s_type;
    const QGemmFn fn = L.bits == 8 ? table_.qgemm8 : table_.qgemm4;
    const int64_t ld = out_strides_[it.lin];
    if (n_groups_) {   // per group: whole blocks of its rows, its input rows, at its output
        for (int g = it.g; g < it.g + it.ng; ++g) {
            if (g > it.g) {
                const size_t db = (size_t)(g - it.g) * g_block_step_;
                v.q = L.q + (b0 + db) * L.q_block_stride;
                v.s = L.s + (b0 + db) * L.s_block_stride * L.s_bytes;
            }
            const int r0 = g * T_ + it.t0;   // quantized input rows of this group
            const ActRows a{xq_rows_.data() + r0, xs_rows_.data() + r0, xsum_rows_.data() + r0,
                            job_tag_ + (uint64_t)r0 + 1};
            fn(v, it.nbn, a, it.tm, outs_[0] + g * out_group_stride_ + it.t0 * ld + it.nb0 * 16, (int)ld);
        }
        return;
    }
    const int r0 = it.t0;   // quantized input rows of this item
    const ActRows a{xq_rows_.data() + r0, xs_rows_.data() + r0, xsum_rows_.data() + r0, job_tag_ + (uint64_t)r0 + 1};
    float* out = outs_[it.lin] + it.t0 * ld + it.nb0 * 16;
    const int c0 = it.nb0 * 16, width = it.nbn * 16;
    if (c0 + width <= L.n) {   // whole blocks: straight into the output rows
        fn(v, it.nbn, a, it.tm, out, (int)ld);
        return;
    }
    float* y = scratch_[worker].data();   // the chunk with the partial last block: padded columns are dropped
    fn(v, it.nbn, a, it.tm, y, width);
    const int nc = L.n - c0;
    for (int i = 0; i < it.tm; ++i) memcpy(out + i * ld, y + (size_t)i * width, sizeof(float) * nc);
}

}  // namespace kt
