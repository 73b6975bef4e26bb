"""Per-request sampling parameters, validated at construction (torch-free: the server and its test fakes use it)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_LOGPROBS = 20   # top alternatives per token, as the OpenAI API allows


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0            # greedy; an API request without one gets ktrun.defaults.API_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0                 # drop tokens whose probability is below min_p x the top token's
    presence_penalty: float = 0.0      # OpenAI: logit -= presence if the token was generated already
    frequency_penalty: float = 0.0     # OpenAI: logit -= frequency x times generated
    repetition_penalty: float = 1.0    # CTRL/transformers: tokens of prompt or output, logit / p (>0) or x p (<0)
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    stop_token_ids: list[int] = field(default_factory=list)      # like EOS: finish "stop" (even with ignore_eos)
    n: int = 1                         # choices sampled from one prompt (its prefill is shared)
    logprobs: int | None = None        # per generated token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # factories: each sequence (each of n choices) calls them once for its own processor(output_ids, logits) -> logits
    logits_processors: list[Callable[[], Callable]] = field(default_factory=list)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]

    @property
    def shapes_logits(self) -> bool:
        """Anything besides temperature / top-k / top-p changes the logits (penalties, bias, min_p, processors)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_p or self.logits_processors)
