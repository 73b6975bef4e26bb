"""ExpertRamTier: routed experts held in RAM under an explicit byte budget, the rest read from the expert files on
demand, whole experts at a time (`ktrun ... --expert-ram SIZE`, for models larger than RAM).

How the kernels see it: each expert file gets a *mirror*, an anonymous private mapping of the file's size in which
every byte sits at its file offset. The kernels are handed the same (E, ...) tensor views as with the file memmaps
(ktrun.loader), only into the mirror: the same kernels read the same bytes, so outputs are bit-identical to the
all-in-RAM run. A mirror costs address space only; RAM is spent on the pages of resident experts:

  load(expert)   its byte ranges (gate/up/down qweight and scales, every NUMA shard) widened to whole 4 KiB pages,
                 merged, and read straight into the mirror at the same offsets (pread into the mapping; with
                 O_DIRECT when the file system allows, so the page cache does not hold a second copy). A widened
                 page may cover a neighbour's bytes: the file's own bytes, so a resident neighbour is unchanged.
  evict(expert)  madvise(MADV_DONTNEED) on the pages no other resident or loading expert touches (a per-page
                 reference count): the pages go back to the kernel; they read as zeros until loaded again.
  budget         resident + in-flight pages x 4 KiB <= budget_bytes, always (checked before each read is issued;
                 `measured_resident_bytes()` asks the kernel which mirror pages are resident: mincore(2)).
                 Transparent huge pages are disabled on the mirrors (a 2 MiB page would break page accounting).

Which experts stay: eviction takes the unpinned resident expert with the lowest routed-call count (learned online,
seeded from an activation profile if given), the least recently used first among equals. The experts of the layer
being computed are pinned until its kernels are done; a layer's experts must fit the budget together (prefill can
route to all of them), else TierError says how much is needed.

Reads run on `io_threads` threads (several reads in flight; the GIL is released while reading). `ensure()` issues
the missing experts of a layer and returns a waiter (adjacent experts' small spans merged into shared reads);
`prefetch()` issues predicted experts without ever waiting for room (it evicts only what nobody pinned), and their
reads start only while no demand read runs or waits; a prefetch its layer then does not want is cancelled while none
of its reads has started. `ensure_each()` gives one future per missing expert, so a caller computes on each as it
lands. Stats (bytes read, split into demand / prefetched / prefetched-then-used, disk time, hits, prefetch use) are in
`stats()`.

Why threads and not io_uring: os.preadv releases the GIL, so a few reader threads keep that many O_DIRECT reads in
flight from Python with no new dependency (the standard library has no io_uring, and a binding would be a package
to install and a kernel feature to probe); on the measured disk the reader alone ran at 0.55-0.9 of its sequential
rate unthrottled and at it throttled (bench/bench_expert_tier.py prints the two side by side), so submission cost is
not what limits decode.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import heapq
import itertools
import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ktlayouts.converted_dir import PROJECTIONS, expert_file, expert_tensor, safe_relpath

PAGE = mmap.PAGESIZE
PREFETCH_WINDOW = 64                  # prefetch outcomes remembered
PREFETCH_MIN_USE = 0.5                # below this share used (or below the disk's busy share), prefetch only
#                                       probes: one expert ...
PROBE_LOADS = 32                      # ... once per this many demand loads (a probe adds at most ~3% to the reads)
WAIT_MIN = 0.05                       # ... and also while callers waited on reads less than this share of the time
BUSY_EMA = 0.1                        # weight of the newest interval in the recent busy / wait shares
CHUNK_PAGES = 512                     # reads of at most 2 MiB: one expert is several reads in flight
MERGE_PAGES = 64                      # adjacent experts' spans are merged into reads of up to 256 KiB: small reads
#                                       (scales, small experts) become fewer larger ones, while an expert's large
#                                       code spans stay its own, so each expert still lands as early as it can
PREFETCH_CHUNK_PAGES = 64             # prefetch reads of at most 256 KiB, one at a time and only while no demand
#                                       read runs: a demand read arriving then waits behind at most one of them (a
#                                       read already submitted is not overtaken: the disk, or a throttled cgroup's
#                                       queue, serves them in order)
IO_MODES = ("direct", "pread")
ABSENT, LOADING, RESIDENT = 0, 1, 2


class TierError(ValueError):
    """The RAM tier cannot do what was asked (a budget too small for one layer, an expert file that cannot be
    read); the message names the flag or the file."""


def _page_range(begin: int, end: int) -> tuple[int, int]:
    return begin // PAGE, -(-end // PAGE)


@dataclass
class _Mirror:
    """An expert file's anonymous mirror: buffer, reference count per page, file descriptors."""
    path: Path
    size: int
    buf: mmap.mmap
    refs: np.ndarray                  # (n_pages,) uint16: resident or loading experts touching the page
    fd: int                           # the descriptor reads go through (O_DIRECT when available)
    direct: bool
    view: memoryview = field(init=False)

    def __post_init__(self):
        self.view = memoryview(self.buf)

    @property
    def address(self) -> int:
        return np.frombuffer(self.buf, dtype=np.uint8, count=1).ctypes.data


