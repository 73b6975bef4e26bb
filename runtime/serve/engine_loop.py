"""The engine's turns on the server's event loop: admit requests, run `engine.step()` (one batched step over every
running request), route each emitted token to its request.

Why on the event loop and not in a thread of its own: the step holds the interpreter between its ~30 C and torch
calls, and gives it up in every one of them. Beside a busy event loop (an SSE write per token per stream) each return
waited for the loop to hand the interpreter back: on 2 cores at 16 streams the default model's served step took 9-13
ms against 2.9 ms alone; on the loop (the writes after it) the output rate was 1.26x at 1 agent client and 1.14x at
16, the same at 4, TTFT p50 at 16 clients 43 against 58 ms (bench/README.md, "the engine's steps on the event loop").
A step with a long prefill (INLINE_PREFILL_SECONDS) runs in a thread of its own instead, so that a long prompt does not
stop the loop: it answers /health, takes new requests and parses them meanwhile.

The engine is touched only by the running turn (on the loop, or in a prefill thread while the loop waits for
it); `submit` / `abort` (event loop only) just queue work and make sure a turn is coming. Requests beyond
`max_batch` sequences (a request with n choices holds n) wait in FIFO order for free slots. After each step,
everything it produced goes to the requests' inboxes at once (`handle.sink.put_nowait([items...])`); an item is a
Token, or an exception that ends the request.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
import traceback
from dataclasses import dataclass, field

# A step whose prefill is expected to take longer (its uncached prompt tokens x the measured seconds per token; the
# first prefill always) runs in a thread of its own. Shorter ones run on the loop: beside a loop that is parsing the
# requests that came with them, a prefill in a thread waits for the interpreter as a decode step did (the default
# model at 16 agent clients on Zen 3: TTFT p50 46-59 ms on the loop against 94-127 ms in a thread).
INLINE_PREFILL_SECONDS = 0.05


class EngineFailure(RuntimeError):
    """The engine raised while running this request (delivered like a token)."""


@dataclass
class Token:
    """One emitted token of choice `index`; finish_reason set on its last. logprobs / prompt_logprobs when asked."""
    token: int
    finish_reason: str | None
    index: int = 0
    logprobs: object = None
    prompt_logprobs: object = None
    t: float = 0.0                       # perf_counter when the step that made it returned
    drafted: int = 0                     # speculative decoding: the choice's drafted / accepted tokens so far
    accepted: int = 0


@dataclass
class RequestHandle:
    """The server's view of one request; its items go to `sink` (put_nowait(list of items))."""

    req_id: str
    prompt_ids: list[int]
    params: object
    sink: object
    n: int = 1
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None     # got its engine slot(s)
    open_choices: set = field(default_factory=set)   # choice indices still generating
    cached_tokens: int = 0               # prompt tokens the prefix cache supplied (set before its first token goes out)


