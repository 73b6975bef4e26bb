"""Attention over per-request caches: GQA (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2) and MLA with a compressed-latent
cache (DeepSeek), optionally sparsified by DeepSeek-V3.2's lightning indexer (indexer.py).

Inputs are a flattened varlen batch: x (T, H) holds the new tokens of several requests; each request's queries see
only its own cache (plus its own new tokens, causally). Projections run once over all T rows; the score/softmax
part loops over requests (cheap next to the experts; no request can read another's cache). A request's cached
positions come as a few runs of views into the KV block pool (kv_cache.py): scores are computed per run and
concatenated (each score is its own dot product over the head dims, the same whatever the runs), one softmax spans
them all, and the output is one matmul of the probabilities with the runs' values concatenated. Not a sum of each
run's share: that splits the reduction over positions at the run boundaries, so a cached prefix (2+ runs) would
round differently from a full prefill (1 run), and the bf16 expert kernels downstream turn those last-bit
differences into ~3e-3 in the logits. Only values are copied, and only for requests whose cache spans 2+ runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig

from ..ops import glue, prompt_attention
from ..ops.kernel_linear import AbsorbedKvB
from ..ops.packed_linear import dense_weight, linear, linear_start
from . import attention_one_call as one_call
from . import indexer as lightning
from .kv_cache import Batch, causal_scores_mask
from .layers import LORA_NORM_EPS, SERIAL_MAX_ROWS, Rope, linears, rms_norm, serial_torch

SERIAL_MAX_SCORES = 16384   # decode scores (heads x tokens x positions) up to which attention's GEMMs run serially


def _softmax_attend(scores: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """scores: (heads, n, S) already scaled, a tensor the caller gives up (masked, and normalized when float32, in
    place); mask (n, S) bool or None (all visible) -> probabilities. sinks (heads,): a learned logit per head that
    joins the softmax as one more key without a value (gpt-oss), so the probabilities of the real keys sum to less
    than 1. In place because a prompt's scores are hundreds of MB and each new tensor of that size is fresh pages
    from the kernel: DeepSeek-V3 shape, pp2048 on the AMX server, masked_fill 2.1 s and softmax 4.1 s of a 19.2 s
    prefill; (128, 512, 2048) alone: 1.5 s -> 0.09 s, the same bits."""
    if mask is not None:
        scores.masked_fill_(~mask[None], float("-inf"))
    if sinks is None:
        if scores.dtype == torch.float32:
            return torch.softmax(scores, dim=-1, out=scores)
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
    sink = sinks.to(scores.dtype).view(-1, 1, 1).expand(scores.shape[0], scores.shape[1], 1)
    return F.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(scores.dtype)


def _mask(s, device, window: int | None) -> torch.Tensor | None:
    """Causal (and sliding-window) mask of one request's new tokens; None when every key is visible (decode)."""
    if s.n == 1 and (window is None or s.start < window):
        return None
    return causal_scores_mask(s.n, s.start, s.start + s.n, device, window)


def _cat_scores(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def _attend_runs(probs: torch.Tensor, values: list[torch.Tensor], apply) -> torch.Tensor:
    """apply(probs, the runs' values (S, ...) in position order): one reduction over all S positions, summed in the
    same order whether the cache is one run or several (see the module docstring)."""
    return apply(probs, _cat_rows(values))


def gqa_cache_widths(cfg: ModelConfig) -> list[tuple[int, ...]]:
    return [(cfg.num_kv_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim)]


def gqa_attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
                  cos: torch.Tensor, sin: torch.Tensor, qk_norm: str | None, window: int | None | str = "config",
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """x: (T, H) -> (T, H). p: weight-name prefix of this layer's self_attn, e.g. 'model.layers.3.self_attn.'.
    qk_norm: None, "head" (RMSNorm over each head's dims: Qwen3, GLM) or "projection" (over the whole q / k
    projection, all heads at once: MiniMax-M2), before RoPE. RoPE covers the first rope.dim dims of each head.
    window / sinks: as gqa_attend."""
    out = one_call.gqa_layer(cfg, w, p, x, batch, layer, rope, cos, sin, qk_norm, window, sinks)
    if out is not None:                               # decode rows on the kernels: x to o_proj's output in one call
        return out
    T, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # q (T, nh*hd), k (T, nkv*hd), v (T, nkv*hd): on the CPU kernels one submission (x quantized once, one job)
    q, k, v = linears(x, [w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]],
                      [w.get(p + "q_proj.bias"), w.get(p + "k_proj.bias"), w.get(p + "v_proj.bias")])
    lin = getattr(w[p + "q_proj.weight"], "lin", None)          # a KernelLinear's context: its pool attends too
    kernels = None if lin is None else lin.kernels
    out = one_call.gqa(cfg, w, p, q, k, v, batch, layer, rope, cos, sin, qk_norm, window, sinks, kernels)
    if out is not None:                               # decode rows: norms, RoPE, cache write, attention in one call
        return linear(out, w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))
    v = v.view(T, nkv, hd)
    if qk_norm == "projection":
        q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
    q, k = q.view(T, nh, hd), k.view(T, nkv, hd)
    if qk_norm == "head":
        q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    out = gqa_attend(cfg, q, k, v, batch, layer, window=window, sinks=sinks, kernels=kernels)
    return linear(out.reshape(T, nh * hd), w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))


