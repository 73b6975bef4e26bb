"""Prefix cache (ktrun.prefix_cache) in the Engine, every family: with the cache, every greedy output equals the output
of an Engine without it (prefix cache off: every prompt prefilled in full), for repeated prompts, prefixes ending
inside a block, a multi-turn conversation (the generated reply's blocks are reused), requests sharing a prefix
added together and joining mid-decode, blocks evicted to RAM and disk and brought back, a restart with a warm disk
tier, and corrupted disk blocks (detected, recomputed, never used). RAM and disk bytes are measured independently of
the tiers' own counters (tensor bytes held, file sizes in the folder) after every step; finished requests leave
only keyed full blocks behind.

The linear-attention families (Qwen3-Next, Qwen3.5-MoE) resume only where a snapshot of their recurrent state was
kept (ktrun.prefix_cache.cache): where that makes them reuse less than the others the test says so (RECURRENT), and
it also checks their snapshots: taken where a prompt parts from a cached one, evicted and brought back with the
blocks, counted in every tier's budget (the device's too), corrupted on disk (detected, resumed from an earlier one)."""
from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
import torch
from ktlayouts import kv_block_file as kvf
from ktrun.engine import Engine, PrefixCacheConfig, SamplingParams
from ktrun.generate import generate
from ktrun.models.kv_cache import MAX_RUNS, Batch
from ktrun.prefix_cache.keys import state_key
from runtime_helpers import converted

from ktconvert.testing import ARCHS  # every registered family (tests/test_families.py)

B = 8            # positions per KV block in these tests
CTX = 160
N_GEN = 10


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


def run(eng: Engine, reqs: dict[str, list[int]], n: int = N_GEN, stagger: bool = False, check=None):
    """req_id -> (tokens, cached prompt tokens); with stagger one request joins per step while others decode;
    check() runs after every step."""
    out = {k: [] for k in reqs}
    cached = {}
    pending = list(reqs.items())
    while pending or eng.has_work():
        for k, ids in pending[:1] if stagger else pending:
            eng.add_request(k, ids, SamplingParams(max_tokens=n, ignore_eos=True))
        pending = pending[1:] if stagger else []
        for rid, tok, _fin in eng.step():
            out[rid].append(tok)
        cached.update(eng.cached_tokens)
        if check is not None:
            check()
    return {k: (out[k], cached[k]) for k in reqs}


# Logits of one prompt computed at another T (whole / chunked / after a shared prefix): the GEMMs' order differs;
# 2e-3 unless listed. DeepSeek-V4: the hyper-connections' Sinkhorn mixing carries it further (observed 3.1e-3). On
# the Intel AMX server (2026-12-05; torch's float GEMMs pick other kernels per row count there) a 30-row chunk then the
# rest against the whole prompt: GLM-4.5 2.6e-3, Kimi-Linear 3.6e-3, the same before and after that session's work.
LOGIT_ATOL = {"deepseek_v4": 5e-3, "glm4_moe": 4e-3, "kimi_linear": 5e-3}
RECURRENT = ("qwen3_next", "qwen3_5_moe", "kimi_linear")    # linear attention: a recurrent state per request


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory):
    conv = converted(tmp_path_factory, request.param, "bf16")
    base = Engine(conv, ctx=CTX, max_batch=8, prefix_cache=False)
    yield request.param, conv, base
    base.close()


def reference(base: Engine, reqs: dict[str, list[int]], n: int = N_GEN) -> dict[str, list[int]]:
    return {k: run(base, {k: ids}, n)[k][0] for k, ids in reqs.items()}


