"""The pieces of the prefix cache without a model: the KV BlockPool (reference counts, consecutive allocation, growth
keeping data), the RAM tier (byte budget, LRU, state snapshots laid across block slots in the same budget), the disk
tier (round trip of KV blocks and state snapshots of mixed dtypes, LRU order kept across a reopen, budget trimmed at
start, interrupted writes cleaned up, one server per folder), block and state keys (a chain over the whole prefix and
the model identity), and the file container (ktlayouts.kv_block_file)."""
from __future__ import annotations

import hashlib

import pytest
import torch
from ktlayouts import kv_block_file as kvf
from ktrun.models.kv_cache import BlockLayout, BlockPool, SeqCache, StateLayout
from ktrun.prefix_cache import DiskTierError, PrefixCache, PrefixCacheConfig
from ktrun.prefix_cache.cache import block_kind, state_kind
from ktrun.prefix_cache.disk_tier import DiskTier
from ktrun.prefix_cache.keys import chain_keys, identity_digest, root_key, state_key
from ktrun.prefix_cache.ram_tier import RamTier, data_bytes

LAYOUT = BlockLayout(num_layers=2, token_shapes=((6,), (2, 3)), block_size=4)
BLOCK = block_kind(BlockPool(LAYOUT, torch.float32, "cpu"))
# a recurrent state of two layers, each a bf16 window (21 elements: the float32 state after it is not 4-byte aligned)
# and a float32 state: 484 bytes, more than one 384-byte block slot
STATE = state_kind(StateLayout((0, 2), ((3, 7), (2, 5, 5)), (torch.bfloat16, torch.float32)))


def block(seed: int, kind=BLOCK) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(d) for s, d in zip(kind.shapes, kind.dtypes)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def key(i: int) -> bytes:
    return hashlib.sha256(b"block %d" % i).digest()


