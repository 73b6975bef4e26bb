"""`--speculative`, `--draft-tokens` and `--draft-policy`, shared by `ktrun generate`, `bench` and `serve` (torch-free: imported by the
CLI before torch loads)."""
from __future__ import annotations

import click

from ..speculative import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, METHODS, POLICIES, SpeculativeConfig


def speculative_options(f):
    """Decorator adding --speculative, --draft-tokens and --draft-policy (parsed by speculative_from)."""
    f = click.option("--draft-policy", "spec_draft_policy", type=click.Choice(POLICIES), default="adaptive",
                     show_default=True, help="With --speculative: 'adaptive' drafts 0 to --draft-tokens tokens per "
                     "step, as many as the request's recent acceptance and the measured cost of a verified row pay "
                     "for (none where drafting would slow decoding down); 'fixed' always drafts --draft-tokens.")(f)
    f = click.option("--draft-tokens", "spec_draft_tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=DEFAULT_DRAFT_TOKENS,
                     show_default=True, help="With --speculative: the most tokens drafted per step (each decode "
                     "forward verifies up to 1 + this many rows per request).")(f)
    return click.option("--speculative", "spec_method", type=click.Choice(METHODS), default="off", show_default=True,
                        help="Speculative decoding: 'ngram' drafts the next tokens from earlier text of the same "
                             "request (prompt lookup), 'mtp' with the checkpoint's multi-token-prediction layer "
                             "(DeepSeek-V3/V3.2, GLM-4.5+: converted by default); each step verifies them in one "
                             "forward; greedy output is unchanged and sampled output keeps its distribution. "
                             "ngram pays on repeated text (code edits, quoted documents).")(f)


def speculative_from(kw: dict) -> SpeculativeConfig | None:
    """Pop the three options from a command's kwargs -> the config, or None when off."""
    method, k = kw.pop("spec_method", "off"), kw.pop("spec_draft_tokens", DEFAULT_DRAFT_TOKENS)
    policy = kw.pop("spec_draft_policy", "adaptive")
    return None if method == "off" else SpeculativeConfig(method, int(k), policy=policy)
