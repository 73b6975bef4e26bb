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

How many tokens a step drafts (policy "adaptive", the default; "fixed" always drafts draft_tokens): the number that
maximizes the expected tokens per unit of step time, E(k) / c(k), over k = 0 .. draft_tokens. E(k) = 1 + a + ... + a^k
with a the request's recent per-token acceptance (DraftLength: an estimate that forgets half its evidence every step,
so a run of accepted copies lengthens the drafts at once and a rejection shortens them); c(k) = 1 + (b + d) k, the
step's cost with k drafted tokens against a plain decode step, measured as the requests run (VerifyCost: b, the
seconds a verified row adds, and d, the seconds drafting a token takes, over the plain step's seconds at that batch
size). k = 0 is a plain decode step: where drafts cost more than they save (a step that is mostly fixed cost, an MTP
layer as costly as a quarter of the model) speculation turns itself off for that request; n-gram drafts try again
after idle steps (DraftLength's probes). The choice depends only on earlier steps, so greedy output stays the same and
sampled output keeps its distribution.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
from dataclasses import dataclass, field

METHODS = ("off", "ngram", "mtp")
POLICIES = ("adaptive", "fixed")
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 64
ACCEPTANCE_PRIOR = 0.5    # DraftLength: the per-token acceptance assumed before (and between) the evidence
ACCEPTANCE_MEMORY = 0.5   # DraftLength: the weight of earlier steps' evidence after each step
ROW_COST_PRIOR = 0.25     # VerifyCost: a verified row's and a drafted token's cost per plain step before it is measured
PROBE_EVERY = 8           # DraftLength: after this many steps without drafts, one step drafts a token
COST_WINDOW = 32          # VerifyCost: the timings each median is taken over
COST_MIN_TIMINGS = 3      # VerifyCost: timings of a kind before they replace ROW_COST_PRIOR
COST_REFRESH = 8          # VerifyCost: timings between two computations of the medians


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
    policy: str = "adaptive"          # "adaptive": 0 .. draft_tokens per step by measured cost; "fixed": draft_tokens
    cost: VerifyCost = field(default_factory=lambda: VerifyCost(), compare=False, repr=False)   # shared by its requests

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"draft policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
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
        """This config drafting with a loaded model's MtpHead (LoadedModel.mtp; None keeps it as it is); its costs
        start from the head's share of a step per drafted token (MtpHead.step_share) until drafts are timed."""
        if head is None:
            return self
        return dataclasses.replace(self, mtp=head, cost=VerifyCost(draft_prior=float(getattr(head, "step_share", 0))))

    def draft_length(self) -> DraftLength | None:
        """A new request's draft-length state (None: the policy is fixed). n-gram drafts probe after idle steps; MTP
        drafts do not (a probe first runs the layer over every position since the last draft, the whole prompt at
        first: where its share of a step says drafts cannot pay, the layer stays idle)."""
        if not self.enabled or self.policy != "adaptive":
            return None
        return DraftLength(self.draft_tokens, probe=self.method == "ngram")

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


class VerifyCost:
    """What drafting costs on this model and machine, measured as requests run: the seconds of plain decode steps
    per batch size, the seconds each verified draft row adds to a step and the seconds drafting one token takes, each
    the median of its last COST_WINDOW timings (a step after a prefill runs on cold caches: 3x a warm one on the
    default model, and one of them in an average kept the drafts off for good). `per_token(batch)`: the last two per
    plain step of that batch size (DraftLength's b + d); until COST_MIN_TIMINGS of a kind are in, ROW_COST_PRIOR for
    a row and draft_prior for a drafted token (0 for n-gram lookups; an MTP head's share of a step)."""

    def __init__(self, draft_prior: float = 0.0):
        self.draft_prior = draft_prior       # a drafted token's cost per plain step until drafts are timed (MTP's)
        self.plain: dict[int, collections.deque] = {}            # batch size -> seconds of steps without drafts
        self.row: collections.deque = collections.deque(maxlen=COST_WINDOW)     # seconds a drafted row adds
        self.draft: collections.deque = collections.deque(maxlen=COST_WINDOW)   # seconds to draft one token
        self._per_token: dict[int, float] = {}                   # cached per_token(), refreshed every COST_REFRESH timings
        self._timings = 0                                        # timings since the cache was last refreshed

    def observe_step(self, batch: int, drafted: int, seconds: float) -> None:
        """A decode forward of `batch` requests with `drafted` draft rows in all took `seconds`."""
        if drafted == 0:
            plain = self.plain.setdefault(batch, collections.deque(maxlen=COST_WINDOW))
            plain.append(seconds)
            self._timed(len(plain))
            return
        base = self._plain(batch)
        if base is not None:
            self.row.append(max(0.0, seconds - base) / drafted)
            self._timed(len(self.row))

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """Drafting `tokens` tokens (all requests of a step) took `seconds`."""
        if tokens > 0:
            self.draft.append(seconds / tokens)
            self._timed(len(self.draft))

    def _timed(self, count: int) -> None:
        """After a timing that made a kind's count `count`: the medians again every COST_REFRESH timings, and as soon
        as a kind has its first COST_MIN_TIMINGS (three medians of 32 every step were ~10% of a default-model step)."""
        self._timings += 1
        if self._timings >= COST_REFRESH or count <= COST_MIN_TIMINGS:
            self._timings = 0
            self._per_token.clear()

    def _plain(self, batch: int) -> float | None:
        """The median plain step at this batch size, or at the nearest one measured enough."""
        sizes = [b for b, d in self.plain.items() if len(d) >= COST_MIN_TIMINGS]
        if not sizes:
            return None
        return statistics.median(self.plain[min(sizes, key=lambda b: abs(b - batch))])

    def per_token(self, batch: int) -> float:
        got = self._per_token.get(batch)
        if got is None:
            base = self._plain(batch)
            draft = self.draft_prior                             # per plain step
            if base and len(self.draft) >= COST_MIN_TIMINGS:
                draft = statistics.median(self.draft) / base
            got = ROW_COST_PRIOR + draft
            if base and len(self.row) >= COST_MIN_TIMINGS:
                got = statistics.median(self.row) / base + draft
            self._per_token[batch] = got
        return got


class DraftLength:
    """One request's recent per-token acceptance and the draft length it buys. The evidence of a verified draft of k
    tokens with j accepted: j successes in min(k, j + 1) trials (each drafted token is tried only if the ones before it
    were accepted); every step multiplies the earlier evidence by ACCEPTANCE_MEMORY, so the estimate follows runs of
    copied text, and a step that drafted nothing lets it drift back to ACCEPTANCE_PRIOR; every PROBE_EVERY-th step
    without drafts (later where a drafted token costs more than ROW_COST_PRIOR) drafts one token anyway: a cost
    measured on cold steps, or a run of text that repeats, would else never be seen again."""

    def __init__(self, k_max: int, probe: bool = True):
        self.k_max = int(k_max)
        self.probe = probe     # try one token after idle steps (n-gram drafts: free to make)
        self.hits = 0.0
        self.trials = 0.0
        self.idle = 0          # steps in a row that chose no draft: every PROBE_EVERY-th tries one token

    @property
    def acceptance(self) -> float:
        return (self.hits + ACCEPTANCE_PRIOR) / (self.trials + 1.0)

    def size(self, cost_per_token: float) -> int:
        """The k in 0 .. k_max with the most expected tokens per step cost, E(k) / (1 + cost_per_token k)."""
        a, best, best_rate = self.acceptance, 0, 1.0
        expected, term = 1.0, 1.0
        for k in range(1, self.k_max + 1):
            term *= a
            expected += term
            rate = expected / (1.0 + cost_per_token * k)
            if rate > best_rate:
                best, best_rate = k, rate
        # a probe: fresh evidence and timings, at most ROW_COST_PRIOR / PROBE_EVERY of a step's cost on average (an
        # MTP draft after idle steps first runs the layer over every position since its last one)
        if best == 0 and self.probe and self.k_max and \
                self.idle + 1 >= PROBE_EVERY * max(1.0, cost_per_token / ROW_COST_PRIOR):
            best = 1
        self.idle = 0 if best else self.idle + 1
        return best

    def update(self, drafted: int, accepted: int) -> None:
        """After a step that drafted `drafted` tokens (0: none) of which the first `accepted` were kept."""
        self.hits *= ACCEPTANCE_MEMORY
        self.trials *= ACCEPTANCE_MEMORY
        if drafted:
            self.hits += accepted
            self.trials += min(drafted, accepted + 1)
