"""DeepSeek-V4's attention (ktlayouts.families.deepseek_v4 describes it) over ktrun's per-request caches.

One shared KV head (head_dim) read as key and value, q from a normalized q LoRA with an unweighted RMSNorm per head,
interleaved RoPE on each head's trailing rope_dim dims (sliding layers: the main rope; compressed layers: the
compress rope), undone on the output by the conjugate rotation, a sink logit per head, the last sliding_window keys,
then the grouped low-rank output projection.
Compressed layers add long-range entries: a compressor pools each window of `rate` tokens (HCA: that window; CSA:
the previous window's first half-channels with this window's second half, 2 x rate tokens) by a softmax over the
window of gate + ape, per channel, then RMSNorm and RoPE at position w * rate. A query at position t sees entries
w < (t + 1) // rate: all of them (HCA), or the index_topk its lightning indexer scores highest (CSA: its own
compressor at index_head_dim, q from the same q LoRA, relu(q . k) weighted per head by weights_proj).

Cache (one row per position, every layer alike): the sliding key (normed, roped), and the compressor's and the
indexer's raw kv / gate projections; the compressed entries of a request are pooled from those rows each forward
(windows are complete once rate tokens are cached, so every forward sees the same entries for the same tokens).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig
from ktlayouts.families.deepseek_v4 import CSA, HCA, DeepseekV4Settings

from ..ops.packed_linear import dense_weight, linear
from .choices import top_k
from .kv_cache import Batch, causal_scores_mask


def cache_widths(cfg: ModelConfig, s: DeepseekV4Settings) -> list[tuple[int, ...]]:
    """(sliding key, compressor kv, compressor gate, indexer kv, indexer gate) per position."""
    return [(s.head_dim,), (2 * s.head_dim,), (2 * s.head_dim,), (2 * cfg.index_head_dim,),
            (2 * cfg.index_head_dim,)]


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference's order: normalize in float32, scale in float32, cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


def rope_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos/sin (T, r/2): rotate the pairs (x[2i], x[2i+1]) of the trailing r dims in place order."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:].float()
    c, s = cos[:, None, :].float(), sin[:, None, :].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _pool(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, rate: int, dim: int, overlap: bool,
          norm_w: torch.Tensor, eps: float, rope, dtype) -> torch.Tensor:
    """Raw rows kv / gate (S, C) of positions [0, S) -> the compressed entries (S // rate, dim) of the complete
    windows, normed and roped at positions w * rate. overlap (CSA): C = 2 dim, entry w pools window w-1's first
    dim channels with window w's last dim channels (window 0: its own only)."""
    n = kv.shape[0] // rate
    if n == 0:
        return kv.new_zeros((0, dim))
    kv = kv[:n * rate].view(n, rate, -1).float()
    gate = gate[:n * rate].view(n, rate, -1).float() + ape.float()
    if overlap:
        k2 = kv.new_zeros((n, 2 * rate, dim))
        g2 = gate.new_full((n, 2 * rate, dim), float("-inf"))
        k2[:, rate:], g2[:, rate:] = kv[..., dim:], gate[..., dim:]
        k2[1:, :rate], g2[1:, :rate] = kv[:-1, :, :dim], gate[:-1, :, :dim]
        kv, gate = k2, g2
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1).to(dtype)               # (n, dim)
    pooled = rms_norm(pooled, norm_w, eps)
    pos = torch.arange(n, device=kv.device) * rate
    cos, sin = rope.cos_sin(pos, torch.float32)
    return rope_trailing(pooled[:, None, :], cos, sin)[:, 0]


