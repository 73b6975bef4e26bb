"""PrefixCache: full KV blocks kept after their request and reused by later requests with the same prefix.

Each full block of a request is keyed (keys.py) by the hash of every token up to its end plus the model identity.
Tiers, each least recently used first out:
- device: the block stays where it is in the model's BlockPool (the live cache tensors). While requests use it, it
  is shared read-only (reference counted); when none does it is kept, up to `device_bytes` (None: as long as the
  pool needs no room for requests; the pool asks for cached blocks back before it grows).
- RAM: blocks evicted from the device are copied into host slots (pinned on CUDA) under `ram_bytes` (ram_tier.py).
- disk: blocks evicted from RAM go to checksummed files under `disk_dir` within `disk_bytes` (disk_tier.py), and
  every cached block is written there at shutdown (flush), so a restarted server starts warm.
A block found in the RAM or disk tier is copied back into a device block instead of being recomputed.

Only full blocks are keyed, and a request always prefills at least its last prompt token (which gives the logits
of its first output token), so a prompt of P tokens reuses at most (P-1)//B blocks. A request's partial last block,
and a full block whose key another device block already holds, are private: freed when the request ends.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ..models.kv_cache import BlockPool, SeqCache
from .disk_tier import DiskTier
from .keys import chain_keys, identity_digest, root_key
from .ram_tier import BlockData, RamTier

TIERS = ("device", "ram", "disk")


@dataclass
class PrefixCacheConfig:
    device_bytes: int | None = None      # cached blocks nobody uses kept on the device (None: what the pool has room for)
    ram_bytes: int = 4 << 30             # CPU RAM tier budget (0: none)
    disk_dir: str | Path | None = None   # disk tier folder (None: no disk tier)
    disk_bytes: int = 16 << 30           # disk tier budget


class PrefixCache:
    def __init__(self, pool: BlockPool, identity: dict[str, str], config: PrefixCacheConfig | None = None):
        self.pool, self.config = pool, config or PrefixCacheConfig()
        cfg = self.config
        self.block_size = pool.block_size
        digest = identity_digest({**identity, "layout": pool.layout.describe()})
        self.root = root_key(digest)
        self.device_budget = None if cfg.device_bytes is None else max(0, int(cfg.device_bytes))
        self.on_device: dict[bytes, int] = {}               # key -> pool block
        self.key_of: dict[int, bytes] = {}                  # pool block -> key
        self.unused: OrderedDict[int, None] = OrderedDict()  # keyed device blocks no request holds, oldest first
        self._pin = pool.device.type == "cuda"
        self.ram = RamTier(cfg.ram_bytes, pool.layout.block_shapes(), pool.dtype, pin=self._pin)
        self.disk = None
        if cfg.disk_dir is not None:
            self.disk = DiskTier(cfg.disk_dir, cfg.disk_bytes, digest.hex(), pool.layout.describe(),
                                 pool.layout.block_shapes(), len(pool.layout.token_shapes), pool.dtype)
        self.counters = {"hit_tokens": 0, "miss_tokens": 0, "evicted_blocks_device": 0, "evicted_blocks_ram": 0,
                         "dropped_blocks": 0,
                         **{f"hit_tokens_{t}": 0 for t in TIERS}, **{f"hit_blocks_{t}": 0 for t in TIERS}}
        pool.on_unused, pool.reclaim = self._on_unused, self._reclaim

    # -- matching a new request ------------------------------------------------------------------------------------
    def prompt_keys(self, prompt_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's blocks that may be reused: full blocks, leaving at least one token to prefill."""
        return chain_keys(self.root, prompt_ids, self.block_size, (len(prompt_ids) - 1) // self.block_size)

    def cached_prefix_blocks(self, keys: list[bytes]) -> int:
        """How many leading keys some tier holds (no side effects; a disk file may still turn out corrupt)."""
        n = 0
        for k in keys:
            if not (k in self.on_device or k in self.ram or (self.disk is not None and k in self.disk)):
                break
            n += 1
        return n

    def match(self, cache: SeqCache, prompt_ids: list[int], keys: list[bytes] | None = None) -> int:
        """Give the empty cache the longest cached prefix of prompt_ids (bringing RAM/disk blocks back to the
        device); -> its length in tokens (a multiple of the block size)."""
        keys = self.prompt_keys(prompt_ids) if keys is None else keys
        from_disk = {}
        if self.disk is not None:                          # read the prefix's disk blocks together
            want = []
            for k in keys:
                if k in self.on_device or k in self.ram:
                    continue
                if k not in self.disk:
                    break
                want.append(k)
            if len(want) > 1:
                from_disk = dict(zip(want, self.disk.get_many(want)))
        blocks = []
        for key in keys:
            b = self._take(key, from_disk)
            if b is None:
                break
            blocks.append(b)
        n = len(blocks) * self.block_size
        cache.adopt(blocks, list(prompt_ids[:n]), keys[:len(blocks)])
        self.counters["hit_tokens"] += n
        self.counters["miss_tokens"] += len(prompt_ids) - n
        return n

    def _take(self, key: bytes, from_disk: dict) -> int | None:
        b = self.on_device.get(key)
        if b is not None:
            self.unused.pop(b, None)
            self.pool.retain(b)
            tier = "device"
        else:
            in_ram = key in self.ram
            if not (in_ram or (self.disk is not None and (key in from_disk or key in self.disk))):
                return None
            if in_ram:
                self.ram.touch(key)                        # newest: the allocation below may push blocks out
            b = self.pool.allocate()                       # (it may move an unused device block to RAM)
            if self.ram.load(key, self.pool.block_views(b)):
                tier = "ram"
            else:
                data = None if self.disk is None else from_disk.pop(key) if key in from_disk else self.disk.get(key)
                if data is None:                           # absent, or corrupt: the prefix ends here
                    self.pool.release(b)
                    return None
                self.pool.load_block(b, data)
                tier = "disk"
            self._register(b, key)
        self.counters[f"hit_blocks_{tier}"] += 1
        self.counters[f"hit_tokens_{tier}"] += self.block_size
        return b

    # -- blocks a request completed --------------------------------------------------------------------------------
    def publish(self, cache: SeqCache) -> None:
        """Key the cache's newly completed full blocks and make them findable (call after each forward)."""
        full = cache.length // self.block_size
        done = len(cache.block_hashes)
        if full <= done:
            return
        cache.block_hashes[:] = chain_keys(self.root, cache.tokens, self.block_size, full, cache.block_hashes)
        for i in range(done, full):
            key, b = cache.block_hashes[i], cache.blocks[i]
            if key in self.on_device or b in self.key_of:
                continue                                   # another block holds this key: this one stays private
            self._register(b, key)
            self.ram.discard(key)                          # the device copy replaces a RAM one

    def _register(self, b: int, key: bytes) -> None:
        self.on_device[key] = b
        self.key_of[b] = key

    # -- pool hooks and eviction -----------------------------------------------------------------------------------
    def _on_unused(self, b: int) -> bool:
        if b not in self.key_of:
            return False                                   # private block: the pool frees it
        self.unused[b] = None
        if self.device_budget is not None:
            while self.unused and len(self.unused) * self.pool.block_bytes > self.device_budget:
                victim, _ = self.unused.popitem(last=False)
                self._evict(victim)
                self.pool.free(victim)
        return True

    def _reclaim(self) -> int | None:
        if not self.unused:
            return None
        victim, _ = self.unused.popitem(last=False)
        self._evict(victim)
        return victim

    def _host_copy(self, b: int) -> BlockData:
        return [v.to("cpu", copy=True) for v in self.pool.block_views(b)]

    def _evict(self, b: int) -> None:
        """Device -> RAM (-> disk): the block's data leaves the device block b, which the caller reuses."""
        key = self.key_of.pop(b)
        del self.on_device[key]
        self.counters["evicted_blocks_device"] += 1
        if self.ram.store(key, self.pool.block_views(b), self._spill):
            return
        # no room in RAM (budget under one block): straight to disk, if there is one
        if self.disk is None or (key not in self.disk and not self.disk.put(key, self._host_copy(b))):
            self.counters["dropped_blocks"] += 1

    def _spill(self, key: bytes, data: BlockData) -> None:
        """The RAM tier's oldest block, pushed out: to disk (data is valid during this call only)."""
        self.counters["evicted_blocks_ram"] += 1
        if self.disk is None or not self.disk.put(key, data):
            self.counters["dropped_blocks"] += 1

    def flush(self) -> int:
        """Write every cached block not yet on disk to the disk tier (server shutdown); -> blocks written."""
        if self.disk is None:
            return 0
        before = self.disk.writes
        for key, data in self.ram.oldest_first():
            self.disk.put(key, data)
        in_use = [b for b in self.key_of if b not in self.unused]
        for b in list(self.unused) + in_use:                  # least recently used first: the disk keeps the newest
            key = self.key_of[b]
            if key not in self.disk:
                self.disk.put(key, self._host_copy(b))
        self.disk.save_recency()
        return self.disk.writes - before

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- numbers for /metrics --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        bb = self.pool.block_bytes
        s = dict(self.counters)
        s.update(block_size=self.block_size, block_bytes=bb,
                 device_blocks=len(self.on_device), device_bytes=len(self.on_device) * bb,
                 device_unused_bytes=len(self.unused) * bb, ram_blocks=len(self.ram), ram_bytes=self.ram.bytes,
                 ram_allocated_bytes=self.ram.allocated_bytes, ram_budget_bytes=self.ram.budget,
                 ram_peak_bytes=self.ram.peak_bytes)
        d = self.disk
        if d is None:
            s.update(disk_blocks=0, disk_bytes=0, disk_budget_bytes=0, disk_peak_bytes=0, disk_corrupt_blocks=0,
                     disk_reads=0, disk_writes=0)
        else:
            s.update(disk_blocks=len(d), disk_bytes=d.bytes, disk_budget_bytes=d.budget, disk_peak_bytes=d.peak_bytes,
                     disk_corrupt_blocks=d.corrupt, disk_reads=d.reads, disk_writes=d.writes)
        return s
