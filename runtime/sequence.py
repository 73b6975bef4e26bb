"""One request's decode state, shared by `generate()` (one request) and the Engine (many, batched): its prompt, KV
cache, sampling generator, generated tokens, text, and the one rule for when it finishes.

A sequence finishes after a token when: the token is an EOS id (unless ignore_eos) or one of the request's
stop_token_ids -> "stop"; its text completes a stop string (the TextStream, text_stream.py, decides) -> "stop"; max_tokens tokens are generated, or prompt +
generated tokens fill the context -> "length".
"""
from __future__ import annotations

from collections.abc import Callable

from .models.kv_cache import SeqCache
from .sampling import Sampler, SamplingParams, TokenLogprobs
from .text.text_stream import TextStream


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, cache: SeqCache, ctx: int, eos_ids: set[int],
                 decode: Callable[[list[int]], str] | None = None, req_id: str = "", index: int = 0):
        """decode (ids -> text) turns the text on: stop strings are matched only when it is given. index: which of
        the request's n choices this is (its seed is params.seed + index)."""
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

    def sample(self, logits) -> tuple[int, TokenLogprobs | None]:
        """logits: (V,) the model's logits for the next token -> (token, its logprobs when asked for)."""
        return self.sampler.sample(logits, self.tokens)

    def append(self, token: int) -> str:
        """Add the token just sampled (not yet in the cache) and decide whether the sequence ends with it;
        -> the text this token releases ("" without decode; never part of a stop string or of a character)."""
        token = int(token)
        self.tokens.append(token)
        if (token in self.eos_ids and not self.params.ignore_eos) or token in self._stop_ids:
            why = "stop"
        elif len(self.tokens) >= self.params.max_tokens or self.cache.length + 1 >= self.ctx:   # prompt + generated
            why = "length"                                                                      # fill the context
        else:
            why = None
        if self.text is None:
            self.finish_reason = why
            return ""
        delta = self.text.push(token, last=why is not None)
        self.finish_reason = "stop" if self.text.stopped else why
        return delta
