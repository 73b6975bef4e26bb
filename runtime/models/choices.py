"""The forward's discrete choices in one place: every router's top-k of experts ("router": routing.py, gpt_oss.py)
and of expert groups ("router_group": group-limited routing), and DeepSeek-V3.2's lightning indexer's top-k of keys
("indexer": indexer.py) are made by top_k().

Without a hook (serving, always) top_k is torch.topk. A test may install one (`with choice_hook(h):`, process-wide,
one at a time) that sees each choice with the scores it was made on and returns the indices to use: recording one
forward's choices, then making a second forward take them, compares two forwards whose continuous parts differ by
rounding (int8 activations, bf16) without a near-tie between two scores deciding the comparison.
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
    ids = torch.topk(scores, k=k, dim=-1, sorted=sorted).indices
    return ids if _hook is None else _hook(kind, scores, ids)


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
