"""A decode step's decoder layers in one library call (kt_decode_layers): for each layer its attention's kt_gqa_layer
call (attention_one_call.gqa_layer) and its MoE half's kt_moe_decode call (moe_one_call.run), the calls MoEModel
makes one after another with the same arguments, so the same bits, without the interpreter between them. Each layer's
two calls cost ~50-90 us of Python apart from the calls themselves (a Qwen3-30B-A3B-shaped step on 2 Zen 3 cores),
most of it cache misses: the experts' job streams megabytes through the caches the interpreter's objects were in.

The plan is learned, not derived: a forward that took the two one-call paths in every layer records them
(Batch.record_one_call), and MoEModel keeps the plan
made from that record. Later forwards run it when they would take the same paths: the generic GQA attention (no
family hook, no sinks), decode-sized float32 CPU rows of one float32 block pool, the experts' executor the plan was
made for, no test hook on the router. A model with a dense layer (GLM-4.5's first) or MLA attention never records a
full plan and keeps its per-layer calls."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..ops import glue
from ..ops.library import DecodeLayer, DecodeLayersArgs, GqaDecodeArgs, KernelError
from . import generic
from .attention_one_call import _float32_pool, _rope_rows_ok, paging
from .choices import hooked
from .kv_cache import Batch
from .layers import SERIAL_MAX_ROWS


@dataclass
class StepPlan:
    experts: object                   # the executor the MoE calls were made for (a bench or test may swap it)
    slots: list[int]                  # each layer's KV slot, in layer order
    attn: list                        # per layer (GqaLayerCall, window)
    moe: list                         # per layer MoeDecodeCall
    layers: ctypes.Array              # (DecodeLayer * n): pointers into the calls' argument blocks
    rows: GqaDecodeArgs               # the step's rows, as every layer's attention reads them
    args: DecodeLayersArgs
    hd: int


def learn(model, batch: Batch) -> None:
    """After a forward through the per-layer loop: the plan, if every layer took both one-call paths."""
    rec = batch.carried.get("one_call")
    if rec is None or model.arch.attention is not generic.attention:
        return
    attn, moe = rec["attn"], rec["moe"]
    slots = list(range(len(model.layers)))
    if any(s not in attn for s in slots) or any(i not in moe or moe[i] is None for i in model.layers):
        return
    a_calls = [attn[s] for s in slots]
    m_calls = [moe[i] for i in model.layers]
    layers = (DecodeLayer * len(slots))()
    for d, (g, _), mc in zip(layers, a_calls, m_calls):
        d.attn_ctx, d.attn = g.kernels.handle, ctypes.pointer(g.args)
        d.moe_ctx, d.moe = mc.kernels.handle, ctypes.pointer(mc.args)
    rows = GqaDecodeArgs()
    args = DecodeLayersArgs(H=model.cfg.hidden_size, rows=ctypes.pointer(rows), n_layers=len(slots),
                            layers=ctypes.cast(layers, ctypes.POINTER(DecodeLayer)))
    model.step_plan = StepPlan(model.experts, slots, a_calls, m_calls, layers, rows, args,
                               a_calls[0][0].args.attn.hd)


def run(model, batch: Batch, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x (T, H) and layer 0's normed input h through every decoder layer -> (x, the final norm), or None (nothing
    done) when there is no plan or this forward would not take its paths."""
    pl = model.step_plan
    if pl is None:
        return None
    T, H = x.shape
    if pl.experts is not model.experts or T > glue.ROUTE_MAX_ROWS or hooked() or \
            any(s.n > SERIAL_MAX_ROWS for s in batch.seqs) or x.dtype != torch.float32 or not x.is_cpu or \
            h.dtype != torch.float32 or not x.is_contiguous() or not h.is_contiguous() or \
            not _rope_rows_ok(cos, sin, pl.hd) or cos.shape[0] != T:
        return None
    pool = _float32_pool(batch)
    if pool is None:
        return None
    toks = pool.tokens
    for s, (g, window) in zip(pl.slots, pl.attn):
        if g.caches_of is not toks:     # the pool grew (new slabs), or a per-layer call set another pool's
            glue._set_rows(g.args.attn, T, cos, sin, cos.shape[-1], model.rope.interleaved, paging(batch),
                           toks[0][s], toks[1][s], window)
            g.caches_of = toks
    r = pl.rows
    r.T, r.rope_half, r.interleaved = T, cos.shape[-1], int(model.rope.interleaved)
    r.cos, r.sin, r.cs_stride = (cos.data_ptr(), sin.data_ptr(), cos.stride(0)) if r.rope_half else (None, None, 0)
    r.m, row0, start, table0, tables = paging(batch)
    r.row0, r.start, r.table0, r.tables = row0.data_ptr(), start.data_ptr(), table0.data_ptr(), tables.data_ptr()
    out = torch.empty((2, T, H), dtype=torch.float32)
    a = pl.args
    a.T, a.x, a.h = T, x.data_ptr(), h.data_ptr()
    p = out.data_ptr()
    a.x_out, a.h_out = p, p + 4 * T * H
    lib = glue._library()
    if lib.kt_decode_layers(ctypes.byref(a)) != 0:
        raise KernelError(lib.kt_last_error().decode())
    tm = model.timing
    tm["attention_s"] += a.attn_s
    tm["mlp_s"] += a.moe_s
    tm["expert_wait_s"] += a.wait_s
    for _ in pl.slots:
        model.experts.record_one_call(T * model.cfg.top_k, a.wait_s / len(pl.slots))
    return out[0], out[1]
