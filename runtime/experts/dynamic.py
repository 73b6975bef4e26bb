"""Dynamic hot-expert placement while serving (`--dynamic-experts`): a windowed frequency count with hysteresis,
swaps done off the critical path.

- Counting: every submit adds the layer's routed ids to a window of the last `window` tokens (per layer).
- Deciding (between steps): in each layer without a swap in flight, the most-called expert on the CPU replaces the
  least-called resident one when its window count beats that by the hysteresis factor and a minimum gap
  (`c_in > (1 + hysteresis) * c_out + min_gap`); a layer with fewer resident experts than its capacity takes the
  candidate without evicting. One swap per layer at a time.
- Swapping: the new expert is packed on the host and copied into a free (spare) slot by a background thread (on
  CUDA on a side stream, after the slot's last reader finished); the swap takes effect only when that copy is
  complete, at the next step boundary: resident set and kernel mask change together, between two steps. A step
  never waits for a copy: an unfinished one is looked at again at the next boundary.
"""
from __future__ import annotations

import sys
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch


class WindowedCounts:
    """Routed calls per (layer, expert) over the most recent `window` tokens of each layer."""

    def __init__(self, layers, n_experts: int, window: int):
        self.n_experts, self.window = n_experts, max(1, int(window))
        self.sum = {L: np.zeros(n_experts, dtype=np.float64) for L in layers}
        self._steps = {L: deque() for L in layers}
        self._tokens = dict.fromkeys(layers, 0)

    def add(self, layer: int, ids: np.ndarray) -> None:
        """ids: (T, k) expert ids of one submit (< 0: not routed)."""
        flat = ids[ids >= 0].ravel()
        c = np.bincount(flat, minlength=self.n_experts).astype(np.float64)
        q = self._steps[layer]
        q.append((ids.shape[0], c))
        self.sum[layer] += c
        self._tokens[layer] += ids.shape[0]
        while len(q) > 1 and self._tokens[layer] - q[0][0] >= self.window:   # keep at least `window` tokens
            t, old = q.popleft()
            self.sum[layer] -= old
            self._tokens[layer] -= t


@dataclass
class _Swap:
    layer: int
    e_in: int
    e_out: int | None
    slot: int
    future: Future | None = None
    event: object = None           # torch.cuda.Event of the copy (CUDA only)
    done_sync: bool = False        # copied synchronously (asynchronous=False)


class DynamicExperts:
    """Registered as a before-step hook of ktrun.experts.hybrid.HybridExperts (which calls observe on every submit)."""

    def __init__(self, store, residency, capacity: dict[int, int], window: int = 2048, hysteresis: float = 0.25,
                 min_gap: float = 2.0, asynchronous: bool = True):
        self.store, self.residency, self.capacity = store, residency, dict(capacity)
        self.counts = WindowedCounts(residency.layers, residency.n_experts, window)
        self.hysteresis, self.min_gap = float(hysteresis), float(min_gap)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ktrun-expert-swap") if asynchronous else None
        cuda = store.device.type == "cuda"
        self._stream = torch.cuda.Stream(store.device) if cuda else None
        self._slot_free_event: dict[tuple[int, int], object] = {}   # (layer, slot) -> event after its last reader
        self.inflight: dict[int, _Swap] = {}
        self.swaps = 0
        self.failed = 0
        self.log: list[tuple[int, int, int, int | None]] = []       # (step it took effect, layer, e_in, e_out)

    # -- called by HybridExperts ---------------------------------------------------------------------------------
    def observe(self, layer: int, ids: np.ndarray) -> None:
        self.counts.add(layer, ids)

    def __call__(self, step: int) -> None:
        """Between steps: flip the swaps whose copy is complete, then start new ones. Never waits."""
        self._flip_ready(step)
        self._decide()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- internals ---------------------------------------------------------------------------------------------
    def _flip_ready(self, step: int) -> None:
        for layer, sw in list(self.inflight.items()):
            if not sw.done_sync:
                if not sw.future.done():
                    continue
                err = sw.future.exception()
                if err is not None:                      # the copy failed: the expert stays where it was
                    print(f"ktrun: hot-expert copy of layer {layer} expert {sw.e_in} failed: {err}", file=sys.stderr)
                    self.residency.give_back(layer, sw.slot)
                    self.failed += 1
                    del self.inflight[layer]
                    continue
                sw.event = sw.future.result()
                if sw.event is not None and not sw.event.query():
                    continue
            self.residency.place(layer, sw.e_in, sw.slot)
            if sw.e_out is not None:
                old = self.residency.evict(layer, sw.e_out)
                if self._stream is not None:              # the next copy into `old` waits for this step's readers
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.store.device))
                    self._slot_free_event[(layer, old)] = ev
            self.swaps += 1
            self.log.append((step, layer, sw.e_in, sw.e_out))
            del self.inflight[layer]

    def _decide(self) -> None:
        skip = self.residency.skip
        for layer in self.residency.layers:
            cap = self.capacity.get(layer, 0)
            if layer in self.inflight or cap == 0:
                continue
            win, resident = self.counts.sum[layer], skip[layer].astype(bool)
            cand = np.where(resident, -np.inf, win)
            c = int(np.argmax(cand))
            if not np.isfinite(cand[c]) or win[c] <= 0:
                continue
            if resident.sum() < cap:
                out = None
            else:
                r = int(np.argmin(np.where(resident, win, np.inf)))
                if not win[c] > (1.0 + self.hysteresis) * win[r] + self.min_gap:
                    continue
                out = r
            slot = self.residency.take_free(layer)
            if slot is None:
                continue
            sw = _Swap(layer, c, out, slot)
            if self._pool is None:
                self.store.load(layer, slot, c)
                sw.done_sync = True
            else:
                sw.future = self._pool.submit(self._copy, layer, slot, c)
            self.inflight[layer] = sw

    def _copy(self, layer: int, slot: int, e: int):
        """Background thread: pack expert e and copy it into the free slot; -> a CUDA event or None."""
        host = self.store.pack(layer, e)
        if self._stream is None:
            self.store.upload(layer, slot, host)
            return None
        with torch.cuda.stream(self._stream):
            ev = self._slot_free_event.pop((layer, slot), None)
            if ev is not None:
                self._stream.wait_event(ev)
            self.store.upload(layer, slot, host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        return done
