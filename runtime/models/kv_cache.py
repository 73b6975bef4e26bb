"""Per-request KV caches in fixed-size blocks, and the varlen batch description the model forwards take.

Storage is one BlockPool per model on the compute device. For each cached tensor kind of the architecture (MLA: the
compressed latent + roped shared key (kv_lora_rank + rope_dim); GQA: k and v (kv_heads, head_dim)) the pool holds one
tensor (layers, blocks, B, *width): block b of layer l is `pool.tokens[kind][l, b]`, B consecutive positions. A
request's SeqCache is a block table (the pool block holding its positions [i*B, (i+1)*B)) plus its length; blocks are
taken as the request grows (so it wastes at most B-1 positions) and are reference counted, so one full block can be
read by several requests at once (ktrun.prefix_cache decides which; a request only ever writes positions at or past
its own length, so a shared full block is never written). A request reads only the blocks of its own table.

Attention reads a request's positions [0, S) as a few runs: each run is a view of the layer's slab over blocks that
are consecutive in the pool, so nothing is copied. The pool hands a growing request the block after its last one
when that is free, so a request alone has one run (exactly the contiguous cache of before) and a request continuing
a shared prefix typically two (the prefix's, then its own); attention computes scores per run and one softmax over
all of them. A table broken into more than MAX_RUNS runs is gathered into one tensor instead (one index_select).

Layers whose cache is a recurrent state rather than one row per position (linear attention) keep it per request in
`SeqCache.recurrent` (layer -> tensors: the state after the request's committed tokens), described by a StateLayout.
The forward never writes those tensors in place (each forward makes new ones), so a snapshot of them is a list of
references, not a copy. For the prefix cache a request records snapshots at chosen block boundaries: positions in
`snap_at` are captured by the forward into `snaps` (a boundary inside a forward: the layer splits its recurrence
there), and `tail` holds the state at the last block boundary the request crossed while decoding; ktrun.prefix_cache
keeps them with the block they end.
"""
from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

KV_BLOCK_SIZE = 16   # positions per block: the granularity of prefix sharing (a prefix reuses its full blocks)
MAX_RUNS = 4         # runs of consecutive blocks attention reads as views; more are gathered into one copy


class ContextFull(RuntimeError):
    """The request would exceed its context limit (--ctx)."""


@dataclass(frozen=True)
class BlockLayout:
    """What one block holds: for each token kind (layers, block_size, *shape)."""

    num_layers: int
    token_shapes: tuple[tuple[int, ...], ...]     # per position, e.g. ((576,),) for MLA, ((8, 128), (8, 128)) for GQA
    block_size: int = KV_BLOCK_SIZE

    def block_shapes(self) -> list[tuple[int, ...]]:
        L, B = self.num_layers, self.block_size
        return [(L, B, *w) for w in self.token_shapes]

    def block_numel(self) -> int:
        return sum(math.prod(s) for s in self.block_shapes())

    def describe(self) -> str:
        """A stable text form (part of a block's cache key: blocks of another layout never match)."""
        return f"L{self.num_layers}.B{self.block_size}.tok{list(self.token_shapes)}"


@dataclass(frozen=True)
class StateLayout:
    """A request's recurrent state: for each recurrent layer in `layers`, tensors of `shapes` in `dtypes` (Qwen3-Next:
    the conv window (kernel-1, conv_dim) in the dense dtype and the DeltaNet state (v_heads, dk, dv) in float32).
    A snapshot is the flat list of every layer's tensors, layer by layer."""

    layers: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(s, d) for _ in self.layers for s, d in zip(self.shapes, self.dtypes)]

    def nbytes(self) -> int:
        """Bytes of one snapshot (one request's state in every recurrent layer)."""
        return len(self.layers) * sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def describe(self) -> str:
        dts = [str(d).removeprefix("torch.") for d in self.dtypes]
        return f"layers{list(self.layers)}.shapes{list(self.shapes)}.dtypes{dts}"

    def flatten(self, recurrent: dict[int, tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in recurrent[layer]]

    def unflatten(self, data: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor, ...]]:
        k = len(self.shapes)
        return {layer: tuple(data[i * k:(i + 1) * k]) for i, layer in enumerate(self.layers)}


