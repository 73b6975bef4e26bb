"""The forward's discrete choices in one place: every router's top-k of experts ("router": routing.py, gpt_oss.py)
and of expert groups ("router_group": group-limited routing), and the lightning indexers' top-k of keys
("indexer": indexer.py, deepseek_v4_attention.py) are made by top_k().

Without a hook (serving, always) top_k is torch.topk, except that the indexer's ties go to the lower index: its
scores are sums of relu'd products, so rows with several exact zeros (or equal values) at the k-th place are common,
and torch.topk breaks such ties by the row's length and layout. A query's picks must not depend on how many keys the
forward holds (a prompt prefilled whole, in chunks or after a cached prefix attends to the same keys); routers'
float scores tie only by coincidence, and their kernel twin (kt_route_sigmoid) already prefers the lower index.

A test may install a hook (`with choice_hook(h):`, process-wide, one at a time) that sees each choice with the scores
it was made on and returns the indices to use: recording one forward's choices, then making a second forward take
them, compares two forwards whose continuous parts differ by rounding (int8 activations, bf16) without a near-tie
between two scores deciding the comparison.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

KINDS = ("router", "router_group", "indexer")
# hook(kind, scores (T, N), ids (T, k) int64 the k largest per row) -> the (T, k) int64 ids to use
ChoiceHook = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
_hook: ChoiceHook | None = None


def top_k(kind: str, scores: torch.Tensor, k: int, sorted: bool = False) -> torch.Tensor:
    """scores: (T, N) -> (T, k) int64 indices of each row's k largest scores (in descending order when sorted)."""
    ids = _lowest_index_on_ties(scores, k, sorted) if kind == "indexer" else \
        torch.topk(scores, k=k, dim=-1, sorted=sorted).indices
    return ids if _hook is None else _hook(kind, scores, ids)


def _lowest_index_on_ties(scores: torch.Tensor, k: int, sorted: bool) -> torch.Tensor:
    """torch.topk's choice with ties at the k-th score resolved to the lowest indices: (T, k) int64, in index order
    (sorted: by score, descending, equal scores by index). No host sync (no nonzero): runs inside CUDA graphs."""
    kth = torch.topk(scores, k=k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)     # (T, 1)
    above, tied = scores > kth, scores == kth
    need = k - above.sum(dim=-1, keepdim=True)                     # how many of the tied ones are taken
    take = above | (tied & (tied.cumsum(dim=-1) <= need))          # exactly k per row
    n = scores.shape[-1]
    rank = take * (n - torch.arange(n, device=scores.device))      # taken: n - index (> 0); others 0
    ids = torch.topk(rank, k=k, dim=-1, sorted=True).indices       # ascending index
    if sorted:
        order = torch.sort(scores.gather(-1, ids), dim=-1, descending=True, stable=True).indices
        ids = ids.gather(-1, order)
    return ids


def hooked() -> bool:
    """Whether a hook is installed (a choice made outside top_k, e.g. in one C call, must then come through it)."""
    return _hook is not None


@contextlib.contextmanager
def choice_hook(hook: ChoiceHook):
    """Every top_k() inside the block goes through hook (tests only; never nested)."""
    global _hook
    if _hook is not None:
        raise RuntimeError("a choice hook is already installed")
    _hook = hook
    try:
        yield
    finally:
        _hook = None
