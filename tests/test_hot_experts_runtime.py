"""Hot experts in the runtime, on the embedded default model (DeepSeek-V3 architecture, int4 experts): every
placement (none, uniform, frequency, per-layer, dynamic after swaps) against the all-CPU run, the GPU hit ratio
accounting, and dynamic swaps during a running batch; the same for gpt-oss (expert biases, clamped SwiGLU) on its
fixture. Without CUDA the "GPU" side is torch on the CPU.

The bound (runtime/README.md "Hot experts"): the GPU formats compute hot experts from the CPU tiles' own weights (Marlin: the
same int codes, scales in float16; bf16: the dequantized weights rounded to bf16), without the kernels' int8
activation quantization. So a hybrid run may differ from the all-CPU run by about as much as the all-CPU run
differs from exact arithmetic (the torch reference on the dequantized weights), and no more:
  - teacher-forced logits: mean |hybrid - cpu| <= BOUND_RATIO * mean |exact - cpu|
  - greedy decoding: every token the hybrid run picks is within GREEDY_GAP of the all-CPU argmax at its prefix
Bit for bit where the same arithmetic runs: no placement = the all-CPU run; a dynamic run = a replay of its own
placement log applied synchronously; the masked kernels = ids set to -1 (test_kernels_mask.py).
"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from ktlayouts.expert_gpu import hot_expert_nbytes
from ktlayouts.expert_placement import PLACEMENT_NAME, ExpertPlacement
from ktlayouts.expert_profile import ExpertProfile
from ktlayouts.files import sha256_file
from ktrun.engine import Engine
from ktrun.experts.hot import build_hot_executor, dense_device_bytes
from ktrun.experts.hot_store import HotExpertStore
from ktrun.experts.hybrid import HybridExperts
from ktrun.experts.kernel import KernelExperts
from ktrun.experts.placement import Budget, HotExpertOptions, hit_ratio
from ktrun.experts.residency import ExpertResidency
from ktrun.experts.routing_recorder import RoutingRecorder
from ktrun.generate import generate
from ktrun.loaded_model import load_model
from ktrun.models.kv_cache import Batch
from ktrun.sampling import SamplingParams
from ktrun.serve.metrics import render_engine_stats
from runtime_helpers import converted

from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.profile import run_profile

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "ktconvert" / "data" / "default_model"
HELDOUT = (DEFAULT_MODEL / "heldout_eval.txt").read_text()
BOUND_RATIO = 1.25
GREEDY_GAP = 0.05
PROMPTS = ["import os\n\n\ndef read_lines(path):", "class Stack:\n    def push(self, item):",
           "for i in range(10):\n    if i %"]


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hot") / "dm-int4"
    convert(DEFAULT_MODEL, out, ConvertOptions(method="int4-amx", gpu_method="bf16"), show_progress=False)
    return out


@pytest.fixture(scope="module")
def profile_path(conv, tmp_path_factory) -> Path:
    """A profile of the first half of the held-out text (the runtime tests measure on other tokens)."""
    path = tmp_path_factory.mktemp("prof") / "profile.json"
    with load_model(conv) as lm:
        prof = run_profile(lm.model, lm.tokenizer, [HELDOUT[: len(HELDOUT) // 2]], chunk_tokens=256, heldout_every=4,
                           max_tokens=2048, progress=False, text_info={"source": "heldout-half"})
    prof.save(path)
    return path


@pytest.fixture(scope="module")
def tokens(conv) -> list[int]:
    with load_model(conv) as lm:
        return lm.tokenizer.encode(HELDOUT[len(HELDOUT) // 2:])[:192]


def forced_logits(lm, ids) -> torch.Tensor:
    """(T, V) logits of every position, one sequence, prefilled in one forward."""
    cache = lm.model.new_cache(len(ids) + 1)
    return lm.model.forward(Batch.build([(cache, ids)], lm.model.device), all_logits=True)


@pytest.fixture(scope="module")
def reference(conv, tokens):
    """All-CPU (kernels) and exact (torch reference) logits of the measured tokens, and the all-CPU greedy runs."""
    with load_model(conv) as lm:
        cpu = forced_logits(lm, tokens)
    with load_model(conv, use_kernels=False) as lm:
        exact = forced_logits(lm, tokens)
    return cpu, exact


def greedy_gaps(conv, lm, prompt: str, n: int = 20) -> list[float]:
    """Greedy-decode with lm; the all-CPU logit gap (max - chosen) of each chosen token at its prefix."""
    ids = lm.tokenizer.encode(prompt)
    out = generate(lm.model, ids, SamplingParams(max_tokens=n, temperature=0), 512, set())
    with load_model(conv) as cpu:
        rows = forced_logits(cpu, ids + out.tokens)[len(ids) - 1: len(ids) - 1 + len(out.tokens)]
    return [float(r.max() - r[t]) for r, t in zip(rows, out.tokens)]


def test_no_placement_is_the_all_cpu_run_bit_for_bit(conv, tokens, reference):
    cpu, _ = reference
    with load_model(conv, hot_experts=HotExpertOptions(budget=Budget(per_layer=0))) as lm:
        assert isinstance(lm.model.experts, KernelExperts)           # --gpu-experts 0: the plain executor
    # a HybridExperts whose slots hold no expert: the masked path is never taken, every bit is the CPU run's
    with load_model(conv) as lm:
        layers = lm.model.cfg.moe_layers
        lm.model.experts = HybridExperts(lm.model.experts, HotExpertStore(lm.converted, dict.fromkeys(layers, 1)),
                                         ExpertResidency(16, dict.fromkeys(layers, 1)))
        got = forced_logits(lm, tokens)
        assert lm.model.experts.stats["gpu_hit_ratio"] == 0.0 and lm.model.experts.stats["routed_expert_calls"]
    assert torch.equal(got, cpu)


@pytest.mark.parametrize("strategy", ["uniform", "frequency", "per-layer"])
@pytest.mark.parametrize("fmt", ["bf16", "marlin"])
def test_static_placements_match_the_all_cpu_run(conv, profile_path, tokens, reference, strategy, fmt):
    opts = HotExpertOptions(profile=str(profile_path), budget=Budget(per_layer=4), strategy=strategy, gpu_format=fmt)
    check_static_placement(conv, opts, tokens, *reference, resident=12, prompt=PROMPTS[0])


def check_static_placement(conv, opts, tokens, cpu, exact, resident: int, prompt: str, check=None) -> None:
    """Loaded with `opts`: teacher-forced logits within the bound of the all-CPU run, greedy tokens within the gap
    of its argmax; check(lm) looks at the loaded hybrid executor first."""
    with load_model(conv, hot_experts=opts) as lm:
        ex = lm.model.experts
        assert isinstance(ex, HybridExperts) and ex.store.format == opts.gpu_format
        assert ex.residency.n_resident() == resident
        if check is not None:
            check(lm)
        got = forced_logits(lm, tokens)
        assert ex.stats["gpu_hit_ratio"] > 0.1
        gaps = greedy_gaps(conv, lm, prompt)
    assert_within_bound(got, cpu, exact)
    assert max(gaps) <= GREEDY_GAP, gaps


def assert_within_bound(got, cpu, exact) -> None:
    err, kernel_err = (got - cpu).abs().mean().item(), (exact - cpu).abs().mean().item()
    assert err <= BOUND_RATIO * kernel_err, f"mean |hybrid - cpu| {err:.5f} vs kernels' own {kernel_err:.5f}"


def test_marlin_hot_experts_on_the_reference_side_are_the_reference(conv, tokens, reference, profile_path):
    """Same arithmetic on both sides (torch reference CPU experts, Marlin hot experts with the same codes and, for
    this bf16-trained model, float16-exact scales): the hybrid run equals the exact run up to float summation order."""
    _, exact = reference
    opts = HotExpertOptions(profile=str(profile_path), budget=Budget(per_layer=8), gpu_format="marlin")
    with load_model(conv, use_kernels=False, hot_experts=opts) as lm:
        got = forced_logits(lm, tokens)
    assert (got - exact).abs().max().item() < 1e-4


def test_hit_ratio_counts_every_routed_call(conv, profile_path, tokens):
    opts = HotExpertOptions(profile=str(profile_path), budget=Budget(ratio=0.25), strategy="per-layer")
    with load_model(conv, hot_experts=opts) as lm:
        ex = lm.model.experts
        rec = RoutingRecorder(ex, ExpertProfile.empty("deepseek_v3", 16, 4, lm.model.cfg.moe_layers))
        lm.model.experts = rec
        forced_logits(lm, tokens)
        placed = {L: tuple(ex.residency.on_gpu(L)) for L in lm.model.cfg.moe_layers}
        assert ex.stats["routed_expert_calls"] == len(tokens) * 4 * 3
        assert ex.stats["gpu_hit_ratio"] == pytest.approx(hit_ratio(rec.profile.counts("fit"), placed), abs=1e-12)
        by_layer = ex.stats["gpu_hit_ratio_by_layer"]
        for L in placed:
            c = rec.profile.counts("fit")[L]
            assert by_layer[L] == pytest.approx(c[list(placed[L])].sum() / c.sum(), abs=1e-12)


class Replay:
    """A before-step hook applying a dynamic run's placement log at the same steps, synchronously."""

    def __init__(self, hybrid: HybridExperts, log):
        self.h, self.log = hybrid, list(log)

    def __call__(self, step: int) -> None:
        r, st = self.h.residency, self.h.store
        for s, L, e_in, e_out in self.log:
            if s != step:
                continue
            if e_out is not None:
                r.evict(L, e_out)
            slot = r.take_free(L)
            st.load(L, slot, e_in)
            r.place(L, e_in, slot)


