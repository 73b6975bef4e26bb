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

Families with recurrent layers (linear attention: Qwen3-Next, Qwen3.5-MoE) need, besides the blocks, the layers'
state after the prefix's last token to continue from it. A snapshot of the whole state (StateLayout: every DeltaNet
layer's conv window and state) is kept at chosen block ends only, under a key derived from the block's (keys.state_key),
and moves through the same tiers, counted in the same budgets: on the device (up to `device_states` of them, or
within `device_bytes`), evicted to RAM (with its block, when the block goes), then to disk, each its own checksummed
file. A request resumes from the longest cached prefix whose end has a snapshot: its blocks are reused, the snapshot
becomes the request's state (shared, not copied: a forward never writes state tensors in place), the rest is
prefilled. Which block ends get a snapshot (a snapshot is ~200 blocks' worth of bytes for Qwen3-Next-80B, so not all):
- the prompt's last reusable block end ((P-1)//B blocks: what a repeat of the prompt resumes from);
- where the prompt leaves the longest cached prefix of blocks (a junction: an earlier request shared the prefix up to
  there, e.g. a system prompt followed by another question) and where it leaves a prefix shared with another request
  added in the same step; the next request sharing that prefix resumes there;
- the last block end a request crossed (`SeqCache.tail`, kept when it ends: the next chat turn resumes after the
  reply), and with `state_every` every that many tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from ktlayouts import kv_block_file as kvf

from ..models.kv_cache import BlockPool, SeqCache, StateLayout
from .disk_tier import DiskTier
from .keys import chain_keys, identity_digest, root_key, state_key
from .ram_tier import BlockData, EntryKind, RamTier

TIERS = ("device", "ram", "disk")


@dataclass
class PrefixCacheConfig:
    device_bytes: int | None = None      # cached blocks nobody uses + state snapshots kept on the device (None: blocks
                                         # as the pool has room, snapshots up to device_states)
    ram_bytes: int = 4 << 30             # CPU RAM tier budget (0: none)
    disk_dir: str | Path | None = None   # disk tier folder (None: no disk tier)
    disk_bytes: int = 16 << 30           # disk tier budget
    device_states: int | None = None     # recurrent-state snapshots kept on the device when device_bytes is None
                                         # (None: DEVICE_STATES; the Engine uses its max_batch)
    state_every: int = 0                 # also snapshot every this many tokens (in whole blocks; 0: no)


DEVICE_STATES = 16


def block_kind(pool: BlockPool) -> EntryKind:
    shapes = tuple(pool.layout.block_shapes())
    return EntryKind("block", tuple(f"t{i}" for i in range(len(shapes))), shapes, (pool.dtype,) * len(shapes),
                     pool.layout.describe(), kvf.SUFFIX)


def state_kind(layout: StateLayout) -> EntryKind:
    specs = layout.specs()
    return EntryKind("state", tuple(f"r{i}" for i in range(len(specs))), tuple(s for s, _ in specs),
                     tuple(d for _, d in specs), layout.describe(), kvf.STATE_SUFFIX)


class PrefixCache:
    def __init__(self, pool: BlockPool, identity: dict[str, str], config: PrefixCacheConfig | None = None,
                 states: StateLayout | None = None):
        """states: the model's recurrent-state layout (None: a family without recurrent layers)."""
        self.pool, self.config = pool, config or PrefixCacheConfig()
        cfg = self.config
        self.block_size = pool.block_size
        self.block_kind = block_kind(pool)
        self.states, self.state_kind = states, (state_kind(states) if states is not None else None)
        ident = {**identity, "layout": pool.layout.describe()}
        if states is not None:
            ident["state_layout"] = states.describe()
        digest = identity_digest(ident)
        self.root = root_key(digest)
        self.device_budget = None if cfg.device_bytes is None else max(0, int(cfg.device_bytes))
        self.max_device_states = DEVICE_STATES if cfg.device_states is None else max(0, int(cfg.device_states))
        self.state_bytes = self.state_kind.nbytes if self.state_kind is not None else 0
        every = max(0, int(cfg.state_every))
        self.state_every = max(1, every // self.block_size) if every else 0   # in blocks
        self.on_device: dict[bytes, int] = {}               # key -> pool block
        self.key_of: dict[int, bytes] = {}                  # pool block -> key
        self.unused: OrderedDict[int, int] = OrderedDict()   # keyed device blocks no request holds -> last use
        self.dev_states: OrderedDict[bytes, tuple[BlockData, int]] = OrderedDict()   # state key -> (data, last use)
        self._tick = 0                                       # recency shared by unused blocks and device states
        self._pin = pool.device.type == "cuda"
        self.ram = RamTier(cfg.ram_bytes, self.block_kind, pin=self._pin)
        self.disk = None
        if cfg.disk_dir is not None:
            kinds = [self.block_kind] + ([self.state_kind] if self.state_kind is not None else [])
            self.disk = DiskTier(cfg.disk_dir, cfg.disk_bytes, digest.hex(), kinds)
        self.counters = {"hit_tokens": 0, "miss_tokens": 0, "evicted_blocks_device": 0, "evicted_blocks_ram": 0,
                         "dropped_blocks": 0, "evicted_states_device": 0, "evicted_states_ram": 0,
                         "dropped_states": 0, "saved_states": 0,
                         **{f"hit_tokens_{t}": 0 for t in TIERS}, **{f"hit_blocks_{t}": 0 for t in TIERS},
                         **{f"hit_states_{t}": 0 for t in TIERS}}
        pool.on_unused, pool.reclaim = self._on_unused, self._reclaim

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    # -- matching a new request ------------------------------------------------------------------------------------
    def prompt_keys(self, prompt_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's blocks that may be reused: full blocks, leaving at least one token to prefill."""
        return chain_keys(self.root, prompt_ids, self.block_size, (len(prompt_ids) - 1) // self.block_size)

    def cached_prefix_blocks(self, keys: list[bytes]) -> int:
        """How many leading keys some tier holds (no side effects; a disk file may still turn out corrupt)."""
        n = 0
        for k in keys:
            if not self._held(k):
                break
            n += 1
        return n

    def _held(self, key: bytes) -> bool:
        return key in self.on_device or key in self.ram or (self.disk is not None and key in self.disk)

    def _has_state(self, block_key: bytes) -> bool:
        sk = state_key(block_key)
        return sk in self.dev_states or self._held(sk)

    def usable_prefix_blocks(self, keys: list[bytes]) -> int:
        """Leading blocks a request could resume after: held blocks, ending (recurrent families) at a snapshot."""
        n = self.cached_prefix_blocks(keys)
        if self.states is not None:
            while n and not self._has_state(keys[n - 1]):
                n -= 1
        return n

    def match(self, cache: SeqCache, prompt_ids: list[int], keys: list[bytes] | None = None,
              shared_blocks: int = 0) -> int:
        """Give the empty cache the longest cached prefix of prompt_ids (bringing RAM/disk blocks back to the
        device; with recurrent layers, ending at a snapshot, which becomes the cache's state); -> its length in
        tokens (a multiple of the block size). shared_blocks: how many leading blocks the prompt shares with another
        request of the same step (recurrent families snapshot there)."""
        keys = self.prompt_keys(prompt_ids) if keys is None else keys
        n_kv = self.cached_prefix_blocks(keys)
        want = keys[:self.usable_prefix_blocks(keys)]
        from_disk = {}
        if self.disk is not None:                          # read the prefix's disk blocks together
            disk_keys = [k for k in want if not (k in self.on_device or k in self.ram)]
            if len(disk_keys) > 1:
                from_disk = dict(zip(disk_keys, self.disk.get_many(disk_keys)))
        taken = []
        for key in want:
            got = self._take(key, from_disk)
            if got is None:
                break
            taken.append(got)
        n, state = len(taken), None
        if self.states is not None:                        # end at the longest prefix whose snapshot loads
            while n and (state := self._take_state(keys[n - 1])) is None:
                n -= 1
            for b, _tier in taken[n:]:
                self.pool.release(b)                       # (keyed: it stays cached)
        for _b, tier in taken[:n]:
            self.counters[f"hit_blocks_{tier}"] += 1
            self.counters[f"hit_tokens_{tier}"] += self.block_size
        hit = n * self.block_size
        cache.adopt([b for b, _ in taken[:n]], list(prompt_ids[:hit]), keys[:n])
        if state is not None:
            cache.recurrent = self.states.unflatten(state)
        if self.states is not None:
            self._plan_snapshots(cache, keys, n, n_kv, shared_blocks)
        self.counters["hit_tokens"] += hit
        self.counters["miss_tokens"] += len(prompt_ids) - hit
        return hit

    def plan_snapshots(self, cache: SeqCache, prompt_ids: list[int], shared_blocks: int = 0) -> None:
        """Snapshots for a request prefilled in full (prompt logprobs): as match() would plan them."""
        if self.states is not None:
            keys = self.prompt_keys(prompt_ids)
            self._plan_snapshots(cache, keys, 0, self.cached_prefix_blocks(keys), shared_blocks)

    def _plan_snapshots(self, cache: SeqCache, keys: list[bytes], start: int, n_kv: int, shared: int) -> None:
        """Which block ends of the prompt the request snapshots while it prefills from block `start` (module
        docstring): the last reusable one, the end of the cached prefix and of one shared in this step, every
        state_every; none that some tier already holds."""
        ends = {len(keys), n_kv, shared}
        if self.state_every:
            ends.update(range(self.state_every, len(keys) + 1, self.state_every))
        cache.snap_at = {i * self.block_size for i in ends
                         if start < i <= len(keys) and not self._has_state(keys[i - 1])}

    def _take(self, key: bytes, from_disk: dict) -> tuple[int, str] | None:
        b = self.on_device.get(key)
        if b is not None:
            self.unused.pop(b, None)
            self.pool.retain(b)
            return b, "device"
        in_ram = key in self.ram
        if not (in_ram or (self.disk is not None and (key in from_disk or key in self.disk))):
            return None
        if in_ram:
            self.ram.touch(key)                            # newest: the allocation below may push entries out
        b = self.pool.allocate()                           # (it may move an unused device block to RAM)
        if self.ram.load(key, self.pool.block_views(b)):
            tier = "ram"
        else:
            data = None if self.disk is None else from_disk.pop(key) if key in from_disk else self.disk.get(key)
            if data is None:                               # absent, or corrupt: the prefix ends here
                self.pool.release(b)
                return None
            self.pool.load_block(b, data)
            tier = "disk"
        self._register(b, key)
        return b, tier

    def _take_state(self, block_key: bytes) -> BlockData | None:
        """The snapshot at this block's end, on the device (brought back from RAM or disk), or None (absent or
        corrupt). The tensors are shared with the cache: the request's forward never writes them."""
        sk = state_key(block_key)
        got = self.dev_states.get(sk)
        if got is not None:
            self.dev_states[sk] = (got[0], self._now())
            self.dev_states.move_to_end(sk)
            tier, data = "device", got[0]
        elif sk in self.ram:
            data = self.state_kind.empty(self.pool.device)
            self.ram.load(sk, data)
            tier = "ram"
        elif self.disk is not None and sk in self.disk:
            data = self.disk.get(sk)
            if data is None:                               # corrupt (deleted): recomputed
                return None
            data = [t.to(self.pool.device) for t in data]
            tier = "disk"
        else:
            return None
        self.counters[f"hit_states_{tier}"] += 1
        if tier != "device":                               # back on the device, as a block found there would be
            self.dev_states[sk] = (data, self._now())
            self._trim_device()
        return data

    # -- blocks a request completed --------------------------------------------------------------------------------
    def publish(self, cache: SeqCache) -> None:
        """Key the cache's newly completed full blocks and make them findable, and keep the state snapshots the
        forward recorded (call after each forward)."""
        full = cache.length // self.block_size
        done = len(cache.block_hashes)
        if full > done:
            cache.block_hashes[:] = chain_keys(self.root, cache.tokens, self.block_size, full, cache.block_hashes)
            for i in range(done, full):
                key, b = cache.block_hashes[i], cache.blocks[i]
                if key in self.on_device or b in self.key_of:
                    continue                               # another block holds this key: this one stays private
                self._register(b, key)
                self.ram.discard(key)                      # the device copy replaces a RAM one
        if self.states is None or not cache.recurrent:
            return
        B, end = self.block_size, cache.length
        for p in sorted(cache.snaps):                      # recorded inside a forward
            self._put_state(cache.block_hashes[p // B - 1], self.states.flatten(cache.snaps.pop(p)))
            cache.snap_at.discard(p)
        if end in cache.snap_at:                           # the state after this forward
            self._put_state(cache.block_hashes[end // B - 1], self.states.flatten(cache.recurrent))
            cache.snap_at.discard(end)
        elif end % B == 0 and end:
            cache.tail = (end, dict(cache.recurrent))     # references: the next forward makes new tensors

    def retire(self, cache: SeqCache) -> None:
        """Before a request's cache is released: keep the state at the last block end it crossed (the next chat
        turn continues after the reply)."""
        if self.states is not None and cache.tail is not None:
            p, rec = cache.tail
            cache.tail = None
            if 0 < p // self.block_size <= len(cache.block_hashes):
                self._put_state(cache.block_hashes[p // self.block_size - 1], self.states.flatten(rec))

    def _register(self, b: int, key: bytes) -> None:
        self.on_device[key] = b
        self.key_of[b] = key

    def _put_state(self, block_key: bytes, data: BlockData) -> None:
        """Keep the snapshot at this block's end on the device (unless some tier has it), then trim the device."""
        sk = state_key(block_key)
        if sk in self.dev_states or self._held(sk):
            return
        self.dev_states[sk] = (data, self._now())
        self.counters["saved_states"] += 1
        self._trim_device()

    # -- pool hooks and eviction -----------------------------------------------------------------------------------
    def _on_unused(self, b: int) -> bool:
        if b not in self.key_of:
            return False                                   # private block: the pool frees it
        self.unused[b] = self._now()
        self._trim_device()
        return True

    def _trim_device(self) -> None:
        """Keep the device tier within its budget: device_bytes for unused blocks + snapshots (least recently used
        first out), or without one, at most max_device_states snapshots (blocks: until the pool needs them)."""
        if self.device_budget is None:
            while len(self.dev_states) > self.max_device_states:
                self._evict_state(next(iter(self.dev_states)))
            return
        while self.device_cached_bytes() > self.device_budget:
            b = next(iter(self.unused), None)
            sk = next(iter(self.dev_states), None)
            if sk is not None and (b is None or self.dev_states[sk][1] < self.unused[b]):
                self._evict_state(sk)
            else:
                del self.unused[b]
                self._evict(b)
                self.pool.free(b)

    def device_cached_bytes(self) -> int:
        """Device bytes the cache holds beyond what requests use: unused blocks and snapshots."""
        return len(self.unused) * self.pool.block_bytes + len(self.dev_states) * self.state_bytes

    def _reclaim(self) -> int | None:
        if not self.unused:
            return None
        victim, _ = self.unused.popitem(last=False)
        self._evict(victim)
        return victim

    def _host_copy(self, data: BlockData) -> BlockData:
        return [v.to("cpu", copy=True) for v in data]

    def _evict(self, b: int) -> None:
        """Device -> RAM (-> disk): the block's data leaves the device block b, which the caller reuses; its
        snapshot, if on the device, goes with it."""
        key = self.key_of.pop(b)
        del self.on_device[key]
        self.counters["evicted_blocks_device"] += 1
        self._to_ram(key, self.pool.block_views(b), self.block_kind)
        if state_key(key) in self.dev_states:
            self._evict_state(state_key(key))

    def _evict_state(self, sk: bytes) -> None:
        data, _ = self.dev_states.pop(sk)
        self.counters["evicted_states_device"] += 1
        self._to_ram(sk, data, self.state_kind)

    def _to_ram(self, key: bytes, data: BlockData, kind: EntryKind) -> None:
        if self.ram.store(key, data, self._spill, kind):
            return
        # no room in RAM (budget under one entry): straight to disk, if there is one
        if self.disk is None or (key not in self.disk and not self.disk.put(key, self._host_copy(data), kind)):
            self.counters[f"dropped_{kind.name}s"] += 1

    def _spill(self, key: bytes, data: BlockData, kind: EntryKind) -> None:
        """The RAM tier's oldest entry, pushed out: to disk (data is valid during this call only)."""
        self.counters[f"evicted_{kind.name}s_ram"] += 1
        if self.disk is None or not self.disk.put(key, data, kind):
            self.counters[f"dropped_{kind.name}s"] += 1

    def flush(self) -> int:
        """Write every cached block and snapshot not yet on disk to the disk tier (server shutdown); -> entries
        written."""
        if self.disk is None:
            return 0
        before = self.disk.writes
        for key, data, kind in self.ram.oldest_first():
            self.disk.put(key, data, kind)
        for sk, (data, _) in list(self.dev_states.items()):
            if sk not in self.disk:
                self.disk.put(sk, self._host_copy(data), self.state_kind)
        in_use = [b for b in self.key_of if b not in self.unused]
        for b in list(self.unused) + in_use:                  # least recently used first: the disk keeps the newest
            key = self.key_of[b]
            if key not in self.disk:
                self.disk.put(key, self._host_copy(self.pool.block_views(b)), self.block_kind)
        self.disk.save_recency()
        return self.disk.writes - before

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # -- numbers for /metrics --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        bb, sb = self.pool.block_bytes, self.state_bytes
        s = dict(self.counters)
        n_dev_states = len(self.dev_states)
        s.update(block_size=self.block_size, block_bytes=bb, state_bytes=sb,
                 device_blocks=len(self.on_device), device_states=n_dev_states,
                 device_bytes=len(self.on_device) * bb + n_dev_states * sb,
                 device_unused_bytes=self.device_cached_bytes(), ram_blocks=self.ram.count("block"),
                 ram_states=self.ram.count("state"), ram_bytes=self.ram.bytes,
                 ram_allocated_bytes=self.ram.allocated_bytes, ram_budget_bytes=self.ram.budget,
                 ram_peak_bytes=self.ram.peak_bytes)
        d = self.disk
        if d is None:
            s.update(disk_blocks=0, disk_states=0, disk_bytes=0, disk_budget_bytes=0, disk_peak_bytes=0,
                     disk_corrupt_blocks=0, disk_reads=0, disk_writes=0)
        else:
            s.update(disk_blocks=d.count("block"), disk_states=d.count("state"), disk_bytes=d.bytes,
                     disk_budget_bytes=d.budget, disk_peak_bytes=d.peak_bytes, disk_corrupt_blocks=d.corrupt,
                     disk_reads=d.reads, disk_writes=d.writes)
        return s