def disk(folder, budget=1 << 20) -> DiskTier:
    return DiskTier(folder, budget, "ab" * 32, [BLOCK, STATE])


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
    ram = RamTier(3 * n + n // 2, BLOCK)
    spilled = []

    def spill(k, data, kind):
        spilled.append((k, [t.clone() for t in data], kind))

    assert all(ram.store(key(i), block(i), spill, BLOCK) for i in range(3)) and not spilled
    out = [torch.empty(s) for s in LAYOUT.block_shapes()]
    assert ram.load(key(0), out) and same(out, block(0))        # back to the device
    ram.store(key(0), block(0), spill, BLOCK)              # now the newest
    ram.store(key(3), block(3), spill, BLOCK)              # full: the oldest (1) spills, with its data
    assert [k for k, _, _ in spilled] == [key(1)] and same(spilled[0][1], block(1)) and spilled[0][2] is BLOCK
    assert ram.bytes == 3 * n and ram.allocated_bytes == 3 * n <= ram.budget and ram.peak_bytes <= ram.budget
    assert sum(c.untyped_storage().nbytes() for c in ram._chunks) == 3 * n   # memory really taken
    assert not RamTier(n - 1, BLOCK).store(key(9), block(9), spill, BLOCK)   # holds none


def test_ram_tier_lays_state_snapshots_across_block_slots():
    """A snapshot bigger than a block takes ceil(bytes / block bytes) slots of the same budget; it comes back bit
    for bit (bf16 and float32, unaligned), spills whole, and one larger than the whole budget is refused."""
    n = BLOCK.nbytes
    assert STATE.nbytes == 484 and n == 384
    ram = RamTier(5 * n, BLOCK)
    assert ram.slots_of(STATE) == 2
    spilled = []

    def spill(k, data, kind):
        spilled.append((k, [t.clone() for t in data], kind))

    for k, data, kind in ((key(0), block(0), BLOCK), (key(1), block(1), BLOCK), (state_key(key(1)), block(7, STATE),
                                                                                 STATE), (key(2), block(2), BLOCK)):
        assert ram.store(k, data, spill, kind)
    assert not spilled and ram.bytes == 5 * n and ram.count("state") == 1 and ram.count("block") == 3
    assert ram.store(state_key(key(2)), block(8, STATE), spill, STATE)   # 2 slots: blocks 0 and 1 go, oldest first
    assert [k for k, _, _ in spilled] == [key(0), key(1)] and same(spilled[1][1], block(1))
    assert ram.store(key(3), block(3), spill, BLOCK)                     # the first snapshot spills, whole
    assert spilled[-1][0] == state_key(key(1)) and spilled[-1][2] is STATE and same(spilled[-1][1], block(7, STATE))
    got = STATE.empty("cpu")
    assert ram.load(state_key(key(2)), got) and same(got, block(8, STATE))
    assert ram.bytes == 2 * n and ram.allocated_bytes == 5 * n <= ram.budget
    assert sum(c.untyped_storage().nbytes() for c in ram._chunks) == 5 * n
    assert not RamTier(n, BLOCK).store(state_key(key(5)), block(5, STATE), spill, STATE)


def test_disk_tier_round_trip_lru_across_reopen_and_budget(tmp_path):
    folder = tmp_path / "kv"
    d = disk(folder)
    for i in range(4):
        assert d.put(key(i), block(i), BLOCK)
    assert same(d.get(key(2)), block(2))
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
    d.put(key(5), block(5), BLOCK)                          # makes room: 2 goes (0, 1 were read after it)
    assert key(2) not in d and key(5) in d and d.peak_bytes <= 3 * size
    assert sum(p.stat().st_size for p in folder.rglob("*.kvblock")) == d.bytes
    d.close()


def test_disk_tier_keeps_state_snapshots_in_their_own_files(tmp_path):
    d = disk(tmp_path / "kv")
    sk = state_key(key(1))
    assert d.put(key(1), block(1), BLOCK) and d.put(sk, block(3, STATE), STATE)
    path = tmp_path / "kv" / kvf.relpath(sk.hex(), kvf.STATE_SUFFIX)
    assert path.is_file() and d.count("state") == 1 and d.count("block") == 1
    assert same(d.get(sk), block(3, STATE))                          # bf16 and float32 tensors, as written
    d.close()
    d = disk(tmp_path / "kv")                                         # a reopen finds both kinds
    assert sk in d and key(1) in d and d.count("state") == 1
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01                                                    # one bit of the last state tensor
    path.write_bytes(bytes(raw))
    assert d.get(sk) is None and d.corrupt == 1 and not path.exists() and d.get(key(1)) is not None
    d.close()


def test_block_file_container():
    raw = kvf.pack(b"payload")
    assert kvf.unpack(raw) == b"payload" and raw[:7] == b"KTKVBLK" and len(raw) == kvf.HEADER_BYTES + 7
    for bad, why in ((raw[:30], "shorter"), (b"XXXXXXX" + raw[7:], "magic"), (raw[:7] + b"\x09" + raw[8:], "version"),
                     (raw[:-1] + b"P", "checksum")):
        with pytest.raises(kvf.KVBlockFileError, match=why):
            kvf.unpack(bad, "f")
    assert kvf.key_of(f"{'0a' * 32}.kvblock") == "0a" * 32 and kvf.key_of("x.kvblock") is None
    assert kvf.key_of(f"{'0a' * 32}.kvstate") == "0a" * 32 and kvf.suffix_of("a.kvstate") == kvf.STATE_SUFFIX
    with pytest.raises(ValueError):
        kvf.relpath("../etc")


def test_keys_chain_over_the_whole_prefix_and_the_identity():
    r1, r2 = (root_key(identity_digest({"model": m})) for m in ("a", "b"))
    toks = list(range(12))
    k = chain_keys(r1, toks, 4, 3)
    assert k == chain_keys(r1, toks, 4, 3, k[:1]) and len(set(k)) == 3
    assert chain_keys(r1, [99] + toks[1:], 4, 3)[2] != k[2]            # an early token changes every later key
    assert chain_keys(r2, toks, 4, 3)[0] != k[0]                        # another model never matches
    assert len({state_key(x) for x in k} | set(k)) == 6                  # a block's snapshot has its own key


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
