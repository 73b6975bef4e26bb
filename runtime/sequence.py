"""One request's decode state, shared by `generate()` (one request) and the Engine (many, batched): its prompt, KV
cache, sampling generator, generated tokens, text, and the one rule for when it finishes.

A sequence finishes after a token when: the token is an EOS id (unless ignore_eos) or one of the request's
stop_token_ids -> "stop"; its text completes a stop string (the TextStream, text_stream.py, decides) -> "stop"; max_tokens tokens are generated, or prompt +
generated tokens fill the context -> "length".

With speculative decoding (ktrun.speculative) a step may add several tokens: draft() guesses the next ones from
the context, the model scores them all in one forward, and advance() keeps what the sampler accepts (each kept
token passes the same finish rule, in order) and rolls the cache back past the rest.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from .models.kv_cache import SeqCache
from .sampling import Sampler, SamplingParams, TokenLogprobs, greedy_tokens
from .speculative import SpeculativeConfig
from .text.text_stream import TextStream


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, cache: SeqCache, ctx: int, eos_ids: set[int],
                 decode: Callable[[list[int]], str] | None = None, req_id: str = "", index: int = 0,
                 speculative: SpeculativeConfig | None = None):
        """decode (ids -> text) turns the text on: stop strings are matched only when it is given. index: which of
        the request's n choices this is (its seed is params.seed + index). speculative: how it drafts tokens."""
        self.req_id, self.index = req_id, index
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.params, self.cache, self.ctx, self.eos_ids = params, cache, int(ctx), eos_ids
        self.sampler = Sampler(params, self.prompt_ids, index)
        self.gen = self.sampler.gen
        self._stop_ids = set(params.stop_token_ids)
        self.tokens: list[int] = []
        self.text = TextStream(decode, params.stop, self.prompt_ids) if decode is not None else None
        self.finish_reason: str | None = None
        self.cached_tokens = 0                     # prompt tokens the prefix cache supplied (never prefilled)
        self.followers: list[Sequence] = []   # Engine, n > 1: the other choices, prefilled by copying this cache
        self.draft_tokens = speculative.draft_tokens if speculative is not None else 0
        self.drafter = speculative.drafter(self.prompt_ids) if speculative is not None else None
        # the adaptive policy's state (None: always draft_tokens) and the costs it weighs (shared by the requests)
        self.lengths = speculative.draft_length() if speculative is not None else None
        self.cost = speculative.cost if speculative is not None else None
        self.chosen = 0                                 # the draft length chosen for the step in flight
        self.drafted = self.accepted = self.steps = 0   # tokens drafted / accepted; forwards that gave tokens

    def sample(self, logits) -> tuple[int, TokenLogprobs | None]:
        """logits: (V,) the model's logits for the next token -> (token, its logprobs when asked for)."""
        return self.sampler.sample(logits, self.tokens)

    def draft(self) -> list[int]:
        """Tokens to verify after tokens[-1] in the next forward ([] without speculation): at most draft_tokens,
        and no more than max_tokens and the context leave room for (the forward also yields one token of its own)."""
        return draft_all([self])[0]

    def draft_size(self, batch: int = 1) -> int:
        """How many tokens draft() may propose now (0 without speculation): draft_tokens, or with the adaptive policy
        the length its acceptance and the measured costs at this batch size pay for (ktrun.speculative)."""
        if self.drafter is None:
            return 0
        room = min(self.params.max_tokens - len(self.tokens), self.ctx - len(self.prompt_ids) - len(self.tokens))
        k = self.draft_tokens if self.lengths is None else self.lengths.size(self.cost.per_token(batch))
        self.chosen = max(0, min(k, room - 1))
        return self.chosen

    def advance(self, rows, drafts: list[int]) -> list[tuple[int, TokenLogprobs | None, str]]:
        """rows: (1 + len(drafts), V) logits of the forward that ran tokens[-1] and the drafts (row j: the token
        after drafts[:j]). Take the accepted drafts and one sampled token (the correction of the first rejected
        draft, or one after all of them), each through append(), until the sequence finishes; roll the cache back
        to the tokens kept. -> [(token, logprobs, text delta)] in order."""
        out = []
        self.steps += 1
        kept = 0
        # plain greedy: every row's argmax at once (greedy_tokens: the token sample() and sample_or_accept() pick at
        # temperature 0, ~0.4 us a row against ~8 us through torch one row at a time)
        argmax = greedy_tokens(rows) if self.sampler.plain_greedy else None
        for j, row in enumerate(rows):
            if argmax is not None:
                token, lp = argmax[j], None
                ok = j < len(drafts) and token == drafts[j]
            elif j < len(drafts):
                token, ok, lp = self.sampler.sample_or_accept(row, self.tokens, drafts[j])
            else:
                token, lp = self.sample(row)
                ok = False
            self.accepted += ok
            kept += ok
            out.append((int(token), lp, self.append(token)))
            if self.finish_reason or not ok:
                break
        if drafts:
            # the cache holds tokens[-1] before this step and the drafts; keep what precedes the newest token
            self.cache.keep(self.cache.length - len(rows) + len(out))
        if self.lengths is not None and (drafts or self.chosen == 0):   # (a drafter with no guess: no evidence)
            self.lengths.update(len(drafts), kept)
        return out

    def take(self, token: int) -> list[tuple[int, TokenLogprobs | None, str]]:
        """advance() without drafts whose token was chosen for it (advance_all: a batched argmax)."""
        self.steps += 1
        return [(token, None, self.append(token))]

    def append(self, token: int) -> str:
        """Add the token just sampled (not yet in the cache) and decide whether the sequence ends with it;
        -> the text this token releases ("" without decode; never part of a stop string or of a character)."""
        token = int(token)
        self.tokens.append(token)
        if self.drafter is not None:
            self.drafter.extend([token])
        if (token in self.eos_ids and not self.params.ignore_eos) or token in self._stop_ids:
            why = "stop"
        elif len(self.tokens) >= self.params.max_tokens or len(self.prompt_ids) + len(self.tokens) >= self.ctx:
            why = "length"                                                  # or prompt + generated fill the context
        else:
            why = None
        if self.text is None:
            self.finish_reason = why
            return ""
        delta = self.text.push(token, last=why is not None)
        self.finish_reason = "stop" if self.text.stopped else why
        return delta