def test_cached_outputs_equal_uncached(family):
    arch, conv, base = family
    eng = Engine(conv, ctx=CTX, max_batch=8, kv_block_size=B)
    rng = random.Random(zlib.crc32(arch.encode()))       # not hash(): str hashes change per process
    system = prompt(rng, 5 * B + 3)                                  # a shared prefix that ends inside a block
    reqs = {"cold": system + prompt(rng, 7), "again": None, "partial": system + prompt(rng, 4)}
    reqs["again"] = list(reqs["cold"])
    want = reference(base, reqs)

    got = run(eng, {"cold": reqs["cold"]})["cold"]
    assert got == (want["cold"], 0)
    hit = (len(reqs["again"]) - 1) // B * B
    assert eng.uncached_tokens(reqs["again"]) == len(reqs["again"]) - hit   # the peek the server plans with
    got = run(eng, {"again": reqs["again"]})["again"]                # every full block but the one holding the last
    assert got == (want["again"], hit)                               # prompt token comes from the cache
    recurrent = arch in RECURRENT        # no snapshot at 5 blocks yet: computed, and one kept where it parts
    assert eng.uncached_tokens(reqs["partial"]) == len(reqs["partial"]) - (0 if recurrent else 5 * B)
    got = run(eng, {"partial": reqs["partial"]})["partial"]          # shares 5 full blocks + 3 tokens of the 6th
    assert got == (want["partial"], 0 if recurrent else 5 * B)
    third = system + prompt(rng, 5)                                  # another question after the same system prompt
    assert run(eng, {"third": third})["third"] == (reference(base, {"third": third})["third"], 5 * B)

    # a second turn: the first turn's prompt + its reply + a new message; the reply's blocks are cached too
    turn2 = reqs["cold"] + want["cold"] + prompt(rng, 6)
    w2 = reference(base, {"turn2": turn2})["turn2"]
    tokens, cached = run(eng, {"turn2": turn2})["turn2"]
    assert tokens == w2
    assert cached == (len(reqs["cold"]) + N_GEN - 1) // B * B > len(reqs["cold"]) - B   # up to the reply's last block

    # requests sharing a prefix, added together (the ones whose next block an earlier one computes wait a step and
    # reuse it) and joining one per step while the others decode
    fresh = prompt(rng, 4 * B)
    group = {f"g{i}": fresh + prompt(rng, 3 + i) for i in range(4)}
    wg = reference(base, group)
    got = run(eng, group)
    assert {k: v[0] for k, v in got.items()} == wg
    assert got["g0"][1] == 0 and all(got[f"g{i}"][1] == 4 * B for i in (1, 2, 3)), got
    join = {f"j{i}": fresh + prompt(rng, 2 + i) for i in range(4)}
    wj = reference(base, join)
    got = run(eng, join, stagger=True)
    assert {k: v[0] for k, v in got.items()} == wj and all(v[1] == 4 * B for v in got.values())

    s = eng.prefix_cache_stats()                                     # (the pool reclaims cached blocks, to RAM,
    assert s["hit_tokens"] == s["hit_tokens_device"] + s["hit_tokens_ram"] > 0   # before it grows)
    assert s["hit_tokens_device"] > 0 and s["disk_blocks"] == 0
    assert eng.model.kv_pool.used == 0 and eng.kv_cache_bytes() == 0 and eng.recurrent_state_bytes() == 0
    if recurrent:               # every hit resumed from a snapshot; at most max_batch of them stay on the device
        assert s["hit_states_device"] + s["hit_states_ram"] == 1 + 1 + 1 + 3 + 4, s   # again, third, turn 2, g, j
        assert s["device_states"] <= eng.max_batch and s["state_bytes"] == eng.model.state_layout.nbytes()
    else:
        assert s["state_bytes"] == 0 and s["saved_states"] == 0
    eng.close()


def test_no_prefix_cache_computes_everything(family):
    _arch, _conv, base = family
    rng = random.Random(7)
    ids = prompt(rng, 3 * B + 1)
    first, again = run(base, {"a": ids})["a"], run(base, {"b": ids})["b"]
    assert first == again and first[1] == 0 and base.uncached_tokens(ids) == len(ids)
    assert base.prefix_cache_stats() == {"enabled": 0, "hit_tokens": 0, "miss_tokens": base.stats["prompt_tokens"]}
    assert base.model.kv_pool.used == 0 and len(base.model.kv_pool._free_set) == base.model.kv_pool.capacity


def measured_ram_bytes(eng: Engine) -> int:
    """Bytes of host memory the RAM tier has allocated (held or not), counted from its tensors' storages."""
    return sum(chunk.untyped_storage().nbytes() for chunk in eng.prefix_cache.ram._chunks)


