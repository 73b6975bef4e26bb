"""`--speculative` and `--draft-tokens`, shared by `ktrun generate`, `bench` and `serve` (torch-free: imported by the
CLI before torch loads)."""
from __future__ import annotations

import click

from ..speculative import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, METHODS, SpeculativeConfig


def speculative_options(f):
    """Decorator adding --speculative and --draft-tokens (parsed by speculative_from)."""
    f = click.option("--draft-tokens", "spec_draft_tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=DEFAULT_DRAFT_TOKENS,
                     show_default=True, help="With --speculative: tokens drafted per step (each decode forward "
                     "verifies up to 1 + this many rows per request).")(f)
    return click.option("--speculative", "spec_method", type=click.Choice(METHODS), default="off", show_default=True,
                        help="Speculative decoding: 'ngram' drafts the next tokens from earlier text of the same "
                             "request (prompt lookup), 'mtp' with the checkpoint's multi-token-prediction layer "
                             "(DeepSeek-V3/V3.2, GLM-4.5+: converted by default); each step verifies them in one "
                             "forward; greedy output is unchanged and sampled output keeps its distribution. "
                             "ngram pays on repeated text (code edits, quoted documents).")(f)


def speculative_from(kw: dict) -> SpeculativeConfig | None:
    """Pop the two options from a command's kwargs -> the config, or None when off."""
    method, k = kw.pop("spec_method", "off"), kw.pop("spec_draft_tokens", DEFAULT_DRAFT_TOKENS)
    return None if method == "off" else SpeculativeConfig(method, int(k))