class ExpertRamTier:
    def __init__(self, converted, budget_bytes: int, io: str = "direct", io_threads: int = 4,
                 profile_counts: dict[int, np.ndarray] | None = None):
        if io not in IO_MODES:
            raise ValueError(f"io={io!r}: use one of {', '.join(IO_MODES)}")
        geo, manifest, root = converted.geometry, converted.manifest, converted.root
        self.geometry = geo
        self.layers = list(geo.moe_layers)
        self.n_experts = geo.n_experts
        self._li = {L: i for i, L in enumerate(self.layers)}
        self.budget_pages = int(budget_bytes) // PAGE
        self.budget_bytes = self.budget_pages * PAGE
        self.io = io
        self._mirrors: list[_Mirror] = []
        # per global expert g = layer_index * E + e: its page spans [(mirror, p0, p1)] (merged, sorted)
        self._spans: list[list[tuple[int, int, int]]] = []
        self.mirror_layers: dict[int, list[dict]] = {}     # the shape of ConvertedModel.experts, into the mirrors
        E = geo.n_experts
        for L in self.layers:
            shards, spans_by_e = [], [[] for _ in range(E)]
            for s in range(geo.numa_nodes):
                rel = expert_file(L, s, geo.numa_nodes)
                m = self._open_mirror(safe_relpath(root, rel), manifest["files"][rel]["size"], io)
                mi = len(self._mirrors)
                self._mirrors.append(m)
                listed = manifest["files"][rel]["tensors"]
                shard = {}
                for p in PROJECTIONS:
                    qw, sc, geom = converted.experts[L][s][p]
                    views = []
                    for a, name in ((qw, expert_tensor(p, "qweight")), (sc, expert_tensor(p, "scales"))):
                        if a is None:
                            views.append(None)
                            continue
                        t = listed[name]
                        off, nbytes = int(t["offset"]), int(t["nbytes"])
                        views.append(np.frombuffer(m.buf, dtype=np.uint8, count=nbytes, offset=off)
                                     .view(a.dtype).reshape(a.shape))
                        per = nbytes // E
                        for e in range(E):
                            spans_by_e[e].append((mi, *_page_range(off + e * per, off + (e + 1) * per)))
                    shard[p] = (views[0], views[1], geom)
                shards.append(shard)
            self.mirror_layers[L] = shards
            self._spans += [_merge(sp) for sp in spans_by_e]
        n = len(self._spans)
        self._state = np.zeros(n, dtype=np.uint8)
        self._pins = np.zeros(n, dtype=np.int32)
        self._freq = np.zeros(n, dtype=np.float64)
        self._last = np.zeros(n, dtype=np.int64)
        self._issued: dict[int, list[tuple[int, int]]] = {}   # layer -> (expert, bytes) prefetched for its next call
        self._outcomes: deque[bool] = deque(maxlen=PREFETCH_WINDOW)   # recent prefetches: used by their layer?
        if profile_counts:
            for L, c in profile_counts.items():
                if L in self._li:
                    self._freq[self._li[L] * E: (self._li[L] + 1) * E] = np.asarray(c, dtype=np.float64)[:E]
        self.layer_pages = max(self._layer_pages(L) for L in self.layers)
        if self.layer_pages > self.budget_pages:
            for m in self._mirrors:
                os.close(m.fd)
            raise TierError(f"--expert-ram {self.budget_bytes} bytes cannot hold one MoE layer's routed experts "
                            f"({self.layer_pages * PAGE} bytes, {E} experts: prefill can route to all of them); "
                            f"give at least that")
        self._futures: dict[int, Future] = {}     # loads in flight: done when the expert is resident
        self._jobs: dict[int, _Job] = {}
        self._cv = threading.Condition()
        self._queue = _ReadQueue(max(1, io_threads), self._read)
        self._tick = 0
        self.resident_pages = 0
        self.peak_pages = 0
        self._inflight = 0
        self._busy_since = 0.0
        self.counters = dict.fromkeys(("bytes_read", "reads", "loads", "evictions", "demand_experts", "ram_hits",
                                       "inflight_hits", "demand_loads", "prefetch_issued", "prefetch_used",
                                       "prefetch_dropped", "prefetch_throttled", "prefetch_cancelled",
                                       "merged_reads", "bytes_demand", "bytes_prefetch", "bytes_prefetch_used"), 0)
        self.disk_busy_s = 0.0          # wall time with at least one read in flight
        self._busy_at: tuple[float, float, float] | None = None   # (time, disk_busy_s, wait_s) at the last call
        self._shares: tuple[float, float] | None = None            # recent (busy, wait) shares
        self._since_probe = 0           # demand loads since the last probe
        self.wait_s = 0.0               # time callers waited on demand reads

    # -- set-up ---------------------------------------------------------------------------------------------
    @staticmethod
    def _open_mirror(path: Path, size: int, io: str) -> _Mirror:
        n_pages = -(-size // PAGE)
        buf = mmap.mmap(-1, n_pages * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_NOHUGEPAGE)      # page accounting needs 4 KiB pages (THP may be "always")
        fd, direct = -1, False
        if io == "direct":
            try:
                fd, direct = os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError:                     # a file system without O_DIRECT (tmpfs): buffered reads
                fd = -1
        if fd < 0:
            fd = os.open(path, os.O_RDONLY)
        return _Mirror(path, size, buf, np.zeros(n_pages, dtype=np.uint16), fd, direct)

    def _layer_pages(self, L: int) -> int:
        """Pages all of layer L's experts occupy together (shared pages counted once: the union of their spans)."""
        E, i = self.n_experts, self._li[L]
        return sum(p1 - p0 for _, p0, p1 in _merge([sp for g in range(i * E, (i + 1) * E) for sp in self._spans[g]]))

    def g(self, layer: int, e: int) -> int:
        return self._li[layer] * self.n_experts + int(e)

    def expert_pages(self, layer: int, e: int) -> int:
        return sum(p1 - p0 for _, p0, p1 in self._spans[self.g(layer, e)])

    # -- state ----------------------------------------------------------------------------------------------
    def is_resident(self, layer: int, e: int) -> bool:
        return self._state[self.g(layer, e)] == RESIDENT

    def resident(self, layer: int) -> list[int]:
        i, E = self._li[layer], self.n_experts
        return [int(e) for e in np.flatnonzero(self._state[i * E:(i + 1) * E] == RESIDENT)]

    def _new_pages(self, g: int) -> int:
        return sum(int((self._mirrors[mi].refs[p0:p1] == 0).sum()) for mi, p0, p1 in self._spans[g])

    def _victim(self, exclude: set[int]) -> int | None:
        ok = (self._state == RESIDENT) & (self._pins == 0)
        if exclude:
            ok[list(exclude)] = False
        idx = np.flatnonzero(ok)
        if idx.size == 0:
            return None
        f = self._freq[idx]
        low = idx[f == f.min()]
        return int(low[np.argmin(self._last[low])])

    def _evict(self, g: int) -> None:
        self._state[g] = ABSENT
        self.counters["evictions"] += 1
        for mi, p0, p1 in self._spans[g]:
            m = self._mirrors[mi]
            refs = m.refs[p0:p1]
            refs -= 1
            free = np.flatnonzero(refs == 0)
            self.resident_pages -= int(free.size)
            for a, b in _runs(free):
                m.buf.madvise(mmap.MADV_DONTNEED, (p0 + a) * PAGE, (b - a) * PAGE)

    def _admit(self, g: int, wait: bool, exclude: set[int], batch: list[_Job], prefetch: bool = False) -> bool:
        """Reserve g's pages (evicting as needed) and add its load to `batch`, whose reads _issue() plans and queues;
        under the lock. False: no room (wait=False)."""
        while True:
            need = self._new_pages(g)
            if self.resident_pages + need <= self.budget_pages:
                break
            v = self._victim(exclude)
            if v is not None:
                self._evict(v)
                continue
            if not wait:
                return False
            if not any(self._state[h] == LOADING and self._pins[h] == 0 for h in self._futures):
                raise TierError(f"--expert-ram {self.budget_bytes} bytes: no room for expert {g % self.n_experts} "
                                f"of layer {self.layers[g // self.n_experts]}: every resident expert is in use")
            self._issue(batch)                  # what this call admitted so far reads meanwhile
            self._cv.wait()                     # an unpinned in-flight read finishes, then it can be evicted
        for mi, p0, p1 in self._spans[g]:
            refs = self._mirrors[mi].refs[p0:p1]
            self.resident_pages += int((refs == 0).sum())
            refs += 1
        self.peak_pages = max(self.peak_pages, self.resident_pages)
        self._state[g] = LOADING
        if self._inflight == 0:
            self._busy_since = time.perf_counter()
        self._inflight += 1
        job = _Job(g, prefetch)
        self._jobs[g], self._futures[g] = job, job.fut
        batch.append(job)
        self.counters["loads"] += 1
        return True

    def _issue(self, batch: list[_Job]) -> None:
        """Plan the reads of the loads admitted together and queue them (under the lock; empties `batch`). Demand
        loads are planned together (_plan: adjacent experts share reads); prefetches one by one, so a wrong guess
        can still be dropped from the queue on its own (_ReadQueue.cancel)."""
        if not batch:
            return
        if batch[0].prefetch:
            reads = [r for job in batch for r in self._plan([job], PREFETCH_CHUNK_PAGES)]
        else:
            reads = self._plan(batch, CHUNK_PAGES)
        for job in batch:
            job.left = len(job.reads)
            job.nbytes = sum(min(p1 * PAGE, self._mirrors[mi].size) - p0 * PAGE for mi, p0, p1 in self._spans[job.g])
        self._queue.push(int(batch[0].prefetch), reads)
        self.counters["merged_reads"] += sum(len(r.jobs) > 1 for r in reads)
        batch.clear()

    def _plan(self, jobs: list[_Job], chunk: int) -> list[_Read]:
        """The reads of `jobs`, in queue order (each job's own list of reads is filled in too).

        Spans of different experts that touch in the same file (adjacent experts of one tensor: expert e's gate
        scales end where e+1's begin) become one read while it stays within MERGE_PAGES, so adjacent missing experts
        share their small reads; longer spans are cut into reads of at most `chunk` pages. Reads are ordered by the first load each serves,
        so loads complete roughly in the order they were admitted (per-expert completion relies on it). A load
        completes when the last read covering it lands."""
        order = {id(job): i for i, job in enumerate(jobs)}
        runs: list[list] = []                                   # [mirror, p0, p1, [(p0, p1, job)]]
        spans = [(mi, p0, p1, j) for j in jobs for mi, p0, p1 in self._spans[j.g]]
        for mi, p0, p1, job in sorted(spans, key=lambda t: (t[0], t[1], order[id(t[3])])):
            if runs and runs[-1][0] == mi and p0 <= runs[-1][2] and max(runs[-1][2], p1) - runs[-1][1] <= MERGE_PAGES:
                runs[-1][2] = max(runs[-1][2], p1)
                runs[-1][3].append((p0, p1, job))
            else:
                runs.append([mi, p0, p1, [(p0, p1, job)]])
        reads = []
        for mi, r0, r1, parts in runs:
            for a in range(r0, r1, chunk):
                b = min(a + chunk, r1)
                covered = {id(j): j for q0, q1, j in parts if q0 < b and q1 > a}
                reads.append(_Read(mi, a, b, list(covered.values())))
        reads.sort(key=lambda r: (min(order[id(j)] for j in r.jobs), r.mi, r.p0))
        for r in reads:
            for j in r.jobs:
                j.reads.append(r)
        return reads

    def _read(self, read: _Read) -> None:
        """One read (on a reader thread); the last read of a load to land completes it."""
        mi, p0, p1 = read.mi, read.p0, read.p1
        m = self._mirrors[mi]
        nbytes = reads = 0
        err = None
        try:
            pos, end = p0 * PAGE, p1 * PAGE
            while pos < end:
                n = os.preadv(m.fd, [m.view[pos:end]], pos)
                reads += 1
                if n <= 0:
                    if pos < m.size:
                        raise TierError(f"{m.path}: read at offset {pos} returned {n} (file is {m.size} bytes)")
                    break
                pos += n
                nbytes += n
            if not m.direct:                     # buffered read: leave no second copy in the page cache
                os.posix_fadvise(m.fd, p0 * PAGE, (p1 - p0) * PAGE, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            err = TierError(f"{m.path}: reading expert {read.jobs[0].g % self.n_experts} at offset {p0 * PAGE}: {e}")
        except TierError as e:
            err = e
        done = []
        with self._cv:
            self.counters["bytes_read"] += nbytes
            self.counters["reads"] += reads
            for job in read.jobs:
                job.err = job.err or err
                job.left -= 1
                if not job.left:
                    self._complete(job)
                    done.append(job)
        for job in done:
            if job.err is None:
                job.fut.set_result(None)
            else:
                job.fut.set_exception(job.err)

    def _complete(self, job: _Job) -> None:
        """The last read of a load landed (under the lock): the expert is resident (or, after an error, gone)."""
        g = job.g
        self.counters["bytes_prefetch" if job.prefetch else "bytes_demand"] += job.nbytes
        self._inflight -= 1
        if self._inflight == 0:
            self.disk_busy_s += time.perf_counter() - self._busy_since
        self._futures.pop(g, None)
        self._jobs.pop(g, None)
        self._state[g] = RESIDENT
        if job.err is not None:               # give the pages back; the caller sees the error
            self._evict(g)
            self.counters["evictions"] -= 1
        self._cv.notify_all()

    # -- the two requests -----------------------------------------------------------------------------------
    def ensure(self, layer: int, experts) -> tuple[list[int], list[Future]]:
        """Pin `experts` of `layer` and start reading the missing ones. -> (their global ids, futures to wait on);
        call release(ids) once the kernels are done with them."""
        gs, each = self.ensure_each(layer, experts)
        return gs, [f for f in each if f is not None]

    def ensure_each(self, layer: int, experts) -> tuple[list[int], list[Future | None]]:
        """ensure(), with one entry per expert: the future of its load (None when it was already resident), so a
        caller can compute on each expert as soon as it lands. Missing experts are issued in the order given (the
        reader is FIFO within a priority, so they complete roughly in that order)."""
        gs = [self.g(layer, e) for e in experts]
        futs: list[Future | None] = []
        with self._cv:
            self._tick += 1
            for g in gs:
                self._pins[g] += 1
                self._freq[g] += 1
                self._last[g] = self._tick
            self.counters["demand_experts"] += len(gs)
            wanted = set(gs)
            for g, nbytes in self._issued.pop(layer, []):  # how the prefetches for this call turned out
                used = g in wanted and self._state[g] != ABSENT
                self._outcomes.append(used)
                self.counters["prefetch_used"] += used
                self.counters["bytes_prefetch_used"] += nbytes if used else 0
                if not used and self._state[g] == LOADING and self._pins[g] == 0 and g in self._jobs \
                        and self._queue.cancel(self._jobs[g]):
                    self._cancel(g)             # a wrong guess not yet started: leave the disk to the demand reads
            batch: list[_Job] = []
            for g in gs:
                st = self._state[g]
                if st == RESIDENT:
                    self.counters["ram_hits"] += 1
                    futs.append(None)
                    continue
                if st == LOADING:
                    self.counters["inflight_hits"] += 1
                    if g in self._jobs:                 # a queued prefetch is now wanted: ahead of other prefetches
                        self._queue.push(0, self._jobs[g].reads)
                else:
                    self.counters["demand_loads"] += 1
                    self._since_probe += 1
                    self._admit(g, wait=True, exclude=set(), batch=batch)
                futs.append(self._futures.get(g))
            self._issue(batch)
        return gs, futs

    def _cancel(self, g: int) -> None:
        """Undo the admission of a load none of whose reads started (under the lock; the queue already dropped it)."""
        job = self._jobs.pop(g)
        self._futures.pop(g, None)
        self._inflight -= 1
        if self._inflight == 0:
            self.disk_busy_s += time.perf_counter() - self._busy_since
        self._state[g] = RESIDENT               # _evict's precondition: give the reserved pages back
        self._evict(g)
        self.counters["evictions"] -= 1
        self.counters["loads"] -= 1
        self.counters["prefetch_cancelled"] += 1
        job.fut.cancel()
        self._cv.notify_all()

    def prefetch_use(self) -> float:
        """Share of the last PREFETCH_WINDOW prefetches their layer then used (1.0 until 16 are known)."""
        if len(self._outcomes) < 16:
            return 1.0
        return sum(self._outcomes) / len(self._outcomes)

    def wait(self, futs: list[Future | None]) -> None:
        t0 = time.perf_counter()
        for f in futs:
            if f is not None:
                f.result()
        self.wait_s += time.perf_counter() - t0

    def release(self, gs: list[int]) -> None:
        with self._cv:
            for g in gs:
                self._pins[g] -= 1
            self._cv.notify_all()

    def recent_shares(self) -> tuple[float, float]:
        """(the disk's busy share: time with a read in flight / wall time, the callers' wait share: time waiting on
        demand reads / wall time), recent: averages over the intervals between calls weighted BUSY_EMA to the
        newest; updated by each call (under the lock)."""
        now = time.perf_counter()
        busy = self.disk_busy_s + (now - self._busy_since if self._inflight else 0.0)
        if self._busy_at is not None and now > self._busy_at[0]:
            t0, busy0, wait0 = self._busy_at
            new = (min(1.0, (busy - busy0) / (now - t0)), min(1.0, (self.wait_s - wait0) / (now - t0)))
            self._shares = new if self._shares is None else \
                tuple((1 - BUSY_EMA) * a + BUSY_EMA * b for a, b in zip(self._shares, new))
        self._busy_at = (now, busy, self.wait_s)
        return self._shares or (0.0, 1.0)

    def prefetch_gate(self) -> int | None:
        """How many predicted experts a prefetch() may read now: None (every one), 1 (a probe is due) or 0 (none: the
        caller need not predict at all, which saves the predictor's CPU time on every throttled layer). Each call
        updates the recent shares and counts a throttled call (prefetch() below says when and why)."""
        with self._cv:
            busy, waited = self.recent_shares()
            if self.prefetch_use() >= max(PREFETCH_MIN_USE, busy) and waited >= WAIT_MIN:
                return None
            self.counters["prefetch_throttled"] += 1
            return 1 if self._since_probe >= PROBE_LOADS else 0

    def prefetch(self, layer: int, experts, limit: int | None | str = "ask") -> int:
        """Start reading predicted experts of `layer` (best first) that are not in RAM, as far as unpinned room
        allows (never waits, never evicts a pinned or just-predicted expert); at most `limit` of them, as
        prefetch_gate() answered (asked here unless given). While the recent prefetches were used
        less than max(PREFETCH_MIN_USE, the disk's recent busy share) of the time, only the best-ranked one is
        read, once per PROBE_LOADS demand loads (a probe that keeps measuring); the same while callers waited on reads
        less than WAIT_MIN of the time. A wrong prefetch costs a read and evicts an expert; a right one can at most
        save the wait on that read, and only by filling time the disk would idle: on a disk busy 87% of the time
        (the default model on a 2 MB/s disk) prefetches used 47% of the time read 17% more bytes and decode ran 16%
        slower; where reads were waited on 2% of the time (unthrottled) they cost CPU time and gained nothing.
        -> reads issued."""
        if limit == "ask":
            limit = self.prefetch_gate()
        issued, batch = 0, []
        with self._cv:
            gs = [self.g(layer, e) for e in experts]
            keep = set(gs)
            if limit is not None:
                gs = [g for g in gs if self._state[g] == ABSENT][:limit]
                if gs:
                    self._since_probe = 0
            for g in gs:
                if self._state[g] != ABSENT:
                    continue
                self._last[g] = self._tick              # recently wanted: evicted after older equals
                if not self._admit(g, wait=False, exclude=keep, batch=batch, prefetch=True):
                    self.counters["prefetch_dropped"] += 1
                    continue
                issued += 1
            jobs = list(batch)
            self._issue(batch)
            self._issued.setdefault(layer, []).extend((job.g, job.nbytes) for job in jobs)
            self.counters["prefetch_issued"] += issued
        return issued

    def drain(self) -> None:
        """Wait for every read in flight (before closing, or to measure a quiet state)."""
        with self._cv:
            futs = list(self._futures.values())
        for f in futs:
            try:
                f.result()
            except TierError:
                pass

    # -- statistics -----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        c = dict(self.counters)
        c.update({"budget_bytes": self.budget_bytes, "resident_bytes": self.resident_pages * PAGE,
                  "peak_resident_bytes": self.peak_pages * PAGE, "disk_busy_s": self.disk_busy_s,
                  "demand_wait_s": self.wait_s, "io": "direct" if all(m.direct for m in self._mirrors) else "pread",
                  "ram_hit_ratio": c["ram_hits"] / c["demand_experts"] if c["demand_experts"] else 0.0,
                  "disk_gbps": c["bytes_read"] / self.disk_busy_s / 1e9 if self.disk_busy_s else 0.0})
        return c

    def measured_resident_bytes(self) -> int:
        """Resident bytes of the mirrors as the kernel reports them (mincore(2) on each mirror), not our own
        accounting. (smaps cannot tell: the kernel merges the mirrors with neighbouring anonymous mappings.) Under
        the tier's lock, so all mirrors are counted at one instant (no eviction or admission in between; reads in
        flight only fill pages already reserved)."""
        with self._cv:
            return self._measure()

    def _measure(self) -> int:
        total = 0
        for m in self._mirrors:
            n = len(m.refs)
            vec = (ctypes.c_ubyte * n)()
            if _libc().mincore(ctypes.c_void_p(m.address), ctypes.c_size_t(n * PAGE), vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore on the mirror of {m.path}")
            total += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum()) * PAGE
        return total

    def close(self) -> None:
        self.drain()
        self._queue.shutdown()
        for m in self._mirrors:
            if m.fd >= 0:
                os.close(m.fd)
                m.fd = -1


class _Read:
    """One preadv: pages [p0, p1) of mirror `mi`, serving the loads in `jobs` (several when adjacent experts'
    spans were merged)."""
    __slots__ = ("jobs", "mi", "p0", "p1", "started")

    def __init__(self, mi: int, p0: int, p1: int, jobs: list[_Job]):
        self.mi, self.p0, self.p1, self.jobs, self.started = mi, p0, p1, jobs, False


class _Job:
    """One expert's load: its reads, how many are left, the bytes they read, the future its waiters hold."""

    def __init__(self, g: int, prefetch: bool):
        self.g, self.prefetch, self.err = g, prefetch, None
        self.reads: list[_Read] = []
        self.left = self.nbytes = 0
        self.fut: Future = Future()


class _ReadQueue:
    """`n` reader threads taking reads by priority (0 = demand before 1 = prefetch), FIFO within one; every read
    of a load is queued on its own, so even one expert keeps several reads in flight. A prefetch read starts only
    when no demand read runs or waits, and one at a time: prefetches fill the time the disk would idle, and a demand
    read never queues on the disk behind more than one (small) prefetch read. (concurrent.futures' pool is FIFO
    only: a demand read would wait behind every prefetch queued before it.) push() may queue a load again at a
    better priority; each read still runs once."""

    def __init__(self, n: int, fn):
        self._fn, self._heap, self._cv = fn, [], threading.Condition()
        self._seq, self._stop = itertools.count(), False
        self.running = [0, 0]                                   # demand, prefetch reads running
        self._threads = [threading.Thread(target=self._work, name=f"ktrun-tier-io-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    def push(self, priority: int, reads: list[_Read]) -> None:
        with self._cv:
            for r in reads:
                if not r.started:
                    heapq.heappush(self._heap, (priority, next(self._seq), r))
            self._cv.notify_all()

    def cancel(self, job: _Job) -> bool:
        """Drop a queued load none of whose reads has started and which shares no read with another load -> True;
        False otherwise (it runs to the end)."""
        with self._cv:
            if any(r.started or len(r.jobs) > 1 for r in job.reads):
                return False
            for r in job.reads:
                r.started = True                            # queued entries are skipped as already run
            return True

    def _next(self) -> tuple[_Read, int] | None:
        """The next read to run and its priority (under the queue's lock; waits): demand first; a prefetch only
        while no other read runs. None: shut down."""
        while True:
            while self._heap and self._heap[0][2].started:      # already run, or cancelled
                heapq.heappop(self._heap)
            if self._heap and (self._heap[0][0] == 0 or self.running == [0, 0]):
                prio, _, r = heapq.heappop(self._heap)
                r.started = True
                return r, prio
            if self._stop and not self._heap:
                return None
            self._cv.wait()

    def _work(self) -> None:
        while True:
            with self._cv:
                nxt = self._next()
                if nxt is None:
                    return
                r, prio = nxt
                self.running[prio] += 1
            try:
                self._fn(r)
            finally:
                with self._cv:
                    self.running[prio] -= 1
                    self._cv.notify_all()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def _merge(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    for mi, p0, p1 in sorted(spans):
        if out and out[-1][0] == mi and p0 <= out[-1][2]:
            out[-1][2] = max(out[-1][2], p1)
        else:
            out.append([mi, p0, p1])
    return [tuple(s) for s in out]


def _runs(idx: np.ndarray):
    """Sorted indices -> [a, b) runs of consecutive values."""
    if idx.size == 0:
        return []
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    return [(int(r[0]), int(r[-1]) + 1) for r in np.split(idx, cut)]
