"""The CPU RAM tier: host copies of blocks evicted from the device, under a byte budget, least recently used first
out. A block is in the device tier or here, never both (a hit moves it back to the device)."""
from __future__ import annotations

from collections import OrderedDict

import torch

BlockData = list[torch.Tensor]     # one tensor per kind, BlockLayout.block_shapes() order


def data_bytes(data: BlockData) -> int:
    return sum(t.numel() * t.element_size() for t in data)


class RamTier:
    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        self.blocks: OrderedDict[bytes, BlockData] = OrderedDict()    # oldest first
        self.bytes = 0
        self.peak_bytes = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def put(self, key: bytes, data: BlockData) -> list[tuple[bytes, BlockData]]:
        """Keep data; -> the blocks pushed out to stay under the budget, oldest first (data itself if it can
        never fit)."""
        n = data_bytes(data)
        if n > self.budget:
            return [(key, data)]
        self.discard(key)
        out = []
        while self.bytes + n > self.budget:
            k, d = self.blocks.popitem(last=False)
            self.bytes -= data_bytes(d)
            out.append((k, d))
        self.blocks[key] = data
        self.bytes += n
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return out

    def take(self, key: bytes) -> BlockData | None:
        """Remove and return the block (it goes back to the device)."""
        data = self.blocks.pop(key, None)
        if data is not None:
            self.bytes -= data_bytes(data)
        return data

    def discard(self, key: bytes) -> None:
        self.take(key)

    def oldest_first(self) -> list[tuple[bytes, BlockData]]:
        return list(self.blocks.items())