def measured_disk_bytes(folder: Path) -> int:
    """Bytes of every file under the disk tier's folder (temporary files included), from the file system."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != ".lock")


def measured_device_bytes(eng: Engine) -> int:
    """Device bytes the cache holds beyond what requests use: its blocks no request references (the pool's own
    reference counts) and the storage of its snapshots' tensors."""
    pc, pool = eng.prefix_cache, eng.model.kv_pool
    states = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for data, _ in pc.dev_states.values() for t in data}
    return sum(pool.ref[b] == 0 for b in pc.key_of) * pool.block_bytes + sum(states.values())


def budget_check(eng: Engine, folder: Path | None, budgets: dict[str, int]):
    """A check() for run(): every tier's measured bytes within its budget after each step; -> (check, peaks)."""
    peaks = dict.fromkeys(budgets, 0)

    def check():
        got = {"device": measured_device_bytes(eng), "ram": measured_ram_bytes(eng),
               "disk": measured_disk_bytes(folder) if folder is not None else 0}
        for t in budgets:
            peaks[t] = max(peaks[t], got[t])
        assert all(peaks[t] <= budgets[t] for t in budgets), (peaks, budgets)
    return check, peaks


def test_eviction_to_ram_and_disk_and_back_within_budgets(family, tmp_path):
    arch, conv, base = family
    recurrent = arch in RECURRENT
    block = base.model.cache_layout(B).block_numel() * base.model.dtype.itemsize
    sb = base.model.state_layout.nbytes() if recurrent else 0
    ram_budget = 3 * block + block // 2                              # 3 blocks fit, never 4 (nor a snapshot)
    disk_budget = 7 * (block + 1024) + 2 * (sb + 2048)                # ~7 block files (+ 2 snapshots; header ~0.3 KiB)
    folder = tmp_path / "kv"
    cfg = PrefixCacheConfig(device_bytes=0, ram_bytes=ram_budget, disk_dir=folder, disk_bytes=disk_budget)
    eng = Engine(conv, ctx=CTX, max_batch=8, kv_block_size=B, prefix_cache=cfg)
    check, _peaks = budget_check(eng, folder, {"device": 0, "ram": ram_budget, "disk": disk_budget})

    rng = random.Random(3)
    ids = prompt(rng, 6 * B + 2)                     # + N_GEN tokens: 7 full blocks, the newest 3 in RAM, 4 on disk
    want = reference(base, {"x": ids})["x"]
    assert run(eng, {"x": ids}, check=check)["x"] == (want, 0)
    assert eng.model.kv_pool.block_bytes == block
    s = eng.prefix_cache_stats()
    assert s["device_blocks"] == 0 and s["ram_blocks"] == 3 and s["disk_blocks"] == 4, s
    # + 2 snapshots (the prompt's 6th block end, the reply's 7th), larger than the RAM budget: straight to disk
    assert s["device_states"] == s["ram_states"] == 0 and s["disk_states"] == 2 * recurrent, s
    got = run(eng, {"x2": ids}, check=check)["x2"]                   # back from RAM and disk, not recomputed
    assert got == (want, 6 * B)
    s = eng.prefix_cache_stats()
    assert s["hit_tokens_ram"] > 0 and s["hit_tokens_disk"] > 0 and s["hit_tokens_device"] == 0, s
    assert s["hit_states_disk"] == recurrent

    # many other prompts push everything through both tiers; the budgets hold throughout
    others = {f"o{i}": prompt(rng, 3 * B + i) for i in range(6)}
    wo = reference(base, others)
    got = run(eng, others, check=check)
    assert {k: v[0] for k, v in got.items()} == wo
    s = eng.prefix_cache_stats()
    assert s["ram_peak_bytes"] <= ram_budget and s["disk_peak_bytes"] <= disk_budget and s["evicted_blocks_ram"] > 0
    assert s["disk_bytes"] == measured_disk_bytes(folder)
    assert s["ram_bytes"] <= s["ram_allocated_bytes"] == measured_ram_bytes(eng) <= ram_budget
    assert eng.model.kv_pool.used == 0
    eng.close()
    assert not list(folder.rglob("*.tmp-*"))                         # every write completed (atomic rename)
    assert measured_disk_bytes(folder) <= disk_budget


