"""The engine thread of `ktrun serve`: admits requests, runs `engine.step()` in a loop (one batched decode step over
every running request), and routes each emitted token to its request's queue.

The engine is touched only from this thread. HTTP handler threads call `submit` / `abort`, which only queue work
under a lock and wake the thread. Requests beyond `max_batch` wait in FIFO order for a free slot.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field


class EngineFailure(RuntimeError):
    """The engine raised while running this request (delivered through the request's queue)."""


@dataclass
class RequestHandle:
    """A handler thread's view of one request: tokens arrive in `out` as (token, finish_reason | None);
    an exception object in `out` ends the request with that error."""

    req_id: str
    prompt_ids: list[int]
    params: object
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    submitted_at: float = field(default_factory=time.perf_counter)
    cached_tokens: int = 0        # prompt tokens the prefix cache supplied (set before the first token is queued)


class EngineThread:
    """Owns the engine: starts its thread at construction; `shutdown()` stops it."""

    def __init__(self, engine, max_batch: int):
        self.engine = engine
        self.max_batch = max(1, int(max_batch))
        self._cond = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._abort_ids: set[str] = set()
        self._running: dict[str, RequestHandle] = {}  # engine thread only (read elsewhere for metrics)
        self._stop = False
        self.aborted = 0                              # running requests stopped by abort()
        self.steps = 0
        self.step_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="ktrun-engine", daemon=True)
        self._thread.start()

    # -- called from handler threads ------------------------------------------------------------------------------
    def submit(self, req_id: str, prompt_ids: list[int], params) -> RequestHandle:
        handle = RequestHandle(req_id, list(prompt_ids), params)
        with self._cond:
            self._waiting.append(handle)
            self._cond.notify()
        return handle

    def abort(self, req_id: str) -> None:
        """Stop a request (client gone or stop string seen): frees its engine slot on the next loop turn."""
        with self._cond:
            self._abort_ids.add(req_id)
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
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
                while not (self._stop or self._waiting or self._abort_ids or self._running):
                    self._cond.wait()
                if self._stop:
                    break
                aborts, self._abort_ids = self._abort_ids, set()
                waiting_aborted = [h for h in self._waiting if h.req_id in aborts]
                for h in waiting_aborted:
                    self._waiting.remove(h)
                admit = []
                while self._waiting and len(self._running) + len(admit) < self.max_batch:
                    admit.append(self._waiting.popleft())
            for req_id in aborts:
                self._abort_running(req_id)
            for h in admit:
                self._admit(h)
            if self._running:
                self._step()
        for req_id in list(self._running):
            self._abort_running(req_id)
        self._flush_prefix_cache()

    def _flush_prefix_cache(self) -> None:
        """At shutdown, on this thread (the engine's only one): cached KV blocks to the disk tier, for a warm restart."""
        flush = getattr(self.engine, "flush_prefix_cache", None)
        if flush is not None:
            try:
                flush()
            except Exception:  # noqa: BLE001 -- a cache that cannot be saved must not turn a shutdown into a crash
                traceback.print_exc()

    def _abort_running(self, req_id: str, count: bool = True) -> None:
        handle = self._running.pop(req_id, None)
        if handle is None:
            return  # already finished (or never admitted)
        try:
            self.engine.abort(req_id)
        except Exception:  # noqa: BLE001 -- the slot is gone either way; one request never kills the loop
            traceback.print_exc()
        if count:
            self.aborted += 1

    def _admit(self, handle: RequestHandle) -> None:
        try:
            self.engine.add_request(handle.req_id, handle.prompt_ids, handle.params)
        except Exception as e:  # noqa: BLE001 -- any refusal goes back to that request's handler
            handle.out.put(e)
            return
        self._running[handle.req_id] = handle

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 -- fail the running requests, keep serving the next ones
            traceback.print_exc()
            failure = EngineFailure(f"engine step failed: {type(e).__name__}: {e}")
            for req_id in list(self._running):
                self._running[req_id].out.put(failure)
                self._abort_running(req_id, count=False)
            return
        self.step_seconds += time.perf_counter() - t0
        self.steps += 1
        cached = getattr(self.engine, "cached_tokens", None) or {}  # requests this step prefilled
        for req_id, token, finish_reason in outputs:
            handle = self._running.get(req_id)
            if handle is None:
                continue  # aborted while this step ran
            if req_id in cached:
                handle.cached_tokens = int(cached[req_id])
            handle.out.put((int(token), finish_reason))
            if finish_reason is not None:
                del self._running[req_id]
        if self._running and not self.engine.has_work():  # never spin on requests the engine no longer holds
            for req_id in list(self._running):
                self._running.pop(req_id).out.put(EngineFailure("the engine dropped this request unfinished"))
