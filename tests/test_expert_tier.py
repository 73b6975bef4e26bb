"""The RAM tier for routed experts (ktrun.experts.ram_tier, ktrun.experts.tiered, `--expert-ram`): the kernels compute
on experts read into a budgeted mirror of the expert files, and everything they return is bit-identical to the
all-in-RAM run (the file maps). The budget is checked against the kernel's own count of resident pages (mincore),
after every forward and while reads are in flight, at the smallest budget the tier accepts (one layer's experts),
so experts are evicted and read back all the time.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import threading
import time

import numpy as np
import pytest
import torch
from ktrun.cli.expert_ram_option import ExpertRamOptions
from ktrun.engine import Engine, SamplingParams
from ktrun.experts.hybrid import HybridExperts
from ktrun.experts.placement import Budget, HotExpertOptions
from ktrun.experts.ram_tier import PAGE, ExpertRamTier, TierError
from ktrun.experts.tiered import TieredExperts, tier_lines
from ktrun.loaded_model import load_model
from ktrun.models.kv_cache import Batch

from tests.runtime_helpers import KTRUN, PROMPT, converted

PROMPT_IDS = [3, 17, 99, 5, 42, 7, 250, 31, 8, 64, 11, 120]
DECODE = [9, 77, 1, 200, 13, 45, 88, 2]


def logits_run(model) -> list[torch.Tensor]:
    """Teacher-forced: the prompt in one prefill (all positions), then one token per step."""
    cache = model.new_cache(64)
    out = [model.forward(Batch.build([(cache, PROMPT_IDS)], model.device), all_logits=True).clone()]
    for t in DECODE:
        out.append(model.forward(Batch.build([(cache, [t])], model.device)).clone())
    return out


def min_budget(conv) -> int:
    """The smallest budget the tier accepts for this conversion: one layer's experts."""
    probe = ExpertRamTier(conv, 1 << 40)
    try:
        return probe.layer_pages * PAGE
    finally:
        probe.close()


class BudgetWatch:
    """Samples the mirrors' resident bytes (mincore) from a thread while the model runs."""

    def __init__(self, tier):
        self.tier, self.peak, self.samples = tier, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.tier.measured_resident_bytes())
            self.samples += 1
            self._stop.wait(0.0005)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def check_identical(conv, budget: int, predict: bool, io: str = "direct", predictor: str = "router"):
    """-> (the tier executor's stats, whether its kernels were launched from the launcher thread). Where the kernels
    can stage, layers were computed expert run by expert run while their reads landed (per-expert completion), and
    the bits still match."""
    with pytest.MonkeyPatch.context() as mp:      # the reference computes the shared expert as the tier does
        mp.setenv("KTRUN_FUSE_SHARED", "0")          # (outside the routed job)
        with load_model(conv, device="cpu") as lm:
            ref = logits_run(lm.model)
    with load_model(conv, device="cpu", expert_ram=ExpertRamOptions(budget, predict=predict, io=io,
                                                                    predictor=predictor)) as lm:
        ex = lm.model.experts
        assert isinstance(ex, TieredExperts)
        with BudgetWatch(ex.tier) as watch:
            got = logits_run(lm.model)
        s = ex.stats
        measured = ex.tier.measured_resident_bytes()
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {i}: tier logits differ from the all-in-RAM run by {(a - b).abs().max()}"
    assert s["ram_tier_evictions"] > 0 and s["ram_tier_demand_loads"] > 0     # the budget really bit
    assert s["ram_tier_peak_resident_bytes"] <= budget
    assert watch.samples > 0 and watch.peak <= budget, f"measured {watch.peak} resident bytes > budget {budget}"
    assert measured <= budget
    if ex.stage:                 # (several calls per layer where experts land apart: the default model's test)
        assert s["ram_tier_staged_layers"] > 0
    else:
        assert s["ram_tier_staged_layers"] == 0 and s["expert_staged_calls"] == 0
    return s, ex.launch_thread


@pytest.mark.parametrize("predict,predictor", [(False, "router"), (True, "router"), (True, "coact")],
                         ids=["no-predict", "predict-router", "predict-coact"])