def run_batch(conv, opts, prompts=PROMPTS, max_tokens=12, replay_log=None, device=None):
    """Greedy requests batched in one Engine; -> (tokens per request, logits of every step, the executor, stats)."""
    eng = Engine(conv, ctx=256, max_batch=8, hot_experts=opts, device=device)
    ex = eng.model.experts
    if replay_log is not None:
        ex.dynamic.close()
        ex.dynamic, ex.before_step = None, [Replay(ex, replay_log)]
    steps = []
    fwd = eng.model.forward
    eng.model.forward = lambda *a, **k: steps.append(fwd(*a, **k)) or steps[-1]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), eng.tokenizer.encode(p), SamplingParams(max_tokens=max_tokens, temperature=0))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for rid, tok, _fin in eng.step():
            out.setdefault(rid, []).append(tok)
    stats = dict(eng.stats)
    eng.close()
    return [out[str(i)] for i in range(len(prompts))], steps, ex, stats


@pytest.mark.parametrize("start", ["profile", "empty"])
def test_dynamic_swaps_during_a_running_batch_change_no_output(conv, profile_path, start):
    """Aggressive dynamic placement (a 24-token window, no hysteresis) swaps experts while three requests decode
    together: the outputs equal a replay of the same placements applied synchronously (bit for bit: a swap does
    nothing but move where an expert runs), and stay within the bound of the all-CPU run."""
    opts = HotExpertOptions(profile=str(profile_path) if start == "profile" else None, budget=Budget(per_layer=3),
                            strategy="frequency", dynamic=True, window=24, hysteresis=0.0, min_gap=0.0)
    toks, logits, ex, stats = run_batch(conv, opts)
    log = ex.dynamic.log
    assert ex.dynamic.swaps == len(log) >= 3 and stats["expert_swaps"] == len(log)
    assert any(e_out is not None for _s, _L, _i, e_out in log) and ex.dynamic.failed == 0
    assert 1 < min(s for s, *_ in log) and max(s for s, *_ in log) <= len(logits)   # before forwards 2.. of the batch
    toks2, logits2, _ex2, _ = run_batch(conv, opts, replay_log=log)
    assert toks2 == toks
    assert len(logits2) == len(logits) and all(torch.equal(a, b) for a, b in zip(logits, logits2))
    cpu_toks, _, _, _ = run_batch(conv, None)
    for got, want, prompt in zip(toks, cpu_toks, PROMPTS):
        if got != want:                        # a near-tie may tip: the pick must be within the gap
            with load_model(conv) as lm:
                ids = lm.tokenizer.encode(prompt)
                rows = forced_logits(lm, ids + got)[len(ids) - 1:]
            assert max(float(r.max() - r[t]) for r, t in zip(rows, got)) <= GREEDY_GAP