def attention(cfg: ModelConfig, s: DeepseekV4Settings, w: dict, p: str, x: torch.Tensor, batch: Batch, layer: int,
              kind: str, ropes: dict, positions: torch.Tensor, token_ids=None) -> torch.Tensor:
    """x: (T, H) normed -> (T, H). p: 'layers.N.attn.'; kind: the layer type; ropes {"main", "compress"}: Rope."""
    T, nh, hd, eps = x.shape[0], cfg.num_heads, s.head_dim, cfg.rms_norm_eps
    rope = ropes["main" if kind == "sliding_attention" else "compress"]
    cos, sin = rope.cos_sin(positions, torch.float32)
    q_res = rms_norm(linear(x, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], eps)          # (T, q_lora_rank)
    q = unweighted_rms_norm(linear(q_res, w[p + "wq_b.weight"]).view(T, nh, hd), eps)
    q = rope_trailing(q, cos, sin)
    kv = rope_trailing(rms_norm(linear(x, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], eps).view(T, 1, hd),
                       cos, sin)[:, 0]                                                         # (T, hd)
    zeros = x.new_zeros((T, 2 * hd))
    izeros = x.new_zeros((T, 2 * cfg.index_head_dim))
    c = p + "compressor."
    ckv, cgate = ((linear(x, w[c + "wkv.weight"]), linear(x, w[c + "wgate.weight"])) if kind != "sliding_attention"
                  else (zeros, zeros))
    if kind == HCA:       # one head_dim series: stored in the first half of the cached rows
        ckv, cgate = F.pad(ckv, (0, hd)), F.pad(cgate, (0, hd))
    ic = p + "indexer.compressor."
    ikv, igate = ((linear(x, w[ic + "wkv.weight"]), linear(x, w[ic + "wgate.weight"])) if kind == CSA
                  else (izeros, izeros))
    out = torch.empty((T, nh, hd), dtype=x.dtype, device=x.device)
    rate = s.compress_rate(kind)
    sinks = w[p + "attn_sink"].float()
    for sq in batch.seqs:
        rows = slice(sq.offset, sq.offset + sq.n)
        runs = sq.cache.write(layer, sq.start, [kv[rows], ckv[rows], cgate[rows], ikv[rows], igate[rows]])
        cached = [torch.cat([r[j] for r in runs], dim=0) if len(runs) > 1 else runs[0][j] for j in range(5)]
        keys = cached[0]                                                                      # (S, hd)
        S = keys.shape[0]
        qs = q[rows].float() * hd ** -0.5                                                     # (n, nh, hd)
        scores = torch.einsum("nhd,sd->hns", qs, keys.float())                                # (nh, n, S)
        visible = causal_scores_mask(sq.n, sq.start, S, x.device, cfg.sliding_window)        # (n, S)
        values = keys.float()
        if rate:
            entries = _pool(cached[1][:, :hd] if kind == HCA else cached[1],
                            cached[2][:, :hd] if kind == HCA else cached[2], w[c + "ape"], rate, hd, kind == CSA,
                            w[c + "norm.weight"], eps, ropes["compress"], x.dtype)           # (E, hd)
            qpos = torch.arange(sq.start, sq.start + sq.n, device=x.device)
            limit = (qpos + 1) // rate                                                        # entries < limit
            allowed = torch.arange(entries.shape[0], device=x.device)[None, :] < limit[:, None]   # (n, E)
            if kind == CSA and entries.shape[0]:
                allowed = _indexer_pick(cfg, s, w, p, x[rows], q_res[rows], cached[3], cached[4], rate, eps,
                                        ropes["compress"], cos[rows], sin[rows], allowed, x.dtype)
            scores = torch.cat([scores, torch.einsum("nhd,ed->hne", qs, entries.float())], dim=-1)
            visible = torch.cat([visible, allowed], dim=-1)
            values = torch.cat([values, entries.float()], dim=0)
        scores = scores.masked_fill(~visible[None], float("-inf"))
        logits = torch.cat([scores, sinks.view(nh, 1, 1).expand(nh, sq.n, 1)], dim=-1)
        probs = F.softmax(logits, dim=-1)[..., :-1]
        out[rows] = torch.einsum("hns,sd->nhd", probs, values).to(x.dtype)
    out = rope_trailing(out, cos, -sin)                                      # undo the rope the values carried
    g = s.o_groups
    wa = dense_weight(w[p + "wo_a.weight"])                                   # (g * o_rank, nh * hd / g)
    grouped = torch.einsum("tgi,goi->tgo", out.reshape(T, g, -1), wa.view(g, s.o_lora_rank, -1).to(x.dtype))
    return linear(grouped.reshape(T, g * s.o_lora_rank), w[p + "wo_b.weight"])


def _indexer_pick(cfg, s, w, p, x, q_res, ikv, igate, rate, eps, rope, cos, sin, allowed, dtype) -> torch.Tensor:
    """The CSA entries each query attends to: the index_topk best by the indexer among those it may see -> (n, E)."""
    ip, ic = p + "indexer.", p + "indexer.compressor."
    d, heads = cfg.index_head_dim, cfg.index_n_heads
    keys = _pool(ikv, igate, w[ic + "ape"], rate, d, True, w[ic + "norm.weight"], eps, rope, dtype)   # (E, d)
    n = x.shape[0]
    q = rope_trailing(linear(q_res, w[ip + "wq_b.weight"]).view(n, heads, d), cos, sin)
    scores = F.relu(torch.einsum("nhd,ed->nhe", q.float(), keys.float())) * d ** -0.5
    weights = linear(x, w[ip + "weights_proj.weight"]).float() * heads ** -0.5                    # (n, heads)
    total = (scores * weights[..., None]).sum(dim=1).masked_fill(~allowed, float("-inf"))         # (n, E)
    E, k = total.shape[1], cfg.index_topk
    if E < k:        # fewer entries than picks: padded with unselectable columns, so every forward picks k
        total = F.pad(total, (0, k - E), value=float("-inf"))
    ids = top_k("indexer", total, k)
    picked = torch.zeros((n, max(E, k)), dtype=torch.bool, device=allowed.device).scatter_(1, ids, True)
    return picked[:, :E] & allowed