def test_default_model_bit_identical_under_budget(default_converted, predict, predictor):
    s, threaded = check_identical(default_converted, min_budget_cached(default_converted), predict,
                                  predictor=predictor)
    assert not threaded          # its int4 GPU layers run on the kernels' pool: later runs started in sync()
    assert s["ram_tier_early_experts"] > 0        # resident experts computed before the layer's reads landed
    assert s["expert_staged_calls"] > 0           # and the later experts in further calls
    if predict:
        assert s["ram_tier_prefetch_issued"] > 0 and s["ram_tier_pred_predicted"] > 0


_MIN = {}


def min_budget_cached(conv) -> int:
    if conv not in _MIN:
        lm = load_model(conv, device="cpu")
        with lm:
            _MIN[conv] = min_budget(lm.converted)
    return _MIN[conv]


@pytest.mark.parametrize("arch,method,kw", [
    ("qwen3_moe", "int8-amx", {"numa_nodes": 2, "group_size": 32}),     # two shard files per layer
    ("mixtral", "bf16", {}),                                             # the bf16 layout: no scales
], ids=["qwen3-int8-2shards", "mixtral-bf16"])
def test_fixture_bit_identical_under_budget(tmp_path_factory, arch, method, kw):
    conv = converted(tmp_path_factory, arch, method, **kw)
    _, threaded = check_identical(conv, min_budget_cached(conv), predict=True)
    assert threaded              # bf16 GPU layers: a pool of its own, kernels started by the launcher thread


def test_buffered_reads_bit_identical(default_converted):
    s, _ = check_identical(default_converted, min_budget_cached(default_converted), predict=True, io="pread")
    assert s["ram_tier_io"] == "pread"


def test_mirror_holds_the_files_bytes_and_eviction_frees_them(default_converted):
    lm = load_model(default_converted, device="cpu")
    with lm:
        c = lm.converted
        tier = ExpertRamTier(c, 1 << 30)
        try:
            L = c.geometry.moe_layers[0]
            gs, futs = tier.ensure(L, [0, 5])
            tier.wait(futs)
            for s, shard in enumerate(c.experts[L]):
                for p, (qw, sc, _) in shard.items():
                    mq, ms, _ = tier.mirror_layers[L][s][p]
                    for e in (0, 5):
                        assert np.array_equal(mq[e], qw[e]) and (sc is None or np.array_equal(ms[e], sc[e]))
            held = tier.measured_resident_bytes()
            assert 0 < held <= tier.stats()["resident_bytes"]
            tier.release(gs)
            with tier._cv:                       # evict both, as room for other experts would
                for g in gs:
                    tier._evict(g)
            assert tier.measured_resident_bytes() == 0 and tier.stats()["resident_bytes"] == 0
            assert tier.counters["bytes_read"] >= tier.expert_pages(L, 0) * PAGE
        finally:
            tier.close()


def test_ensure_each_gives_one_future_per_missing_expert_in_order(default_converted):
    """The reader: one future per expert that was not resident (None for a RAM hit), completed in the order asked
    (one reader thread: FIFO), each as soon as its own reads land, and holding the file's bytes then."""
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
        tier = ExpertRamTier(c, 1 << 30, io_threads=1)
        try:
            L = c.geometry.moe_layers[0]
            gs, each = tier.ensure_each(L, [0, 5])
            tier.wait(each)
            tier.release(gs)
            done: list[int] = []
            gs, each = tier.ensure_each(L, [0, 9, 5, 3])
            assert each[0] is None and each[2] is None and all(f is not None for f in (each[1], each[3]))
            for e, f in ((9, each[1]), (3, each[3])):
                f.add_done_callback(lambda _f, e=e: done.append(e))
            each[1].result()
            qw = c.experts[L][0]["gate"][0]
            assert np.array_equal(tier.mirror_layers[L][0]["gate"][0][9], qw[9])   # usable before 3 has landed
            tier.wait(each)
            assert done == [9, 3]
            tier.release(gs)
        finally:
            tier.close()


