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

A request with params.n > 1 holds n sequences (choices) that share its prompt's prefill: the prompt runs once, the
other choices start from a copy of its cache. step() returns StepOutput tuples (req_id, token, finish_reason) with
.index (the choice), .logprobs (TokenLogprobs when params.logprobs is set) and, with a choice's first token,
.prompt_logprobs (params.prompt_logprobs: one TokenLogprobs per prompt token after the first).

Prefix cache (ktrun.prefix_cache, on by default): before a new request is prefilled, the longest prefix of its prompt
held in full cached KV blocks (left by earlier requests, on the device, in RAM or on disk) is attached to its cache
and only the rest is prefilled; `engine.cached_tokens[req_id]` says how many prompt tokens that saved, for the
requests the latest step() prefilled. A new request whose next block an earlier request of the same step is about to
compute waits one step and reuses it. Every full block a request completes (prompt or generated) is kept for later
requests when it ends; its partial last block is freed. Families with linear attention resume only where a snapshot
of their recurrent state was kept (ktrun.prefix_cache.cache says which block ends get one); requests of one step that
share a prefix snapshot its end, the first computes it and the others wait one step.

Speculative decoding (speculative=SpeculativeConfig("ngram", k)): in the decode forward each running request runs
its last token plus up to k drafted tokens (varlen rows in the same batch), and keeps the drafts its sampler
accepts plus one token of its own (Sequence.advance): step() then yields several tokens for it. The cache is rolled
back past rejected drafts before its blocks are published to the prefix cache; stats count the drafted and accepted
tokens (spec_draft_tokens, spec_accepted_tokens, spec_acceptance_rate).

Memory: the KV cache (--ctx x --max-batch tokens at most) and the recurrent states (a fixed size per request) are
planned at start (ktrun.cache_budget): a configuration that cannot fit the device's free memory is refused.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # effective only if torch is not loaded yet (see cli.py)

import torch

from .cache_budget import CacheBudgetError, CachePlan, states_per_engine
from .defaults import DEFAULT_CTX, DEFAULT_MAX_BATCH
from .generate import PREFILL_CHUNK, decode, prefill, verify
from .loaded_model import load_model
from .models.kv_cache import KV_BLOCK_SIZE, Batch
from .prefix_cache import PrefixCache, PrefixCacheConfig
from .sampling import SamplingParams, TokenLogprobs, prompt_logprobs
from .sequence import Sequence, advance_all, draft_all
from .speculative import SpeculativeConfig

__all__ = ["CacheBudgetError", "Engine", "PrefixCacheConfig", "RequestError", "SamplingParams", "SpeculativeConfig",
           "StepOutput"]


PREFILL_BATCH_TOKENS = 512   # new prompts up to this many tokens in all are prefilled together in one forward


class RequestError(ValueError):
    """A request the engine refuses (prompt longer than ctx, duplicate id, batch full, bad token ids)."""


class StepOutput(tuple):
    """(req_id, token, finish_reason), as step() has always yielded, plus .index (which of the request's n choices),
    .logprobs (TokenLogprobs | None), .prompt_logprobs (list[TokenLogprobs] | None: with a choice's first token
    when params.prompt_logprobs is set) and, with speculative decoding, .drafted / .accepted (the choice's drafted
    and accepted tokens so far)."""

    def __new__(cls, req_id: str, token: int, finish_reason: str | None, index: int = 0,
                logprobs: TokenLogprobs | None = None, prompt_logprobs: list[TokenLogprobs] | None = None,
                drafted: int = 0, accepted: int = 0):
        out = super().__new__(cls, (req_id, token, finish_reason))
        out.index, out.logprobs, out.prompt_logprobs = index, logprobs, prompt_logprobs
        out.drafted, out.accepted = drafted, accepted
        return out