@pytest.mark.parametrize("family", ("deepseek_v3", *RECURRENT), indirect=True)   # (MLA and both state layouts)
def test_device_budget_counts_blocks_and_snapshots(family):
    """--prefix-cache-device: unused blocks and (linear attention) snapshots on the device stay within it, least
    recently used first out, measured after every step."""
    arch, conv, base = family
    block = base.model.cache_layout(B).block_numel() * base.model.dtype.itemsize
    sb = base.model.state_layout.nbytes() if arch in RECURRENT else 0
    budget = 4 * block + sb + block // 2
    eng = Engine(conv, ctx=CTX, max_batch=8, kv_block_size=B,
                 prefix_cache=PrefixCacheConfig(device_bytes=budget, ram_bytes=1 << 20))
    check, peaks = budget_check(eng, None, {"device": budget, "ram": 1 << 20})
    rng = random.Random(19)
    reqs = {f"d{i}": prompt(rng, 2 * B + 5 * i) for i in range(3)}
    want = reference(base, reqs)
    again = {f"{k}'": v for k, v in reqs.items()}
    assert {k: v[0] for k, v in run(eng, reqs, check=check).items()} == want
    got = run(eng, again, check=check)
    assert {k[:-1]: v[0] for k, v in got.items()} == want and sum(v[1] for v in got.values()) > 0
    s = eng.prefix_cache_stats()
    assert 0 < peaks["device"] <= budget and s["device_unused_bytes"] <= budget and s["evicted_blocks_device"] > 0
    eng.close()


def test_restart_with_warm_disk_tier_and_corrupted_blocks(family, tmp_path):
    arch, conv, base = family
    recurrent = arch in RECURRENT
    folder = tmp_path / "kv"
    # (linear attention: a snapshot every 2 blocks, so a prefix cut short by a corrupt block resumes at an even one)
    cfg = PrefixCacheConfig(ram_bytes=1 << 20, disk_dir=folder, disk_bytes=64 << 20, state_every=2 * B)
    rng = random.Random(5)
    ids = prompt(rng, 6 * B + 5)
    want = reference(base, {"x": ids})["x"]
    first = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    assert run(first, {"x": ids})["x"] == (want, 0)
    first.close()                                                    # shutdown writes the cached blocks to disk
    files = sorted(folder.rglob("*.kvblock"))
    assert len(files) >= 6 and len(list(folder.rglob("*.kvstate"))) == (4 if recurrent else 0)   # 2, 4, 6, 7 blocks

    # a new engine on the same folder (a restart) reuses them from disk
    second = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    assert run(second, {"y": ids})["y"] == (want, 6 * B)
    assert second.prefix_cache_stats()["hit_tokens_disk"] == 6 * B
    second.close()

    # corrupt the 4th block's file (one flipped payload byte): the first 3 blocks are reused (linear attention: 2,
    # the last snapshot before it), the rest recomputed
    keys = second.prefix_cache.prompt_keys(ids)
    victim = folder / keys[3].hex()[:2] / f"{keys[3].hex()}.kvblock"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    victim.write_bytes(bytes(raw))
    third = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    n = 2 * B if recurrent else 3 * B
    assert run(third, {"z": ids})["z"] == (want, n)
    s = third.prefix_cache_stats()
    assert s["disk_corrupt_blocks"] == 1 and s["hit_tokens_disk"] == n
    assert not victim.exists() or victim.read_bytes() != bytes(raw)   # deleted (later rewritten from the recompute)
    third.close()

    # a file holding another block's data under this key's name, then a truncated file: each refused in turn
    path = [folder / k.hex()[:2] / f"{k.hex()}.kvblock" for k in keys]
    path[1].write_bytes(path[0].read_bytes())
    fourth = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    assert run(fourth, {"w": ids})["w"] == (want, 0 if recurrent else B)
    assert fourth.prefix_cache_stats()["disk_corrupt_blocks"] == 1   # the chain stops at the first bad block
    fourth.close()
    path[2].write_bytes(path[2].read_bytes()[:100])
    fifth = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    assert run(fifth, {"v": ids})["v"] == (want, 2 * B)             # block 1 was rewritten by the recompute
    assert fifth.prefix_cache_stats()["disk_corrupt_blocks"] == 1
    fifth.close()
    if not recurrent:
        return

    # a corrupted snapshot (one flipped bit of the one at 6 blocks): resumed from the one at 4, the 6th recomputed
    snap = folder / kvf.relpath(state_key(keys[5]).hex(), kvf.STATE_SUFFIX)
    raw = bytearray(snap.read_bytes())
    raw[-5] ^= 0x01
    snap.write_bytes(bytes(raw))
    sixth = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    assert run(sixth, {"u": ids})["u"] == (want, 4 * B)
    s = sixth.prefix_cache_stats()
    assert s["disk_corrupt_blocks"] == 1 and s["hit_states_disk"] == 1
    sixth.close()
    seventh = Engine(conv, ctx=CTX, max_batch=4, kv_block_size=B, prefix_cache=cfg)
    assert run(seventh, {"t": ids})["t"] == (want, 6 * B) and snap.read_bytes() != bytes(raw)
    seventh.close()