def test_unwanted_prefetch_not_started_is_cancelled(default_converted):
    """A prediction its layer then does not route to is dropped from the read queue while none of its reads has
    started (the disk is left to the demand reads), its reserved pages given back; a wanted one is read."""
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
        tier = ExpertRamTier(c, 1 << 30, io_threads=1)
        gate = threading.Event()
        read = tier._queue._fn
        tier._queue._fn = lambda r: (gate.wait(), read(r))     # the reader stalls until the gate opens
        try:
            L1, L2 = c.geometry.moe_layers[:2]
            gs1, each1 = tier.ensure_each(L1, [0])                  # the reader takes this one and waits
            assert tier.prefetch(L2, [3, 4, 5]) == 3
            gs2, each2 = tier.ensure_each(L2, [4, 6])               # 3 and 5 were wrong guesses, 4 was right
            assert tier.counters["prefetch_cancelled"] == 2 and tier.counters["prefetch_used"] == 1
            assert tier.counters["bytes_prefetch_used"] == tier.expert_pages(L2, 4) * PAGE      # the needed bytes
            assert not tier.is_resident(L2, 3) and tier.g(L2, 3) not in tier._futures
            gate.set()
            tier.wait(each1 + each2)
            assert tier.resident(L2) == [4, 6]
            # the three experts' pages, each counted once (experts' spans may share a page at their edges)
            pages = {(mi, p) for L, e in ((L1, 0), (L2, 4), (L2, 6)) for mi, p0, p1 in tier._spans[tier.g(L, e)]
                     for p in range(p0, p1)}
            want = len(pages) * PAGE
            assert tier.stats()["resident_bytes"] == want == tier.measured_resident_bytes()
            tier.release(gs1 + gs2)
        finally:
            gate.set()
            tier.close()


class StalledReader:
    """Holds the tier's reader threads at the start of each read until released; records the reads in the order
    they started, as (kind, experts) with kind 'demand' / 'prefetch'."""

    def __init__(self, tier):
        self.tier, self.gate, self.started = tier, threading.Event(), []
        self._read = tier._queue._fn
        tier._queue._fn = self._run

    def _run(self, r):
        kind = "prefetch" if r.jobs[0].prefetch else "demand"
        self.started.append((kind, sorted(j.g % self.tier.n_experts for j in r.jobs)))
        self.gate.wait()
        self._read(r)


def test_adjacent_missing_experts_share_reads(default_converted):
    """Missing experts next to each other in the files are read together: experts 2 and 3 of a layer share every
    read (each of their spans is small), expert 7 reads its codes on its own (its scales share pages, so reads,
    with theirs); all three land holding the file's bytes, and each expert's bytes count as demand bytes."""
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
        tier = ExpertRamTier(c, 1 << 30, io_threads=1)
        stall = StalledReader(tier)
        try:
            L = c.geometry.moe_layers[0]
            gs, each = tier.ensure_each(L, [2, 3, 7])
            jobs = {e: tier._jobs[tier.g(L, e)] for e in (2, 3, 7)}
            assert [id(r) for r in jobs[2].reads] == [id(r) for r in jobs[3].reads]      # one set of reads
            own7 = [r for r in jobs[7].reads if r.jobs == [jobs[7]]]
            assert len(own7) == 3                                   # gate, up, down codes
            n_reads = len({id(r) for j in jobs.values() for r in j.reads})
            assert n_reads < sum(len(tier._spans[tier.g(L, e)]) for e in (2, 3, 7))
            assert tier.counters["merged_reads"] == n_reads - len(own7)
            stall.gate.set()
            tier.wait(each)
            for s, shard in enumerate(c.experts[L]):
                for p, (qw, sc, _) in shard.items():
                    mq, ms, _ = tier.mirror_layers[L][s][p]
                    for e in (2, 3, 7):
                        assert np.array_equal(mq[e], qw[e]) and (sc is None or np.array_equal(ms[e], sc[e]))
            per_expert = sum(tier.expert_pages(L, e) * PAGE for e in (2, 3, 7))
            assert tier.counters["bytes_demand"] == per_expert and tier.counters["bytes_prefetch"] == 0
            assert [k for k, _ in stall.started] == ["demand"] * len(stall.started)
            assert stall.started[0][1] == [2, 3]          # reads start in the order the experts were asked for
            tier.release(gs)
        finally:
            stall.gate.set()
            tier.close()


