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
"""
from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # effective only if torch is not loaded yet (see cli.py)

import torch

from .generate import decode, prefill
from .loaded_model import load_model
from .models.kv_cache import Batch
from .sampling import SamplingParams, sample_token
from .sequence import Sequence

__all__ = ["Engine", "RequestError", "SamplingParams"]


PREFILL_BATCH_TOKENS = 512   # new prompts up to this many tokens in all are prefilled together in one forward


class RequestError(ValueError):
    """A request the engine refuses (prompt longer than ctx, duplicate id, batch full, bad token ids)."""


class Engine:
    def __init__(self, model_dir, ctx: int = 4096, max_batch: int = 16, device=None, verify: bool = False,
                 use_kernels: bool | None = None, quiet: bool = True, numa_prefault: bool = False,
                 dtype: torch.dtype | None = None, gpu_weights: str = "auto", hot_experts=None):
        """Loads MODEL_DIR with ktrun.loaded_model.load_model (the same options; hot_experts: ktrun.hot_experts.
        HotExpertOptions, a --gpu-mem plan leaving room for ctx * max_batch tokens of KV cache); ctx: tokens per
        request (prompt + generated); max_batch: requests held at once."""
        self.model_dir = Path(model_dir)
        t0 = time.perf_counter()
        self.loaded = load_model(self.model_dir, device=device, dtype=dtype, verify=verify, quiet=quiet,
                                 numa_prefault=numa_prefault, gpu_weights=gpu_weights, use_kernels=use_kernels,
                                 hot_experts=hot_experts, kv_tokens=int(ctx) * int(max_batch))
        self.converted, self.model, self.tokenizer = self.loaded.converted, self.loaded.model, self.loaded.tokenizer
        self.experts, self.eos_ids, self.model_name = self.model.experts, self.loaded.eos_ids, self.loaded.name
        self.ctx, self.max_batch = int(ctx), int(max_batch)
        if self.ctx < 1 or self.max_batch < 1:
            raise ValueError(f"ctx and max_batch must be >= 1 (got ctx={ctx}, max_batch={max_batch})")
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
        self._running.pop(req_id, None)            # its SeqCache is dropped with it
        self._new = [r for r in self._new if r.req_id != req_id]

    def kv_cache_bytes(self) -> int:
        """KV-cache bytes held by the requests in the engine (read by /metrics from another thread: list() of a
        dict's values is one step under the GIL)."""
        return sum(r.cache.nbytes() for r in list(self._running.values()) + list(self._new))

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
                self.stats["requests_finished"] += 1
            else:
                self._running[s.req_id] = s
        self.stats["generated_tokens"] += len(seqs)

    def step(self) -> list[tuple[str, int, str | None]]:
        out: list[tuple[str, int, str | None]] = []
        decoding = list(self._running.values())
        if self._new:
            new, self._new = self._new, []
            t0 = time.perf_counter()
            if sum(len(r.prompt_ids) for r in new) <= PREFILL_BATCH_TOKENS:     # short prompts: one forward
                logits = self.model.forward(Batch.build([(r.cache, r.prompt_ids) for r in new], self.model.device))
            else:                                                               # long ones: chunked, one by one
                logits = torch.stack([prefill(self.model, r.cache, r.prompt_ids) for r in new])
            self.stats["prefill_s"] += time.perf_counter() - t0
            self.stats["prompt_tokens"] += sum(len(r.prompt_ids) for r in new)
            self._emit(new, logits, out)
        if decoding:
            t0 = time.perf_counter()
            logits = decode(self.model, [(s.cache, s.tokens[-1]) for s in decoding])
            self.stats["decode_s"] += time.perf_counter() - t0
            self.stats["decode_steps"] += 1
            self._emit(decoding, logits, out)
        self.stats.update(self.experts.stats)
        self.stats["expert_wait_s"] = self.model.timing["expert_wait_s"]
        return out

    def close(self) -> None:
        self.loaded.close()