def test_a_decode_step_never_waits_for_a_copy(conv, profile_path):
    """The copy of a swap runs on its own thread: while it is held up the steps go on with the old placement,
    and the swap lands at a step boundary after it finished."""
    opts = HotExpertOptions(budget=Budget(per_layer=2), strategy="uniform", dynamic=True, window=16,
                            hysteresis=0.0, min_gap=0.0)
    with load_model(conv, hot_experts=opts) as lm:
        ex = lm.model.experts
        release, entered = threading.Event(), threading.Event()
        pack = ex.store.pack

        def slow_pack(layer, e):
            entered.set()
            assert release.wait(60)
            return pack(layer, e)

        ex.store.pack = slow_pack
        ids = lm.tokenizer.encode(PROMPTS[1])
        cache = lm.model.new_cache(256)
        lm.model.forward(Batch.build([(cache, ids)], lm.model.device))     # counts ...
        lm.model.forward(Batch.build([(cache, [ids[-1]])], lm.model.device))   # ... copies start before this step
        assert entered.wait(30)
        for _ in range(6):                                                 # decode steps while the copy is held
            lm.model.forward(Batch.build([(cache, [ids[-1]])], lm.model.device))
        assert ex.dynamic.swaps == 0 and ex.residency.n_resident() == 0 and ex.dynamic.inflight
        held_at = ex.steps
        release.set()
        for _ in range(60):
            lm.model.forward(Batch.build([(cache, [ids[-1]])], lm.model.device))
            if ex.dynamic.swaps:
                break
        assert ex.dynamic.swaps >= 1 and min(s for s, *_ in ex.dynamic.log) > held_at