class EngineLoop:
    """Drives `engine` from the event loop `loop`: a turn is queued whenever there is work, one step per turn."""

    def __init__(self, engine, max_batch: int, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.max_batch = max(1, int(max_batch))
        self.loop = loop
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._aborts: list[tuple[str, int | None]] = []
        self._running: dict[str, RequestHandle] = {}
        self._queued = False                 # a turn is queued on the loop, or a step runs in a prefill thread
        self._stopped = False
        self._offloaded: concurrent.futures.Future | None = None   # the step running in a prefill thread
        self._prefill_rate: float | None = None   # seconds per prompt token of the steps that prefilled (averaged)
        self.aborted = 0                     # running requests stopped by abort()
        self.steps = 0
        self.step_seconds = 0.0

    # -- called from the event loop's requests -------------------------------------------------------------------
    def submit(self, req_id: str, prompt_ids: list[int], params, sink) -> RequestHandle:
        handle = RequestHandle(req_id, list(prompt_ids), params, sink, max(1, int(getattr(params, "n", 1))))
        self._waiting.append(handle)
        self._queue_turn()
        return handle

    def abort(self, req_id: str, index: int | None = None) -> None:
        """Stop a request (client gone), or one of its choices (a stop string seen): frees its engine slot(s) on the
        next turn."""
        self._aborts.append((req_id, index))
        self._queue_turn()

    def shutdown(self, timeout: float = 30.0, flush: bool = True) -> None:
        """After the event loop has stopped: abort what runs and write the prefix cache to its disk tier (hence the
        wait). flush=False: no cache write (a forced exit does not wait for it)."""
        self._stopped = True
        if self._offloaded is not None:   # a prefill thread still running: the engine is its until it ends
            done, _ = concurrent.futures.wait([self._offloaded], timeout)
            if not done:
                return
        for req_id in list(self._running):
            self._abort_running(req_id)
        if flush:
            self._flush_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- the turns -----------------------------------------------------------------------------------------------
    def _queue_turn(self) -> None:
        if not self._queued and not self._stopped:
            self._queued = True
            self.loop.call_soon(self._turn)

    def _turn(self) -> None:
        """Aborts, admissions, then one step: on the loop, or in a prefill thread when its prefill is long."""
        self._queued = False
        if self._stopped:
            return
        aborts, self._aborts = self._aborts, []
        gone = {rid for rid, index in aborts if index is None}
        if gone:
            self._waiting = collections.deque(h for h in self._waiting if h.req_id not in gone)
        for req_id, index in aborts:
            self._abort_running(req_id, index)
        admitted, used = [], sum(h.n for h in self._running.values())
        while self._waiting and used + self._waiting[0].n <= self.max_batch:
            handle = self._waiting.popleft()
            if self._admit(handle):
                admitted.append(handle)
                used += handle.n
        if self._waiting and not self._running:   # n > max_batch never fits: refuse it
            h = self._waiting.popleft()
            self._deliver([(h, [ValueError(f"n={h.n} is more than --max-batch {self.max_batch}")])])
        if not self._running:
            if self._waiting:
                self._queue_turn()
            return
        self._queued = True                       # until this step's outputs are out
        tokens = sum(self._uncached(h) for h in admitted)
        if tokens and (self._prefill_rate is None or tokens * self._prefill_rate > INLINE_PREFILL_SECONDS):
            self._offloaded = concurrent.futures.Future()
            # a daemon thread per long prefill (~0.1 ms to start, against 50 ms and more): a forced exit does not
            # wait for it, as it would for an executor's worker
            threading.Thread(target=self._offloaded_step, args=(self._offloaded, tokens), name="ktrun-prefill",
                             daemon=True).start()
        else:
            self._after_step(*self._timed_step(tokens))

    def _offloaded_step(self, future: concurrent.futures.Future, tokens: int) -> None:   # in the prefill thread
        future.set_result(self._timed_step(tokens))
        try:
            self.loop.call_soon_threadsafe(self._after_offloaded, future)
        except RuntimeError:   # the loop has closed (shutting down): nobody is waiting for these
            pass

    def _after_offloaded(self, future: concurrent.futures.Future) -> None:
        self._offloaded = None
        if not self._stopped:
            self._after_step(*future.result())

    def _uncached(self, handle: RequestHandle) -> int:
        """The prompt tokens the request's prefill computes (asked for prompt logprobs: all of them)."""
        peek = getattr(self.engine, "uncached_tokens", None)
        if peek is None or getattr(handle.params, "prompt_logprobs", None) is not None:
            return len(handle.prompt_ids)
        return peek(handle.prompt_ids)

    def _timed_step(self, prefill_tokens: int = 0) -> tuple[list | BaseException, float]:
        """engine.step(); a step that prefilled updates the seconds-per-token estimate -> (outputs or the
        exception, when it returned)."""
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
            rest = getattr(self.engine, "rest_kernels", None)
            if rest is not None:   # the streams' writes and the clients need the cores until the next step
                rest()
        except Exception as e:  # noqa: BLE001 -- fail the running requests, keep serving the next ones
            traceback.print_exc()
            return e, time.perf_counter()
        t1 = time.perf_counter()
        self.step_seconds += t1 - t0
        self.steps += 1
        if prefill_tokens:
            rate = (t1 - t0) / prefill_tokens
            self._prefill_rate = rate if self._prefill_rate is None else 0.5 * (self._prefill_rate + rate)
        return outputs, t1

    def _after_step(self, outputs: list | BaseException, t1: float) -> None:
        self._queued = False
        if isinstance(outputs, BaseException):
            failure = EngineFailure(f"engine step failed: {type(outputs).__name__}: {outputs}")
            batch = [(h, [failure]) for h in self._running.values()]
            for req_id in list(self._running):
                self._abort_running(req_id, count=False)
            self._deliver(batch)
        else:
            self._route(outputs, t1)
        if self._running or self._waiting or self._aborts:
            # the next turn one loop iteration later than the tasks this delivery woke: they write, then wait a whole
            # iteration for their next items, and what the loop does for a waiting task happens then (anyio cancels
            # a task only while its wait is pending: a stream whose client left would else never be cancelled)
            self._queued = True
            self.loop.call_soon(self.loop.call_soon, self._turn)

    def _route(self, outputs: list, t1: float) -> None:
        per_handle: dict[str, tuple[RequestHandle, list]] = {}
        cached = getattr(self.engine, "cached_tokens", None) or {}  # requests this step prefilled
        for out in outputs:
            req_id, token, finish_reason = out
            handle = self._running.get(req_id)
            if handle is None:
                continue  # aborted while this step ran
            if req_id in cached:
                handle.cached_tokens = int(cached[req_id])
            item = Token(int(token), finish_reason, getattr(out, "index", 0), getattr(out, "logprobs", None),
                         getattr(out, "prompt_logprobs", None), t1, getattr(out, "drafted", 0),
                         getattr(out, "accepted", 0))
            per_handle.setdefault(req_id, (handle, []))[1].append(item)
            if finish_reason is not None:
                handle.open_choices.discard(item.index)
                if not handle.open_choices:
                    del self._running[req_id]
        if self._running and not self.engine.has_work():  # never spin on requests the engine no longer holds
            for req_id in list(self._running):
                h = self._running.pop(req_id)
                per_handle.setdefault(req_id, (h, []))[1].append(EngineFailure("the engine dropped this request "
                                                                               "unfinished"))
        if per_handle:
            self._deliver(list(per_handle.values()))

    @staticmethod
    def _deliver(batch: list[tuple[RequestHandle, list]]) -> None:
        for handle, items in batch:
            handle.sink.put_nowait(items)

    def _admit(self, handle: RequestHandle) -> bool:
        try:
            self.engine.add_request(handle.req_id, handle.prompt_ids, handle.params)
        except Exception as e:  # noqa: BLE001 -- any refusal goes back to that request
            self._deliver([(handle, [e])])
            return False
        handle.admitted_at = time.perf_counter()
        handle.open_choices = set(range(handle.n))
        self._running[handle.req_id] = handle
        return True

    def _abort_running(self, req_id: str, index: int | None = None, count: bool = True) -> None:
        handle = self._running.get(req_id)
        if handle is None:
            return  # already finished (or never admitted)
        try:
            if index is None:
                self.engine.abort(req_id)
            else:
                self.engine.abort(req_id, index)
        except Exception:  # noqa: BLE001 -- the slot is gone either way; one request never kills the loop
            traceback.print_exc()
        handle.open_choices.discard(index)
        if index is None or not handle.open_choices:
            del self._running[req_id]
            if count:
                self.aborted += 1

    def _flush_prefix_cache(self) -> None:
        """At shutdown: cached KV blocks to the disk tier, for a warm restart."""
        flush = getattr(self.engine, "flush_prefix_cache", None)
        if flush is not None:
            try:
                flush()
            except Exception:  # noqa: BLE001 -- a cache that cannot be saved must not turn a shutdown into a crash
                traceback.print_exc()
