"""Engine: the API `ktrun serve` (and anything else batching requests) drives.

    engine = Engine("converted/", ctx=4096, max_batch=16)
    engine.add_request("a", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=32))
    while engine.has_work():
        for req_id, token, finish in engine.step():   # one new token per running request per step
            ...

step(): first prefill the newly added requests (one varlen forward; each emits its first token), then ONE batched
decode forward over the requests that were already running: their new tokens go through every layer together (one
expert submission per layer for all of them), while attention reads each request's own cache only. Each request is
a Sequence (sequence.py) that decides when it finishes, with the same rule and the same prefill / decode functions
as `generate()` (generate.py): for the same prompt, parameters and seed both give the same tokens.

Prefix cache (ktrun.prefix_cache, on by default): before a new request is prefilled, the longest prefix of its prompt
held in full cached KV blocks (left by earlier requests, on the device, in RAM or on disk) is attached to its cache
and only the rest is prefilled; `engine.cached_tokens[req_id]` says how many prompt tokens that saved, for the
requests the latest step() prefilled. A new request whose next block an earlier request of the same step is about to
compute waits one step and reuses it. Every full block a request completes (prompt or generated) is kept for later
requests when it ends; its partial last block is freed.
"""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # effective only if torch is not loaded yet (see cli.py)

import torch

from .generate import decode, prefill
from .loaded_model import load_model
from .models.kv_cache import KV_BLOCK_SIZE, Batch
from .prefix_cache import PrefixCache, PrefixCacheConfig
from .sampling import SamplingParams, sample_token
from .sequence import Sequence

__all__ = ["Engine", "PrefixCacheConfig", "RequestError", "SamplingParams"]


PREFILL_BATCH_TOKENS = 512   # new prompts up to this many tokens in all are prefilled together in one forward


class RequestError(ValueError):
    """A request the engine refuses (prompt longer than ctx, duplicate id, batch full, bad token ids)."""