class Engine:
    def __init__(self, model_dir, ctx: int = DEFAULT_CTX, max_batch: int = DEFAULT_MAX_BATCH, device=None, verify: bool = False,
                 use_kernels: bool | None = None, quiet: bool = True, numa_prefault: bool = False,
                 dtype: torch.dtype | None = None, gpu_weights: str = "auto", hot_experts=None,
                 prefix_cache: PrefixCacheConfig | bool = True, kv_block_size: int = KV_BLOCK_SIZE,
                 expert_ram=None, speculative: SpeculativeConfig | None = None):
        """Loads MODEL_DIR with ktrun.loaded_model.load_model (the same options; hot_experts: ktrun.experts.hot.
        HotExpertOptions, a --gpu-mem plan leaving room for ctx * max_batch tokens of KV cache; expert_ram:
        ktrun.cli.expert_ram_option.ExpertRamOptions, the routed experts' RAM tier); ctx: tokens per request (prompt +
        generated); max_batch: requests held at once; prefix_cache: True (default tiers: device + 4 GiB RAM), a
        PrefixCacheConfig (budgets, disk folder) or False (every prompt prefilled in full); kv_block_size: positions
        per KV block (the granularity of prefix reuse). Raises CacheBudgetError when the KV cache of ctx x max_batch
        tokens and the recurrent states cannot fit the device's free memory. speculative: n-gram or MTP drafts
        verified in the decode forward (None: off; "mtp" loads the conversion's MTP layer, LoadError without one)."""
        self.model_dir = Path(model_dir)
        t0 = time.perf_counter()
        if prefix_cache is True:
            prefix_cache = PrefixCacheConfig()
        kv_states = states_per_engine(int(max_batch), bool(prefix_cache))
        self.loaded = load_model(self.model_dir, device=device, dtype=dtype, verify=verify, quiet=quiet,
                                 numa_prefault=numa_prefault, gpu_weights=gpu_weights, use_kernels=use_kernels,
                                 hot_experts=hot_experts, kv_tokens=int(ctx) * int(max_batch),
                                 expert_ram=expert_ram, kv_states=kv_states,
                                 mtp=speculative is not None and speculative.needs_mtp)
        self.converted, self.model, self.tokenizer = self.loaded.converted, self.loaded.model, self.loaded.tokenizer
        self.experts, self.eos_ids, self.model_name = self.model.experts, self.loaded.eos_ids, self.loaded.name
        self.ctx, self.max_batch = int(ctx), int(max_batch)
        try:
            if self.ctx < 1 or self.max_batch < 1:
                raise ValueError(f"ctx and max_batch must be >= 1 (got ctx={ctx}, max_batch={max_batch})")
            self.model.set_kv_block_size(kv_block_size)
            self.cache_plan = CachePlan.of(self.model.cfg, self.model.dtype, self.ctx, self.max_batch,
                                           bool(prefix_cache))
            self.cache_plan.check(self.model.device)
            if prefix_cache and prefix_cache.device_states is None:
                prefix_cache = replace(prefix_cache, device_states=self.max_batch)
            self.prefix_cache = PrefixCache(self.model.kv_pool, self._cache_identity(), prefix_cache,
                                            self.model.state_layout) if prefix_cache else None
        except BaseException:              # e.g. the disk tier's folder is in use: stop the expert threads first
            self.loaded.close()
            raise
        self._state_bytes = 0
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        if self.speculative is not None:           # MTP drafts: the head loaded with the model
            self.speculative = self.speculative.with_mtp(self.loaded.mtp)
        self.cached_tokens: dict[str, int] = {}    # req_id -> prompt tokens taken from the cache, latest step()
        self._new: list[Sequence] = []
        self._running: dict[tuple[str, int], Sequence] = {}    # (req_id, choice index) -> its sequence
        self.stats = {"load_s": time.perf_counter() - t0, "prompt_tokens": 0, "generated_tokens": 0,
                      "prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "requests_finished": 0,
                      "expert_backend": type(self.experts).__name__, "spec_draft_tokens": 0,
                      "spec_accepted_tokens": 0, "spec_acceptance_rate": 0.0}

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if any(k[0] == req_id for k in self._running) or any(r.req_id == req_id for r in self._new):
            raise RequestError(f"request id {req_id!r} is already active")
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if len(prompt_ids) > self.ctx:
            raise RequestError(f"prompt has {len(prompt_ids)} tokens, longer than the context limit --ctx {self.ctx}")
        V = self.model.cfg.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < V]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
        n = max(1, int(getattr(params, "n", 1)))
        if self._n_sequences() + n > self.max_batch:
            raise RequestError(f"engine is full: max_batch {self.max_batch} sequences (n={n} asked for)")
        # the text is decoded only for stop strings (`ktrun serve` matches them itself and sends none)
        decode_text = self.tokenizer.decode if params.stop else None
        choices = [Sequence(prompt_ids, params, self.model.new_cache(self.ctx) if i == 0 else None, self.ctx,
                            self.eos_ids, decode_text, req_id=req_id, index=i, speculative=self.speculative)
                   for i in range(n)]
        choices[0].followers = choices[1:]         # they get a copy of choice 0's cache after its prefill
        self._new.append(choices[0])

    def abort(self, req_id: str, index: int | None = None) -> None:
        """Drop a request (all its choices, or only choice `index`); its blocks go back to the pool (the full ones
        the prefix cache keys stay cached)."""
        for key in [k for k in self._running if k[0] == req_id and (index is None or k[1] == index)]:
            self._release(self._running.pop(key).cache)
        if index is None:
            for r in self._new:
                if r.req_id == req_id:
                    self._release(r.cache)
            self._new = [r for r in self._new if r.req_id != req_id]
        else:
            for r in self._new:
                if r.req_id == req_id:
                    r.followers = [f for f in r.followers if f.index != index]
        self._count_states()

    def _n_sequences(self) -> int:
        return len(self._running) + sum(1 + len(r.followers) for r in self._new)

    def _release(self, cache) -> None:
        """A request's cache is done: the prefix cache keeps what it wants of it, the rest goes back to the pool."""
        if self.prefix_cache is not None:
            self.prefix_cache.retire(cache)
        cache.release()

    def kv_cache_bytes(self) -> int:
        """KV-cache bytes of the blocks requests hold (a block shared by several counts once; cached blocks no
        request holds are in prefix_cache_stats()). Read by /metrics from another thread: one int."""
        pool = self.model.kv_pool
        return pool.used * pool.block_bytes

    def recurrent_state_bytes(self) -> int:
        """Recurrent-state bytes requests hold (linear-attention layers: each request's state, and with the prefix
        cache the state at its last block end); snapshots the cache keeps are in prefix_cache_stats(). Read by
        /metrics from another thread: one int, updated by step() and abort()."""
        return self._state_bytes

    def _count_states(self) -> None:
        layout = self.model.state_layout
        if layout is None:
            return
        caches = [s.cache for s in self._running.values()] + [r.cache for r in self._new]
        n = sum(bool(c.recurrent) + (c.tail is not None) for c in caches if c is not None)
        self._state_bytes = n * layout.nbytes()

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
        ident = {"manifest_sha256": manifest, "kv_dtype": str(self.model.dtype), "device": self.model.device.type,
                 "experts": f"{type(self.experts).__name__}:{backend}", "gpu_weights": str(self.converted.gpu_weights)}
        residency = getattr(self.experts, "residency", None)
        if residency is not None:        # hot experts (HybridExperts) compute on the GPU in their own format
            placed = hashlib.sha256(b"".join(residency.skip[L].tobytes() for L in sorted(residency.skip)))
            mode = "dynamic" if getattr(self.experts, "dynamic", None) is not None else "static"
            ident["hot_experts"] = f"{getattr(self.experts.store, 'format', '')}:{mode}:{placed.hexdigest()}"
        return ident

    def uncached_tokens(self, prompt_ids: list[int]) -> int:
        """Prompt tokens a prefill would compute if the request came now: the prefix cache's current hit left out (a
        peek: nothing is claimed, and blocks evicted meanwhile make it more)."""
        pc = self.prefix_cache
        if pc is None:
            return len(prompt_ids)
        return len(prompt_ids) - pc.usable_prefix_blocks(pc.prompt_keys(prompt_ids)) * pc.block_size

    def rest_kernels(self) -> None:
        """After a step with other work ahead for the cores (a server writing its streams): the kernel pool's idle
        workers sleep at once instead of spinning for the next job; the next step wakes them (MoEKernels.rest)."""
        if getattr(self.model, "kernels", None) is not None:
            self.model.kernels.rest()

    def has_work(self) -> bool:
        return bool(self._new or self._running)

    # -- one step ----------------------------------------------------------------------------------------------
    def _emit(self, seqs: list[Sequence], picks: list[list], out: list, first: dict | None = None) -> None:
        """picks: per sequence, the tokens its advance() just took [(token, logprobs, text)] (several with
        speculative decoding); finished sequences leave the batch. first: id(sequence) -> its prompt logprobs, sent
        with its first token."""
        for s, taken in zip(seqs, picks):
            for j, (token, lp, _) in enumerate(taken):
                out.append(StepOutput(s.req_id, token, s.finish_reason if j == len(taken) - 1 else None, s.index,
                                      lp, first.get(id(s)) if first else None, s.drafted, s.accepted))
            self.stats["generated_tokens"] += len(taken)
            if s.finish_reason:
                self._running.pop((s.req_id, s.index), None)
                self._release(s.cache)
                self.stats["requests_finished"] += 1
            else:
                self._running[s.req_id, s.index] = s

    def _match_prefixes(self, new: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Attach each new request's cached prefix; -> (requests to prefill now, requests that wait one step because
        an earlier one in this step computes their next block, or with recurrent layers the snapshot they would
        resume from). A request asking for prompt logprobs prefills its whole prompt (the cache holds KV, not the
        logits that score each prompt token)."""
        pc = self.prefix_cache
        if pc is None:
            return new, []
        recurrent = pc.states is not None
        keyed = [pc.prompt_keys(r.prompt_ids) for r in new]
        shared = _shared_blocks(keyed) if recurrent else [0] * len(new)
        producing: set[bytes] = set()   # keys of the blocks (recurrent: of the snapshots) this step computes
        ready, wait = [], []
        for r, keys, sh in zip(new, keyed, shared):
            if r.params.prompt_logprobs is not None:
                pc.plan_snapshots(r.cache, r.prompt_ids, sh)
                producing.update(self._produces(r, keys))
                ready.append(r)
                continue
            n = pc.usable_prefix_blocks(keys)
            if any(k in producing for k in keys[n:]) if recurrent else (n < len(keys) and keys[n] in producing):
                wait.append(r)
                continue
            r.cached_tokens = pc.match(r.cache, r.prompt_ids, keys, sh)
            producing.update(self._produces(r, keys))
            ready.append(r)
        return ready, wait

    def _produces(self, r: Sequence, keys: list[bytes]) -> list[bytes]:
        """Keys a request's prefill makes: its blocks past the cached prefix, or (recurrent) the blocks it snapshots
        the end of."""
        B = self.prefix_cache.block_size
        if self.prefix_cache.states is not None:
            return [keys[p // B - 1] for p in r.cache.snap_at]
        return keys[r.cached_tokens // B:]

    def _publish(self, seqs: list[Sequence]) -> None:
        if self.prefix_cache is not None:
            for s in seqs:
                self.prefix_cache.publish(s.cache)

    def _prefill_with_logprobs(self, r: Sequence) -> tuple[torch.Tensor, list[TokenLogprobs]]:
        """Prefill one prompt in chunks keeping every position's logits long enough to score the prompt token that
        follows it -> (logits (V,) after the prompt, prompt logprobs for tokens 1..T-1)."""
        ids, scored = r.prompt_ids, []
        for i in range(0, len(ids), PREFILL_CHUNK):
            logits = self.model.forward(Batch.build([(r.cache, ids[i:i + PREFILL_CHUNK])], self.model.device),
                                        all_logits=True)                                    # (chunk, V)
            nxt = ids[i + 1:i + 1 + PREFILL_CHUNK]                                          # what each row predicts
            scored += prompt_logprobs(logits[:len(nxt)], nxt, r.params.prompt_logprobs)
        return logits[-1], scored

    def step(self) -> list[StepOutput]:
        if getattr(self.model, "kernels", None) is not None:   # the kernel pool's workers sleep after a pause (a server's writes)
            self.model.kernels.wake()
        out: list[StepOutput] = []
        decoding = list(self._running.values())
        self.cached_tokens = {}
        new, self._new = self._match_prefixes(self._new) if self._new else ([], [])
        if new:
            t0 = time.perf_counter()
            plain = [r for r in new if r.params.prompt_logprobs is None]
            scored = [r for r in new if r.params.prompt_logprobs is not None]
            rows: dict[int, torch.Tensor] = {}
            first: dict[int, list[TokenLogprobs]] = {}
            todo = [(r.cache, r.prompt_ids[r.cached_tokens:]) for r in plain]   # what the cache does not hold
            if plain and sum(len(ids) for _, ids in todo) <= PREFILL_BATCH_TOKENS:   # short prompts: one forward
                logits = self.model.forward(Batch.build(todo, self.model.device))
                rows.update({id(r): row for r, row in zip(plain, logits)})
            else:                                                                   # long ones: chunked, one by one
                rows.update({id(r): prefill(self.model, cache, ids) for r, (cache, ids) in zip(plain, todo)})
            for r in scored:
                rows[id(r)], first[id(r)] = self._prefill_with_logprobs(r)
            self.stats["prefill_s"] += time.perf_counter() - t0
            self.stats["prompt_tokens"] += sum(len(r.prompt_ids) for r in new)
            self.cached_tokens = {r.req_id: r.cached_tokens for r in new}
            self._publish(new)
            seqs, logits = [], []
            for r in new:                    # choices 1..n-1 start from a fork of choice 0's prefilled cache
                for f in r.followers:
                    f.cache = r.cache.fork()
                    f.cached_tokens = r.cached_tokens
                    first[id(f)] = first.get(id(r))
                seqs += [r, *r.followers]
                logits += [rows[id(r)]] * (1 + len(r.followers))
            self._emit(seqs, [s.advance(row[None], []) for s, row in zip(seqs, logits)], out, first)
        if decoding:
            t0 = time.perf_counter()
            if self.speculative is None:   # one token each: the plain decode forward verify() runs without drafts
                decoded = decode(self.model, [(s.cache, s.tokens[-1]) for s in decoding])            # logits (B, V)
                self._decoded(t0)
                picks = advance_all(decoding, decoded)             # the plain greedy rows: one batched argmax
            else:
                drafts = draft_all(decoding)         # MTP drafts in batched forwards
                accepted = sum(s.accepted for s in decoding)
                t1 = time.perf_counter()
                rows = verify(self.model, [(s.cache, [s.tokens[-1], *d]) for s, d in zip(decoding, drafts)])
                self.speculative.cost.observe_step(len(decoding), sum(map(len, drafts)), time.perf_counter() - t1)
                self._decoded(t0)
                picks = [s.advance(r, d) for s, r, d in zip(decoding, rows, drafts)]   # rolls rejected drafts back
            self._publish(decoding)
            self._emit(decoding, picks, out)
            if self.speculative is not None:
                st = self.stats
                st["spec_draft_tokens"] += sum(len(d) for d in drafts)
                st["spec_accepted_tokens"] += sum(s.accepted for s in decoding) - accepted
                st["spec_acceptance_rate"] = st["spec_accepted_tokens"] / max(st["spec_draft_tokens"], 1)
        self.stats.update(self.experts.stats)
        self.stats["expert_wait_s"] = self.model.timing["expert_wait_s"]
        self._count_states()
        return out

    def _decoded(self, t0: float) -> None:
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["decode_steps"] += 1

    def close(self) -> None:
        """Abort what is left, write the cached blocks to the disk tier, stop the expert threads."""
        for req_id in {*(k[0] for k in self._running), *(r.req_id for r in self._new)}:
            self.abort(req_id)
        if self.prefix_cache is not None:
            self.prefix_cache.flush()
            self.prefix_cache.close()
        self.loaded.close()


def _shared_blocks(keyed: list[list[bytes]]) -> list[int]:
    """For each request of a step: the most leading blocks it shares with another request of the step."""
    out = []
    for i, a in enumerate(keyed):
        best = 0
        for j, b in enumerate(keyed):
            if i != j:
                n = 0
                while n < min(len(a), len(b)) and a[n] == b[n]:
                    n += 1
                best = max(best, n)
        out.append(best)
    return out
