"""The decode loop, on one screen: prefill the prompt, then decode one token at a time until EOS, a stop string,
max_tokens or the context limit. One request; the Engine (engine.py) batches many with the same pieces: `prefill`,
`verify` and a Sequence (sequence.py) per request, which holds the finish rule and the text (stop strings).

Speculative decoding (ktrun.speculative) runs in the same loop: each step the Sequence drafts up to k tokens, one
forward (`verify`) runs the last token and the drafts (1 + k rows), and Sequence.advance keeps the drafts the
sampler accepts plus one token of its own, rolling the cache back past them. Without drafts a step is a plain
one-token decode."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .models.kv_cache import Batch, SeqCache
from .sampling import SamplingParams
from .sequence import Sequence
from .speculative import SpeculativeConfig

PREFILL_CHUNK = 512   # prompt tokens per forward: bounds the (heads, chunk, context) attention scores in memory
PREFILL_CHUNK_MAX = 1024        # prefill_chunk's largest
PREFILL_ROWS_PER_EXPERT = 64    # prefill_chunk: routed rows per expert a chunk should give on average


def prefill_chunk(model) -> int:
    """Prompt tokens per forward for this model: PREFILL_CHUNK, or more (a multiple of 256, up to PREFILL_CHUNK_MAX)
    until each routed expert gets PREFILL_ROWS_PER_EXPERT rows on average (num_experts * 64 / top_k): an expert's
    weight tiles are read once per chunk for all of its rows. bench_vs_llamacpp's int4 conversions, Zen 4, 2 threads,
    pp2048 in one process, chunks alternated: the Qwen3-30B-A3B shape (128 experts, top-8: 32 rows per expert at 512)
    710 / 787 / 743 tok/s at chunks of 512 / 1024 / 2048; the DeepSeek-V3 shape (16 experts: 256 rows at 512) 121 /
    121 / 120."""
    E, k = getattr(model.cfg, "num_experts", 0) or 0, getattr(model.cfg, "top_k", 0) or 0
    if E < 1 or k < 1:
        return PREFILL_CHUNK
    want = -(-PREFILL_ROWS_PER_EXPERT * E // k // 256) * 256
    return max(PREFILL_CHUNK, min(PREFILL_CHUNK_MAX, want))


def prefill(model, cache: SeqCache, prompt_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Run the prompt in chunks of `chunk` tokens (default: prefill_chunk(model)), each reading the cache the
    previous ones wrote; -> logits (V,) for the token after it."""
    chunk = chunk or prefill_chunk(model)
    for i in range(0, len(prompt_ids), chunk):
        logits = model.forward(Batch.build([(cache, prompt_ids[i:i + chunk])], model.device))
    return logits[0]


def decode(model, steps: list[tuple[SeqCache, int]]) -> torch.Tensor:
    """One batched decode forward: each (cache, last token) goes one token further; -> logits (B, V)."""
    return model.forward(Batch.build([(cache, [token]) for cache, token in steps], model.device))


def decode_one_token(model, cache: SeqCache, token: int) -> torch.Tensor:
    return decode(model, [(cache, token)])[0]


def verify(model, steps: list[tuple[SeqCache, list[int]]]) -> list[torch.Tensor]:
    """One batched decode forward where each (cache, [last token, *drafts]) runs 1 + k rows; -> per step logits
    (1 + k, V): row j predicts the token after drafts[:j]. Recurrent layers record their state after every drafted
    position (SeqCache.spec_states), so SeqCache.keep can roll back to any of them."""
    if all(len(ids) == 1 for _, ids in steps):
        return list(decode(model, [(cache, ids[0]) for cache, ids in steps])[:, None])
    added = []
    for cache, ids in steps:
        extra = set()
        if model.has_recurrent_state and len(ids) > 1:
            extra = set(range(cache.length + 1, cache.length + len(ids))) - cache.snap_at
            cache.snap_at |= extra            # the forward cuts its recurrence there and records the state
        added.append(extra)
    logits = model.forward(Batch.build(steps, model.device), all_logits=True)        # (T, V)
    out, row = [], 0
    for (cache, ids), extra in zip(steps, added):
        out.append(logits[row:row + len(ids)])
        row += len(ids)
        # positions the prefix cache asked for stay in snaps for it to keep; the rest were ours
        cache.spec_states = {p: cache.snaps.pop(p) if p in extra else cache.snaps[p]
                             for p in range(cache.length - len(ids) + 1, cache.length) if p in cache.snaps}
        cache.snap_at -= extra
    return out


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""                 # with decode_text: the completion, ending before a stop string
    finish_reason: str | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: int = 0               # speculative decoding: tokens drafted, of them accepted
    accepted: int = 0
    steps: int = 0                 # forwards that produced tokens (prefill's first token included)


def generate(model, prompt_ids: list[int], params: SamplingParams, ctx: int, eos_ids: set[int],
             decode_text: Callable[[list[int]], str] | None = None,
             on_text: Callable[[str], None] | None = None,
             speculative: SpeculativeConfig | None = None) -> Generation:
    """Greedy/sampled continuation of prompt_ids. With decode_text (ids -> str) the text is decoded as it grows and
    stop strings end it; on_text(delta) gets each piece of text as soon as it may be shown. speculative: draft and
    verify several tokens per forward (the same tokens greedy, the same distribution sampled)."""
    seq = Sequence(prompt_ids, params, model.new_cache(ctx), ctx, eos_ids, decode_text,
                   speculative=speculative)
    t0 = time.perf_counter()
    try:
        rows, drafts = prefill(model, seq.cache, seq.prompt_ids)[None], []
        t1 = time.perf_counter()
        while True:
            for _, _, delta in seq.advance(rows, drafts):      # 1 token, or with drafts up to 1 + k
                if delta and on_text is not None:
                    on_text(delta)
            if seq.finish_reason:
                break
            drafts = seq.draft()
            t2 = time.perf_counter()
            rows = verify(model, [(seq.cache, [seq.tokens[-1], *drafts])])[0]
            if seq.cost is not None:           # what a drafted row costs here (the adaptive draft length)
                seq.cost.observe_step(1, len(drafts), time.perf_counter() - t2)
    finally:
        seq.cache.release()                        # its KV blocks go back to the model's pool
    return Generation(seq.prompt_ids, seq.tokens, seq.text.text if seq.text else "", seq.finish_reason,
                      prefill_s=t1 - t0, decode_s=time.perf_counter() - t1, drafted=seq.drafted,
                      accepted=seq.accepted, steps=seq.steps)