class Engine:
    def __init__(self, model_dir, ctx: int = 4096, max_batch: int = 16, device=None, verify: bool = False,
                 use_kernels: bool | None = None, quiet: bool = True, numa_prefault: bool = False,
                 dtype: torch.dtype | None = None, gpu_weights: str = "auto",
                 prefix_cache: PrefixCacheConfig | bool = True, kv_block_size: int = KV_BLOCK_SIZE):
        """Loads MODEL_DIR with ktrun.loaded_model.load_model (the same options); ctx: tokens per request (prompt +
        generated); max_batch: requests held at once; prefix_cache: True (default tiers: device + 4 GiB RAM), a
        PrefixCacheConfig (budgets, disk folder) or False (every prompt prefilled in full); kv_block_size:
        positions per KV block (the granularity of prefix reuse)."""
        self.model_dir = Path(model_dir)
        t0 = time.perf_counter()
        self.loaded = load_model(self.model_dir, device=device, dtype=dtype, verify=verify, quiet=quiet,
                                 numa_prefault=numa_prefault, gpu_weights=gpu_weights, use_kernels=use_kernels)
        self.converted, self.model, self.tokenizer = self.loaded.converted, self.loaded.model, self.loaded.tokenizer
        self.experts, self.eos_ids, self.model_name = self.model.experts, self.loaded.eos_ids, self.loaded.name
        self.ctx, self.max_batch = int(ctx), int(max_batch)
        if self.ctx < 1 or self.max_batch < 1:
            raise ValueError(f"ctx and max_batch must be >= 1 (got ctx={ctx}, max_batch={max_batch})")
        self.model.set_kv_block_size(kv_block_size)
        if prefix_cache is True:
            prefix_cache = PrefixCacheConfig()
        try:
            self.prefix_cache = PrefixCache(self.model.kv_pool, self._cache_identity(), prefix_cache) \
                if prefix_cache else None
        except BaseException:              # e.g. the disk tier's folder is in use: stop the expert threads first
            self.loaded.close()
            raise
        self.cached_tokens: dict[str, int] = {}    # req_id -> prompt tokens taken from the cache, latest step()
        self._new: list[Sequence] = []
        self._running: dict[str, Sequence] = {}
        self.stats = {"load_s": time.perf_counter() - t0, "prompt_tokens": 0, "generated_tokens": 0,
                      "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "requests_finished": 0,
                      "expert_backend": type(self.experts).__name__}

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if req_id in self._running or any(r.req_id == req_id for r in self._new):
            raise RequestError(f"request id {req_id!r} is already active")
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if len(prompt_ids) > self.ctx:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens, longer than the context limit --ctx {self.ctx}")
        V = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        if len(self._running) + len(self._new) >= self.max_batch:
            raise RequestError(f"engine is full: max_batch {self.max_batch} requests already running")
        # the text is decoded only for stop strings (`ktrun serve` matches them itself and sends none)
        self._new.append(Sequence(prompt_ids, params, self.model.new_cache(self.ctx), self.ctx, self.eos_ids,
                                  self.tokenizer.decode if params.stop else None, req_id=req_id))

    def abort(self, req_id: str) -> None:
        seq = self._running.pop(req_id, None)
        for r in [seq] + [r for r in self._new if r.req_id == req_id]:
            if r is not None:
                r.cache.release()                  # its blocks go back (full ones stay in the prefix cache)
        self._new = [r for r in self._new if r.req_id != req_id]

    def kv_cache_bytes(self) -> int:
        """KV-cache bytes of the blocks requests hold (a block shared by several counts once; cached blocks no
        request holds are in prefix_cache_stats()). Read by /metrics from another thread: one int."""
        pool = self.model.kv_pool
        return pool.used * pool.block_bytes

    def prefix_cache_stats(self) -> dict[str, int]:
        """Plain numbers for /metrics: hit/miss prompt tokens (hits by tier), bytes and blocks per tier, budgets."""
        if self.prefix_cache is None:
            return {"enabled": 0, "hit_tokens": 0, "miss_tokens": self.stats["prompt_tokens"]}
        return {"enabled": 1, **self.prefix_cache.stats()}

    def flush_prefix_cache(self) -> int:
        """Write every cached block to the disk tier (if there is one): what a restart starts warm with."""
        return self.prefix_cache.flush() if self.prefix_cache is not None else 0

    def _cache_identity(self) -> dict[str, str]:
        """What a cached block's values depend on besides its tokens: a block made under any other is never used."""
        manifest = hashlib.sha256((self.converted.root / "manifest.json").read_bytes()).hexdigest()
        backend = getattr(self.experts, "stats", {}).get("kernel_backend", "")
        return {"manifest_sha256": manifest, "kv_dtype": str(self.model.dtype), "device": self.model.device.type,
                "experts": f"{type(self.experts).__name__}:{backend}", "gpu_weights": str(self.converted.gpu_weights)}

    def has_work(self) -> bool:
        return bool(self._new or self._running)

    # -- one step ----------------------------------------------------------------------------------------------
    def _emit(self, seqs: list[Sequence], logits: torch.Tensor, out: list) -> None:
        """logits: (len(seqs), V): sample each sequence's next token; finished ones leave the batch."""
        for s, row in zip(seqs, logits):
            s.append(sample_token(row, s.params, s.gen))
            out.append((s.req_id, s.tokens[-1], s.finish_reason))
            if s.finish_reason:
                self._running.pop(s.req_id, None)
                s.cache.release()
                self.stats["requests_finished"] += 1
            else:
                self._running[s.req_id] = s
        self.stats["generated_tokens"] += len(seqs)

    def _match_prefixes(self, new: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Attach each new request's cached prefix; -> (requests to prefill now, requests that wait one step because
        an earlier one in this step computes their next block)."""
        pc = self.prefix_cache
        if pc is None:
            return new, []
        producing: set[bytes] = set()
        ready, wait = [], []
        for r in new:
            keys = pc.prompt_keys(r.prompt_ids)
            n = pc.cached_prefix_blocks(keys)
            if n < len(keys) and keys[n] in producing:
                wait.append(r)
                continue
            r.cached_tokens = pc.match(r.cache, r.prompt_ids, keys)
            producing.update(keys[r.cached_tokens // pc.block_size:])
            ready.append(r)
        return ready, wait

    def _publish(self, seqs: list[Sequence]) -> None:
        if self.prefix_cache is not None:
            for s in seqs:
                self.prefix_cache.publish(s.cache)

    def step(self) -> list[tuple[str, int, str | None]]:
        out: list[tuple[str, int, str | None]] = []
        decoding = list(self._running.values())
        self.cached_tokens = {}
        if self._new:
            new, self._new = self._match_prefixes(self._new)
            if new:
                t0 = time.perf_counter()
                todo = [(r.cache, r.prompt_ids[r.cached_tokens:]) for r in new]     # what the cache does not hold
                if sum(len(ids) for _, ids in todo) <= PREFILL_BATCH_TOKENS:      # short prompts: one forward
                    logits = self.model.forward(Batch.build(todo, self.model.device))
                else:                                                           # long ones: chunked, one by one
                    logits = torch.stack([prefill(self.model, cache, ids) for cache, ids in todo])
                self.stats["prefill_s"] += time.perf_counter() - t0
                self.stats["prompt_tokens"] += sum(len(r.prompt_ids) for r in new)
                self.cached_tokens = {r.req_id: r.cached_tokens for r in new}
                self._publish(new)
                self._emit(new, logits, out)
        if decoding:
            t0 = time.perf_counter()
            logits = decode(self.model, [(s.cache, s.tokens[-1]) for s in decoding])
            self.stats["decode_s"] += time.perf_counter() - t0
            self.stats["decode_steps"] += 1
            self._publish(decoding)
            self._emit(decoding, logits, out)
        self.stats.update(self.experts.stats)
        self.stats["expert_wait_s"] = self.model.timing["expert_wait_s"]
        return out

    def close(self) -> None:
        """Abort what is left, write the cached blocks to the disk tier, stop the expert threads."""
        for req_id in [*self._running, *(r.req_id for r in self._new)]:
            self.abort(req_id)
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
            self.prefix_cache.close()
        self.loaded.close()
