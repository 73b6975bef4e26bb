"""The pieces of the prefix cache without a model: the KV BlockPool (reference counts, consecutive allocation, growth
keeping data), the RAM tier (byte budget, LRU), the disk tier (round trip of token and per-block state tensors, LRU
order kept across a reopen, budget trimmed at start, interrupted writes cleaned up, one server per folder), block keys
(a chain over the whole prefix and the model identity), and the block file container (ktlayouts.kv_block_file)."""
from __future__ import annotations

import hashlib

import pytest
import torch
from ktlayouts import kv_block_file as kvf
from ktrun.models.kv_cache import BlockLayout, BlockPool, SeqCache
from ktrun.prefix_cache import DiskTierError, PrefixCache, PrefixCacheConfig
from ktrun.prefix_cache.disk_tier import DiskTier
from ktrun.prefix_cache.keys import chain_keys, identity_digest, root_key
from ktrun.prefix_cache.ram_tier import RamTier, data_bytes

# a layout with a per-block state snapshot next to the KV rows (what a linear-attention family would add)
LAYOUT = BlockLayout(num_layers=2, token_shapes=((6,), (2, 3)), block_size=4, state_shapes=((3, 3),))


def block(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in LAYOUT.block_shapes()]


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def disk(folder, budget=1 << 20) -> DiskTier:
    return DiskTier(folder, budget, "ab" * 32, LAYOUT.describe(), LAYOUT.block_shapes(), len(LAYOUT.token_shapes),
                    torch.float32)


def test_pool_refcounts_consecutive_allocation_and_growth():
    pool = BlockPool(LAYOUT, torch.float32, "cpu")
    a, b = SeqCache(pool, 64), SeqCache(pool, 64)
    a.reserve(4 * 3)
    b.reserve(4 * 2)
    a.reserve(4 * 5)                                        # a's next blocks: after b's, consecutive again
    assert a.blocks == [0, 1, 2, 5, 6] and b.blocks == [3, 4] and a._runs == [[0, 3], [5, 2]] and pool.used == 7
    data = block(1)
    pool.load_block(a.blocks[2], data)
    c = SeqCache(pool, 200)
    c.reserve(4 * 20)                                       # the pool grows; every block keeps its data
    assert pool.capacity >= 27 and all(torch.equal(x, y) for x, y in zip(pool.block_views(a.blocks[2]), data))
    pool.retain(a.blocks[0])                                # shared by a second reader
    a.release()
    assert pool.ref[0] == 1 and pool.used == 1 + 2 + 20
    pool.release(0)
    b.release()
    del c                                                   # dropped without release(): the finalizer frees it
    assert pool.used == 0 and len(pool._free_set) == pool.capacity