def test_finished_requests_keep_only_keyed_full_blocks(family):
    _arch, conv, _base = family
    eng = Engine(conv, ctx=CTX, max_batch=8, kv_block_size=B)
    pool, pc = eng.model.kv_pool, eng.prefix_cache
    rng = random.Random(11)
    ids = prompt(rng, 4 * B + 5)                                     # + N_GEN tokens: 6 full blocks, 7 blocks held
    run(eng, {"a": ids})
    assert pool.used == 0                                            # no request holds a block
    kept = set(pc.key_of)
    assert len(kept) == (len(ids) + N_GEN - 1) // B                  # its full blocks, keyed (the last token is
    assert len(pool._free_set) == pool.capacity - len(kept)          # never written); the partial block is free
    # one-off generations (not through the Engine) key nothing and give every block back
    out = generate(eng.model, prompt(rng, 3 * B + 1), SamplingParams(max_tokens=4, ignore_eos=True), CTX,
                   eng.eos_ids)
    assert len(out.tokens) == 4 and pool.used == 0 and set(pc.key_of) == kept
    # an aborted request gives back its blocks too
    eng.add_request("ab", prompt(rng, 2 * B + 3), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert pool.used == 3
    eng.abort("ab")
    assert pool.used == 0 and not eng.has_work()
    eng.close()


def test_a_prompts_logits_do_not_depend_on_the_tokens_after_it(family):
    """What a cached prefix relies on: a forward over a prompt's first tokens gives the logits the forward over the
    whole prompt gives there (within the GEMMs' order at another T). An indexer's exact ties (its relu'd scores are
    often 0) are broken by index, not by how many keys the forward holds."""
    arch, _conv, base = family
    model = base.model
    ids = prompt(random.Random(17), 4 * B + 5)

    def logits(toks):
        cache = model.new_cache(CTX)
        try:
            return model.forward(Batch.build([(cache, toks)], model.device), all_logits=True)
        finally:
            cache.release()
    whole, head = logits(ids), logits(ids[:3 * B + 2])
    torch.testing.assert_close(head, whole[:3 * B + 2], rtol=1e-3, atol=LOGIT_ATOL.get(arch, 2e-3))


def test_block_runs_and_gathered_blocks_give_the_same_logits(family):
    """Attention over a cache whose blocks are one run, two runs (a shared prefix) or scattered past MAX_RUNS (one
    gathered copy) gives the same logits as the contiguous case. (Linear attention: the shared prefix's state is the
    snapshot the first forward recorded at its end, the recurrence split there.)"""
    arch, _conv, base = family
    model = base.model
    Bp = model.kv_pool.block_size                                   # the default block size, here
    rng = random.Random(13)
    ids = prompt(rng, 4 * Bp + 3)

    def logits(cache, toks):
        return model.forward(Batch.build([(cache, toks)], model.device), all_logits=True)

    one = model.new_cache(CTX)
    one.snap_at.add(2 * Bp)
    want = logits(one, ids)
    assert set(one.snaps) == ({2 * Bp} if arch in RECURRENT else set())
    assert len(one._runs) == 1
    scattered, other = model.new_cache(CTX), model.new_cache(CTX)
    for i in range(1, len(ids) // Bp + 2):
        scattered.reserve(min(i * Bp, len(ids)))
        other.reserve(min(i * Bp, len(ids)))
    got = logits(scattered, ids[:30])
    got = torch.cat([got, logits(scattered, ids[30:])])
    assert len(scattered._runs) > MAX_RUNS
    atol = LOGIT_ATOL.get(arch, 2e-3)
    torch.testing.assert_close(got, want, rtol=1e-3, atol=atol)
    two = model.new_cache(CTX)                                     # one's first 2 blocks, then its own
    for b in one.blocks[:2]:
        model.kv_pool.retain(b)
    two.adopt(one.blocks[:2], ids[:2 * Bp], [])
    two.recurrent = dict(one.snaps.get(2 * Bp, {}))
    got = logits(two, ids[2 * Bp:])
    assert len(two._runs) == 2
    torch.testing.assert_close(got, want[2 * Bp:], rtol=1e-3, atol=atol)
    for c in (one, two, scattered, other):
        c.release()


def run_choices(eng: Engine, req_id: str, ids: list[int], params: SamplingParams, check=None):
    """-> ({choice index: tokens}, {first token's prompt logprobs per choice}, cached prompt tokens)."""
    eng.add_request(req_id, ids, params)
    toks: dict[int, list[int]] = {}
    plp, cached = {}, None
    while eng.has_work():
        for out in eng.step():
            toks.setdefault(out.index, []).append(out[1])
            if out.prompt_logprobs is not None:
                plp[out.index] = out.prompt_logprobs
        cached = eng.cached_tokens.get(req_id, cached)
        if check is not None:
            check()
    return toks, plp, cached


def test_n_choices_fork_a_cached_prefix_and_prompt_logprobs_prefill_in_full(family):
    """n > 1: the choices fork choice 0's cache after its (partly cached) prefill: the full blocks are shared, the
    partial last block copied; each choice equals the uncached engine's. A request asking for prompt logprobs is
    prefilled in full (cached_tokens 0) and scores its prompt exactly as without the cache. Every block goes back."""
    _arch, conv, base = family
    eng = Engine(conv, ctx=CTX, max_batch=8, kv_block_size=B)
    pool = eng.model.kv_pool
    rng = random.Random(17)
    ids = prompt(rng, 4 * B + 5)
    run(eng, {"warm": ids[:3 * B + 2]})                              # caches 3 full blocks of the prompt
    greedy = SamplingParams(max_tokens=N_GEN, ignore_eos=True, n=3)
    want, _, _ = run_choices(base, "n3", ids, greedy)
    held = []

    def check():
        held.append(pool.used)

    got, _, cached = run_choices(eng, "n3", ids, greedy, check)
    assert cached == 3 * B and got == want and len(got) == 3 and all(t == got[0] for t in got.values())
    # the first step holds 4 shared full blocks + one partial block per choice (3 copies), not 3 x 5 blocks
    assert held[0] == 4 + 3, held
    assert pool.used == 0 and eng.kv_cache_bytes() == 0
    # the choices completed the same blocks (greedy): each key is kept once, the copies and partial blocks are freed
    pc = eng.prefix_cache
    assert len(pool._free_set) == pool.capacity - len(pc.key_of) and len(pc.key_of) == len(pc.on_device)
    assert len(pc.key_of) == (len(ids) + N_GEN - 1) // B + 1         # + the warm request's own 4th block

    scored = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    w_toks, w_plp, _ = run_choices(base, "lp", ids, scored)
    g_toks, g_plp, cached = run_choices(eng, "lp", ids, scored)
    assert cached == 0 and g_toks == w_toks
    assert [p.token for p in g_plp[0]] == ids[1:] and [p.token for p in w_plp[0]] == ids[1:]
    torch.testing.assert_close(torch.tensor([p.logprob for p in g_plp[0]]),
                               torch.tensor([p.logprob for p in w_plp[0]]), rtol=0, atol=0)
    assert pool.used == 0
    eng.close()