def test_engine_stats_reach_metrics(conv, profile_path):
    opts = HotExpertOptions(profile=str(profile_path), budget=Budget(per_layer=2), dynamic=True, window=64)
    _toks, _logits, _ex, stats = run_batch(conv, opts, max_tokens=4)
    assert 0 < stats["gpu_hit_ratio"] < 1 and stats["routed_expert_calls"] > 0
    text = "\n".join(render_engine_stats(stats))
    assert f"ktrun_engine_gpu_hit_ratio {stats['gpu_hit_ratio']!r}" in text
    assert "ktrun_engine_expert_swaps " in text and 'ktrun_engine_gpu_hit_ratio_by_layer{layer="2"}' in text


def test_written_placement_is_used_and_can_be_turned_off(conv, profile_path, tmp_path):
    """A placement in the conversion applies by default; --gpu-experts 0 turns it off; one of another model fails."""
    mine = Path(shutil.copytree(conv, tmp_path / "conv"))

    def write(placement: ExpertPlacement) -> None:
        (mine / PLACEMENT_NAME).write_bytes(placement.dumps())
        m = json.loads((mine / "manifest.json").read_text())
        m["files"][PLACEMENT_NAME] = {"kind": "placement", "size": (mine / PLACEMENT_NAME).stat().st_size,
                                      "sha256": sha256_file(mine / PLACEMENT_NAME)}
        (mine / "manifest.json").write_text(json.dumps(m))

    write(ExpertPlacement({1: (3,), 2: (), 3: (0, 5)}, "frequency", "bf16"))
    with load_model(mine) as lm:
        assert lm.model.experts.residency.snapshot() == {1: (3,), 2: (), 3: (0, 5)}
        assert lm.model.experts.store.format == "bf16"
    with load_model(mine, hot_experts=HotExpertOptions(budget=Budget(per_layer=0))) as lm:
        assert isinstance(lm.model.experts, KernelExperts)
    write(ExpertPlacement({1: (30,)}))
    with pytest.raises(ValueError, match="layer 1 lists experts"):
        load_model(mine)


