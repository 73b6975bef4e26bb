"""A decoder layer's attention for decode rows in one library call, where the layer allows it (ktrun.models.attention
asks first and keeps its separate steps otherwise): GQA after its projections (kt_gqa_decode: q/k norms, RoPE, the
paged KV write, the attention) and MLA from x to o_proj's output (kt_mla_decode: its seven jobs and the glue between
them chained in C). Each call is the sequence of functions the separate steps call, with the same arguments: the same
bits (tests/test_kernels_gqa_decode.py, tests/test_kernels_mla_decode.py). Why: between a layer's jobs the separate
steps ran ~10-25 library calls and torch ops with Python between them while the kernel pool waited
(docs/decode-step.md)."""
from __future__ import annotations

import numpy as np
import torch
from ktlayouts.families import ModelConfig

from ..ops import glue
from ..ops.kernel_linear import AbsorbedKvB, KernelLinear
from .kv_cache import Batch
from .layers import LORA_NORM_EPS, SERIAL_MAX_ROWS, Rope


def gqa(cfg: ModelConfig, w: dict, p: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
        layer: int, rope: Rope, cos: torch.Tensor, sin: torch.Tensor, qk_norm: str | None, window: int | None | str,
        sinks: torch.Tensor | None, kernels) -> torch.Tensor | None:
    """ktrun.models.attention.gqa_attention after the projections, for a batch of decode-sized requests (each at most
    SERIAL_MAX_ROWS new rows: decode, a speculative verify) of a float32 CPU model: the q / k norms, RoPE, the cache
    write and every row's attention over its causal (windowed) prefix in one kt_gqa_decode call
    (ktrun.ops.glue.gqa_decode), the same bits as gqa_attention's separate steps. -> (T, nh * vd), or None (nothing
    done) for anything else: sinks, longer prompts, other dtypes or devices, norms or RoPE the call does not
    reproduce, caches it cannot address."""
    nh, hd = cfg.num_heads, cfg.head_dim
    if sinks is not None or q.dtype != torch.float32 or not q.is_cpu or hd % 16 or \
            any(s.n > SERIAL_MAX_ROWS for s in batch.seqs):
        return None
    caches = _caches(batch, layer, hd)
    if caches is None:
        return None
    kc, vc = caches
    nkv = kc.shape[2]
    if k.shape[1] != nkv * hd or v.shape[1] != nkv * vc.shape[3]:
        return None
    q_w, k_w = _qk_norms(w, p, qk_norm)
    if q_w is False or not _rope_rows_ok(cos, sin, hd) or any(t.stride(-1) != 1 for t in (q, k, v)):
        return None
    return glue.gqa_decode(q, k, v, nh, hd, qk_norm, q_w, k_w, cfg.rms_norm_eps, cos, sin, cos.shape[-1],
                           rope.interleaved, paging(batch), kc, vc, cfg.softmax_scale, _window(cfg, window), kernels)


