"""serve.engine_loop.EngineLoop on a real asyncio loop (and uvloop, which `ktrun serve` runs on) with a counting engine:
decode steps and short prefills run on the loop's thread, the first and long prefills in a thread of their own while
the loop keeps serving its other callbacks, max_batch and FIFO admission hold, refusals and failures reach their
request, and a task reading its inbox is cancellable while the steps keep coming (anyio cancels a task only while its
wait is pending: the engine's turns must leave it one)."""
from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest
from ktrun.serve.engine_loop import EngineFailure, EngineLoop, Token
from ktrun.serve.generation import Inbox


class CountingEngine:
    """Each running request gets token = its step count; a request ends after `length` tokens. Records the thread of
    every step and whether it prefilled."""

    def __init__(self, length: int = 5, prefill_seconds: float = 0.0, fail_on: str | None = None):
        self.length, self.prefill_seconds, self.fail_on = length, prefill_seconds, fail_on
        self.running: dict[str, int] = {}
        self.new: list[str] = []
        self.steps: list[tuple[int, bool, int]] = []   # (thread id, prefilled, rows)
        self.cached_tokens: dict = {}

    def add_request(self, req_id, prompt_ids, params):
        if not prompt_ids:
            raise ValueError("empty prompt")
        self.running[req_id] = 0
        self.new.append(req_id)

    def abort(self, req_id, index=None):
        self.running.pop(req_id, None)

    def has_work(self):
        return bool(self.running)

    def step(self):
        prefilled, self.new = bool(self.new), []
        if prefilled and self.prefill_seconds:
            time.sleep(self.prefill_seconds)
        if self.fail_on in self.running:
            raise RuntimeError("injected failure")
        self.steps.append((threading.get_ident(), prefilled, len(self.running)))
        out = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] == self.length
            out.append((rid, self.running[rid], "length" if done else None))
            if done:
                del self.running[rid]
        return out


class Params:
    n = 1


async def collect(box: Inbox) -> list:
    got = []
    while True:
        for item in await box.get():
            got.append(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                return got


def run(main, backend: str):
    if backend == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run(main())
    return asyncio.run(main())


@pytest.fixture(params=["asyncio", "uvloop"])
def backend(request) -> str:
    return request.param


def test_decode_on_the_loop_prefill_off_it(backend):
    engine = CountingEngine(length=4, prefill_seconds=0.05)

    async def main():
        loop = asyncio.get_running_loop()
        el = EngineLoop(engine, max_batch=8, loop=loop)
        ticks = 0

        async def ticker():                  # the loop's other work goes on while a prefill runs
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        t = asyncio.ensure_future(ticker())
        boxes = [Inbox() for _ in range(3)]
        for i, box in enumerate(boxes):
            el.submit(f"r{i}", [1, 2], Params(), box)
        results = await asyncio.gather(*(collect(b) for b in boxes))
        t.cancel()
        el.shutdown()
        return threading.get_ident(), ticks, results, el

    loop_thread, ticks, results, el = run(main, backend)
    assert [[(x.token, x.finish_reason) for x in r] for r in results] == [[(1, None), (2, None), (3, None),
                                                                           (4, "length")]] * 3
    assert all(isinstance(x, Token) for r in results for x in r)
    assert [(p, rows) for _, p, rows in engine.steps] == [(True, 3), (False, 3), (False, 3), (False, 3)]
    assert all((tid != loop_thread) == prefilled for tid, prefilled, _ in engine.steps)
    assert ticks >= 5            # 50 ms of prefill off the loop: its 5 ms ticker kept running
    assert el.steps == 4 and el.num_running == 0 and el.num_waiting == 0


def test_max_batch_and_fifo_admission(backend):
    engine = CountingEngine(length=2)

    async def main():
        el = EngineLoop(engine, max_batch=2, loop=asyncio.get_running_loop())
        boxes = [Inbox() for _ in range(5)]
        for i, box in enumerate(boxes):
            el.submit(f"r{i}", [1], Params(), box)
        await asyncio.gather(*(collect(b) for b in boxes))

    run(main, backend)
    assert max(rows for _, _, rows in engine.steps) == 2
    assert len(engine.steps) == 6          # pairs (r0 r1) (r2 r3) (r4), two steps each


def test_refusals_and_failures_go_to_their_request(backend):
    engine = CountingEngine(length=3, fail_on="bad")

    async def main():
        el = EngineLoop(engine, max_batch=2, loop=asyncio.get_running_loop())
        empty, big, bad = Inbox(), Inbox(), Inbox()
        el.submit("empty", [], Params(), empty)        # add_request refuses it
        wide = Params()
        wide.n = 3
        el.submit("big", [1], wide, big)               # n > max_batch
        got = [await collect(empty), await collect(big)]
        el.submit("bad", [1], Params(), bad)           # its step raises
        got.append(await collect(bad))
        good = Inbox()
        el.submit("good", [1], Params(), good)         # the loop goes on serving
        got.append(await collect(good))
        return got

    empty, big, bad, good = run(main, backend)
    assert isinstance(empty[0], ValueError) and "empty prompt" in str(empty[0])
    assert isinstance(big[0], ValueError) and "max-batch" in str(big[0])
    assert isinstance(bad[0], EngineFailure) and "injected failure" in str(bad[0])
    assert [x.token for x in good] == [1, 2, 3]


def test_a_reading_task_is_cancellable_while_steps_keep_coming(backend):
    engine = CountingEngine(length=10_000)

    async def main():
        el = EngineLoop(engine, max_batch=4, loop=asyncio.get_running_loop())
        box, seen = Inbox(), []

        async def read():
            while True:
                seen.extend(await box.get())

        with anyio.move_on_after(5):
            async with anyio.create_task_group() as tg:     # as Starlette's StreamingResponse does
                tg.start_soon(read)
                el.submit("r", [1], Params(), box)
                while len(seen) < 3:
                    await asyncio.sleep(0.001)
                tg.cancel_scope.cancel()
        el.abort("r")
        await asyncio.sleep(0.01)
        return seen, el

    seen, el = run(main, backend)
    assert 3 <= len(seen) < 1000, len(seen)     # cancelled within a few steps, not at the 5 s deadline
    assert el.num_running == 0 and not engine.running


def test_short_prefills_on_the_loop_long_ones_off_it(backend):
    """The first prefill runs in a thread and measures seconds per prompt token; then a prefill expected under
    INLINE_PREFILL_SECONDS runs on the loop, a longer one in a thread. The engine's own uncached_tokens (its
    prefix cache's hit left out) is what counts when it has one, the whole prompt for prompt logprobs."""
    engine = CountingEngine(length=1, prefill_seconds=0.02)
    engine.uncached_tokens = lambda ids: len(ids) - ids.count(0)      # a 0 stands for a cached token

    async def main():
        el = EngineLoop(engine, max_batch=8, loop=asyncio.get_running_loop())
        scored = Params()
        scored.prompt_logprobs = 1                                         # prefills its whole prompt
        for prompt, params in (([1, 2], Params()), ([1], Params()), ([0] * 50 + [1], Params()), ([1] * 10, Params()),
                               ([1], Params()), ([0] * 50 + [1], scored)):     # 10 ms / token measured first
            box = Inbox()
            el.submit("r", prompt, params, box)
            await collect(box)
        return threading.get_ident()

    loop_thread = run(main, backend)
    assert [tid != loop_thread for tid, _, _ in engine.steps] == [True, False, False, True, False, True]
