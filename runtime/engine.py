"""Engine: the API `ktrun serve` (and anything else batching requests) drives.

    engine = Engine("converted/", ctx=4096, max_batch=16)
    engine.add_request("a", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=32))
    while engine.has_work():
        for req_id, token, finish in engine.step():   # one new token per running request per step
            ...

step(): first prefill the newly added requests (one varlen forward; each emits its first token), then ONE batched
decode forward over the requests that were already running: their new tokens go through every layer together (one
expert submission per layer for all of them), while attention reads each request's own cache only.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # effective only if torch is not loaded yet (see cmd_bench.py)

import torch

from .generate import finish_reason, prefill
from .loader import load_converted
from .models.kv_cache import Batch, SeqCache
from .models.model import MoEModel
from .sampling import SamplingParams, make_generator, sample_token
from .tokenizer import Tokenizer

__all__ = ["Engine", "RequestError", "SamplingParams"]


PREFILL_BATCH_TOKENS = 512   # new prompts up to this many tokens in all are prefilled together in one forward


class RequestError(ValueError):
    """A request the engine refuses (prompt longer than ctx, duplicate id, batch full, bad token ids)."""


@dataclass
class _Request:
    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache: SeqCache
    gen: torch.Generator
    generated: list[int] = field(default_factory=list)


def eos_ids_of(model_dir: Path, cfg, tokenizer: Tokenizer) -> set[int]:
    ids = set(cfg.eos_token_ids)
    gc = model_dir / "generation_config.json"
    if gc.is_file():
        v = json.loads(gc.read_text()).get("eos_token_id")
        ids |= set(v if isinstance(v, list) else [] if v is None else [v])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Engine:
    def __init__(self, model_dir, ctx: int = 4096, max_batch: int = 16, device=None, verify: bool = False,
                 use_kernels: bool | None = None, quiet: bool = True, numa_prefault: bool = False,
                 dtype: torch.dtype | None = None, gpu_weights: str = "auto"):
        from .experts import make_executor
        self.model_dir = Path(model_dir)
        t0 = time.perf_counter()
        # dtype of the dense part: None = bfloat16 on CUDA, float32 on the CPU
        self.converted = load_converted(self.model_dir, device=device, dtype=dtype, verify=verify, quiet=quiet,
                                        numa_prefault=numa_prefault, gpu_weights=gpu_weights)
        self.experts = make_executor(self.converted, use_kernels=use_kernels)
        cfg = self.converted.config
        self.model = MoEModel(cfg, self.converted.dense, self.experts, self.converted.device, self.converted.dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        self.model_name = self.model_dir.resolve().name
        self.ctx, self.max_batch = int(ctx), int(max_batch)
        if self.ctx < 1 or self.max_batch < 1:
            raise ValueError(f"ctx and max_batch must be >= 1 (got ctx={ctx}, max_batch={max_batch})")
        self.eos_ids = eos_ids_of(self.model_dir, cfg, self.tokenizer)
        self._new: list[_Request] = []
        self._running: dict[str, _Request] = {}
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
        self._new.append(_Request(req_id, [int(t) for t in prompt_ids], params, self.model.new_cache(self.ctx),
                                  make_generator(params.seed)))

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
    def _emit(self, reqs: list[_Request], logits: torch.Tensor, out: list) -> None:
        for r, row in zip(reqs, logits):
            tok = sample_token(row, r.params, r.gen)
            r.generated.append(tok)
            why = finish_reason(tok, len(r.generated), r.cache.length, self.ctx, r.params, self.eos_ids,
                                lambda r=r: self._tail_text(r))
            out.append((r.req_id, tok, why))
            if why:
                self._running.pop(r.req_id, None)
                self.stats["requests_finished"] += 1
            else:
                self._running[r.req_id] = r
        self.stats["generated_tokens"] += len(reqs)

    def _tail_text(self, r: _Request) -> str:
        """Text of the last tokens, enough to hold any stop string (a character is at most 4 byte-level tokens),
        so stop checks do not re-decode the whole generation every step."""
        n = 4 * max(map(len, r.params.stop)) + 8
        return self.tokenizer.decode(r.generated[-n:])

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
            logits = self.model.forward(Batch.build([(r.cache, [r.generated[-1]]) for r in decoding],
                                                    self.model.device))
            self.stats["decode_s"] += time.perf_counter() - t0
            self.stats["decode_steps"] += 1
            self._emit(decoding, logits, out)
        self.stats.update(self.experts.stats)
        self.stats["expert_wait_s"] = self.model.timing["expert_wait_s"]
        return out

    def close(self) -> None:
        close = getattr(self.experts, "close", None)
        if close:
            close()