def gqa_attend(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
               layer: int, window: int | None | str = "config", sinks: torch.Tensor | None = None,
               kernels=None) -> torch.Tensor:
    """Write each request's k/v into its cache and attend over its cached positions: q (T, nh, hd), k (T, nkv, hd)
    roped, v (T, nkv, vd) -> (T, nh, vd) (vd: the value head dim, hd but for MiMo-V2-Flash). window: keys per
    query (sliding window; "config": cfg.sliding_window, None: all); sinks (nh,): per-head sink logits
    (_softmax_attend). The cache keeps every position either way.

    A float32 CPU request of at most SERIAL_MAX_ROWS new rows (decode, a speculative verify, a short chunk) has each
    row attend over its causal (windowed) prefix in one kt_gqa_attend_batch call for all such requests (on kernels'
    pool when given: a MoEKernels / LinearKernels context), so each row gets the bits of its token decoded alone
    whatever the batch. With kernels, longer prompts and rows with sinks take kt_prompt_attend on its pool
    (_gqa_prompt_on_kernels); the rest (bf16, no kernels) torch's SDPA or GEMMs."""
    window = cfg.sliding_window if window == "config" else window
    T, nh = q.shape[:2]
    nkv, vd = k.shape[1], v.shape[-1]
    out = torch.empty((T, nh, vd), dtype=q.dtype, device=q.device)
    rep, scale = nh // nkv, cfg.softmax_scale
    runs = [s.cache.write(layer, s.start, [k[s.offset:s.offset + s.n], v[s.offset:s.offset + s.n]])
            for s in batch.seqs]                                  # per request [(k_r, v_r) (S_r, nkv, hd)]
    on_kernels = [sinks is None and q.dtype == torch.float32 and q.is_cpu and s.n <= SERIAL_MAX_ROWS
                  for s in batch.seqs]
    if any(on_kernels) and _gqa_rows_on_kernels(q, batch, runs, on_kernels, window, scale, out, kernels):
        rest = [(s, r) for s, r, on in zip(batch.seqs, runs, on_kernels) if not on]
    else:
        rest = list(zip(batch.seqs, runs))
    if rest and kernels is not None:                 # prompts and chunks: kt_prompt_attend on the kernels' pool
        rest = [(s, r) for s, r in rest if not _gqa_prompt_on_kernels(q, s, r, window, sinks, scale, out, kernels)]
    if rest:
        with serial_torch(T <= SERIAL_MAX_ROWS):      # decode-sized: no OpenMP wake-up per op (layers.serial_torch)
            _gqa_attend_torch(q, rest, window, sinks, rep, scale, out)
    return out


