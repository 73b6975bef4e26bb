"""Speculative decoding's drafts: guesses of the next tokens that one forward then verifies (generate.py `verify`,
Sequence.advance). Only the guessing lives here; the acceptance rule is the sampler's (sampling.py
`Sampler.sample_or_accept`), so what a request outputs has the distribution of plain decoding (greedy: the same
tokens).

n-gram drafts (prompt lookup): the last n tokens of the request's context (prompt + generated) are looked up among
its earlier n-grams, longest n first (max_ngram down to min_ngram); the tokens that followed their latest occurrence
are the draft. It costs no model and pays on repeated text: code edited in place, documents quoted back, tool
outputs echoed. Torch-free.

MTP drafts (method "mtp"): the checkpoint's own multi-token-prediction layer guesses the next tokens from the main
model's hidden state (ktrun.mtp, which needs the layer loaded: load_model(..., mtp=True) gives the MtpHead that
`mtp` holds).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

METHODS = ("off", "ngram", "mtp")
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: 'off' | 'ngram' | 'mtp'; draft_tokens: tokens guessed per step (the verify forward runs 1 + that
    many rows per request); max_ngram / min_ngram: the suffix lengths looked up, longest first; mtp: the loaded
    model's MtpHead (ktrun.mtp), for method 'mtp'."""
    method: str = "off"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    max_ngram: int = 3
    min_ngram: int = 2
    mtp: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def needs_mtp(self) -> bool:
        """Drafts from the MTP layer: load the model with mtp=True and hand its head to with_mtp()."""
        return self.method == "mtp"

    def with_mtp(self, head) -> SpeculativeConfig:
        """This config drafting with a loaded model's MtpHead (LoadedModel.mtp; None keeps it as it is)."""
        return self if head is None else dataclasses.replace(self, mtp=head)

    def drafter(self, context: list[int]):
        """A new request's drafter over its prompt (NgramDrafter, or ktrun.mtp.MtpDrafter), or None when off."""
        if self.method == "mtp":
            if self.mtp is None:
                raise ValueError("--speculative mtp needs the model's MTP layer loaded (load_model(..., mtp=True)) "
                                 "and set as SpeculativeConfig.mtp")
            return self.mtp.drafter(context)
        return NgramDrafter(context, self.max_ngram, self.min_ngram) if self.enabled else None


class NgramDrafter:
    """Prompt-lookup drafts over one request's context. Each n-gram maps to the index just after its latest
    occurrence (what followed it); the table grows with every token, so a lookup costs O(max_ngram)."""

    def __init__(self, context: list[int], max_ngram: int = 3, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.ids: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}     # n-gram (any n in range) -> index of the token after it
        self.extend(context)

    def extend(self, ids: list[int]) -> None:
        """Append tokens to the context (prompt first, then each generated token)."""
        for t in ids:
            i = len(self.ids)
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                self.follows[tuple(self.ids[i - n:i])] = i     # this n-gram is followed by the token at i
            self.ids.append(int(t))

    def propose(self, k: int, cache=None) -> list[int]:
        """(cache: the request's KV cache, which MTP drafts read; unused here.) Up to k tokens that followed the latest earlier occurrence of the context's longest matching suffix;
        [] when no suffix of min_ngram tokens or more occurred before."""
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(self.ids)), self.min_ngram - 1, -1):
            at = self.follows.get(tuple(self.ids[-n:]))
            if at is not None:
                return self.ids[at:at + k]
        return []
