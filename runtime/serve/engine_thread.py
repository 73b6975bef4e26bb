"""The engine thread of `ktrun serve`: admits requests, runs `engine.step()` in a loop (one batched decode step over
every running request), and routes each emitted token to its request.

The engine is touched only from this thread. The HTTP side (the asyncio event loop) calls `submit` / `abort`, which
only queue work under a lock and wake the thread. Requests beyond `max_batch` sequences (a request with n choices
holds n) wait in FIFO order for free slots. After each step, everything that step produced goes out in ONE call of
`publish([(handle, [items...]), ...])` (the server hands that to its event loop with one call_soon_threadsafe); an
item is a Token, or an exception that ends the request.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field


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
    """The server's view of one request. Without a publish callback, items arrive in `out`."""

    req_id: str
    prompt_ids: list[int]
    params: object
    n: int = 1
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    sink: object = None                  # set by the server: where its event loop puts this request's items
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None     # got its engine slot(s)
    open_choices: set = field(default_factory=set)   # choice indices still generating (engine thread)
    cached_tokens: int = 0               # prompt tokens the prefix cache supplied (set before its first token goes out)


def _queue_publish(batch) -> None:
    for handle, items in batch:
        for item in items:
            handle.out.put(item)


class EngineThread:
    """Owns the engine: starts its thread at construction; `shutdown()` stops it."""

    def __init__(self, engine, max_batch: int, publish: Callable[[list], None] | None = None):
        self.engine = engine
        self.max_batch = max(1, int(max_batch))
        self.publish = publish or _queue_publish
        self._cond = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._aborts: list[tuple[str, int | None]] = []
        self._running: dict[str, RequestHandle] = {}  # engine thread only (read elsewhere for metrics)
        self._stop = False
        self._flush = True
        self.aborted = 0                              # running requests stopped by abort()
        self.steps = 0
        self.step_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="ktrun-engine", daemon=True)
        self._thread.start()

    # -- called from the server ----------------------------------------------------------------------------------
    def submit(self, req_id: str, prompt_ids: list[int], params, sink=None) -> RequestHandle:
        handle = RequestHandle(req_id, list(prompt_ids), params, max(1, int(getattr(params, "n", 1))), sink=sink)
        with self._cond:
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def abort(self, req_id: str, index: int | None = None) -> None:
        """Stop a request (client gone), or one of its choices (a stop string seen): frees its engine slot(s) on the
        next loop turn."""
        with self._cond:
            self._aborts.append((req_id, index))
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0, flush: bool = True) -> None:
        """Stop the loop; it aborts what runs and writes the prefix cache to its disk tier first (hence the wait).
        flush=False: no cache write (a forced exit does not wait for it)."""
        with self._cond:
            self._stop = True
            self._flush = flush
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # -- engine thread --------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._waiting or self._aborts or self._running):
                    self._cond.wait()
                if self._stop:
                    break
                aborts, self._aborts = self._aborts, []
                gone = {rid for rid, index in aborts if index is None}
                for h in [h for h in self._waiting if h.req_id in gone]:
                    self._waiting.remove(h)
                admit, used = [], sum(h.n for h in self._running.values())
                while self._waiting and used + self._waiting[0].n <= self.max_batch:
                    admit.append(self._waiting.popleft())
                    used += admit[-1].n
                if self._waiting and not self._running and not admit:   # n > max_batch never fits: refuse it
                    h = self._waiting.popleft()
                    self.publish([(h, [ValueError(f"n={h.n} is more than --max-batch {self.max_batch}")])])
            for req_id, index in aborts:
                self._abort_running(req_id, index)
            for h in admit:
                self._admit(h)
            if self._running:
                self._step()
        for req_id in list(self._running):
            self._abort_running(req_id)
        if self._flush:
            self._flush_prefix_cache()

    def _flush_prefix_cache(self) -> None:
        """At shutdown, on this thread (the engine's only one): cached KV blocks to the disk tier, for a warm restart."""
        flush = getattr(self.engine, "flush_prefix_cache", None)
        if flush is not None:
            try:
                flush()
            except Exception:  # noqa: BLE001 -- a cache that cannot be saved must not turn a shutdown into a crash
                traceback.print_exc()

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

    def _admit(self, handle: RequestHandle) -> None:
        try:
            self.engine.add_request(handle.req_id, handle.prompt_ids, handle.params)
        except Exception as e:  # noqa: BLE001 -- any refusal goes back to that request
            self.publish([(handle, [e])])
            return
        handle.admitted_at = time.perf_counter()
        handle.open_choices = set(range(handle.n))
        self._running[handle.req_id] = handle

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- fail the running requests, keep serving the next ones
            traceback.print_exc()
            failure = EngineFailure(f"engine step failed: {type(e).__name__}: {e}")
            batch = [(h, [failure]) for h in self._running.values()]
            for req_id in list(self._running):
                self._abort_running(req_id, count=False)
            self.publish(batch)
            return
        t1 = time.perf_counter()
        self.step_seconds += t1 - t0
        self.steps += 1
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
            self.publish(list(per_handle.values()))