def _gqa_prompt_on_kernels(q: torch.Tensor, s, runs: list, window: int | None, sinks: torch.Tensor | None,
                           scale: float, out: torch.Tensor, kernels) -> bool:
    """A request's new rows by kt_prompt_attend into out, when more than SERIAL_MAX_ROWS (a prompt, a chunk after a
    cached prefix) or with sinks (gpt-oss: kt_gqa_attend_batch has none; a decode row of its 64 / 8 heads of 64 over
    512 positions 385 -> 190 us with the layer's glue, Zen 4). ktrun.ops.prompt_attention: each row's bits depend only
    on its query and the keys and values it sees, so a chunked or prefix-cached prompt's rows get a whole prompt's
    bits, and a verify's rows those of its tokens decoded one by one. False: not taken."""
    if s.n <= SERIAL_MAX_ROWS and sinks is None:   # decode rows without sinks: kt_gqa_attend_batch's bits
        return False
    k, v = _cat_rows([kr for kr, _ in runs]), _cat_rows([vr for _, vr in runs])      # (S, nkv, hd), (S, nkv, vd)
    rows = slice(s.offset, s.offset + s.n)
    return prompt_attention.attend(q[rows], k, v, s.start, scale, out[rows], window, sinks, kernels=kernels)


def _window_runs(runs: list, lo: int, hi: int) -> list:
    """Positions [lo, hi) of a request's cache runs (views, empty ones dropped)."""
    out, at = [], 0
    for kr, vr in runs:
        n = kr.shape[0]
        a, b = max(lo - at, 0), min(hi - at, n)
        if a < b:
            out.append((kr[a:b], vr[a:b]))
        at += n
    return out


def _gqa_rows_on_kernels(q: torch.Tensor, batch: Batch, runs: list, on_kernels: list[bool], window: int | None,
                         scale: float, out: torch.Tensor, kernels) -> bool:
    """The rows of the requests marked on_kernels, each over its causal (windowed) prefix, in one
    glue.gqa_attend_batch call into out. False (nothing done) when the call does not take them."""
    entries, rows = [], []
    for s, r, on in zip(batch.seqs, runs, on_kernels):
        if on:
            for i in range(s.n):
                pos = s.start + i
                entries.append(_window_runs(r, 0 if window is None else max(0, pos - window + 1), pos + 1))
                rows.append(s.offset + i)
    if len(rows) == q.shape[0]:                                   # every row, in order: no gather / scatter
        return glue.gqa_attend_batch(q, entries, scale, out, kernels)
    idx = torch.tensor(rows)
    o = torch.empty((len(rows), *out.shape[1:]), dtype=out.dtype)
    if not glue.gqa_attend_batch(q[idx], entries, scale, o, kernels):
        return False
    out[idx] = o
    return True


def _gqa_attend_torch(q, seq_runs: list, window: int | None, sinks: torch.Tensor | None, rep: int, scale: float,
                      out: torch.Tensor) -> None:
    """gqa_attend's torch path for [(request, its cache runs)], into out (T, nh, vd)."""
    T, nh, hd = q.shape
    nkv, vd = nh // rep, out.shape[-1]
    # Query heads grouped by the kv head they share: (nkv, rep, T, hd), scaled once (T rows, not S).
    qg = (q * scale).view(T, nkv, rep, hd).permute(1, 2, 0, 3)
    for s, runs in seq_runs:
        rows = slice(s.offset, s.offset + s.n)
        if s.n > SERIAL_MAX_ROWS and sinks is None:      # a prompt: torch's fused kernel, no (nh, n, S) scores
            out[rows] = _sdpa_rows(q[rows], runs, s, window, scale)
            continue
        # Each kv head's (S_r, hd) keys and values are read in place from the cache views (strided: no per-step
        # copy or per-head repeat of the cache; values are concatenated when the cache spans 2+ runs); its rep
        # query heads and n tokens are the rows of one GEMM.
        qs = qg[:, :, rows].reshape(nkv, rep * s.n, hd)                          # (nkv, rep*n, hd)
        scores = _cat_scores([torch.matmul(qs, kr.permute(1, 2, 0)) for kr, _ in runs])   # (nkv, rep*n, S)
        probs = _softmax_attend(scores.view(nh, s.n, -1), _mask(s, q.device, window), sinks)
        o = _attend_runs(probs.view(nkv, rep * s.n, -1), [vr for _, vr in runs],
                         lambda p, vr: torch.matmul(p, vr.transpose(0, 1)))      # (nkv, rep*n, vd)
        out[rows] = o.view(nh, s.n, vd).transpose(0, 1)