def test_ram_tier_budget_and_lru():
    n = data_bytes(block(0))
    ram = RamTier(3 * n + n // 2, LAYOUT.block_shapes(), torch.float32)
    spilled = []

    def spill(k, data):
        spilled.append((k, [t.clone() for t in data]))

    assert all(ram.store(key(i), block(i), spill) for i in range(3)) and not spilled
    out = [torch.empty(s) for s in LAYOUT.block_shapes()]
    assert ram.load(key(0), out) and all(torch.equal(a, b) for a, b in zip(out, block(0)))   # back to the device
    ram.store(key(0), block(0), spill)                     # now the newest
    ram.store(key(3), block(3), spill)                     # full: the oldest (1) spills, with its data
    assert [k for k, _ in spilled] == [key(1)] and all(torch.equal(a, b) for a, b in zip(spilled[0][1], block(1)))
    assert ram.bytes == 3 * n and ram.allocated_bytes == 3 * n <= ram.budget and ram.peak_bytes <= ram.budget
    assert sum(t.untyped_storage().nbytes() for c in ram._chunks for t in c) == 3 * n   # memory really taken
    assert not RamTier(n - 1, LAYOUT.block_shapes(), torch.float32).store(key(9), block(9), spill)   # holds none


def test_disk_tier_round_trip_lru_across_reopen_and_budget(tmp_path):
    folder = tmp_path / "kv"
    d = disk(folder)
    for i in range(4):
        assert d.put(key(i), block(i))
    got = d.get(key(2))
    assert all(torch.equal(x, y) for x, y in zip(got, block(2)))      # token kinds and the state snapshot
    assert d.get_many([key(0), key(1)])[1] is not None                # 2, then 0, 1 read: 3 is least recent
    size = d.bytes // 4
    d.close()
    (folder / "ab" / f"{'ab' * 32}.kvblock.tmp-123").parent.mkdir(exist_ok=True)
    (folder / "ab" / f"{'ab' * 32}.kvblock.tmp-123").write_bytes(b"half a file")   # an interrupted write
    d = disk(folder, budget=3 * size)                       # reopened with a smaller budget: the LRU one goes
    assert key(3) not in d and all(key(i) in d for i in (0, 1, 2)) and d.bytes <= 3 * size
    assert not list(folder.rglob("*.tmp-*"))
    with pytest.raises(DiskTierError, match="in use by another ktrun server"):
        disk(folder)
    d.put(key(5), block(5))                                 # makes room: 2 goes (0, 1 were read after it)
    assert key(2) not in d and key(5) in d and d.peak_bytes <= 3 * size
    assert sum(p.stat().st_size for p in folder.rglob("*.kvblock")) == d.bytes
    d.close()


def test_disk_tier_rejects_bad_files(tmp_path):
    d = disk(tmp_path / "kv")
    for i in range(3):
        d.put(key(i), block(i))
    paths = [tmp_path / "kv" / kvf.relpath(key(i).hex()) for i in range(3)]
    paths[0].write_bytes(paths[0].read_bytes()[:-1] + b"\x00")       # payload byte changed
    paths[1].write_bytes(paths[2].read_bytes())                       # another block's file under this name
    assert d.get(key(0)) is None and d.get(key(1)) is None and d.corrupt == 2
    assert not paths[0].exists() and not paths[1].exists() and d.get(key(2)) is not None
    other = DiskTier(tmp_path / "kv2", 1 << 20, "cd" * 32, LAYOUT.describe(), LAYOUT.block_shapes(), 2,
                     torch.float32)                                  # same key, another model identity
    other.put(key(2), block(2))
    d.close()
    other.close()
    (tmp_path / "kv" / kvf.relpath(key(2).hex())).write_bytes((tmp_path / "kv2" / kvf.relpath(key(2).hex())).read_bytes())
    d = disk(tmp_path / "kv")
    assert d.get(key(2)) is None and d.corrupt == 1
    d.close()


def test_block_file_container():
    raw = kvf.pack(b"payload")
    assert kvf.unpack(raw) == b"payload" and raw[:7] == b"KTKVBLK" and len(raw) == kvf.HEADER_BYTES + 7
    for bad, why in ((raw[:30], "shorter"), (b"XXXXXXX" + raw[7:], "magic"), (raw[:7] + b"\x09" + raw[8:], "version"),
                     (raw[:-1] + b"P", "checksum")):
        with pytest.raises(kvf.KVBlockFileError, match=why):
            kvf.unpack(bad, "f")
    assert kvf.key_of(f"{'0a' * 32}.kvblock") == "0a" * 32 and kvf.key_of("x.kvblock") is None
    with pytest.raises(ValueError):
        kvf.relpath("../etc")


def test_keys_chain_over_the_whole_prefix_and_the_identity():
    r1, r2 = (root_key(identity_digest({"model": m})) for m in ("a", "b"))
    toks = list(range(12))
    k = chain_keys(r1, toks, 4, 3)
    assert k == chain_keys(r1, toks, 4, 3, k[:1]) and len(set(k)) == 3
    assert chain_keys(r1, [99] + toks[1:], 4, 3)[2] != k[2]            # an early token changes every later key
    assert chain_keys(r2, toks, 4, 3)[0] != k[0]                        # another model never matches


def test_prefix_cache_device_budget_and_reclaim():
    pool = BlockPool(LAYOUT, torch.float32, "cpu")
    bb = pool.block_bytes
    pc = PrefixCache(pool, {"t": "1"}, PrefixCacheConfig(device_bytes=2 * bb, ram_bytes=10 * bb))
    a = SeqCache(pool, 64)
    a.reserve(4 * 4)
    a.length, a.tokens[:] = 16, list(range(16))
    pc.publish(a)
    assert len(pc.key_of) == 4
    a.release()                                             # 4 keyed blocks unused: 2 stay, 2 go to RAM
    assert len(pc.unused) == 2 and len(pc.ram) == 2 and pool.used == 0
    b = SeqCache(pool, 64)
    assert pc.match(b, list(range(16)) + [7]) == 16          # 2 from the device, 2 back from RAM
    assert pc.counters["hit_blocks_device"] == 2 and pc.counters["hit_blocks_ram"] == 2 and len(pc.ram) == 0
    b.release()
    evicted, cap, free = pc.counters["evicted_blocks_device"], pool.capacity, len(pool._free_set)
    big = SeqCache(pool, 64 * 8)
    big.reserve(4 * (free + 1))                             # one block more than is free: the pool reclaims the
    assert pool.capacity == cap and pc.counters["evicted_blocks_device"] == evicted + 1   # LRU cached one first
    assert len(pc.unused) == 1 and len(pc.ram) == 3