def draft_all(seqs: list[Sequence]) -> list[list[int]]:
    """Sequence.draft() of several sequences: drafters with a batched `propose_many` (MTP: ktrun.mtp) share their
    forwards, the others (n-gram) propose one by one; -> each sequence's drafts."""
    sizes = [s.draft_size(len(seqs)) for s in seqs]
    out: list[list[int]] = [[] for _ in seqs]
    t0 = time.perf_counter()
    batched = [i for i, s in enumerate(seqs) if s.drafter is not None and hasattr(s.drafter, "propose_many")]
    if batched:
        got = seqs[batched[0]].drafter.propose_many([(seqs[i].drafter, sizes[i], seqs[i].cache) for i in batched])
        for i, drafts in zip(batched, got):
            out[i] = drafts
    for i, s in enumerate(seqs):
        if s.drafter is not None and not hasattr(s.drafter, "propose_many"):
            out[i] = s.drafter.propose(sizes[i], s.cache)
        s.drafted += len(out[i])
    if seqs and seqs[0].cost is not None:
        seqs[0].cost.observe_draft(sum(map(len, out)), time.perf_counter() - t0)
    return out


def advance_all(seqs: list[Sequence], logits) -> list[list[tuple[int, TokenLogprobs | None, str]]]:
    """Sequence.advance() of each sequence over its row of one decode forward's logits (B, V), without drafts. The
    plain greedy ones (Sampler.plain_greedy) get their argmax in one greedy_tokens() call instead of one per row."""
    greedy = [i for i, s in enumerate(seqs) if s.sampler.plain_greedy]
    rows = logits if len(greedy) == len(seqs) else logits[greedy]
    tokens = dict(zip(greedy, greedy_tokens(rows))) if greedy else {}
    return [s.take(tokens[i]) if i in tokens else s.advance(logits[i:i + 1], []) for i, s in enumerate(seqs)]
