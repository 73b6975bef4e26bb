"""The decode loop, on one screen: prefill the prompt, then decode one token at a time until EOS, a stop string,
max_tokens or the context limit. One request; the Engine (engine.py) batches many with the same model calls."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .models.kv_cache import Batch, SeqCache
from .sampling import SamplingParams, make_generator, sample_token

PREFILL_CHUNK = 512   # prompt tokens per forward: bounds the (heads, chunk, context) attention scores in memory


def prefill(model, cache: SeqCache, prompt_ids: list[int], chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run the prompt in chunks of `chunk` tokens (each reads the cache the previous ones wrote);
    -> logits (V,) for the token after it."""
    for i in range(0, len(prompt_ids), chunk):
        logits = model.forward(Batch.build([(cache, prompt_ids[i:i + chunk])], model.device))
    return logits[0]


def decode_one_token(model, cache: SeqCache, token: int) -> torch.Tensor:
    return model.forward(Batch.build([(cache, [token])], model.device))[0]


def finish_reason(token: int, n_generated: int, cache_len: int, ctx: int, params: SamplingParams,
                  eos_ids: set[int], text: Callable[[], str] | None = None) -> str | None:
    """Why generation stops after `token` (already counted in n_generated), or None to go on."""
    if token in eos_ids and not params.ignore_eos:
        return "stop"
    if params.stop and text is not None and any(s in text() for s in params.stop):
        return "stop"
    if n_generated >= params.max_tokens or cache_len + 1 >= ctx:   # prompt + generated tokens fill the context
        return "length"
    return None


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0


def generate(model, prompt_ids: list[int], params: SamplingParams, ctx: int, eos_ids: set[int],
             decode_text: Callable[[list[int]], str] | None = None,
             callback: Callable[[int], None] | None = None) -> Generation:
    """Greedy/sampled continuation of prompt_ids; callback(token) is called for every new token as it appears."""
    cache, gen = model.new_cache(ctx), make_generator(params.seed)
    out = Generation(list(prompt_ids))
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt_ids)
    out.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    while True:
        token = sample_token(logits, params, gen)
        out.tokens.append(token)
        if callback is not None:
            callback(token)
        text = (lambda: decode_text(out.tokens)) if decode_text else None
        out.finish_reason = finish_reason(token, len(out.tokens), cache.length, ctx, params, eos_ids, text)
        if out.finish_reason:
            break
        logits = decode_one_token(model, cache, token)
    out.decode_s = time.perf_counter() - t0
    return out