def _sdpa_rows(q: torch.Tensor, runs: list, s, window: int | None, scale: float) -> torch.Tensor:
    """A request's n new rows q (n, nh, hd) over its cached positions (runs, concatenated when 2+) under the causal
    (windowed) mask, by torch's scaled_dot_product_attention (on the CPU a blocked kernel with an online softmax: a
    512-token prompt's attention at 2.6x the GEMM + masked-softmax form, nothing of size nh x n x S) -> (n, nh, vd)."""
    k, v = _cat_rows([kr for kr, _ in runs]), _cat_rows([vr for _, vr in runs])      # (S, nkv, hd), (S, nkv, vd)
    # A whole prompt (nothing cached before it, no window) is torch's top-left causal mask: is_causal lets the kernel
    # skip the key blocks above the diagonal instead of computing and masking them, with the same bits (Zen 4, 32 / 4
    # heads of 128, 2 threads: a 2048-token prompt's attention 454-798 -> 268-465 ms per layer; 512: no change)
    causal = s.start == 0 and window is None
    mask = None if causal else causal_scores_mask(s.n, s.start, s.start + s.n, q.device, window)[None, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)   # (1, nh, n, vd)
    return o[0].transpose(0, 1)


PROMPT_BLOCK_ROWS = 128   # query rows per block of a prompt's expanded MLA attention (_attend_causal_blocks)


def _attend_causal_blocks(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                          start: int) -> torch.Tensor:
    """Attention of n query rows at positions start.. (q: (nh, n, d), scaled) over keys kt (nh, d, S) and values v
    (nh, S, dv) under mask (n, S) (causal: row i sees no key past start + i) -> (nh, n, dv). Up to PROMPT_BLOCK_ROWS
    rows: one (nh, n, S) score tensor. More (a prompt): blocks of PROMPT_BLOCK_ROWS rows, each over the keys up to
    its last row's position only, since every later key is masked for all of its rows: about half the multiply-adds
    of a whole prompt, and scores of (nh, 128, S) instead of (nh, n, S) (a 2048-token prompt at DeepSeek-V3's 128
    heads: 134 MB instead of 2.1 GB; a 512-row chunk at position 32k: 2 GB instead of 8.6 GB). Torch's fused attention
    has no kernel for MLA's key width 192 != value width 128 (it fell back to its unfused path: no faster with
    is_causal). Zen 4, 2 threads, 128 heads, the op alone: 512 rows 213 -> 166-181 ms, 2048 rows 4.3-5.1 -> 2.0-2.2 s;
    the DeepSeek-V3-shaped int4 prefill (3 layers, 512-token chunks), both forms alternated in one process: pp512
    121.2 -> 123.3 tok/s, pp2048 100.1 -> 102.8. Within float32 rounding of the one-tensor form (the softmax and the
    value sums drop the masked keys' zero terms)."""
    nh, n, _ = q.shape
    if n <= PROMPT_BLOCK_ROWS:
        return torch.matmul(_softmax_attend(torch.matmul(q, kt), mask), v)
    out = torch.empty((nh, n, v.shape[-1]), dtype=q.dtype, device=q.device)
    for i0 in range(0, n, PROMPT_BLOCK_ROWS):
        i1 = min(n, i0 + PROMPT_BLOCK_ROWS)
        hi = start + i1                                   # keys 0 .. hi-1: the block's last row sees key hi-1
        scores = torch.matmul(q[:, i0:i1], kt[..., :hi])                                    # (nh, b, hi)
        out[:, i0:i1] = torch.matmul(_softmax_attend(scores, None if mask is None else mask[i0:i1, :hi]), v[:, :hi])
    return out


def mla_cache_widths(cfg: ModelConfig, indexed: bool = False) -> list[tuple[int, ...]]:
    """The compressed latent (and, with the indexer, its keys) per position."""
    return [(cfg.kv_lora_rank + cfg.qk_rope_head_dim,)] + ([lightning.cache_width(cfg)] if indexed else [])


