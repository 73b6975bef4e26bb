"""A decode step's decoder layers in one library call (kt_decode_layers): for each layer its attention's one call
(attention_one_call.gqa_layer's kt_gqa_layer or attention_one_call.mla's kt_mla_decode) and its MoE half's
kt_moe_decode call (moe_one_call.run), the calls MoEModel makes one after another with the same arguments, so the
same bits, without the interpreter between them. Each layer's two calls cost ~50-90 us of Python apart from the
calls themselves (a Qwen3-30B-A3B-shaped step on 2 Zen 3 cores), most of it cache misses: the experts' job streams
megabytes through the caches the interpreter's objects were in.

The plan is learned, not derived: a forward records the one-call paths its layers took (Batch.record_one_call), and
MoEModel keeps the plan made from the last layers that took both: all of them for Qwen3-MoE or MiniMax-M2, and for
DeepSeek-V3 or GLM-4.5 too when their dense layers' MLPs run as one-expert layers (KernelExperts.fuse_dense: the MoE
half's call with its dense router), else the MoE layers after the dense ones, which keep running in Python. Later
forwards run it from that layer on when they would take the same paths: the generic attention (no family hook, no
sinks, no indexer), decode-sized float32 CPU rows of one float32 block pool (MLA: rows in the absorbed form), the
experts' executor the plan was made for, no test hook on the router. When the forward wants every row's logits
(decode rows, a verify: Batch.carried[HEAD_ROWS]) the call runs the output head too (ABI 23, _head_fields), as the
caller's float_linear.head would after it; its caches are then still warm (kernels/README.md). A plan that starts
at layer 0 and runs the head takes the step's first steps too (whole_step: the embedding rows of its tokens and layer
0's norm in the same call, ABI 25), so MoEModel.forward calls nothing else for such a step: in a Qwen3-30B-A3B-shaped
decode step on 2 Zen 4 cores the embedding, its widening and the norm were ~50 us of Python and torch dispatch, cold
from the kernels' weight stream.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..ops import float_linear, glue
from ..ops.kernel_linear import KernelLinear
from ..ops.library import DecodeLayer, DecodeLayersArgs, GqaDecodeArgs, KernelError
from . import attention, generic
from .attention_one_call import _float32_pool, _rope_rows_ok, paging
from .choices import hooked
from .kv_cache import Batch
from .layers import SERIAL_MAX_ROWS, rms_norm

HEAD_ROWS = "head_every_row"   # Batch.carried: True when the forward wants logits of every row (decode rows)
HEAD_LOGITS = "head_logits"    # Batch.carried: (T, V) float32 logits the plan's call computed with its head


@dataclass
class StepPlan:
    experts: object                   # the executor the MoE calls were made for (a bench or test may swap it)
    first: int                        # the first layer (slot) the plan runs; the ones before run in Python
    slots: list[int]                  # each planned layer's KV slot, in layer order
    attn: list                        # per planned layer (GqaLayerCall or MlaLayerCall, window)
    moe: list                         # per planned layer MoeDecodeCall
    layers: ctypes.Array              # (DecodeLayer * n): pointers into the calls' argument blocks
    rows: GqaDecodeArgs               # the step's rows, as every layer's attention reads them
    args: DecodeLayersArgs
    mla: tuple | None                 # (nh, dn, dr, dv, R) when the attention is MLA (every planned layer's), else None
    hd: int                           # GQA's head dim (0 for MLA)
    n_moe: int                        # planned MoE layers (a dense layer's MLP is not counted as an experts' call)
    head: tuple | None = None         # the output head as the call runs it (_head_fields), None: the caller's
    first_steps: tuple | None = None  # (embedding table, its KT dtype, layer 0's norm weight) when the call can start
                                      # from the tokens (_first_step_fields), else None


def learn(model, batch: Batch) -> None:
    """After a forward through the per-layer loop: the plan of the last layers that all took both one-call paths
    (with one kind of attention), if any."""
    rec = batch.carried.get("one_call")
    if rec is None or model.arch.attention is not generic.attention:
        return
    attn, moe = rec["attn"], rec["moe"]
    first = len(model.layers)
    while first > 0 and first - 1 in attn and moe.get(model.layers[first - 1]) is not None:
        first -= 1
    slots = list(range(first, len(model.layers)))
    if not slots:
        return
    a_calls = [attn[s] for s in slots]
    m_calls = [moe[model.layers[s]] for s in slots]
    kinds = {type(c) for c, _ in a_calls}
    H = model.cfg.hidden_size
    if len(kinds) != 1 or any(c.n_out != H for c, _ in a_calls):
        return
    is_mla = kinds == {glue.MlaLayerCall}
    layers = (DecodeLayer * len(slots))()
    for d, (c, _), mc in zip(layers, a_calls, m_calls):
        d.attn_ctx, d.moe_ctx, d.moe = c.kernels.handle, mc.kernels.handle, ctypes.pointer(mc.args)
        if is_mla:
            d.mla = ctypes.pointer(c.args)
        else:
            d.attn = ctypes.pointer(c.args)
    rows = GqaDecodeArgs()
    args = DecodeLayersArgs(H=H, rows=ctypes.pointer(rows), n_layers=len(slots),
                            layers=ctypes.cast(layers, ctypes.POINTER(DecodeLayer)))
    c0 = a_calls[0][0]
    head = _head_fields(model)
    model.step_plan = StepPlan(model.experts, first, slots, a_calls, m_calls, layers, rows, args,
                               c0.dims[:5] if is_mla else None, 0 if is_mla else c0.args.attn.hd,
                               sum(model.layers[s] in model.moe_layers for s in slots), head,
                               _first_step_fields(model) if first == 0 and head is not None else None)


def _first_step_fields(model) -> tuple | None:
    """first_step_fields with the model's own embedding table and layer 0's input norm."""
    return first_step_fields(model, model.w.get(model.names.embed),
                             model.w.get(model.names.layer(model.layers[0]) + "input_layernorm.weight"))


def first_step_fields(model, emb, norm0) -> tuple | None:
    """(embedding table, KT dtype code, the first layer's input norm weight) for a call that starts from the step's
    tokens, as MoEModel.forward's F.embedding(...).to(float32) and decoder's norm would (the same bits): a CPU (V, H)
    float32 / bfloat16 table with contiguous rows, the family's plain RMSNorm on float32 weights. None: the caller's.
    (An MTP block passes its own table and norm: ktrun.mtp.)"""
    H = model.cfg.hidden_size
    if (not isinstance(emb, torch.Tensor) or emb.dim() != 2 or emb.shape[1] != H or emb.device.type != "cpu"
            or emb.dtype not in float_linear.DTYPES or emb.stride(1) != 1 or model.dtype != torch.float32
            or model.norm is not rms_norm or norm0 is None or not glue.norm_weights_ok(norm0)
            or norm0.numel() != H):
        return None
    return emb, float_linear.DTYPES[emb.dtype], norm0


def _head_fields(model) -> tuple | None:
    """The output head as kt_decode_layers runs it after the last layer (ABI 23): (head_kind, head_id, head_ctx,
    head_w, head_w_dtype, head_w_stride, head_n), the call MoEModel.forward's float_linear.head makes on the final
    norm's rows (so the same bits): a float32 / bfloat16 tensor kt_float_linear takes (kind 1) or a quantized
    KernelLinear with no input permutation or padding (kind 2). None: the head stays the caller's."""
    w, H = model.lm_head, model.cfg.hidden_size
    if isinstance(w, torch.Tensor):
        if w.dim() != 2 or w.shape[1] != H or not float_linear.takes(w):
            return None
        ctx = model.kernels.handle if model.kernels is not None else None
        return 1, 0, ctx, w.data_ptr(), float_linear.DTYPES[w.dtype], w.stride(0), w.shape[0]
    if isinstance(w, KernelLinear) and w.perm is None and w.k == w.k_op == H:
        return 2, w.id, w.lin.kernels.handle, None, 0, 0, w.n
    return None


def start(model, batch: Batch, T: int, cos: torch.Tensor, sin: torch.Tensor) -> int | None:
    """The layer (slot) from which this forward of T rows (the model's dtype and device) runs its plan, or None when it
    has none or would not take its paths (what the per-layer calls check, once for the step)."""
    pl = model.step_plan
    if pl is None:
        return None
    if pl.experts is not model.experts or not 0 < T <= glue.ROUTE_MAX_ROWS or hooked() or \
            model.dtype != torch.float32 or model.device.type != "cpu" or cos.shape[0] != T or \
            cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.stride(-1) != 1 or \
            sin.stride() != cos.stride():
        return None
    pool = _float32_pool(batch)
    if pool is None:
        return None
    if pl.mla is None:
        if any(s.n > SERIAL_MAX_ROWS for s in batch.seqs) or not _rope_rows_ok(cos, sin, pl.hd) or \
                len(pool.tokens) < 2:
            return None
    else:
        nh, dn, dr, dv, R = pl.mla
        if 2 * cos.shape[-1] != dr or len(pool.tokens) != 1 or \
                not attention._absorbed_one_call_rows(batch, nh, dn, dr, dv, R):
            return None
    return pl.first


def whole_step(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The batch's rows (decode rows, a verify's: the caller wants every row's logits) from their tokens to their
    logits in the plan's one call, committed to their caches -> (the final norm (T, H), logits (T, V)); None (nothing
    done) when the plan does not start from the tokens or would not take these rows."""
    pl = model.step_plan
    if pl is None or pl.first_steps is None:
        return None
    cos, sin = model.rope.cos_sin(batch.positions, model.dtype)
    if start(model, batch, batch.tokens.shape[0], cos, sin) != 0:
        return None
    batch.carried[HEAD_ROWS] = True
    got = run(model, batch, None, None, cos, sin)
    if got is None:
        return None
    batch.commit()
    return got[1], batch.carried.pop(HEAD_LOGITS)


def mtp_step(model, batch: Batch, hidden: torch.Tensor, fields: tuple) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An MTP block's draft forward (ktrun.mtp) in the plan's one call (ABI 26): the batch's tokens' embedding rows
    and the main model's hidden rows (T, H) float32 through enorm / hnorm, eh_proj, the block's layer and its head on
    each request's last row, committed to the block's caches -> (the layer's output x (T, H), logits (B, V)); None
    (nothing done) when the plan would not take these rows. fields: (embed, KT dtype code, the layer's input norm,
    enorm, hnorm, eh_proj's context handle, eh_proj's Linear id): MtpHead.one_call."""
    pl = model.step_plan
    T = batch.tokens.shape[0]
    if pl is None or pl.first != 0 or pl.head is None or hidden.dtype != torch.float32 or \
            not hidden.is_contiguous() or hidden.shape != (T, model.cfg.hidden_size):
        return None
    cos, sin = model.rope.cos_sin(batch.positions, model.dtype)
    if start(model, batch, T, cos, sin) != 0:
        return None
    a = pl.args
    embed, embed_dtype, norm0, enorm, hnorm, eh_ctx, eh_id = fields
    a.mtp_hidden, a.mtp_enorm, a.mtp_hnorm = hidden.data_ptr(), enorm.data_ptr(), hnorm.data_ptr()
    a.mtp_ctx, a.mtp_eh_id = eh_ctx, eh_id
    batch.carried[HEAD_ROWS] = True
    try:
        got = run(model, batch, None, None, cos, sin, (embed, embed_dtype, norm0), batch.last_token_rows())
    finally:            # the plan's arguments serve the block's other calls too
        a.mtp_hidden = a.mtp_enorm = a.mtp_hnorm = a.mtp_ctx = a.head_rows = None
        a.head_T = 0
    if got is None:
        return None
    batch.commit()
    return got[0], batch.carried.pop(HEAD_LOGITS)


def run(model, batch: Batch, x: torch.Tensor | None, h: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        first_steps: tuple | None = None, head_rows: torch.Tensor | None = None
        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x (T, H) and the plan's first layer's normed input h through it and every layer after -> (x, the final norm),
    or None (nothing done) when these rows are not the call's (start() said yes for the step). x and h None: from the
    batch's tokens (first_steps, else the plan's: its first layer is layer 0). head_rows (R,) int64: with the head in
    the call, its logits (R, V) are those rows' only."""
    pl = model.step_plan
    a = pl.args
    if x is None:
        T, H = batch.tokens.shape[0], model.cfg.hidden_size
        emb, emb_dtype, norm0 = first_steps or pl.first_steps
        a.tokens, a.embed, a.embed_dtype, a.embed_rows, a.embed_stride = (batch.tokens.data_ptr(), emb.data_ptr(),
                                                                          emb_dtype, emb.shape[0], emb.stride(0))
        a.norm0, a.eps, a.lanes = norm0.data_ptr(), model.cfg.rms_norm_eps, glue.norm_lanes()
        a.x = a.h = None
    else:
        T, H = x.shape
        if not x.is_contiguous() or not h.is_contiguous() or h.dtype != torch.float32 or h.shape != x.shape:
            return None
        a.tokens = a.norm0 = None
        a.x, a.h = x.data_ptr(), h.data_ptr()
    toks = _float32_pool(batch).tokens
    for s, (c, window) in zip(pl.slots, pl.attn):
        if c.caches_of is not toks:     # the pool grew (new slabs), or a per-layer call set another pool's
            if pl.mla is None:
                glue._set_rows(c.args.attn, T, cos, sin, cos.shape[-1], model.rope.interleaved, paging(batch),
                               toks[0][s], toks[1][s], window)
            else:
                c.set_cache(toks[0][s])
            c.caches_of = toks
    r = pl.rows
    r.T, r.rope_half, r.interleaved = T, cos.shape[-1], int(model.rope.interleaved)
    r.cos, r.sin, r.cs_stride = (cos.data_ptr(), sin.data_ptr(), cos.stride(0)) if r.rope_half else (None, None, 0)
    r.m, row0, start, table0, tables = paging(batch)
    r.row0, r.start, r.table0, r.tables = row0.data_ptr(), start.data_ptr(), table0.data_ptr(), tables.data_ptr()
    out = torch.empty((2, T, H), dtype=torch.float32)
    a.T = T
    p = out.data_ptr()
    a.x_out, a.h_out = p, p + 4 * T * H
    logits = None
    if pl.head is not None and batch.carried.get(HEAD_ROWS):     # every row's logits: the head in the same call
        logits = torch.empty((T if head_rows is None else head_rows.shape[0], pl.head[-1]), dtype=torch.float32)
        (a.head_kind, a.head_id, a.head_ctx, a.head_w, a.head_w_dtype, a.head_w_stride, a.head_n) = pl.head
        a.logits = logits.data_ptr()
        a.head_rows, a.head_T = (None, 0) if head_rows is None else (head_rows.data_ptr(), head_rows.shape[0])
    else:
        a.head_kind = 0
    lib = glue._library()
    if lib.kt_decode_layers(ctypes.byref(a)) != 0:
        raise KernelError(lib.kt_last_error().decode())
    if logits is not None:
        batch.carried[HEAD_LOGITS] = logits
    tm = model.timing
    tm["attention_s"] += a.attn_s
    tm["mlp_s"] += a.moe_s
    tm["expert_wait_s"] += a.wait_s
    for _ in range(pl.n_moe):
        model.experts.record_one_call(T * model.cfg.top_k, a.wait_s / pl.n_moe)
    return out[0], out[1]