class BlockPool:
    """The compute device's KV blocks: storage, reference counts and the free list.

    A block is free (in no table, not cached), in use (ref > 0: in the tables of that many requests) or cached
    (ref 0, kept for a later request by the prefix cache). Two hooks let a prefix cache take part:
    `on_unused(b) -> bool` is called when b's last reference goes (True: the cache keeps or has freed it), and
    `reclaim() -> int | None` is asked for a cached block to reuse before the pool grows.
    Capacity grows by doubling (old blocks are copied) and is kept: it is the high-water mark of blocks held."""

    def __init__(self, layout: BlockLayout, dtype: torch.dtype, device):
        self.layout, self.dtype, self.device = layout, dtype, torch.device(device)
        self.block_size = layout.block_size
        self.capacity = 0
        self.tokens = [torch.zeros((layout.num_layers, 0, layout.block_size, *w), dtype=dtype, device=self.device)
                       for w in layout.token_shapes]
        self.ref: list[int] = []
        self._free: list[int] = []                 # min-heap of free ids (entries not in _free_set are stale)
        self._free_set: set[int] = set()
        self.used = 0                              # blocks with ref > 0
        self.block_bytes = layout.block_numel() * torch.empty((), dtype=dtype).element_size()
        self.on_unused: Callable[[int], bool] | None = None
        self.reclaim: Callable[[], int | None] | None = None

    # -- allocation ------------------------------------------------------------------------------------------------
    def allocate(self, prefer: int | None = None) -> int:
        """A block for one request (ref 1): `prefer` if it is free (the block after the request's last, keeping
        its blocks consecutive), else the lowest free one, else one the prefix cache gives back, else a new one."""
        if prefer is not None and prefer in self._free_set:
            b = prefer
        else:
            b = self._pop_free()
            if b is None:
                b = self.reclaim() if self.reclaim is not None else None
                if b is None:
                    self._grow(self.capacity + 1)
                    b = self._pop_free()
        self._free_set.discard(b)
        self.ref[b] = 1
        self.used += 1
        return b

    def _pop_free(self) -> int | None:
        while self._free:
            b = heapq.heappop(self._free)
            if b in self._free_set:
                return b
        return None

    def _push_free(self, b: int) -> None:
        self._free_set.add(b)
        heapq.heappush(self._free, b)

    def retain(self, b: int) -> None:
        if self.ref[b] == 0:
            self.used += 1
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.used -= 1
            if self.on_unused is None or not self.on_unused(b):
                self._push_free(b)

    def free(self, b: int) -> None:
        """A cached block (ref 0) the prefix cache no longer keeps."""
        self._push_free(b)

    def _grow(self, need: int) -> None:
        new_cap = max(need, 2 * self.capacity, 16)
        grown = []
        for t in self.tokens:
            g = torch.zeros((t.shape[0], new_cap, *t.shape[2:]), dtype=self.dtype, device=self.device)
            g[:, : self.capacity] = t
            grown.append(g)
        self.tokens = grown
        self.ref.extend([0] * (new_cap - self.capacity))
        for b in range(self.capacity, new_cap):
            self._push_free(b)
        self.capacity = new_cap

    # -- whole blocks (moving between tiers) -----------------------------------------------------------------------
    def block_views(self, b: int) -> list[torch.Tensor]:
        """Views of block b per kind, in BlockLayout.block_shapes() order."""
        return [t[:, b] for t in self.tokens]

    def load_block(self, b: int, data: list[torch.Tensor]) -> None:
        for view, d in zip(self.block_views(b), data):
            view.copy_(d, non_blocking=True)

    def nbytes(self) -> int:
        """Device bytes of the pool (its capacity, held or not)."""
        return self.capacity * self.block_bytes


def _release_blocks(pool: BlockPool, blocks: list[int]) -> None:
    for b in blocks:
        pool.release(b)
    blocks.clear()


