"""The decode loop, on one screen: prefill the prompt, then decode one token at a time until EOS, a stop string,
max_tokens or the context limit. One request; the Engine (engine.py) batches many with the same pieces: `prefill`,
`decode` and a Sequence (sequence.py) per request, which holds the finish rule and the text (stop strings)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .models.kv_cache import Batch, SeqCache
from .sampling import SamplingParams
from .sequence import Sequence

PREFILL_CHUNK = 512   # prompt tokens per forward: bounds the (heads, chunk, context) attention scores in memory


def prefill(model, cache: SeqCache, prompt_ids: list[int], chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run the prompt in chunks of `chunk` tokens (each reads the cache the previous ones wrote);
    -> logits (V,) for the token after it."""
    for i in range(0, len(prompt_ids), chunk):
        logits = model.forward(Batch.build([(cache, prompt_ids[i:i + chunk])], model.device))
    return logits[0]


def decode(model, steps: list[tuple[SeqCache, int]]) -> torch.Tensor:
    """One batched decode forward: each (cache, last token) goes one token further; -> logits (B, V)."""
    return model.forward(Batch.build([(cache, [token]) for cache, token in steps], model.device))


def decode_one_token(model, cache: SeqCache, token: int) -> torch.Tensor:
    return decode(model, [(cache, token)])[0]


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""                 # with decode_text: the completion, ending before a stop string
    finish_reason: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0


def generate(model, prompt_ids: list[int], params: SamplingParams, ctx: int, eos_ids: set[int],
             decode_text: Callable[[list[int]], str] | None = None,
             on_text: Callable[[str], None] | None = None) -> Generation:
    """Greedy/sampled continuation of prompt_ids. With decode_text (ids -> str) the text is decoded as it grows and
    stop strings end it; on_text(delta) gets each piece of text as soon as it may be shown."""
    seq = Sequence(prompt_ids, params, model.new_cache(ctx), ctx, eos_ids, decode_text)
    t0 = time.perf_counter()
    try:
        logits = prefill(model, seq.cache, seq.prompt_ids)
        t1 = time.perf_counter()
        while True:
            delta = seq.append(seq.sample(logits)[0])
            if delta and on_text is not None:
                on_text(delta)
            if seq.finish_reason:
                break
            logits = decode_one_token(model, seq.cache, seq.tokens[-1])
    finally:
        seq.cache.release()                        # its KV blocks go back to the model's pool
    return Generation(seq.prompt_ids, seq.tokens, seq.text.text if seq.text else "", seq.finish_reason,
                      prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)