def test_build_refuses_what_it_cannot_do_and_fits_gpu_mem(conv, profile_path, tmp_path):
    with load_model(conv) as lm:
        c = lm.converted
        cpu = lm.model.experts
        with pytest.raises(ValueError, match="--placement frequency chooses experts from a profile"):
            build_hot_executor(c, cpu, HotExpertOptions(budget=Budget(per_layer=2), strategy="frequency"))
        with pytest.raises(ValueError, match="--profile needs a budget"):
            build_hot_executor(c, cpu, HotExpertOptions(profile=str(profile_path)))
        other = ExpertProfile.empty("deepseek_v3", 8, 4, (1, 2, 3))
        other.save(tmp_path / "other.json")
        with pytest.raises(ValueError, match="other.json: measured with 8 routed experts"):
            build_hot_executor(c, cpu, HotExpertOptions(profile=str(tmp_path / "other.json"),
                                                         budget=Budget(per_layer=2)))
        # --gpu-mem: what is left after the dense weights as placed, the KV budget and the 5% reserve
        per, dense, kv = hot_expert_nbytes(c.geometry, "marlin"), dense_device_bytes(c), 100_000
        ex = build_hot_executor(c, cpu, HotExpertOptions(profile=str(profile_path), budget=Budget(
            gpu_mem=int((dense + kv + 10.5 * per) / 0.95), kv_mem=kv), gpu_format="marlin", strategy="per-layer"))
        assert isinstance(ex, HybridExperts) and ex.residency.n_resident() == 10
        assert ex.placement.budget["plan"]["dense_bytes"] == dense


def test_prefix_cache_blocks_are_keyed_by_the_hot_expert_placement(conv, tmp_path):
    """Hot experts compute in another format than the CPU kernels, so KV blocks made with one placement are never
    reused under another (the placement is part of the prefix cache's identity): a disk tier written by an engine
    with 3 hot experts per layer is cold for one with 2, which then reuses its own blocks (same greedy tokens as
    its uncached run)."""
    from ktrun.engine import PrefixCacheConfig

    cfg = PrefixCacheConfig(disk_dir=tmp_path / "kv")
    hot = HotExpertOptions(budget=Budget(per_layer=2), strategy="uniform")

    conv_ids: list[int] = []

    def once(eng, rid):
        eng.add_request(rid, conv_ids, SamplingParams(max_tokens=6, ignore_eos=True))
        toks = []
        cached = None
        while eng.has_work():
            toks += [t for _, t, _ in eng.step()]
            cached = eng.cached_tokens.get(rid, cached)
        return toks, cached

    other = Engine(conv, ctx=256, max_batch=2, hot_experts=HotExpertOptions(budget=Budget(per_layer=3),
                                                                           strategy="uniform"), prefix_cache=cfg)
    conv_ids = other.tokenizer.encode(HELDOUT[:400])[:80]
    _, cached = once(other, "a")
    assert cached == 0 and once(other, "b")[1] == 64                 # (80 - 1) // 16 full blocks
    other.close()                                                    # written to the disk tier
    assert len(list((tmp_path / "kv").rglob("*.kvblock"))) >= 4

    plain = Engine(conv, ctx=256, max_batch=2, hot_experts=hot, prefix_cache=False)
    want, _ = once(plain, "w")
    plain.close()
    hybrid = Engine(conv, ctx=256, max_batch=2, hot_experts=hot, prefix_cache=cfg)
    assert isinstance(hybrid.model.experts, HybridExperts)
    assert once(hybrid, "c") == (want, 0)                            # the other placement's blocks are not its own
    assert once(hybrid, "d") == (want, 64)
    assert hybrid.prefix_cache_stats()["hit_tokens_disk"] == 0
    hybrid.close()


# --- gpt-oss: expert biases and the clamped SwiGLU on the GPU side ------------------------------------------------
# The store holds each hot expert's gate/up/down biases (float32) beside its weights and computes the family's
# activation; the same bounds hold against the all-CPU run (the kernels' kt_set_layer_activation).

@pytest.fixture(scope="module")
def oss(tmp_path_factory) -> Path:
    """gpt-oss's peaked fixture, int4 g32 experts (int codes: both GPU formats apply)."""
    return converted(tmp_path_factory, "gpt_oss", "int4-amx", group_size=32)