def _caches(batch: Batch, layer: int, hd: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer's (k (blocks, B, nkv, hd), v (blocks, B, nkv, vd)) slabs of the batch's one float32 block pool as
    kt_gqa_decode addresses them (contiguous, key heads of hd, value heads a multiple of 16), or None."""
    pool = _float32_pool(batch)
    if pool is None or len(pool.tokens) < 2:
        return None
    kc, vc = pool.tokens[0][layer], pool.tokens[1][layer]
    if kc.dim() != 4 or vc.dim() != 4 or vc.shape[2] != kc.shape[2] or kc.shape[3] != hd or vc.shape[3] % 16 or \
            not (kc.is_contiguous() and vc.is_contiguous()):
        return None
    return kc, vc


def _qk_norms(w: dict, p: str, qk_norm: str | None):
    """(q_norm, k_norm) weights of a layer whose norm kt_rms_norm reproduces ((None, None) without one), or
    (False, False) when the call cannot norm them."""
    q_w, k_w = (w.get(p + "q_norm.weight"), w.get(p + "k_norm.weight")) if qk_norm else (None, None)
    if qk_norm not in (None, "head", "projection") or (qk_norm and not glue.norm_weights_ok(q_w, k_w)):
        return False, False
    return q_w, k_w


def _rope_rows_ok(cos: torch.Tensor, sin: torch.Tensor, hd: int) -> bool:
    """cos / sin (T, rope_half) float32 rows with contiguous columns, rotating at most the head's hd dims."""
    return 2 * cos.shape[-1] <= hd and cos.dtype == torch.float32 and sin.dtype == torch.float32 and \
        cos.stride(-1) == 1 and sin.stride() == cos.stride()


def _window(cfg: ModelConfig, window: int | None | str) -> int | None:
    return cfg.sliding_window if window == "config" else window


def gqa_layer(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope,
              cos: torch.Tensor, sin: torch.Tensor, qk_norm: str | None, window: int | None | str,
              sinks: torch.Tensor | None) -> torch.Tensor | None:
    """ktrun.models.attention.gqa_attention whole, from the layer's normed input x (T, hidden) to o_proj's output, for
    a batch of decode-sized requests of a float32 CPU model whose q / k / v / o Linears sit on one kernel context: one
    kt_gqa_layer call (glue.GqaLayerCall), the bits of the separate steps (the q / k / v job and its biases, gqa()
    above, o_proj's job and bias). -> (T, hidden), or None (nothing done) where gqa() would not run or the Linears are
    not all on the op (_gqa_plan)."""
    if sinks is not None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.stride(-1) != 1 or \
            any(s.n > SERIAL_MAX_ROWS for s in batch.seqs):
        return None
    call = _gqa_plan(cfg, w, p, qk_norm)
    if call is None:
        return None
    g = call.args.attn
    caches = _caches(batch, layer, g.hd)
    if caches is None or caches[0].shape[2] != g.nkv or caches[1].shape[3] != g.vd or not _rope_rows_ok(cos, sin, g.hd):
        return None
    win = _window(cfg, window)
    batch.record_one_call("attn", layer, (call, win))
    return call(x, cos, sin, rope.interleaved, paging(batch), *caches, win)


def _gqa_plan(cfg: ModelConfig, w: dict, p: str, qk_norm: str | None) -> glue.GqaLayerCall | None:
    """The layer's kt_gqa_layer call, or None when its weights are not what the call takes: q / k / v / o all
    KernelLinears on one context, q / k / v sharing their input (one job, as layers.linears runs them), no act-order
    or padded inputs, float32 biases, head sizes multiples of 16, norms kt_rms_norm reproduces. Made once per layer
    and kept next to the weights (not a tensor or tuple: byte counts skip it)."""
    key = p + "gqa_layer_plan"
    if key in w:
        return w[key]
    w[key] = None
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    lins = {k: w.get(p + k + "_proj.weight") for k in ("q", "k", "v", "o")}
    first = lins["q"]
    if not isinstance(first, KernelLinear) or hd % 16 or nkv < 1 or nh % nkv or any(
            not isinstance(li, KernelLinear) or li.lin is not first.lin or li.perm is not None or li.k_op != li.k
            for li in lins.values()):
        return None
    vd = lins["v"].n // nkv
    if not (first.shares_input_with(lins["k"]) and first.shares_input_with(lins["v"])) or \
            first.n != nh * hd or lins["k"].n != nkv * hd or lins["v"].n != nkv * vd or vd % 16 or \
            lins["o"].k != nh * vd:
        return None
    biases = {k: w.get(p + k + "_proj.bias") for k in lins}
    if any(b is not None and (not isinstance(b, torch.Tensor) or b.dtype != torch.float32 or not b.is_cpu or
                              not b.is_contiguous() or b.numel() != lins[k].n) for k, b in biases.items()):
        return None
    q_w, k_w = _qk_norms(w, p, qk_norm)
    if q_w is False:
        return None
    w[key] = glue.GqaLayerCall(nh, nkv, hd, vd, {k: li.id for k, li in lins.items()}, biases, qk_norm, q_w, k_w,
                               cfg.rms_norm_eps, cfg.softmax_scale, lins["o"].n, first.lin.kernels)
    return w[key]


def _float32_pool(batch: Batch):
    """The one float32 KV block pool every request of the batch uses, or None (a cache that is not a block pool's,
    several pools, another dtype)."""
    pool = getattr(batch.seqs[0].cache, "pool", None)
    if pool is None or pool.dtype != torch.float32 or any(getattr(s.cache, "pool", None) is not pool
                                                          for s in batch.seqs):
        return None
    return pool


def paging(batch: Batch) -> tuple:
    """The batch's requests as kt_gqa_decode and kt_mla_decode read them: (m, row0 (m + 1), start (m), table0
    (m + 1), the block tables concatenated), int64 tensors made once per forward (Batch.carried) and read by every
    layer."""
    got = batch.carried.get("kv_paging")
    if got is None:
        row0, start, table0, tables = [0], [], [0], []
        for s in batch.seqs:
            row0.append(s.offset + s.n)
            start.append(s.start)
            tables.extend(s.cache.blocks)
            table0.append(len(tables))
        # one int64 array cut into the four (four torch.tensor calls of lists were ~30 us of a decode step)
        m = len(batch.seqs)
        flat = torch.from_numpy(np.array(row0 + start + table0 + tables, dtype=np.int64))
        got = batch.carried["kv_paging"] = (m, flat[:m + 1], flat[m + 1:2 * m + 1], flat[2 * m + 1:3 * m + 2],
                                             flat[3 * m + 2:])
    return got


def mla(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int, rope: Rope, cos: torch.Tensor,
        sin: torch.Tensor, absorbed) -> torch.Tensor | None:
    """ktrun.models.attention.mla_attention for a batch whose requests' rows all take the absorbed form on
    kt_mla_attend_batch (the caller checks: decode, a speculative verify) of a float32 CPU model whose Linears all
    sit on one kernel context, kv_b absorbed on the op (absorbed(): the layer's AbsorbedKvB): x to o_proj's output in
    one kt_mla_decode call (ktrun.ops.glue.MlaLayerCall), the bits of mla_attention's steps. -> (T, hidden), or None
    (nothing done) for anything else: biases, act-order or padded inputs, other dtypes, caches it cannot address."""
    call = _mla_plan(cfg, w, p, absorbed)
    if call is None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.stride(-1) != 1:
        return None
    dr, R = call.dims[2], call.dims[4]
    if 2 * cos.shape[-1] != dr or cos.dtype != torch.float32 or sin.dtype != torch.float32 or \
            cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return None
    pool = _float32_pool(batch)
    if pool is None or len(pool.tokens) != 1:
        return None
    cache = pool.tokens[0][layer]                                     # (blocks, B, R + dr)
    if cache.dim() != 3 or cache.shape[2] != R + dr or not cache.is_contiguous():
        return None
    batch.record_one_call("attn", layer, (call, None))
    return call(x, cos, sin, rope.interleaved, paging(batch), cache)


def _mla_plan(cfg: ModelConfig, w: dict, p: str, absorbed) -> glue.MlaLayerCall | None:
    """The layer's kt_mla_decode call (glue.MlaLayerCall, its argument block made once), or None when its weights are
    not what kt_mla_decode takes: every Linear a KernelLinear on one context, no biases, no act-order, padded inputs
    only on q_b, kv_b absorbed on the op, float32 norms kt_rms_norm reproduces, R and dr multiples of 16. Kept next to
    the weights like the absorbed kv_b (not a tensor or tuple: byte counts skip it)."""
    key = p + "mla_decode_plan"
    if key in w:
        return w[key]
    w[key] = None
    nh, dn, dr, dv, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    q_lora = cfg.q_lora_rank or 0
    names = {"q_a": "q_a_proj" if q_lora else "q_proj", "kv_a": "kv_a_proj_with_mqa", "o": "o_proj"}
    if q_lora:
        names["q_b"] = "q_b_proj"
    lins = {k: w.get(p + n + ".weight") for k, n in names.items()}
    first = lins["q_a"]
    if dr % 16 or R % 16 or not isinstance(first, KernelLinear) or any(
            not isinstance(li, KernelLinear) or li.lin is not first.lin or li.perm is not None
            or (li.k_op != li.k and k != "q_b") or w.get(p + names[k] + ".bias") is not None for k, li in lins.items()):
        return None
    if q_lora and not first.shares_input_with(lins["kv_a"]):    # one job for both, as layers.linears runs them
        return None
    ab = absorbed()
    q_norm, kv_norm = w.get(p + "q_a_layernorm.weight") if q_lora else None, w.get(p + "kv_a_layernorm.weight")
    if not isinstance(ab, AbsorbedKvB) or ab.kv_b.lin is not first.lin or \
            not glue.norm_weights_ok(kv_norm, *([q_norm] if q_lora else [])):
        return None
    ids = {k: li.id for k, li in lins.items()}
    ids.update(uk=ab.uk_id, kv_b=ab.kv_b.id)
    dims = (nh, dn, dr, dv, R, q_lora, lins["q_b"].k_op if q_lora else 0)
    w[key] = glue.MlaLayerCall(ids, dims, ab.G, ab.s_uk, q_norm, kv_norm, LORA_NORM_EPS, cfg.softmax_scale,
                               lins["o"].n, first.lin.kernels)
    return w[key]
