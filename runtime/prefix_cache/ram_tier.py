"""The CPU RAM tier: host copies of cache entries evicted from the device (KV blocks and recurrent-state snapshots),
under a byte budget, least recently used first out. An entry is in the device tier or here, never both (a hit moves
it back to the device).

Memory is a set of equal slots of one KV block each, in host chunks allocated as they are needed (up to CHUNK_BYTES
each) and never more than the budget in all: the budget bounds the memory really allocated, not just the bytes in
use. A block takes one slot (typed views into it); a state snapshot, usually many blocks' worth (Qwen3-Next-80B: one
snapshot ~ 200 blocks of 16 positions), takes as many slots as its bytes need, its tensors' bytes laid end to end
across them. So blocks and snapshots share one budget and one free list without fragmenting it. On CUDA the chunks
are pinned (fast, asynchronous-capable copies) and sized as the pinned allocator rounds them (to a power of two), so
the rounding cannot overrun the budget either.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

BlockData = list[torch.Tensor]     # one tensor per tensor of the entry's kind, in EntryKind order
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class EntryKind:
    """One kind of cache entry: its tensors' names (as in the disk file), shapes and dtypes, the text form of its
    layout (checked when a file is read back) and its file suffix."""

    name: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    layout: str
    suffix: str

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def empty(self, device, pin: bool = False) -> BlockData:
        return [torch.empty(s, dtype=d, device=device, pin_memory=pin) for s, d in zip(self.shapes, self.dtypes)]


def data_bytes(data: BlockData) -> int:
    return sum(t.numel() * t.element_size() for t in data)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class RamTier:
    def __init__(self, budget_bytes: int, block: EntryKind, pin: bool = False):
        """block: the KV block's kind (one slot each)."""
        self.budget, self.pin = max(0, int(budget_bytes)), pin
        self.block_bytes = self.slot_bytes = max(1, block.nbytes)
        self.entries: OrderedDict[bytes, tuple[EntryKind, list[int]]] = OrderedDict()   # key -> slots, oldest first
        self._chunks: list[torch.Tensor] = []                     # (slots, slot_bytes) uint8 each
        self._where: list[tuple[int, int]] = []                   # slot -> (chunk, index in it)
        self._free: list[int] = []
        self._used = 0                                            # slots held by entries
        self._count: dict[str, int] = {}                          # entries by kind (read by /metrics' thread)
        self.allocated_bytes = 0                                  # what the chunks take (pinned: as rounded)
        self.peak_bytes = 0

    @property
    def bytes(self) -> int:
        """Bytes of the slots the entries hold."""
        return self._used * self.slot_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def count(self, kind: str) -> int:
        return self._count.get(kind, 0)

    def _counted(self, kind: EntryKind, n: int) -> None:
        self._count[kind.name] = self._count.get(kind.name, 0) + n

    def slots_of(self, kind: EntryKind) -> int:
        return max(1, -(-kind.nbytes // self.slot_bytes))

    def _row(self, slot: int) -> torch.Tensor:
        c, i = self._where[slot]
        return self._chunks[c][i]

    def _cost(self, slots: int) -> int:
        n = slots * self.slot_bytes
        return _pow2(n) if self.pin else n

    def _new_chunk(self, want: int) -> bool:
        room = self.budget - self.allocated_bytes
        slots = min(max(want, CHUNK_BYTES // self.slot_bytes), room // self.slot_bytes)
        while slots and self._cost(slots) > room:
            slots -= 1
        if slots == 0:
            return False
        self._chunks.append(torch.empty((slots, self.slot_bytes), dtype=torch.uint8, pin_memory=self.pin))
        self.allocated_bytes += self._cost(slots)
        first = len(self._where)
        self._where.extend((len(self._chunks) - 1, i) for i in range(slots))
        self._free.extend(range(first + slots - 1, first - 1, -1))
        return True

    def _take(self, n: int) -> list[int] | None:
        """n free slots (allocating chunks within the budget), or None when there is no room for them."""
        while len(self._free) < n:
            if not self._new_chunk(n - len(self._free)):
                return None
        return [self._free.pop() for _ in range(n)]

    # -- an entry's bytes in its slots -----------------------------------------------------------------------------
    def _views(self, kind: EntryKind, slots: list[int]) -> BlockData | None:
        """Typed views of a one-slot entry whose tensors sit aligned in it (a KV block); else None."""
        if len(slots) != 1:
            return None
        row, out, off = self._row(slots[0]), [], 0
        for s, d in zip(kind.shapes, kind.dtypes):
            n = math.prod(s) * d.itemsize
            if off % d.itemsize:
                return None
            out.append(row[off:off + n].view(d).view(s))
            off += n
        return out

    def _copy(self, kind: EntryKind, slots: list[int], tensors: BlockData, into_slots: bool) -> None:
        """Copy tensors into the entry's slots (into_slots) or the slots into tensors: typed for a one-slot block,
        else as one byte stream laid across the slots in order."""
        views = self._views(kind, slots)
        if views is not None:
            for v, t in zip(views, tensors):
                if into_slots:
                    v.copy_(t)
                else:
                    t.copy_(v)                 # blocking: the slots may be reused at once
            return
        rows = (self._row(slot) for slot in slots)
        row, r = next(rows), 0                                      # the current slot and the position in it
        for t in tensors:
            f = _flat_bytes(t) if into_slots or t.is_contiguous() else None
            if f is None:
                raise ValueError("a multi-slot entry is read into contiguous tensors only")
            w = 0
            while w < f.numel():
                if r == self.slot_bytes:
                    row, r = next(rows), 0
                k = min(self.slot_bytes - r, f.numel() - w)
                if into_slots:
                    row[r:r + k].copy_(f[w:w + k])
                else:
                    f[w:w + k].copy_(row[r:r + k])
                w += k
                r += k

    def _data(self, kind: EntryKind, slots: list[int]) -> BlockData:
        """The entry's tensors: views into its slot (a block: valid until the slot is reused) or a host copy."""
        views = self._views(kind, slots)
        if views is not None:
            return views
        out = kind.empty("cpu")
        self._copy(kind, slots, out, into_slots=False)
        return out

    # -- the tier's operations -------------------------------------------------------------------------------------
    def store(self, key: bytes, src: BlockData, spill: Callable[[bytes, BlockData, EntryKind], None],
              kind: EntryKind) -> bool:
        """Copy the entry in (the newest); when full, the oldest entries go to spill(key, data, kind) first (data is
        valid during the call only). False when the whole budget cannot hold it."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return True
        need = self.slots_of(kind)
        if self._cost(need) > self.budget:
            return False
        while (slots := self._take(need)) is None:
            if not self.entries:
                return False
            old, (k, sl) = self.entries.popitem(last=False)
            self._used -= len(sl)
            self._counted(k, -1)
            spill(old, self._data(k, sl), k)
            self._free.extend(sl)
        self._copy(kind, slots, src, into_slots=True)
        self.entries[key] = (kind, slots)
        self._used += need
        self._counted(kind, 1)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return True

    def touch(self, key: bytes) -> None:
        self.entries.move_to_end(key)

    def load(self, key: bytes, dst: BlockData) -> bool:
        """Copy the entry out into dst and drop it from the tier (it is back on the device); False if absent."""
        got = self.entries.pop(key, None)
        if got is None:
            return False
        kind, slots = got
        self._copy(kind, slots, dst, into_slots=False)
        self._release(kind, slots)
        return True

    def _release(self, kind: EntryKind, slots: list[int]) -> None:
        self._used -= len(slots)
        self._counted(kind, -1)
        self._free.extend(slots)

    def discard(self, key: bytes) -> None:
        got = self.entries.pop(key, None)
        if got is not None:
            self._release(*got)

    def oldest_first(self) -> list[tuple[bytes, BlockData, EntryKind]]:
        return [(k, self._data(kind, sl), kind) for k, (kind, sl) in self.entries.items()]