def test_prefetch_reads_wait_for_demand_reads(default_converted):
    """A prefetch read starts only while no demand read runs or waits: with a demand read in flight the other
    reader thread leaves the queued prefetch alone, a demand read queued after it goes first, and the prefetch
    reads run once the demand reads are done."""
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
        tier = ExpertRamTier(c, 1 << 30, io_threads=2)
        stall = StalledReader(tier)
        try:
            L1, L2 = c.geometry.moe_layers[:2]
            gs1, each1 = tier.ensure_each(L1, [0])                 # both threads take one of its reads and stall
            assert tier.prefetch(L2, [9]) == 1
            gs2, each2 = tier.ensure_each(L1, [12])                # queued after the prefetch
            time.sleep(0.2)
            assert tier._queue.running == [2, 0] and [k for k, _ in stall.started] == ["demand", "demand"]
            stall.gate.set()
            tier.wait(each1 + each2)
            tier.drain()
            kinds = [k for k, _ in stall.started]
            assert kinds.index("prefetch") > max(i for i, k in enumerate(kinds) if k == "demand")
            assert tier.counters["bytes_prefetch"] == tier.expert_pages(L2, 9) * PAGE
            tier.release(gs1 + gs2)
        finally:
            stall.gate.set()
            tier.close()


def test_prefetch_throttles_to_a_rare_probe_while_its_guesses_go_unused(default_converted):
    """While fewer than PREFETCH_MIN_USE of the recent prefetches were used (or fewer than the disk's recent busy
    share), or callers hardly waited on reads, a prefetch call reads at most its best-ranked expert, and only once
    per PROBE_LOADS demand loads; with good guesses, on a disk that is waited on and idle, every prediction is read."""
    from ktrun.experts.ram_tier import PREFETCH_WINDOW, PROBE_LOADS

    def shares(busy, waited):             # the recent busy / wait shares, as if measured
        tier._shares, tier._busy_at = (busy, waited), (time.perf_counter(), tier.disk_busy_s, tier.wait_s)
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
        tier = ExpertRamTier(c, 1 << 30)
        try:
            L, E = c.geometry.moe_layers[1], c.geometry.n_experts
            tier._outcomes.extend([False] * PREFETCH_WINDOW)
            issued = []
            for i in range(4):
                tier._since_probe = PROBE_LOADS if i in (0, 3) else PROBE_LOADS - 1
                shares(0.0, 0.5)
                issued.append(tier.prefetch(L, [2 * i, 2 * i + 1]))
            assert issued == [1, 0, 0, 1] and tier.counters["prefetch_throttled"] == 4
            shares(0.0, 0.5)                   # the gate alone: nothing to read (the caller skips predicting)
            assert tier.prefetch_gate() == 0 and tier.counters["prefetch_throttled"] == 5
            tier._since_probe = PROBE_LOADS
            shares(0.0, 0.5)
            assert tier.prefetch_gate() == 1                                   # a probe is due
            tier._outcomes.extend([True] * PREFETCH_WINDOW)
            shares(0.0, 0.5)
            assert tier.prefetch_gate() is None
            shares(0.0, 0.5)
            assert tier.prefetch(L, [E - 3, E - 2, E - 1]) == 3
            tier.drain()
            # guesses used 3 times in 4: read on an idle, waited-on disk; probed on a busy one or an unwaited one
            tier._outcomes.extend([True, True, True, False] * (PREFETCH_WINDOW // 4))
            thr = tier.counters["prefetch_throttled"]
            shares(0.0, 0.5)
            assert tier.prefetch(L, [E - 6, E - 5]) == 2 and tier.counters["prefetch_throttled"] == thr
            tier.drain()
            for busy, waited in ((0.9, 0.5), (0.0, 0.01)):
                shares(busy, waited)
                tier.prefetch(L, [E - 8, E - 7])
            assert tier.counters["prefetch_throttled"] == thr + 2
            tier.drain()
        finally:
            tier.close()


def test_no_prediction_while_the_tier_would_read_none():
    """TieredExperts asks the tier's gate before predicting: a closed gate (0) skips the predictor (its router
    matmul and ranking cost ~0.3 ms of CPU per layer for reads that would not be issued); a due probe (1) or an open
    gate (None) predicts and passes the limit on to prefetch()."""
    from ktrun.experts.tiered import TieredExperts

    class Tier:
        n_experts = 8

        def __init__(self, gates):
            self.gates, self.prefetched = list(gates), []

        def ensure_each(self, layer, need):
            return [], [None] * len(need)                    # everything resident

        def prefetch_gate(self):
            return self.gates.pop(0)

        def prefetch(self, layer, experts, limit):
            self.prefetched.append((layer, experts, limit))

        def release(self, gs):
            pass

    class Cpu:
        def submit(self, *a, **k):
            pass

        def sync(self):
            pass

    class Predictor:
        calls = 0

        def observe(self, layer, actual, ids):
            pass

        def predict(self, layer, x, ids):
            Predictor.calls += 1
            return layer + 1, [5, 6]

    tier = Tier([0, 1, None])
    ex = TieredExperts(Cpu(), tier, Predictor())
    try:
        x, ids, w = torch.zeros(1, 4), torch.tensor([[1, 2]]), torch.ones(1, 2)
        for _ in range(3):
            ex.submit(0, x, ids, w, torch.zeros(1, 4))
            ex.sync()
        assert Predictor.calls == 2 and tier.prefetched == [(1, [5, 6], 1), (1, [5, 6], None)]
    finally:
        ex._launcher.shutdown()


@pytest.mark.parametrize("T", [1, 6])
def test_kernel_runs_in_ascending_expert_order_equal_one_call(default_converted, T):
    """Why per-expert completion keeps the bits: one kernel call on a layer equals calls over ascending runs of its
    experts (the later ones adding into out), bit for bit, wherever KernelExperts.can_stage."""
    from ktrun.experts.kernel import KernelExperts
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
        ke = KernelExperts(c, n_threads=2)
        try:
            if not ke.can_stage:
                pytest.skip("several NUMA pools or shards here: the tier computes each layer in one call")
            geo = c.geometry
            L, E, k = geo.moe_layers[0], geo.n_experts, c.config.top_k
            gen = torch.Generator().manual_seed(T)
            x = torch.randn(T, geo.hidden, generator=gen)
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int64)
            w = torch.rand(T, k, generator=gen)
            one = torch.empty(T, geo.hidden)
            ke.submit(L, x, ids, w, one)
            ke.sync()
            used = np.unique(ids.numpy())
            cuts = [0, 1, len(used) // 2, len(used)]
            runs = [used[a:b] for a, b in itertools.pairwise(cuts) if b > a]
            staged = torch.empty(T, geo.hidden)
            for i, run in enumerate(runs):
                m = np.ones(E, dtype=np.uint8)
                m[run] = 0
                if i == 0:
                    ke.submit(L, x, ids, w, staged, skip=m)
                else:
                    ke.submit_more(m)
            ke.sync()
            assert torch.equal(one, staged)
            assert ke.stats["expert_staged_calls"] == len(runs) - 1
        finally:
            ke.close()


def test_profile_seeds_what_stays(default_converted, tmp_path):
    """--profile with --expert-ram seeds the eviction counts (and places nothing on the GPU): at the smallest budget,
    reading another layer's experts evicts the profile's cold experts of a full layer and keeps its hot one."""
    from ktlayouts.expert_profile import ExpertProfile
    with load_model(default_converted, device="cpu") as lm:
        c = lm.converted
    geo = c.geometry
    L, other = geo.moe_layers[0], geo.moe_layers[1]
    prof = ExpertProfile.empty(c.config.model_type, geo.n_experts, c.config.top_k, geo.moe_layers)
    prof.splits["fit"].counts[L][0] = 1000     # expert 0 of layer L: hot (without it, the first victim: ties go
    #                                            to the least recently used, then the lowest index)
    path = tmp_path / "profile.json"
    prof.save(path)
    with load_model(default_converted, device="cpu", hot_experts=HotExpertOptions(profile=str(path)),
                    expert_ram=ExpertRamOptions(min_budget_cached(default_converted), predict=False)) as lm:
        tiered = lm.model.experts
        assert isinstance(tiered, TieredExperts)                   # no GPU placement from a profile alone
        tier = tiered.tier
        gs, futs = tier.ensure(L, range(geo.n_experts))            # the whole layer: the budget is full
        tier.wait(futs)
        tier.release(gs)
        gs, futs = tier.ensure(other, [0, 1, 2, 3])
        tier.wait(futs)
        tier.release(gs)
        kept = tier.resident(L)
        assert 0 in kept and len(kept) < geo.n_experts
        assert tier.resident_pages * PAGE <= tier.budget_bytes


def test_budget_below_one_layer_is_refused(default_converted):
    lm = load_model(default_converted, device="cpu")
    with lm:
        need = min_budget(lm.converted)
        with pytest.raises(TierError, match="--expert-ram .* one MoE layer"):
            ExpertRamTier(lm.converted, need - PAGE)


def test_gpu_hot_experts_bit_identical_and_never_read(default_converted):
    """Under hot experts (ktrun.experts.hybrid) the tier is the CPU executor: the run equals the same hot placement
    without the tier, bit for bit, and the skip mask keeps GPU-resident experts out of the tier's reads."""
    hot = HotExpertOptions(budget=Budget(4), strategy="uniform")
    budget = min_budget_cached(default_converted)
    with load_model(default_converted, device="cpu", hot_experts=hot) as lm:
        ref = logits_run(lm.model)
    with load_model(default_converted, device="cpu", hot_experts=hot, expert_ram=ExpertRamOptions(budget)) as lm:
        hybrid = lm.model.experts
        assert isinstance(hybrid, HybridExperts) and isinstance(hybrid.cpu, TieredExperts)
        got = logits_run(lm.model)
        tier = hybrid.cpu.tier
        on_gpu = {L: hybrid.residency.on_gpu(L) for L in tier.layers}
        assert all(len(v) == 4 for v in on_gpu.values())
        assert all(tier._freq[tier.g(L, e)] == 0 for L, es in on_gpu.items() for e in es)
        assert tier.counters["demand_loads"] > 0
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_engine_batch_with_expert_ram(default_converted):
    """The batching engine behind `ktrun serve`: two requests decoded together give the same tokens with the tier
    (at the minimum budget) as without."""
    def run(**kw):
        eng = Engine(str(default_converted), ctx=128, max_batch=2, device="cpu", **kw)
        try:
            for rid, text in (("a", PROMPT), ("b", "def fibonacci(n):")):
                eng.add_request(rid, eng.tokenizer.encode(text), SamplingParams(max_tokens=10))
            got: dict[str, list[int]] = {"a": [], "b": []}
            while eng.has_work():
                for rid, tok, *_ in eng.step():
                    got[rid].append(tok)
            return got, eng.experts.stats
        finally:
            eng.close()
    plain, _ = run()
    tiered, stats = run(expert_ram=ExpertRamOptions(min_budget_cached(default_converted)))
    assert tiered == plain
    assert stats["ram_tier_demand_loads"] > 0 and stats["ram_tier_peak_resident_bytes"] <= stats["ram_tier_budget_bytes"]


def test_serve_with_expert_ram(default_converted):
    """`ktrun serve --expert-ram` as a real subprocess, driven by the openai client: greedy completions equal the
    Engine's without the tier, and /metrics carries the tier's gauges."""
    import openai

    from tests.serve_helpers import ServerProcess, metric
    budget = min_budget_cached(default_converted)
    prompts = [PROMPT, "def fibonacci(n):"]
    eng = Engine(str(default_converted), ctx=256, max_batch=1, device="cpu")
    try:
        want = []
        for i, text in enumerate(prompts):
            eng.add_request(str(i), eng.tokenizer.encode(text), SamplingParams(max_tokens=8))
            toks = []
            while eng.has_work():
                toks += [out[1] for out in eng.step()]
            want.append(eng.tokenizer.decode(toks))
    finally:
        eng.close()
    s = ServerProcess([*KTRUN, "serve", str(default_converted), "--port", "0", "--ctx", "256",
                       "--expert-ram", str(budget)], timeout=180)
    try:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = [client.completions.create(model=default_converted.resolve().name, prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
        assert got == want
        assert metric(s, "ktrun_engine_ram_tier_budget_bytes") == budget
        assert metric(s, "ktrun_engine_ram_tier_demand_loads") > 0
    finally:
        assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def test_tier_lines_report_the_issue_metrics():
    before = {"ram_tier_budget_bytes": 100, "ram_tier_bytes_read": 0, "ram_tier_disk_busy_s": 0.0,
              "ram_tier_demand_experts": 0, "ram_tier_ram_hits": 0}
    after = dict(before, ram_tier_io="direct", ram_tier_peak_resident_bytes=90,
                 ram_tier_bytes_read=4000, ram_tier_disk_busy_s=0.002, ram_tier_demand_experts=10, ram_tier_ram_hits=7,
                 ram_tier_pred_predicted=8, ram_tier_pred_correct=6, ram_tier_pred_actual=10,
                 ram_tier_prefetch_issued=4, ram_tier_prefetch_used=3, ram_tier_bytes_demand=3000,
                 ram_tier_bytes_prefetch=1000, ram_tier_bytes_prefetch_used=600)
    lines = dict(line.split(": ", 1) for line in tier_lines(before, after, tokens=2, measured=80))
    assert lines["ram_tier_measured_resident"] == "80 bytes"
    assert lines["ram_tier_disk_bytes_per_token"] == "2000 bytes"
    assert lines["ram_tier_needed_bytes_per_token"] == "1800 bytes"
    assert lines["ram_tier_prefetch_bytes_per_token"] == "500 bytes"
    assert lines["ram_tier_disk_read_rate"] == "0.002 GB/s"
    assert lines["ram_tier_hit_ratio"] == "0.7000"
    assert lines["ram_tier_prefetch_hit_ratio"] == "0.7500"
    assert lines["ram_tier_prediction_precision"] == "0.7500" and lines["ram_tier_prediction_recall"] == "0.6000"


def test_cli_generate_and_bench_with_expert_ram(default_converted):
    """Real subprocesses: the same greedy tokens with --expert-ram (at the minimum budget) as without; bench prints
    the tier's lines; a budget below one layer fails naming the flag."""
    budget = str(min_budget_cached(default_converted))
    base = [*KTRUN, "generate", str(default_converted), "--prompt", PROMPT, "--max-tokens", "12", "--json"]
    plain = json.loads(subprocess.run(base, check=True, capture_output=True, text=True).stdout)
    tiered = json.loads(subprocess.run(base + ["--expert-ram", budget], check=True, capture_output=True,
                                       text=True).stdout)
    assert tiered["token_ids"] == plain["token_ids"]
    bench = subprocess.run([*KTRUN, "bench", str(default_converted), "--pp", "8", "--tg", "4", "--reps", "1",
                            "--expert-ram", budget], check=True, capture_output=True, text=True).stdout
    for key in ("ram_tier_disk_bytes_per_token", "ram_tier_disk_read_rate", "ram_tier_hit_ratio",
                "ram_tier_prefetch_hit_ratio", "ram_tier_budget"):
        assert f"\n{key}: " in bench, bench
    bad = subprocess.run(base + ["--expert-ram", "4KB"], check=False, capture_output=True, text=True)
    assert bad.returncode != 0 and "--expert-ram" in bad.stderr and "one MoE layer" in bad.stderr