@pytest.fixture(scope="module")
def oss_profile(oss, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("oss_prof") / "profile.json"
    with load_model(oss) as lm:
        prof = run_profile(lm.model, lm.tokenizer, [HELDOUT[:6000]], chunk_tokens=256, heldout_every=4,
                           max_tokens=1024, progress=False, text_info={"source": "heldout-start"})
    prof.save(path)
    return path


@pytest.fixture(scope="module")
def oss_reference(oss):
    with load_model(oss) as lm:
        ids = lm.tokenizer.encode(HELDOUT[8000:12000])[:128]
        cpu = forced_logits(lm, ids)
    with load_model(oss, use_kernels=False) as lm:
        exact = forced_logits(lm, ids)
    return ids, cpu, exact


@pytest.mark.parametrize(("fmt", "strategy"), [("bf16", "uniform"), ("marlin", "frequency"), ("bf16", "per-layer")])
def test_gpt_oss_placements_match_the_all_cpu_run(oss, oss_profile, oss_reference, strategy, fmt):
    def biases_counted(lm):            # float32 gate/up/down biases beside each expert's weights
        geo = lm.converted.geometry
        extra = 4 * (2 * geo.intermediate + geo.hidden)
        assert lm.model.experts.store.expert_nbytes == hot_expert_nbytes(geo, fmt) + extra

    opts = HotExpertOptions(profile=str(oss_profile), budget=Budget(per_layer=3), strategy=strategy, gpu_format=fmt)
    check_static_placement(oss, opts, *oss_reference, resident=6, prompt=PROMPTS[1], check=biases_counted)


def test_gpt_oss_marlin_hot_experts_on_the_reference_side_are_the_reference(oss, oss_reference):
    """The torch reference's CPU experts and Marlin hot experts (same codes, float16-exact scales here) run the same
    arithmetic, biases and clamped SwiGLU included: the hybrid run equals the exact run up to summation order."""
    ids, _cpu, exact = oss_reference
    opts = HotExpertOptions(budget=Budget(per_layer=5), strategy="uniform", gpu_format="marlin")
    with load_model(oss, use_kernels=False, hot_experts=opts) as lm:
        got = forced_logits(lm, ids)
        assert lm.model.experts.stats["gpu_hit_ratio"] > 0.5
    assert (got - exact).abs().max().item() < 1e-4


def test_gpt_oss_dynamic_swaps_change_no_output(oss, oss_reference):
    """Dynamic placement (Marlin slots, from empty slots) while a text is decoded token by token (teacher-forced:
    the fixture's greedy continuations repeat a token, so their routing never moves): the biases travel with each
    swapped expert (packed and copied with it), so the logits equal a synchronous replay of the placement log bit for
    bit, and stay within the bound of the all-CPU run."""
    ids, cpu, exact = oss_reference
    opts = HotExpertOptions(budget=Budget(per_layer=2), strategy="uniform", dynamic=True, window=8,
                            hysteresis=0.0, min_gap=0.0, gpu_format="marlin")
    n = 64

    def run(replay_log=None):
        with load_model(oss, hot_experts=opts) as lm:
            ex = lm.model.experts
            if replay_log is not None:
                ex.dynamic.close()
                ex.dynamic, ex.before_step = None, [Replay(ex, replay_log)]
            cache = lm.model.new_cache(n + 1)
            rows = [lm.model.forward(Batch.build([(cache, ids[:16])], "cpu"), all_logits=True)]
            rows += [lm.model.forward(Batch.build([(cache, [t])], "cpu"), all_logits=True) for t in ids[16:n]]
            assert ex.store.format == "marlin" and ex.store.bias_slots is not None
            return torch.cat(rows), (list(ex.dynamic.log) if replay_log is None else None)

    got, log = run()
    assert len(log) >= 6 and sum(e_out is not None for *_, e_out in log) >= 3
    again, _ = run(log)
    assert torch.equal(got, again)
    assert_within_bound(got, cpu[:n], exact[:n])
