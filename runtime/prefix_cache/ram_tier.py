"""The CPU RAM tier: host copies of blocks evicted from the device, under a byte budget, least recently used first
out. A block is in the device tier or here, never both (a hit moves it back to the device).

Every block has the same size, so the tier is a set of fixed-size slots in host chunks allocated as they are needed
(up to CHUNK_BYTES each) and never more than the budget in all: the budget bounds the memory really allocated, not
just the bytes in use. On CUDA the chunks are pinned (fast, asynchronous-capable copies) and sized as the pinned
allocator rounds them (to a power of two), so the rounding cannot overrun the budget either.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import torch

BlockData = list[torch.Tensor]     # one tensor per kind, BlockLayout.block_shapes() order
CHUNK_BYTES = 64 << 20


def data_bytes(data: BlockData) -> int:
    return sum(t.numel() * t.element_size() for t in data)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class RamTier:
    def __init__(self, budget_bytes: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, pin: bool = False):
        self.budget = max(0, int(budget_bytes))
        self.shapes, self.dtype, self.pin = [tuple(s) for s in shapes], dtype, pin
        self.block_bytes = sum(math.prod(s) for s in self.shapes) * torch.empty((), dtype=dtype).element_size()
        self.blocks: OrderedDict[bytes, int] = OrderedDict()     # key -> slot, oldest first
        self._chunks: list[list[torch.Tensor]] = []               # per chunk, per kind: (slots, *shape)
        self._where: list[tuple[int, int]] = []                   # slot -> (chunk, index in it)
        self._free: list[int] = []
        self.allocated_bytes = 0                                  # what the chunks take (pinned: as rounded)
        self.peak_bytes = 0

    @property
    def bytes(self) -> int:
        """Bytes of the blocks held."""
        return len(self.blocks) * self.block_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def views(self, slot: int) -> BlockData:
        c, i = self._where[slot]
        return [t[i] for t in self._chunks[c]]

    def _cost(self, slots: int) -> int:
        n = slots * self.block_bytes
        return _pow2(n) if self.pin else n

    def _new_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        room = self.budget - self.allocated_bytes
        slots = min(max(1, CHUNK_BYTES // max(self.block_bytes, 1)), room // max(self.block_bytes, 1))
        while slots and self._cost(slots) > room:
            slots -= 1
        if slots == 0:
            return None
        chunk = [torch.empty((slots, *s), dtype=self.dtype, pin_memory=self.pin) for s in self.shapes]
        self._chunks.append(chunk)
        self.allocated_bytes += self._cost(slots)
        first = len(self._where)
        self._where.extend((len(self._chunks) - 1, i) for i in range(slots))
        self._free.extend(range(first + slots - 1, first, -1))
        return first

    def store(self, key: bytes, src: BlockData, spill: Callable[[bytes, BlockData], None]) -> bool:
        """Copy the block in (the newest); when full, the oldest block goes to spill(key, its data) first (the data
        is valid during the call only). False when the tier holds nothing at all (budget under one block)."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return True
        slot = self._new_slot()
        if slot is None:
            if not self.blocks:
                return False
            old, slot = self.blocks.popitem(last=False)
            spill(old, self.views(slot))
        for d, s in zip(self.views(slot), src):
            d.copy_(s)
        self.blocks[key] = slot
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return True

    def touch(self, key: bytes) -> None:
        self.blocks.move_to_end(key)

    def load(self, key: bytes, dst: BlockData) -> bool:
        """Copy the block out into dst and drop it from the tier (it is back on the device); False if absent."""
        slot = self.blocks.pop(key, None)
        if slot is None:
            return False
        for d, s in zip(dst, self.views(slot)):
            d.copy_(s)                     # blocking: the slot is reused at once
        self._free.append(slot)
        return True

    def discard(self, key: bytes) -> None:
        slot = self.blocks.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def oldest_first(self) -> list[tuple[bytes, BlockData]]:
        return [(k, self.views(s)) for k, s in self.blocks.items()]
