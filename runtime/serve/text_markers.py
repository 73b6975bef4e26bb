"""Helpers for parsers that find markers in generated text that arrives piece by piece."""
from __future__ import annotations


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (text to hold back: the next piece
    may complete the marker)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def held_back(text: str, markers: tuple[str, ...]) -> int:
    return max((partial_tail(text, m) for m in markers), default=0)
