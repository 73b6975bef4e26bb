"""Next-token sampling: greedy (temperature 0), temperature, top-k, top-p, min-p, per-request seeded generators; the
logits shaping before it (presence/frequency/repetition penalties, logit_bias, per-request logits processors such as
a grammar); log-probabilities of the model's own distribution (before any shaping) for `logprobs`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

__all__ = ["Sampler", "SamplingParams", "TokenLogprobs", "greedy_tokens", "make_generator", "prompt_logprobs",
           "sample_token", "token_logprobs"]


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed) % (1 << 64))
    return g


@dataclass
class TokenLogprobs:
    """One position: the token there, its log-probability under the model, and the top alternatives
    [(token id, logprob)] best first (the raw model distribution: no temperature, penalties or grammar)."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprobs:
    """logits: (V,) raw model logits -> the TokenLogprobs of `token` with `top_n` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = []
    if top_n:
        vals, ids = torch.topk(lp, top_n)
        top = list(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(int(token), float(lp[token]), top)


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top_n: int) -> list[TokenLogprobs]:
    """logits: (T, V) for positions 0..T-1 of a chunk; ids: the T tokens that FOLLOW each position ->
    one TokenLogprobs per position (log P(ids[i] | everything up to position i))."""
    lp = torch.log_softmax(logits.float(), dim=-1)                                  # (T, V)
    idx = torch.tensor(ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    tops = [[] for _ in ids]
    if top_n:
        vals, tids = torch.topk(lp, top_n, dim=-1)
        tops = [list(zip(a, b)) for a, b in zip(tids.tolist(), vals.tolist())]
    return [TokenLogprobs(int(t), c, tp) for t, c, tp in zip(ids, chosen, tops)]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits: (V,) float32, already divided by the temperature. Tokens outside top-k / the top-p nucleus / below
    min_p x the top probability -> -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
        logits = logits.masked_fill(logits < logits.max() + torch.log(torch.tensor(min_p)), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass of the tokens before it already reaches top_p (always keep the first)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits: (V,) (already shaped) -> one token id."""
    logits = logits.float().cpu()
    if params.temperature == 0.0:
        return greedy_tokens(logits[None])[0]
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """logits: (B, V) -> each row's argmax, the token sample_token() picks at temperature 0. A float32 CPU tensor
    goes through numpy's argmax: torch's takes 4-6 us a 4096-wide row on a Zen 4 core, numpy's 0.3-0.5 us, and both
    pick the first maximum with NaN counted as the largest value (tests/test_sampling_greedy.py holds them equal on
    ties, NaN, +-inf and signed zeros)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=1).tolist()
    return logits.float().cpu().argmax(dim=-1).tolist()


class Sampler:
    """One sequence's sampling: its generator (seed + choice index, so choice 0 of n equals an n=1 request with the
    same seed), its own logits processors, and the token counts the penalties need."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], index: int = 0):
        self.params = params
        self.gen = make_generator(None if params.seed is None else params.seed + index)
        self.processors = [make() for make in params.logits_processors]
        self._prompt_ids = prompt_ids
        self._seen: torch.Tensor | None = None      # (V,) bool: in prompt or output (repetition penalty)
        self._counts: torch.Tensor | None = None    # (V,) float: times generated (presence/frequency)
        self._counted = 0                           # output tokens already in _counts/_seen
        # the token is the argmax of the raw logits and nothing else is asked of them (no shaping, no logprobs):
        # a batch of such rows takes one greedy_tokens() call
        self.plain_greedy = params.temperature == 0.0 and params.logprobs is None and not params.shapes_logits

    def shape(self, logits: torch.Tensor, output_ids: list[int]) -> torch.Tensor:
        """logits: (V,) raw -> penalised, biased, processed logits (float32, CPU)."""
        p = self.params
        logits = logits.float().cpu().clone()
        V = logits.shape[0]
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            if self._counts is None:
                self._counts = torch.zeros(V)
                self._seen = torch.zeros(V, dtype=torch.bool)
                self._seen[torch.tensor([t for t in self._prompt_ids if 0 <= t < V], dtype=torch.long)] = True
            new = [t for t in output_ids[self._counted:] if 0 <= t < V]
            if new:
                idx = torch.tensor(new, dtype=torch.long)
                self._counts.index_add_(0, idx, torch.ones(len(new)))
                self._seen[idx] = True
            self._counted = len(output_ids)
            if p.repetition_penalty != 1.0:
                rp = p.repetition_penalty
                hit = logits[self._seen]
                logits[self._seen] = torch.where(hit > 0, hit / rp, hit * rp)
            if p.frequency_penalty or p.presence_penalty:
                logits -= p.frequency_penalty * self._counts + p.presence_penalty * (self._counts > 0).float()
        for tok, bias in p.logit_bias.items():
            if 0 <= tok < V:
                logits[tok] += bias
        for proc in self.processors:
            logits = proc(output_ids, logits)
        return logits

    def sample(self, logits: torch.Tensor, output_ids: list[int]) -> tuple[int, TokenLogprobs | None]:
        """logits: (V,) raw model logits -> (token, its TokenLogprobs if params.logprobs is set)."""
        p = self.params
        token = sample_token(self.shape(logits, output_ids) if p.shapes_logits else logits, p, self.gen)
        return token, (None if p.logprobs is None else token_logprobs(logits, token, p.logprobs))

    def sample_or_accept(self, logits: torch.Tensor, output_ids: list[int],
                         draft: int) -> tuple[int, bool, TokenLogprobs | None]:
        """Speculative decoding's rule for one drafted token whose draft distribution is a point mass on `draft`
        (n-gram drafts): -> (token, whether it is the draft, its logprobs). Greedy: the draft stands iff it is the
        argmax. Sampled, with p the distribution sample() draws from: the draft stands with probability p(draft);
        else the token is drawn from p without the draft, renormalized. P(token = x) = p(x) either way, so the
        output has plain sampling's distribution (it uses the generator differently, so a seed gives other tokens).
        """
        p = self.params
        shaped = (self.shape(logits, output_ids) if p.shapes_logits else logits).float().cpu()
        if p.temperature == 0.0:
            token = int(torch.argmax(shaped))
        else:
            probs = torch.softmax(filter_logits(shaped / p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)
            if float(torch.rand((), generator=self.gen)) < float(probs[draft]):
                token = draft
            else:
                probs[draft] = 0.0
                token = int(torch.multinomial(probs, 1, generator=self.gen))   # multinomial renormalizes
        return token, token == draft, (None if p.logprobs is None else token_logprobs(logits, token, p.logprobs))