class SeqCache:
    """One request's cache: a block table over the model's BlockPool and the tokens committed to it."""

    def __init__(self, pool: BlockPool, ctx: int):
        self.pool, self.ctx = pool, int(ctx)
        self.dtype, self.device = pool.dtype, pool.device
        self.blocks: list[int] = []                # pool block of positions [i*B, (i+1)*B)
        self.length = 0                            # tokens committed (all layers written)
        self.tokens: list[int] = []                # the committed token ids (positions [0, length))
        self.block_hashes: list[bytes] = []        # cache keys of the leading full blocks (set by the prefix cache)
        self._runs: list[list[int]] = []           # [first block, block count] of each run of consecutive blocks
        self._table: torch.Tensor | None = None    # blocks as a device tensor, for index_select
        self._slots: tuple[int, int, torch.Tensor] | None = None
        # recurrent layers (linear attention): layer -> that layer's state tensors after the committed tokens
        # (Qwen3-Next: the conv window and the DeltaNet state), written by the forward, per request
        self.recurrent: dict[int, tuple[torch.Tensor, ...]] = {}
        self.snap_at: set[int] = set()             # positions (block boundaries) whose state the forward records
        self.snaps: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {}   # position -> recorded states, by layer
        self.tail: tuple[int, dict[int, tuple[torch.Tensor, ...]]] | None = None   # state at the last boundary
        # speculative decoding: the state after each drafted position of the latest verify forward (keep() rolls
        # back to one of them when drafts are rejected)
        self.spec_states: dict[int, dict[int, tuple[torch.Tensor, ...]]] = {}
        # MTP drafts (MoEModel.keep_hidden): (start position, final hidden rows (n, H)) of each forward since the
        # drafter last read them (ktrun.mtp; rows past a rollback are stale, the drafter reads by position)
        self.hidden: list[tuple[int, torch.Tensor]] = []
        # a cache dropped without release() (one-off forwards in tests, `ktrun bench`) gives its blocks back
        self._finalizer = weakref.finalize(self, _release_blocks, pool, self.blocks)

    def _append(self, b: int) -> None:
        if self._runs and b == self.blocks[-1] + 1:
            self._runs[-1][1] += 1
        else:
            self._runs.append([b, 1])
        self.blocks.append(b)
        self._table = None

    def adopt(self, blocks: list[int], tokens: list[int], hashes: list[bytes]) -> None:
        """Start an empty cache with shared full blocks (already retained for it) holding these tokens."""
        assert not self.blocks and len(tokens) == len(blocks) * self.pool.block_size
        for b in blocks:
            self._append(b)
        self.tokens.extend(tokens)
        self.block_hashes.extend(hashes)
        self.length = len(tokens)

    def fork(self) -> SeqCache:
        """A second cache holding the same tokens (n > 1: the other choices start from the prompt's prefill): the
        full blocks are shared (retained: neither writes them again), the partial last block is copied."""
        dst = SeqCache(self.pool, self.ctx)
        full = self.length // self.pool.block_size
        for b in self.blocks[:full]:
            self.pool.retain(b)
            dst._append(b)
        if full < len(self.blocks) and self.length > full * self.pool.block_size:
            b = self.pool.allocate(dst.blocks[-1] + 1 if dst.blocks else None)
            self.pool.load_block(b, self.pool.block_views(self.blocks[full]))   # views taken after any growth
            dst._append(b)
        dst.tokens.extend(self.tokens)
        dst.block_hashes.extend(self.block_hashes)
        dst.length = self.length
        dst.recurrent = dict(self.recurrent)      # shared: a forward makes new state tensors, never writes them
        dst.hidden = list(self.hidden)             # the prompt's hidden rows, for the copy's own MTP drafter
        return dst

    def reserve(self, total: int) -> None:
        """Hold blocks for positions [0, total) (before a forward, so a forward never allocates)."""
        if total > self.ctx:
            raise ContextFull(f"sequence of {total} tokens exceeds the context limit --ctx {self.ctx}")
        need = -(-total // self.pool.block_size)
        while len(self.blocks) < need:
            self._append(self.pool.allocate(self.blocks[-1] + 1 if self.blocks else None))

    def keep(self, length: int) -> None:
        """After a forward that verified drafted tokens (speculative decoding): keep positions [0, length), drop
        the rejected ones after it. Their KV rows stay where they are, to be overwritten; blocks wholly past
        `length` go back to the pool (never a shared one: a request writes only past its own length). Recurrent
        layers get back the state after position length-1 (recorded by the forward in spec_states), and `tail`
        the state at the last block end crossed, as one-token decode steps would have left them."""
        B = self.pool.block_size
        crossed = [p for p in self.spec_states if p % B == 0 and p < length]
        if crossed:
            self.tail = (max(crossed), self.spec_states[max(crossed)])
        if length < self.length:
            if self.recurrent:
                state = self.spec_states.get(length, {})
                if set(state) != set(self.recurrent):
                    raise RuntimeError(f"no recurrent state recorded at position {length} for layers "
                                       f"{sorted(set(self.recurrent) - set(state))}: cannot roll back")
                self.recurrent = dict(state)
            del self.tokens[length:]
            del self.block_hashes[length // B:]
            self.length = length
            while len(self.blocks) > -(-length // B):
                run = self._runs[-1]
                run[1] -= 1
                if not run[1]:
                    self._runs.pop()
                self.pool.release(self.blocks.pop())
            self._table, self._slots = None, None
        self.spec_states = {}

    def release(self) -> None:
        """Give every block back (the prefix cache keeps the full blocks it knows); the cache is empty after."""
        _release_blocks(self.pool, self.blocks)
        self.tokens.clear()
        self.block_hashes.clear()
        self.length, self._table, self._slots = 0, None, None
        self._runs.clear()
        self.recurrent.clear()
        self.snap_at.clear()
        self.snaps.clear()
        self.tail = None
        self.spec_states = {}
        self.hidden = []

    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_bytes

    # -- the attention's read/write --------------------------------------------------------------------------------
    def write(self, layer: int, start: int, values: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Store values (n, *w) per token kind at positions [start, start+n); return positions [0, start+n) as
        runs, in order: each run is one (run_len, *w) view per kind (or, past MAX_RUNS runs, one gathered copy)."""
        n, B = values[0].shape[0], self.pool.block_size
        slabs = [t[layer] for t in self.pool.tokens]                          # (capacity, B, *w) each
        i, off = divmod(start, B)
        if off + n <= B:                                                      # one block (every decode step)
            b = self.blocks[i]
            for s, v in zip(slabs, values):
                s[b, off:off + n] = v
        else:
            idx = self._slot_index(start, n)
            for s, v in zip(slabs, values):
                s.view(-1, *s.shape[2:]).index_copy_(0, idx, v)
        end = start + n
        nb = -(-end // B)
        runs, left = [], end
        for b0, count in self._runs:
            if left <= 0:
                break
            k = min(count, -(-left // B))
            runs.append((b0, k, min(left, k * B)))
            left -= k * B
        if len(runs) <= MAX_RUNS:
            return [[s[b0:b0 + k].view(k * B, *s.shape[2:])[:m] for s in slabs] for b0, k, m in runs]
        if self._table is None:
            self._table = torch.tensor(self.blocks, dtype=torch.long, device=self.device)
        table = self._table[:nb]
        return [[s.index_select(0, table).view(nb * B, *s.shape[2:])[:end] for s in slabs]]

    def _slot_index(self, start: int, n: int) -> torch.Tensor:
        """Flat pool rows (block * B + offset) of positions [start, start+n); reused by every layer of a forward."""
        if self._slots is None or self._slots[:2] != (start, n):
            B = self.pool.block_size
            pos = torch.arange(start, start + n)
            table = torch.tensor(self.blocks, dtype=torch.long)
            self._slots = (start, n, (table[pos // B] * B + pos % B).to(self.device))
        return self._slots[2]


@dataclass
class SeqSlice:
    """One request's tokens inside a flattened batch: tokens [offset, offset+n) at positions [start, start+n)."""
    cache: SeqCache
    start: int
    n: int
    offset: int
    ids: list[int] = field(default_factory=list)


@dataclass
class Batch:
    tokens: torch.Tensor          # (T,) int64, all requests' new tokens concatenated
    positions: torch.Tensor       # (T,) int64
    seqs: list[SeqSlice]
    # what one layer of this forward hands on to a later one, by name (GLM-5's shared indexer layers: the keys the
    # last full layer selected for each request)
    carried: dict = field(default_factory=dict)

    @staticmethod
    def build(items: list[tuple[SeqCache, list[int]]], device) -> Batch:
        toks, pos, seqs, off = [], [], [], 0
        for cache, ids in items:
            if cache.length + len(ids) > cache.ctx:
                raise ContextFull(f"{cache.length + len(ids)} tokens exceed the context limit --ctx {cache.ctx}")
            cache.reserve(cache.length + len(ids))
            ints = [int(t) for t in ids]
            toks.extend(ints)
            pos.extend(range(cache.length, cache.length + len(ids)))
            seqs.append(SeqSlice(cache, cache.length, len(ids), off, ints))
            off += len(ids)
        # tokens and positions as one int64 array: numpy makes it from the lists in ~1 us where each torch.tensor
        # of a list took ~4-8 us, twice per decode step (torch.from_numpy shares the array: no copy)
        both = torch.from_numpy(np.array(toks + pos, dtype=np.int64))
        if device is not None and torch.device(device).type != "cpu":
            both = both.to(device)
        return Batch(both[:off], both[off:], seqs)

    def record_one_call(self, kind: str, key: int, value) -> None:
        """One layer's one-call path as this forward took it (ktrun.models.step_one_call learns a decode step's plan
        from them): kind "attn" (KV slot -> (glue.GqaLayerCall, window)) or "moe" (layer -> glue.MoeDecodeCall)."""
        self.carried.setdefault("one_call", {"attn": {}, "moe": {}})[kind][key] = value

    def commit(self) -> None:
        for s in self.seqs:
            s.cache.length = s.start + s.n
            s.cache.tokens.extend(s.ids)

    def last_token_rows(self) -> torch.Tensor:
        """Index of each request's last token in the flattened batch: (B,)."""
        return torch.tensor([s.offset + s.n - 1 for s in self.seqs], dtype=torch.long)


def causal_scores_mask(n: int, start: int, total: int, device, window: int | None = None) -> torch.Tensor:
    """Bool (n, total): query i (position start+i) may see key j when j <= start+i (and within the window)."""
    q = torch.arange(start, start + n, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    m = k <= q
    if window is not None:
        m &= k > q - window
    return m