def _absorbed(w: dict, p: str, nh: int, dn: int, dv: int, R: int):
    """kv_b_proj (nh*(dn+dv), R) in the absorbed form, derived once per layer and kept next to the weights:
    - on the CPU kernels (kv_b a KernelLinear): an AbsorbedKvB, both halves on the quantized Linear op (no float
      copy; ktrun.ops.kernel_linear);
    - otherwise split per head into W_uk^T (nh, R, dn) and W_uv (nh, dv, R), float32 whatever the model dtype (bf16
      widens exactly): these are batched matrix-vector products at decode, and torch's CPU bf16 bmm runs them 2-3x
      slower than float32 reads twice the bytes (bench/README.md, "MLA decode"); the orientations are the fast ones
      (weight rows along the contraction, the vector on the right)."""
    key = p + "kv_b_proj.absorbed"
    if key not in w:
        kv_b = w[p + "kv_b_proj.weight"]
        if AbsorbedKvB.supported(kv_b, nh, dn, dv, R):
            w[key] = AbsorbedKvB(kv_b, nh, dn, dv, R)
        else:
            wkv_b = dense_weight(kv_b).float().view(nh, dn + dv, R)
            w[key] = (wkv_b[:, :dn].transpose(1, 2).contiguous(), wkv_b[:, dn:].contiguous())
    return w[key]


def prepare_absorbed(cfg: ModelConfig, w: dict, layer_prefixes: list[str]) -> None:
    """Derive every MLA layer's absorbed kv_b on the quantized Linear op now, at load (AbsorbedKvB): its one-time
    unpack / transpose temporaries (tens of MB for V3's kv_b) then come before the routed experts' pages are
    resident and never raise a run's peak RSS. The float32 pair of other paths stays lazy (67 MB per layer)."""
    nh, dn, dv, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for p in layer_prefixes:
        kv_b = w.get(p + "kv_b_proj.weight")
        if kv_b is not None and AbsorbedKvB.supported(kv_b, nh, dn, dv, R):
            _absorbed(w, p, nh, dn, dv, R)


ONE_CALL_MAX_ROWS = 512   # a request's rows kt_mla_decode takes: a prompt chunk (ktrun.generate.PREFILL_CHUNK)


def _absorbed_one_call_rows(batch: Batch, nh: int, dn: int, dr: int, dv: int, R: int) -> bool:
    """Whether every request of the batch has rows that take the absorbed form on kt_mla_attend_batch (at most
    ONE_CALL_MAX_ROWS rows: decode rows, a verify, a prompt's chunk): what kt_mla_decode runs. A prompt of n rows is n
    entries there, each over its causal prefix; in Python each cost a list of cache views per layer (the default
    model's 60-token prompt: ~1.5 ms of a 7.5 ms forward). Any context length: the call's attention runs on the pool,
    which takes a long cache in chunks. (It was held to glue.MLA_ATTEND_MAX_SCORES, the calling thread's limit: a
    128-head model left the call after 128 positions, for the per-layer path and torch's GEMMs; the
    DeepSeek-V3-shaped bench model's decode after a 512-token prompt 23.9 -> 30.7 tok/s, after 2048 18.9 -> 23.9,
    Zen 4, 2 cores, alternated in one process. A forward of several rows there, a verify or a short chunk, is slower
    in the call than torch's GEMMs over all its rows at once: 5 / 16 / 64 rows +8% / +14% / +20%, measured with a
    test run beside it. It stays in the call all the same: there every row has the bits of its token decoded alone,
    so a verify keeps plain decoding's greedy tokens at any length.)"""
    return all(s.n <= ONE_CALL_MAX_ROWS and not _naive_is_cheaper(s.n, s.start + s.n, dn, dr, dv, R)
               for s in batch.seqs)


def _naive_is_cheaper(n: int, S: int, dn: int, dr: int, dv: int, R: int) -> bool:
    """Multiply-adds per head: absorbed (n query rows through W_uk, over S latent rows of R + dr and R, through
    W_uv) vs expanded (S latent rows through kv_b into keys and values, then n x S attention of head dims)."""
    absorbed = n * (dn * R + S * (2 * R + dr) + R * dv)
    expanded = S * R * (dn + dv) + n * S * (dn + dr + dv)
    return expanded < absorbed


