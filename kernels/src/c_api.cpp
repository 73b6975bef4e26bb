// C ABI of libktkernels (include/ktkernels.h): error strings instead of exceptions, plus the machine-limit probes.
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../include/ktkernels.h"
#include "bf16.h"
#include "context.h"
#include "cpu_features.h"

namespace {
thread_local std::string t_error;

template <class F>
int guarded(F&& f) {
    try {
        f();
        return 0;
    } catch (const std::exception& e) {
        t_error = e.what();
    } catch (...) {
        t_error = "unknown error";
    }
    return -1;
}

// A job with run(worker index, n workers) on ctx's pool (the caller one of its workers), or on the calling thread
// alone when ctx is NULL; set(job) checks the arguments and fills it (false: -1). The pool's job slot lives in ctx
// (member), the calling thread's in a thread_local.
template <class Job, class Set>
int run_job(kt_ctx* ctx, Job kt_ctx::*member, Set&& set) {
    if (!ctx) {
        thread_local Job job;
        if (!set(job)) return -1;
        job.run(0, 1);
        return 0;
    }
    kt::ThreadPool& pool = ctx->engine.pool();
    pool.wait();   // the job in flight may be an earlier one's: it may use the same slot
    Job& job = ctx->*member;
    if (!set(job)) return -1;
    pool.launch([&job](const kt::WorkerInfo& w) { job.run(w.index, w.n_threads); });
    pool.wait();
    return 0;
}

// run_job for a job whose set(args, &why) takes an argument block (ktkernels.h) and says why it refuses one: the
// error is "name: why" ("name: no arguments" for NULL)
template <class Job, class Args>
int run_args_job(kt_ctx* ctx, Job kt_ctx::*member, const Args* args, const char* name) {
    if (!args) { t_error = std::string(name) + ": no arguments"; return -1; }
    return run_job(ctx, member, [&](Job& job) {
        const char* why = "";
        if (job.set(*args, &why)) return true;
        t_error = std::string(name) + ": " + why;
        return false;
    });
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

extern "C" {

int kt_abi_version(void) { return KT_ABI_VERSION; }
const char* kt_last_error(void) { return t_error.c_str(); }
int kt_backend_supported(const char* name) { return name && kt::backend_supported(name) ? 1 : 0; }

kt_ctx* kt_create(int n_threads, int n_pools, const char* backend) {
    kt_ctx* ctx = nullptr;
    guarded([&] { ctx = new kt_ctx(n_threads, n_pools, backend ? backend : ""); });
    return ctx;
}

void kt_destroy(kt_ctx* ctx) { delete ctx; }
const char* kt_backend_name(const kt_ctx* ctx) { return ctx->engine.table().name; }
// the table's detail and how decode streams prefetch (kt::decode_prefetch_name: chosen per vendor, or env)
const char* kt_backend_detail(const kt_ctx* ctx) {
    thread_local std::string detail;
    detail = std::string(ctx->engine.table().detail) + "; decode prefetch " + kt::decode_prefetch_name();
    return detail.c_str();
}
int kt_n_threads(const kt_ctx* ctx) { return const_cast<kt_ctx*>(ctx)->engine.pool().n_threads(); }
int kt_n_pools(const kt_ctx* ctx) { return const_cast<kt_ctx*>(ctx)->engine.pool().n_pools(); }

// An empty job, not waited for: the pool's workers, asleep after an idle gap (a server writing its streams between
// two decode steps), wake now instead of at the step's first job, which would otherwise wait for them (a futex
// wake-up and the scheduler: ~0.1-0.3 ms there). The next job's launch waits for it, as for any job.
void kt_pool_wake(kt_ctx* ctx) {
    kt::ThreadPool& p = ctx->engine.pool();
    if (p.n_threads() > 1 && !p.busy()) p.launch([](const kt::WorkerInfo&) {});
}

// The opposite, after a burst: idle workers sleep at once instead of spinning up to 1 ms for a next job that will
// not come soon (a server writing its streams between two decode steps needs the cores: its event loop and, on one
// machine, its clients). The next job (or kt_pool_wake) wakes them.
void kt_pool_rest(kt_ctx* ctx) { ctx->engine.pool().rest(); }

int kt_thread_cpu(const kt_ctx* ctx, int thread) {
    kt::ThreadPool& p = const_cast<kt_ctx*>(ctx)->engine.pool();
    p.wait();   // the worker writes -1 there if pinning failed
    return thread >= 0 && thread < p.n_threads() ? p.cpu_of(thread) : -2;
}

int kt_thread_pool(const kt_ctx* ctx, int thread) {
    kt::ThreadPool& p = const_cast<kt_ctx*>(ctx)->engine.pool();
    return thread >= 0 && thread < p.n_threads() ? p.info(thread).pool : -1;
}

int kt_add_layer(kt_ctx* ctx, int layer_id, int n_experts, int hidden, int intermediate_pad, int bits, int group_size,
                 int n_pieces, const kt_shard_piece* pieces) {
    return kt_add_layer_ex(ctx, layer_id, n_experts, hidden, intermediate_pad, bits, group_size, KT_F32, n_pieces,
                           pieces);
}

int kt_add_layer_ex(kt_ctx* ctx, int layer_id, int n_experts, int hidden, int intermediate_pad, int bits,
                    int group_size, int scale_dtype, int n_pieces, const kt_shard_piece* pieces) {
    return guarded([&] {
        ctx->engine.add_layer(layer_id, n_experts, hidden, intermediate_pad, bits, group_size, n_pieces, pieces,
                              scale_dtype);
    });
}

int kt_set_layer_activation(kt_ctx* ctx, int layer_id, int activation, float alpha, float limit,
                            const float* gate_bias, const float* up_bias, const float* down_bias) {
    return guarded([&] {
        kt::Activation act;
        act.kind = activation; act.alpha = alpha; act.limit = limit;
        act.gate_bias = gate_bias; act.up_bias = up_bias; act.down_bias = down_bias;
        ctx->engine.set_activation(layer_id, act);
    });
}

int kt_submit(kt_ctx* ctx, int layer_id, int n_tokens, const void* x, int x_dtype, int64_t x_stride, int k,
              const int32_t* ids, const float* weights, float* out, int64_t out_stride, int accumulate) {
    return guarded([&] {
        ctx->engine.submit(layer_id, n_tokens, x, x_dtype, x_stride, k, ids, weights, out, out_stride, accumulate != 0,
                           nullptr);
    });
}

int kt_submit_masked(kt_ctx* ctx, int layer_id, int n_tokens, const void* x, int x_dtype, int64_t x_stride, int k,
                     const int32_t* ids, const float* weights, float* out, int64_t out_stride, int accumulate,
                     const uint8_t* skip) {
    return guarded([&] {
        ctx->engine.submit(layer_id, n_tokens, x, x_dtype, x_stride, k, ids, weights, out, out_stride, accumulate != 0,
                           skip);
    });
}

int kt_submit_shared(kt_ctx* ctx, int layer_id, int n_tokens, const void* x, int x_dtype, int64_t x_stride, int k,
                     const int32_t* ids, const float* weights, float* out, int64_t out_stride, int accumulate,
                     const uint8_t* skip, int shared_layer_id, const float* shared_weights) {
    return guarded([&] {
        if (shared_layer_id < 0) throw std::invalid_argument("shared expert layer id must be >= 0");
        ctx->engine.submit(layer_id, n_tokens, x, x_dtype, x_stride, k, ids, weights, out, out_stride, accumulate != 0,
                           skip, shared_layer_id, shared_weights);
    });
}

int kt_sync(kt_ctx* ctx) {
    return guarded([&] { ctx->engine.sync(); });
}

int kt_add_linear(kt_ctx* ctx, int linear_id, int n, int k, int bits, int group_size, const void* qweight,
                  const float* scales) {
    return guarded([&] { ctx->linear.add(linear_id, n, k, bits, group_size, qweight, scales); });
}

int kt_add_linear_ex(kt_ctx* ctx, int linear_id, int n, int k, int bits, int group_size, int scale_dtype,
                     const void* qweight, const void* scales) {
    return guarded([&] { ctx->linear.add(linear_id, n, k, bits, group_size, qweight, scales, scale_dtype); });
}

int kt_mla_attend(kt_ctx* ctx, int64_t nh, int64_t R, int64_t dr, const float* q_lat, int64_t q_lat_stride,
                  const float* q_rot, int64_t q_rot_stride, float scale, int64_t n_runs, const float* const* runs,
                  const int64_t* run_len, int64_t row_stride, float* out, int64_t out_stride) {
    return run_job(ctx, &kt_ctx::attend, [&](kt::MlaAttend& job) {
        return job.set(nh, R, dr, q_lat, q_lat_stride, q_rot, q_rot_stride, scale, n_runs, runs, run_len, row_stride,
                       out, out_stride);
    });
}

int kt_mla_attend_batch(kt_ctx* ctx, int64_t m, int64_t nh, int64_t R, int64_t dr, const float* q_lat,
                        int64_t q_lat_req_stride, int64_t q_lat_stride, const float* q_rot, int64_t q_rot_req_stride,
                        int64_t q_rot_stride, float scale, const int64_t* req_n_runs, const float* const* runs,
                        const int64_t* run_len, int64_t row_stride, float* out, int64_t out_req_stride,
                        int64_t out_stride) {
    return run_job(ctx, &kt_ctx::attend_batch, [&](kt::MlaAttendBatch& job) {
        return job.set(m, nh, R, dr, q_lat, q_lat_req_stride, q_lat_stride, q_rot, q_rot_req_stride, q_rot_stride,
                       scale, req_n_runs, runs, run_len, row_stride, out, out_req_stride, out_stride);
    });
}

int kt_gqa_attend_batch(kt_ctx* ctx, int64_t m, int64_t nkv, int64_t rep, int64_t hd, int64_t vd, const float* q,
                        int64_t q_entry_stride, int64_t q_head_stride, float scale, const int64_t* entry_n_runs,
                        const float* const* k_runs, const float* const* v_runs, const int64_t* run_len,
                        int64_t k_row_stride, int64_t v_row_stride, float* out, int64_t out_entry_stride,
                        int64_t out_head_stride) {
    return run_job(ctx, &kt_ctx::gqa_batch, [&](kt::GqaAttendBatch& job) {
        return job.set(m, nkv, rep, hd, vd, q, q_entry_stride, q_head_stride, scale, entry_n_runs, k_runs, v_runs,
                       run_len, k_row_stride, v_row_stride, out, out_entry_stride, out_head_stride);
    });
}

int kt_gqa_decode(kt_ctx* ctx, const kt_gqa_decode_args* args) {
    return run_args_job(ctx, &kt_ctx::gqa_decode, args, "kt_gqa_decode");
}

int kt_prompt_attend(kt_ctx* ctx, const kt_prompt_attend_args* args) {
    return run_args_job(ctx, &kt_ctx::prompt, args, "kt_prompt_attend");
}

int kt_gqa_layer(kt_ctx* ctx, const kt_gqa_layer_args* args) {
    if (!ctx || !args) { t_error = "kt_gqa_layer: needs a context and arguments"; return -1; }
    const char* why = "";
    bool ok = false;
    ctx->engine.pool().wait();   // a job in flight may be an earlier one's: it may use the same slot
    if (guarded([&] { ok = ctx->gqa_decode.run_layer(ctx, *args, &why); }) != 0) return -1;   // a Linear's error
    if (!ok) t_error = std::string("kt_gqa_layer: ") + why;
    return ok ? 0 : -1;
}

int kt_mla_decode(kt_ctx* ctx, const kt_mla_decode_args* args) {
    if (!ctx || !args) { t_error = "kt_mla_decode: needs a context and arguments"; return -1; }
    const char* why = "";
    bool ok = false;
    if (guarded([&] { ok = ctx->mla_decode.run(ctx, *args, &why); }) != 0) return -1;   // a Linear's error
    if (!ok) t_error = std::string("kt_mla_decode: ") + why;
    return ok ? 0 : -1;
}

int kt_moe_decode_impl(kt_ctx* ctx, kt_moe_decode_args* a, const char** why);   // moe_decode.cpp

int kt_moe_decode(kt_ctx* ctx, kt_moe_decode_args* args) {
    if (!ctx || !args) { t_error = "kt_moe_decode: needs a context and arguments"; return -1; }
    const char* why = "";
    int rc = -1;
    if (guarded([&] { rc = kt_moe_decode_impl(ctx, args, &why); }) != 0) return -1;   // the experts' own errors
    if (rc != 0) t_error = std::string("kt_moe_decode: ") + why;
    return rc;
}

// The decode step's layers without Python between them: in ktrun each layer's two calls cost ~50-90 us of
// interpreter time apart from the calls themselves (a Qwen3-30B-A3B-shaped step on 2 Zen 3 cores), most of it cache
// misses: the experts' job streams megabytes through the caches the interpreter's objects were in.
int kt_decode_layers(kt_decode_layers_args* a) {
    if (!a) { t_error = "kt_decode_layers: no arguments"; return -1; }
    a->attn_s = a->moe_s = a->wait_s = a->head_s = 0.0;
    if (a->T < 1 || a->H < 16 || (!a->x && !a->tokens) || (!a->h && !a->norm0) || !a->rows || !a->x_out ||
        !a->h_out || a->n_layers < 1 || !a->layers) {
        t_error = "kt_decode_layers: bad geometry, a missing x (or tokens) / h (or norm0) / rows / x_out / h_out, or "
                  "no layers";
        return -1;
    }
    if (a->tokens && (!a->embed || (a->embed_dtype != KT_F32 && a->embed_dtype != KT_BF16) || a->embed_rows < 1 ||
                      a->embed_stride < a->H)) {
        t_error = "kt_decode_layers: tokens without an embedding table (embed, embed_dtype KT_F32 / KT_BF16, "
                  "embed_rows, embed_stride >= H)";
        return -1;
    }
    if (a->mtp_hidden && (!a->tokens || !a->mtp_enorm || !a->mtp_hnorm || !a->mtp_ctx)) {
        t_error = "kt_decode_layers: an MTP block's first steps need tokens, mtp_enorm, mtp_hnorm and mtp_ctx";
        return -1;
    }
    for (int64_t t = 0; a->head_rows && t < a->head_T; ++t)
        if (a->head_rows[t] < 0 || a->head_rows[t] >= a->T) {
            t_error = "kt_decode_layers: head row " + std::to_string(a->head_rows[t]) + " is outside the " +
                      std::to_string(a->T) + " rows";
            return -1;
        }
    if (a->head_rows && a->head_T < 1) {
        t_error = "kt_decode_layers: head_rows without rows (head_T < 1)";
        return -1;
    }
    for (int64_t t = 0; a->tokens && t < a->T; ++t)
        if (a->tokens[t] < 0 || a->tokens[t] >= a->embed_rows) {
            t_error = "kt_decode_layers: token " + std::to_string(a->tokens[t]) + " at row " + std::to_string(t) +
                      " is outside the embedding table's " + std::to_string(a->embed_rows) + " rows";
            return -1;
        }
    // the head's arguments before any layer runs: a refusal after the layers would leave a step half done (its KV
    // rows written, no logits)
    if (a->head_kind < 0 || a->head_kind > 2 ||
        (a->head_kind != 0 && ((a->head_kind == 2 && !a->head_ctx) || !a->logits || a->head_n < 1))) {
        t_error = "kt_decode_layers: the head: head_kind not 0, 1 or 2, a missing Linear context or logits, or "
                  "head_n < 1";
        return -1;
    }
    const int64_t T = a->T, H = a->H;
    thread_local std::vector<float> delta, x0, h0, u, xm, head_x;
    const kt_gqa_decode_args& r = *a->rows;
    const float* x = a->x;
    const float* h = a->h;
    if (a->tokens) {   // the embedding rows, as float32 (bf16 widened: its bits are a float32's high half)
        x0.resize((size_t)(T * H));
        for (int64_t t = 0; t < T; ++t) {
            float* dst = x0.data() + t * H;
            if (a->embed_dtype == KT_F32) {
                std::memcpy(dst, (const float*)a->embed + a->tokens[t] * a->embed_stride, (size_t)H * sizeof(float));
            } else {
                const uint16_t* src = (const uint16_t*)a->embed + a->tokens[t] * a->embed_stride;
                for (int64_t j = 0; j < H; ++j) dst[j] = kt::bf16_to_f32(src[j]);
            }
        }
        x = x0.data();
    }
    if (a->mtp_hidden) {   // the MTP block's x = eh_proj([enorm(e) | hnorm(hidden)]) (row-wise: the same bits as its
                           // two norms into separate rows, then their concatenation)
        u.resize((size_t)(T * 2 * H));
        xm.resize((size_t)(T * H));
        if (kt_rms_norm(T, H, x, H, nullptr, 0, nullptr, 0, a->mtp_enorm, a->eps, a->lanes, u.data(), 2 * H) != 0 ||
            kt_rms_norm(T, H, a->mtp_hidden, H, nullptr, 0, nullptr, 0, a->mtp_hnorm, a->eps, a->lanes, u.data() + H,
                        2 * H) != 0) {
            t_error = "kt_decode_layers: the MTP block's enorm / hnorm: bad lanes or H";
            return -1;
        }
        const int32_t id = a->mtp_eh_id;
        float* const outs[1] = {xm.data()};
        const int64_t strides[1] = {H};
        if (kt_linear_submit(a->mtp_ctx, 1, &id, (int)T, u.data(), KT_F32, 2 * H, outs, strides) != 0 ||
            kt_sync(a->mtp_ctx) != 0) {
            t_error = "kt_decode_layers: the MTP block's eh_proj: " + t_error;
            return -1;
        }
        x = xm.data();
    }
    if (a->norm0) {
        h0.resize((size_t)(T * H));
        if (kt_rms_norm(T, H, x, H, nullptr, 0, nullptr, 0, a->norm0, a->eps, a->lanes, h0.data(), H) != 0) {
            t_error = "kt_decode_layers: layer 0's norm: bad lanes or H";
            return -1;
        }
        h = h0.data();
    }
    auto clock = [] { return std::chrono::steady_clock::now(); };
    for (int i = 0; i < a->n_layers; ++i) {
        const kt_decode_layer& L = a->layers[i];
        auto fail = [&](const char* what) {
            t_error = "kt_decode_layers: layer " + std::to_string(i) + ": " + what;
            return -1;
        };
        if (!L.attn_ctx || (!L.attn == !L.mla) || !L.moe_ctx || !L.moe)
            return fail("missing a context or an argument block (one of attn and mla)");
        delta.resize((size_t)(T * H));
        const auto t0 = clock();
        if (L.attn) {
            kt_gqa_layer_args& g = *L.attn;
            if (g.n_out != H) return fail("o_proj's N is not H");
            g.attn.T = T; g.attn.rope_half = r.rope_half; g.attn.interleaved = r.interleaved;
            g.attn.cos = r.cos; g.attn.sin = r.sin; g.attn.cs_stride = r.cs_stride;
            g.attn.m = r.m; g.attn.row0 = r.row0; g.attn.start = r.start; g.attn.table0 = r.table0;
            g.attn.tables = r.tables;
            g.x = h; g.x_stride = H; g.out = delta.data(); g.out_stride = H;
            if (kt_gqa_layer(L.attn_ctx, &g) != 0) return fail(t_error.c_str());
        } else {
            kt_mla_decode_args& g = *L.mla;
            g.T = T; g.interleaved = r.interleaved; g.cos = r.cos; g.sin = r.sin; g.cs_stride = r.cs_stride;
            g.m = r.m; g.row0 = r.row0; g.start = r.start; g.table0 = r.table0; g.tables = r.tables;
            g.x = h; g.x_stride = H; g.out = delta.data(); g.out_stride = H;
            if (kt_mla_decode(L.attn_ctx, &g) != 0) return fail(t_error.c_str());
        }
        const auto t1 = clock();
        kt_moe_decode_args& m = *L.moe;
        if (m.H != H || !m.finish) return fail("the MoE block's H is not H, or its finish is 0");
        // in place after the first layer: kt_moe_decode reads x and delta into its scratch before it writes x_out
        // and h_out (moe_decode.cpp), and the attention above has consumed h
        m.T = T; m.x = x; m.x_stride = H; m.delta = delta.data(); m.delta_stride = H;
        m.x_out = a->x_out; m.h_out = a->h_out;
        if (kt_moe_decode(L.moe_ctx, &m) != 0) return fail(t_error.c_str());
        a->attn_s += std::chrono::duration<double>(t1 - t0).count();
        a->moe_s += std::chrono::duration<double>(clock() - t1).count();
        a->wait_s += m.wait_s;
        x = a->x_out;
        h = a->h_out;
    }
    if (a->head_kind == 0) return 0;
    // the output head on the final norm, while its weights' and the pool's state are what the layers left (the
    // caller's own call after this one found them cold: ~95 of its ~145 us on a Qwen3-shaped step, Zen 4)
    const auto t0 = clock();
    const float* hx = a->h_out;
    int64_t hT = T;
    if (a->head_rows) {   // the chosen rows, gathered as the caller's h[rows] would be
        hT = a->head_T;
        head_x.resize((size_t)(hT * H));
        for (int64_t t = 0; t < hT; ++t)
            std::memcpy(head_x.data() + t * H, a->h_out + a->head_rows[t] * H, (size_t)H * sizeof(float));
        hx = head_x.data();
    }
    if (a->head_kind == 1) {
        if (kt_float_linear(a->head_ctx, hT, a->head_n, H, hx, H, a->head_w, a->head_w_dtype, a->head_w_stride,
                            a->logits, a->head_n) != 0) {
            t_error = "kt_decode_layers: the head: kt_float_linear refused its arguments";
            return -1;
        }
    } else {   // head_kind 2 (checked before the layers)
        const int32_t id = a->head_id;
        float* const outs[1] = {a->logits};
        const int64_t strides[1] = {a->head_n};
        if (kt_linear_submit(a->head_ctx, 1, &id, (int)hT, hx, KT_F32, H, outs, strides) != 0 ||
            kt_sync(a->head_ctx) != 0) {
            t_error = "kt_decode_layers: the head: " + t_error;
            return -1;
        }
    }
    a->head_s = std::chrono::duration<double>(clock() - t0).count();
    return 0;
}

int kt_linear_submit(kt_ctx* ctx, int n_linears, const int32_t* ids, int n_tokens, const void* x, int x_dtype,
                     int64_t x_stride, float* const* outs, const int64_t* out_strides) {
    return guarded([&] {
        static_assert(sizeof(int32_t) == sizeof(int), "linear ids are int32");
        ctx->linear.submit(n_linears, (const int*)ids, n_tokens, x, x_dtype, x_stride, outs, out_strides);
    });
}

int kt_linear_submit_grouped(kt_ctx* ctx, int linear_id, int n_groups, int row0, int row_step, int rows,
                             int n_tokens, const void* x, int x_dtype, int64_t x_stride, int64_t x_group_stride,
                             float* out, int64_t out_stride, int64_t out_group_stride) {
    return guarded([&] {
        ctx->linear.submit_grouped(linear_id, n_groups, row0, row_step, rows, n_tokens, x, x_dtype, x_stride,
                                   x_group_stride, out, out_stride, out_group_stride);
    });
}

int kt_linear_submit_grouped_scaled(kt_ctx* ctx, int linear_id, int n_groups, int row0, int row_step, int rows,
                                    int n_tokens, const void* x, int x_dtype, int64_t x_stride,
                                    int64_t x_group_stride, int x_group_div, const float* x_scale, float* out,
                                    int64_t out_stride, int64_t out_group_stride) {
    return guarded([&] {
        ctx->linear.submit_grouped(linear_id, n_groups, row0, row_step, rows, n_tokens, x, x_dtype, x_stride,
                                   x_group_stride, out, out_stride, out_group_stride, x_group_div, x_scale);
    });
}

int kt_linear_repack(kt_ctx* ctx, int n, int k, int bits, int group_size, const void* codes, int codes_kind,
                     int64_t code_stride_k, int64_t code_stride_n, const uint16_t* scales, int64_t scale_stride_g,
                     int64_t scale_stride_n, void* qweight, float* scales_out) {
    return guarded([&] {
        ctx->linear.repack(n, k, bits, group_size, codes, codes_kind, code_stride_k, code_stride_n, scales,
                           scale_stride_g, scale_stride_n, (uint8_t*)qweight, scales_out);
    });
}

int kt_linear_repack_ex(kt_ctx* ctx, int n, int k, int bits, int group_size, const void* codes, int codes_kind,
                        int64_t code_stride_k, int64_t code_stride_n, const uint16_t* scales, int64_t scale_stride_g,
                        int64_t scale_stride_n, void* qweight, void* scales_out, int scales_dtype) {
    return guarded([&] {
        ctx->linear.repack(n, k, bits, group_size, codes, codes_kind, code_stride_k, code_stride_n, scales,
                           scale_stride_g, scale_stride_n, (uint8_t*)qweight, scales_out, scales_dtype);
    });
}

int kt_profile(kt_ctx* ctx, double* out, int capacity) {
    const std::vector<double>& p = ctx->engine.profile();
    const int n = (int)p.size() < capacity ? (int)p.size() : capacity;
    for (int i = 0; i < n; ++i) out[i] = p[i];
    return n;
}

double kt_measure_read_bandwidth(kt_ctx* ctx, size_t bytes, int reps) {
    kt::ThreadPool& pool = ctx->engine.pool();
    const kt::ReadFn read = ctx->engine.table().read_sum;
    bytes = bytes / (2u << 20) * (2u << 20);
    // Anonymous memory with transparent huge pages, as numpy gives large arrays (and as weights in a page-cache
    // mapping are read): the probe should not lose to the kernels on TLB misses.
    void* map = bytes ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) : MAP_FAILED;
    if (map == MAP_FAILED) { t_error = "cannot allocate the bandwidth probe buffer"; return -1.0; }
    madvise(map, bytes, MADV_HUGEPAGE);
    char* buf = (char*)map;
    memset(buf, 1, bytes);   // fault every page in before timing
    std::vector<uint64_t> sink(pool.n_threads());
    constexpr size_t kChunk = 2u << 20;
    double best = 0.0;
    for (int r = 0; r < (reps > 0 ? reps : 1); ++r) {
        const double t0 = now_s();
        // 2 MiB chunks taken dynamically, like the kernels' work items: a worker that loses its core to another
        // process does not hold the others up (a static split measured the scheduler, not the memory)
        std::atomic<size_t> next{0};
        pool.launch([&](const kt::WorkerInfo& w) {
            for (size_t c; (c = next.fetch_add(1)) < bytes / kChunk;) sink[w.index] += read(buf + c * kChunk, kChunk);
        });
        pool.wait();
        const double dt = now_s() - t0;
        if (bytes / dt > best) best = bytes / dt;
    }
    munmap(map, bytes);
    return best;
}

namespace {
// Runs peak(iters) on every worker, doubling iters until `seconds` were spent; the best rate, ops/s.
double measure_peak(kt::ThreadPool& pool, kt::PeakFn peak, double seconds) {
    std::vector<double> ops(pool.n_threads());
    double best = 0.0, spent = 0.0;
    for (int64_t iters = 1 << 16; spent < seconds; iters *= 2) {
        const double t0 = now_s();
        pool.launch([&](const kt::WorkerInfo& w) { ops[w.index] = peak(iters); });
        pool.wait();
        const double dt = now_s() - t0;
        spent += dt;
        double total = 0.0;
        for (double o : ops) total += o;
        if (dt > 0.01 && total / dt > best) best = total / dt;
    }
    return best;
}
}  // namespace

double kt_measure_int8_peak(kt_ctx* ctx, double seconds) {
    return measure_peak(ctx->engine.pool(), ctx->engine.table().peak, seconds);
}

double kt_measure_tile_int8_peak(kt_ctx* ctx, double seconds) {
    const kt::PeakFn peak = ctx->engine.table().tile_peak;
    return peak ? measure_peak(ctx->engine.pool(), peak, seconds) : 0.0;
}

}  // extern "C"
