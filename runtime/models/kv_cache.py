"""Per-request KV caches and the varlen batch description the model forwards take.

Each request owns one SeqCache: per layer, a list of tensors whose first dim is the token position (MLA keeps one
compressed-latent tensor (S, kv_lora_rank + rope_dim); GQA keeps k and v (S, kv_heads, head_dim)). Storage grows by
doubling up to the context limit, so a short request never holds a full --ctx worth of memory. A request reads only
its own cache: batching never mixes caches.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class ContextFull(RuntimeError):
    """The request would exceed its context limit (--ctx)."""


class SeqCache:
    def __init__(self, num_layers: int, widths: list[tuple[int, ...]], ctx: int, dtype, device):
        self.ctx, self.dtype, self.device = ctx, dtype, device
        self.widths = widths                     # per cached tensor: trailing shape, e.g. (576,) or (8, 128)
        self.layers: list[list[torch.Tensor] | None] = [None] * num_layers
        self.length = 0                          # tokens committed (all layers written)

    def _ensure(self, layer: int, need: int) -> list[torch.Tensor]:
        bufs = self.layers[layer]
        cap = 0 if bufs is None else bufs[0].shape[0]
        if need <= cap:
            return bufs
        if need > self.ctx:
            raise ContextFull(f"sequence of {need} tokens exceeds the context limit --ctx {self.ctx}")
        new_cap = min(self.ctx, max(need, 2 * cap, 64))
        new = [torch.zeros((new_cap, *w), dtype=self.dtype, device=self.device) for w in self.widths]
        if bufs is not None:
            for n, o in zip(new, bufs):
                n[:cap] = o
        self.layers[layer] = new
        return new

    def write(self, layer: int, start: int, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Store values (n, *w) at positions [start, start+n); return views of positions [0, start+n)."""
        n = values[0].shape[0]
        bufs = self._ensure(layer, start + n)
        for b, v in zip(bufs, values):
            b[start:start + n] = v
        return [b[: start + n] for b in bufs]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for bufs in self.layers if bufs for t in bufs)


@dataclass
class SeqSlice:
    """One request's tokens inside a flattened batch: tokens [offset, offset+n) at positions [start, start+n)."""
    cache: SeqCache
    start: int
    n: int
    offset: int


@dataclass
class Batch:
    tokens: torch.Tensor          # (T,) int64, all requests' new tokens concatenated
    positions: torch.Tensor       # (T,) int64
    seqs: list[SeqSlice]

    @staticmethod
    def build(items: list[tuple[SeqCache, list[int]]], device) -> Batch:
        toks, pos, seqs, off = [], [], [], 0
        for cache, ids in items:
            if cache.length + len(ids) > cache.ctx:
                raise ContextFull(f"{cache.length + len(ids)} tokens exceed the context limit --ctx {cache.ctx}")
            toks.extend(ids)
            pos.extend(range(cache.length, cache.length + len(ids)))
            seqs.append(SeqSlice(cache, cache.length, len(ids), off))
            off += len(ids)
        return Batch(torch.tensor(toks, dtype=torch.long, device=device),
                     torch.tensor(pos, dtype=torch.long, device=device), seqs)

    def commit(self) -> None:
        for s in self.seqs:
            s.cache.length = s.start + s.n

    def last_token_rows(self) -> torch.Tensor:
        """Index of each request's last token in the flattened batch: (B,)."""
        return torch.tensor([s.offset + s.n - 1 for s in self.seqs], dtype=torch.long)


def causal_scores_mask(n: int, start: int, total: int, device, window: int | None = None) -> torch.Tensor:
    """Bool (n, total): query i (position start+i) may see key j when j <= start+i (and within the window)."""
    q = torch.arange(start, start + n, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    m = k <= q
    if window is not None:
        m &= k > q - window
    return m