def mla_attention(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
                  cos: torch.Tensor, sin: torch.Tensor, indexed: bool = False,
                  selections: list | None = None) -> torch.Tensor:
    """Multi-head latent attention. The cache holds c_kv = norm(W_dkv x) (R) and the roped shared key (r) per
    position. Per request, the cheaper of two exact forms:
      absorbed (decode, short chunks): kv_b_proj is absorbed, q_nope is mapped into latent space and the latent
        output is mapped to values, so keys/values are never expanded per head and a step reads the latent cache
        once for all heads;
      expanded (prefill): the latent rows go through kv_b_proj (the Linear as stored, quantized or not) into
        per-head keys and values, then ordinary attention: fewer multiply-adds once n is large.
    indexed (DeepSeek-V3.2): the lightning indexer's keys are cached too and each query attends only to the keys it
    selects (the same mask in both forms). selections (GLM-5's index sharing), one entry per request of batch: with
    indexed, this layer's selections are stored in it; without, this layer runs no indexer and attends to the keys
    stored there by an earlier layer of the same forward (each request's (n, S) mask, or None: all visible).
    x: (T, H) -> (T, H)."""
    T, nh = x.shape[0], cfg.num_heads
    dn, dr, dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    scale = cfg.softmax_scale
    if not indexed and selections is None and _absorbed_one_call_rows(batch, nh, dn, dr, dv, R):
        out = one_call.mla(cfg, w, p, x, batch, layer, rope, cos, sin, lambda: _absorbed(w, p, nh, dn, dv, R))
        if out is not None:                           # x to o_proj's output in one call
            return out
    ix = None                                         # the lightning indexer's inputs (DeepSeek-V3.2)
    kv_a = p + "kv_a_proj_with_mqa."
    if cfg.q_lora_rank is None:
        q = linear(x, w[p + "q_proj.weight"])
        ckv = linear(x, w[kv_a + "weight"], w.get(kv_a + "bias"))                               # (T, R + dr)
    else:                       # q_a and kv_a read the same x: one submission on the CPU kernels
        qa, ckv = linears(x, [w[p + "q_a_proj.weight"], w[kv_a + "weight"]],
                          [w.get(p + "q_a_proj.bias"), w.get(kv_a + "bias")])
        q_resid = rms_norm(qa, w[p + "q_a_layernorm.weight"], LORA_NORM_EPS)                 # (T, q_lora_rank)
        q_b = linear_start(q_resid, w[p + "q_b_proj.weight"])   # on the CPU kernels: the latent's glue overlaps it
        if indexed:
            ix = lightning.project(cfg, w, p, x, q_resid, rope, cos, sin)
    c = rms_norm(ckv[:, :R], w[p + "kv_a_layernorm.weight"], LORA_NORM_EPS)
    k_rot = rope.apply(ckv[:, None, R:], cos, sin)[:, 0]                                       # (T, dr)
    latent = torch.cat([c, k_rot], dim=-1)                                                    # (T, R + dr)
    # every request's cache write before q_b's wait: on the CPU kernels this glue overlaps q_b's job
    written = [s.cache.write(layer, s.start, [latent[s.offset:s.offset + s.n]]
                             + ([ix.k[s.offset:s.offset + s.n]] if ix is not None else [])) for s in batch.seqs]
    if cfg.q_lora_rank is not None:
        q = q_b()
    q = q.view(T, nh, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    roped: list[torch.Tensor] = []

    def q_rot() -> torch.Tensor:          # (T, nh, dr), roped on first use: the absorbed decode ropes it during W_uk
        if not roped:
            roped.append(rope.apply(q_pe, cos, sin))
        return roped[0]
    o = torch.empty((T, nh, dv), dtype=x.dtype, device=x.device)
    lin = getattr(w[p + "kv_b_proj.weight"], "lin", None)       # a KernelLinear's context: its pool attends too
    kernels = None if lin is None else lin.kernels
    absorbed = []                                     # (request, its latent cache) in the absorbed form
    if selections is not None and ix is not None:
        selections[:] = [None] * len(batch.seqs)
    for j, (s, runs) in enumerate(zip(batch.seqs, written)):
        rows = slice(s.offset, s.offset + s.n)
        lats = [r[0] for r in runs]                                                           # [(S_r, R + dr)]
        S = s.start + s.n
        mask = _mask(s, x.device, None)
        if ix is not None:                     # the indexer's top-k over every cached key: (S, d_index) in one piece
            keys = runs[0][1] if len(runs) == 1 else torch.cat([r[1] for r in runs])
            mask = lightning.select(cfg, ix.q[rows], keys, ix.weights[rows], mask)
        if selections is not None:               # GLM-5: hand this layer's selection on, or take an earlier one's
            if ix is not None:
                selections[j] = mask
            else:
                mask = selections[j]
        if not _naive_is_cheaper(s.n, S, dn, dr, dv, R):
            absorbed.append((s, lats, mask))
            continue
        lat_all = _cat_rows(lats)                                                             # (S, R + dr)
        kv = linear(lat_all[:, :R], w[p + "kv_b_proj.weight"]).view(S, nh, dn + dv)           # (S, nh, dn + dv)
        qf = torch.cat([q_nope[rows], q_rot()[rows]], dim=-1)                               # (n, nh, dn + dr)
        if ix is None and selections is None and kernels is not None and prompt_attention.attend(
                qf, kv[..., :dn], kv[..., dn:], s.start, scale, o[rows], k2=lat_all[:, None, R:],
                kernels=kernels):                     # causal: the roped key shared by the heads, not expanded
            continue
        k = torch.cat([kv[..., :dn], lat_all[:, None, R:].expand(S, nh, dr)], dim=-1)        # (S, nh, dn + dr)
        qh = qf.transpose(0, 1) * scale                                                       # (nh, n, dn + dr)
        o[rows] = _attend_causal_blocks(qh, k.permute(1, 2, 0), kv[..., dn:].transpose(0, 1), mask,
                                        s.start).transpose(0, 1)                              # (n, nh, dv)
    if absorbed:
        _absorbed_attention(w, p, nh, dn, dr, dv, R, scale, x, T, q_nope, q_rot, absorbed, batch, o)
    return linear(o.reshape(T, nh * dv), w[p + "o_proj.weight"], w.get(p + "o_proj.bias"))


def _absorbed_attention(w: dict, p: str, nh: int, dn: int, dr: int, dv: int, R: int, scale: float, x: torch.Tensor,
                        T: int, q_nope: torch.Tensor, q_rot, absorbed: list, batch: Batch, o: torch.Tensor) -> None:
    """The absorbed form for the requests in absorbed [(request, its latent cache runs, mask)]: writes their rows
    of o (T, nh, dv). q_rot(): the roped (T, nh, dr) query half (made on first call)."""
    ab = _absorbed(w, p, nh, dn, dv, R)
    on_op = isinstance(ab, AbsorbedKvB)
    if len(absorbed) == len(batch.seqs):    # every request (decode): all T rows in order, no gather/scatter
        idx, m = slice(None), T
    else:
        idx = torch.cat([torch.arange(s.offset, s.offset + s.n) for s, _, _ in absorbed]).to(x.device)
        m = idx.numel()
    # Absorbed query rows [q_nope W_uk | q_rot] * scale (the softmax scale folded into the m query rows, not
    # the S keys), scored against the cached latent rows [c | k_rot] in one GEMM per request.
    small = m <= SERIAL_MAX_ROWS          # decode-sized: no OpenMP wake-up per op (layers.serial_torch)
    # decode rows on the kernels however many requests run (each request one row): many users are one batched step
    if on_op and _attend_on_kernels(ab, q_nope, q_rot, idx, scale, absorbed, o):
        return
    q_rot = q_rot()
    if on_op and small:   # the rotary half is scaled into place while W_uk's job runs, then the latent half
        q_lat_done = ab.q_latent_start(q_nope[idx])
        q_cat = torch.empty((nh, m, R + dr), dtype=x.dtype, device=x.device)             # (nh, m, R + dr)
        with serial_torch():      # the same products as the cat-then-scale below, element by element
            torch.mul(q_rot[idx].transpose(0, 1), scale, out=q_cat[..., R:])
            torch.mul(q_lat_done().transpose(0, 1).to(x.dtype), scale, out=q_cat[..., :R])
    else:
        if on_op:
            q_lat = ab.q_latent(q_nope[idx]).transpose(0, 1)                              # (nh, m, R)
        else:
            q_lat = torch.matmul(ab[0], q_nope[idx].permute(1, 2, 0).float()).transpose(1, 2)  # (nh, m, R)
        with serial_torch(small):
            q_cat = torch.cat([q_lat.to(x.dtype), q_rot[idx].transpose(0, 1)], dim=-1) * scale
    out_lat = torch.empty((m, nh, R), dtype=torch.float32, device=x.device)                  # (m, nh, R)
    j = 0
    for s, lats, mask in absorbed:
        # All heads and tokens of the request are the M rows of two GEMMs per cache run, read in place: the
        # per-step work besides them is a fixed number of small ops per run, whatever S is. Serial while the
        # scores are few (a short context); a long one's GEMMs are worth torch's threads.
        with serial_torch(small and nh * s.n * (s.start + s.n) <= SERIAL_MAX_SCORES):
            qs = q_cat[:, j:j + s.n].reshape(nh * s.n, R + dr)                                # (nh*n, R + dr)
            scores = _cat_scores([torch.matmul(qs, lat.t()) for lat in lats]).view(nh, s.n, -1)  # (nh, n, S)
            probs = _softmax_attend(scores, mask).view(nh * s.n, -1)
            lat_o = _attend_runs(probs, [lat[:, :R] for lat in lats], torch.matmul).view(nh, s.n, R)
        with serial_torch(small):
            out_lat[j:j + s.n] = lat_o.transpose(0, 1)
        j += s.n
    if on_op:
        o[idx] = ab.values(out_lat).to(x.dtype)                                          # (m, nh, dv)
    else:
        o[idx] = torch.matmul(ab[1], out_lat.permute(1, 2, 0)).permute(2, 0, 1).to(x.dtype)


def _prefix(lats: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first n cached rows of a request's runs (views)."""
    out = []
    for lat in lats:
        if n <= 0:
            break
        out.append(lat[:n])
        n -= lat.shape[0]
    return out


def _query_rows(absorbed: list, device) -> list | None:
    """Per query row, in row order, the cache runs it attends to: a request's one new row (decode) its whole cache;
    a request's n new rows under the plain causal mask (a speculative verify, a short chunk) one row each over its
    causal prefix (row r: positions [0, start + r]), so each row is what decoding its token alone would be; None
    when a mask is anything else (an indexer's selection)."""
    rows = []
    for s, lats, mask in absorbed:
        if mask is None and s.n == 1:
            rows.append(lats)
        elif mask is not None and torch.equal(mask, causal_scores_mask(s.n, s.start, s.start + s.n, device, None)):
            rows.extend(_prefix(lats, s.start + r + 1) for r in range(s.n))
        else:
            return None
    return rows


def _attend_on_kernels(ab: AbsorbedKvB, q_nope: torch.Tensor, q_rot, idx, scale: float, absorbed: list,
                       o: torch.Tensor) -> bool:
    """Query rows of a float32 model with kv_b on the kernels, each over its causal prefix (_query_rows: decode rows,
    and a request's several new rows under the plain causal mask): q_lat from W_uk's job (q_rot() is roped
    meanwhile), then scores / softmax / latent output of every row in one kt_mla_attend_batch call
    (ktrun.ops.glue.mla_attend_batch: its own fixed summation order, not torch's GEMMs; on the pool), then W_uv's
    job, straight into o. A row's result has the bits of that token decoded alone. False (nothing done) for anything
    else."""
    rows = _query_rows(absorbed, q_nope.device)
    if rows is None or q_nope.dtype != torch.float32 or \
            not all(glue.mla_attend_supported(lats, ab.R, ab.nh, pooled=True) for lats in rows):
        return False
    q_lat_done = ab.q_latent_start(q_nope[idx])
    qr = q_rot()[idx]                                                                        # (m, nh, dr)
    q_lat = q_lat_done()                                                                     # (m, nh, R)
    out_lat = torch.empty_like(q_lat)                                                        # (m, nh, R)
    if not glue.mla_attend_batch(q_lat, qr, rows, scale, out_lat, ab.kv_b.lin.kernels):     # one pool job
        for j, lats in enumerate(rows):
            glue.mla_attend(q_lat[j], qr[j], lats, scale, out_lat[j], ab.kv_b.lin.kernels)
    if isinstance(idx, slice) and o.is_contiguous():
        ab.values(out_lat, out=o)
    else:
        o[idx] = ab.values(out_lat)
    return True
