"""Decode of a model whose expert files are larger than the RAM allowed to it, in the same run, under a memory cgroup
and, with --throttle-mbps, a disk slowed to a given read rate (cgroup-v1 blkio): plain mmap (the page cache decides),
plain mmap with posix_fadvise(WILLNEED) readahead of whole experts (routed + router-predicted), and the RAM tier
(`--expert-ram`) without prediction, with the router predictor and with the co-activation predictor (`--modes` adds
tier-pread: buffered reads, and tier-onecall: no per-expert completion).

Models (--model):
  synthetic  a Qwen3-MoE-architecture checkpoint written here (random bf16 weights, hidden 1024, expert intermediate
             1536, 64 experts, top-8, 8 layers; the dense part from ktconvert.testing), converted by `ktconvert
             quantize --method int4-amx`: about 1.3 GB of expert files (kept in --work for later runs). Decode feeds
             the same seeded random tokens in every run (a random model's greedy output repeats one token, which
             would make routing unrealistically repetitive).
  default    the shipped default model (ktconvert/data/default_model: trained, so its routing is real; DeepSeek-V3
             architecture, 3 MoE layers of 16 experts, top-4), converted with int4 experts: about 0.8 MB of expert
             files, so the budgets are a few experts and the throttle a few MB/s. Decode is teacher-forced on its
             held-out text (heldout_eval.txt). The memory cgroup is left out (its 64 MiB margin dwarfs these files;
             the tier's own budget is the cap, checked by mincore), and with it the mmap modes.
4 warm-up steps, then --tokens timed steps (a run stops early after --max-run-s seconds, at 2 steps at least).

Each run is a fresh process moved into its cgroups after the page cache of the expert files was dropped
(posix_fadvise DONTNEED): memory (v1 memory.limit_in_bytes, or v2 memory.max; root only; limit = the process's own
anonymous memory after loading, measured first without a limit, + 64 MiB + expert files / ratio, for each --ratios;
the tier's budget is expert files / ratio; page cache counts against the limit), and with a throttle a blkio cgroup
whose reads from the disk holding the files are held to that rate. Every cgroup is removed and every throttle cleared
on exit, also after an error or SIGTERM / SIGINT (bench/cgroup_limits.py); one a SIGKILLed run left is removed at the
next start. Modes alternate within each repetition.

Limits measured in the same run, per throttle setting: the disk's sequential read speed (O_DIRECT, 8 MiB reads, 1, 4
and 8 in flight, cache dropped, in the same blkio cgroup as the runs; before and after the runs, the best one is the
limit), the tier's reader alone on the same files (2 and 8 random experts per layer: does it read at the disk's rate?),
the all-in-RAM decode rate (no cgroup, files in the page cache: the compute limit), and the load average. What the
throttle holds back (O_DIRECT, buffered reads, mmap faults, fadvise readahead) is measured once (`throttle_check_*`).

Per run: tokens/s, bytes read from disk per token (/proc/self/io read_bytes; with a throttle also the blkio
cgroup's own count), the tier's bytes split into demand reads, prefetches and prefetches then used, the share of
the run the disk was busy, hit ratios, prediction precision/recall, the tier's resident bytes measured by mincore
after every step against its budget, the cgroup's peak usage, OOM kills, and a hash of each step's logits (all modes
must agree on the steps they share: the tier is bit-identical to mmap).

The target (issue 21: ">= 70% of what the disk's read speed allows for the bytes that must come from disk per token")
as printed:
  disk_bound_ratio    = tok/s / (disk GB/s / disk bytes per token): the disk's busy share at its full rate
  needed_bound_ratio  = the same with the bytes that had to come from disk: demand reads + prefetches then used
                        (wrong prefetches are not counted as needed), for the tier modes
  bound_ratio         = tok/s / min(disk-allowed tok/s for the needed bytes, all-in-RAM tok/s): decode cannot beat
                        compute; `limit` says which of the two is smaller
  conservative_bound_ratio = bound_ratio with the disk's speed taken as the faster of its sequential rate and the
                        rate the run's reads ran at while in flight (a throttled disk lets a read after an idle gap
                        run faster than its sequential rate: blk-throttle grants a 100 ms slice's bytes at once)
  vs_mmap, vs_tier    = tok/s over plain mmap's / the tier's without prediction, same cap and throttle

    .venv/bin/python bench/bench_expert_tier.py [--work /var/tmp/ktrun-bench-expert-tier] [--tokens 32] [--reps 2]
    .venv/bin/python bench/bench_expert_tier.py --throttle-mbps 0,100            # unthrottled, then 100 MB/s
    .venv/bin/python bench/bench_expert_tier.py --model default --ratios 2,3 --throttle-mbps 2 --tokens 48
"""
from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cgroup_limits import (  # bench/ sits on sys.path as the script's folder
    BlkioThrottle,
    Limits,
    MemoryCgroup,
    group_name,
    install_cleanup,
    whole_disk,
)

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 1024, "moe_intermediate_size": 1536, "num_experts": 64, "num_experts_per_tok": 8,
         "num_layers": 8}
# ram: plain mmap, no cgroup, files in the page cache; mmap+willneed: plain mmap plus posix_fadvise(WILLNEED) of
# each layer's routed experts as soon as it is routed and of the next layer's router-predicted ones (the page
# cache's own asynchronous readahead, in place of our reader); tier: --expert-ram without prediction;
# tier+predict: with the router predictor; tier+coact: with the co-activation predictor; tier-pread: buffered reads
MODES = ("ram", "mmap", "mmap+willneed", "tier", "tier+predict", "tier+coact")
ALL_MODES = (*MODES, "tier-pread", "tier-onecall")   # tier-onecall: no per-expert completion (one call per layer)
DEFAULT_MODEL_MODES = ("ram", "tier", "tier+predict", "tier+coact")
MMAP_MODES = ("mmap", "mmap+willneed")
MARGIN = 64 << 20
WARMUP = 4


# -- the model ------------------------------------------------------------------------------------------------
def build_model(work: Path) -> Path:
    """Write the checkpoint (streamed, one shard per layer) and convert it; reused when already there."""
    conv = work / "conv-int4"
    if (conv / "manifest.json").exists():
        return conv
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ktconvert.testing import make_checkpoint
    src = work / "src"
    if not (src / "config.json").exists():
        tpl = make_checkpoint("qwen3_moe", work / "template", num_layers=SHAPE["num_layers"], num_experts=2,
                              num_experts_per_tok=2, hidden_size=SHAPE["hidden_size"],
                              moe_intermediate_size=SHAPE["moe_intermediate_size"], intermediate_size=2048,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=128)
        src.mkdir(parents=True, exist_ok=True)
        dense = {}
        for f in sorted(tpl.glob("*.safetensors")):
            with safe_open(f, "pt") as g:
                dense.update({k: g.get_tensor(k) for k in g.keys() if ".mlp.experts." not in k})  # noqa: SIM118 (a safe_open handle is not iterable)
        gen = torch.Generator().manual_seed(0)
        E, H, I = SHAPE["num_experts"], SHAPE["hidden_size"], SHAPE["moe_intermediate_size"]

        def rnd(*shape):
            return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        weight_map = {}
        for L in range(SHAPE["num_layers"]):
            t = {k: v for k, v in dense.items() if k.startswith(f"model.layers.{L}.")}
            t[f"model.layers.{L}.mlp.gate.weight"] = rnd(E, H)
            for e in range(E):
                p = f"model.layers.{L}.mlp.experts.{e}."
                t[p + "gate_proj.weight"], t[p + "up_proj.weight"], t[p + "down_proj.weight"] = \
                    rnd(I, H), rnd(I, H), rnd(H, I)
            name = f"model-{L:05d}.safetensors"
            save_file(t, str(src / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(t, name))
            print(f"  wrote {name}", file=sys.stderr, flush=True)
        rest = {k: v for k, v in dense.items() if not k.startswith("model.layers.")}
        save_file(rest, str(src / "model-rest.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(rest, "model-rest.safetensors"))
        (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (tpl / name).exists():
                (src / name).write_bytes((tpl / name).read_bytes())
        cfg = json.loads((tpl / "config.json").read_text())
        cfg.update(num_experts=E, num_experts_per_tok=SHAPE["num_experts_per_tok"])
        (src / "config.json").write_text(json.dumps(cfg, indent=2))
    subprocess.run([str(Path(sys.executable).parent / "ktconvert"), "quantize", str(src), "-o", str(conv),
                    "--method", "int4-amx", "--gpu-method", "bf16", "--quiet"], check=True)
    return conv


def expert_files(conv: Path) -> list[Path]:
    return sorted((conv / "experts").glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(8 << 20):
                pass


def disk_read_gbps(files: list[Path], in_flight: int, limit: int = 1 << 30, block: int = 8 << 20) -> float:
    """Sequential O_DIRECT reads of the expert files (cache dropped first), `in_flight` reads at a time, up to
    `limit` bytes."""
    drop_cache(files)
    jobs, total = [], 0
    for f in files:
        size = f.stat().st_size
        for off in range(0, size, block):
            if total >= limit:
                break
            jobs.append((f, off))
            total += min(block, size - off)
    bufs = [mmap.mmap(-1, block) for _ in range(in_flight)]
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}
    free, lock = list(range(in_flight)), threading.Lock()

    def read(job):
        with lock:
            b = free.pop()
        try:
            return os.preadv(fds[job[0]], [memoryview(bufs[b])], job[1])
        finally:
            with lock:
                free.append(b)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        got = sum(pool.map(read, jobs))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return got / dt / 1e9


def build_default_model(work: Path) -> Path:
    """The shipped default model converted with int4 experts (as the tests convert it); reused when already there."""
    conv = work / "default-int4"
    if not (conv / "manifest.json").exists():
        import ktconvert
        src = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
        subprocess.run([str(Path(sys.executable).parent / "ktconvert"), "quantize", str(src), "-o", str(conv),
                        "--gpu-method", "rtn-int4", "--quiet"], check=True)
    return conv


def decode_tokens(model: str, lm, n: int) -> list[int]:
    """The n tokens a run feeds: seeded random ids (synthetic), or the default model's held-out text."""
    import torch
    if model == "default":
        import ktconvert
        text = (Path(ktconvert.__file__).resolve().parent / "data" / "default_model" / "heldout_eval.txt").read_text()
        ids = lm.tokenizer.encode(text)
        if len(ids) < n:
            raise SystemExit(f"heldout_eval.txt has {len(ids)} tokens, {n} needed")
        return ids[:n]
    return torch.randint(0, lm.model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()


# -- one run (child process) ----------------------------------------------------------------------------------
def read_bytes() -> int:
    return next(int(ln.split()[1]) for ln in Path("/proc/self/io").read_text().splitlines()
                if ln.startswith("read_bytes:"))


def rss_anon() -> int:
    return next(int(ln.split()[1]) * 1024 for ln in Path("/proc/self/status").read_text().splitlines()
                if ln.startswith("RssAnon:"))


class WillneedExperts:
    """Plain mmap with the kernel's readahead asked for whole experts: at each MoE layer's submit,
    posix_fadvise(WILLNEED) on the byte ranges of its routed experts and of the next layer's predicted ones (the
    router predictor), then the kernels fault the pages in as usual. (madvise(MADV_WILLNEED) on a file mapping
    does the same: it starts the same page-cache readahead.) The bench's stand-in for "let the page cache read"."""

    def __init__(self, inner, converted):
        from ktlayouts.converted_dir import PROJECTIONS, expert_file, expert_tensor
        from ktrun.experts.prediction import NextLayerPredictor
        geo, man = converted.geometry, converted.manifest
        self.inner, self.E = inner, geo.n_experts
        self.predictor = NextLayerPredictor(converted)
        self.ranges: dict[int, list[tuple[int, int, int]]] = {}   # layer -> [(fd, offset of expert 0, bytes per expert)]
        self.fds = []
        for L in geo.moe_layers:
            for s_ in range(geo.numa_nodes):
                rel = expert_file(L, s_, geo.numa_nodes)
                fd = os.open(converted.root / rel, os.O_RDONLY)
                self.fds.append(fd)
                for p in PROJECTIONS:
                    for kind in ("qweight", "scales"):
                        t = man["files"][rel]["tensors"].get(expert_tensor(p, kind))
                        if t is not None:
                            self.ranges.setdefault(L, []).append((fd, int(t["offset"]), int(t["nbytes"]) // self.E))
        self.calls = 0

    def _willneed(self, layer, experts):
        for fd, off, per in self.ranges.get(layer, []):
            for e in experts:
                os.posix_fadvise(fd, off + int(e) * per, per, os.POSIX_FADV_WILLNEED)
        self.calls += 1

    def submit(self, layer, x, ids, weights, out, **kw):
        import numpy as np
        ids_np = ids.cpu().numpy()
        self._willneed(layer, np.unique(ids_np[ids_np >= 0]))
        nxt, pred = self.predictor.predict(layer, x)
        if nxt is not None:
            self._willneed(nxt, pred)
        self.inner.submit(layer, x, ids, weights, out, **kw)

    def sync(self):
        self.inner.sync()

    @property
    def stats(self):
        return self.inner.stats

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.inner.close()


def reader_child(a) -> None:
    """The tier's reader alone (ExpertRamTier.ensure_each, default reads and threads), cache dropped: per MoE layer
    `a.budget` random experts at once (what a decode step misses), timed from issue to the last landing."""
    import random

    from ktrun.experts.ram_tier import ExpertRamTier
    from ktrun.loaded_model import load_model
    lm = load_model(a.conv, device="cpu")
    c, rng, rates = lm.converted, random.Random(0), []
    for _ in range(3):
        tier = ExpertRamTier(c, 1 << 34)
        drop_cache(expert_files(a.conv))
        busy = 0.0
        for L in c.geometry.moe_layers:
            t0 = time.perf_counter()
            gs, each = tier.ensure_each(L, rng.sample(range(c.geometry.n_experts), a.budget))
            tier.wait(each)
            busy += time.perf_counter() - t0
            tier.release(gs)
        rates.append(tier.counters["bytes_read"] / busy / 1e9)
        tier.close()
    lm.close()
    print(json.dumps({"rates": rates, "experts_per_layer": a.budget}))


def probe_child(a) -> None:
    """Run in the limits' cgroups: the disk's sequential rate there (`disk`), or what the throttle holds back
    (`throttle-check`: O_DIRECT, buffered read(), faults on a file mmap, fadvise(WILLNEED) readahead, each on
    `a.budget` bytes of the expert files with their cache dropped)."""
    files = expert_files(a.conv)
    if a.mode == "disk":
        print(json.dumps({n: disk_read_gbps(files, n, limit=a.budget) for n in (1, 4, 8)}))
        return
    print(json.dumps({k: read_rate(files, k, a.budget) for k in ("direct", "buffered", "mmap", "willneed")}))


def read_rate(files: list[Path], kind: str, limit: int) -> float:
    """GB/s reading up to `limit` bytes of `files` from disk one way (cache dropped first)."""
    if kind == "direct":
        return disk_read_gbps(files, 1, limit=limit, block=1 << 20)
    drop_cache(files)
    got, t0 = 0, time.perf_counter()
    for f in files:
        size = min(f.stat().st_size, limit - got)
        if size <= 0:
            break
        fd = os.open(f, os.O_RDONLY)
        try:
            if kind == "buffered":
                for off in range(0, size, 1 << 20):
                    got += len(os.pread(fd, min(1 << 20, size - off), off))
                continue
            if kind == "willneed":           # ask for readahead of the whole range, then touch it
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            with mmap.mmap(fd, f.stat().st_size, prot=mmap.PROT_READ) as m:
                got += sum(m[o] >= 0 for o in range(0, size, mmap.PAGESIZE)) and size
        finally:
            os.close(fd)
    return got / (time.perf_counter() - t0) / 1e9


def child(a) -> None:
    import torch
    from ktrun.cli.expert_ram_option import ExpertRamOptions
    from ktrun.generate import decode_one_token, prefill
    from ktrun.loaded_model import load_model
    torch.set_num_threads(1)
    opts = None if a.mode in ("ram", "mmap", "mmap+willneed", "baseline") else ExpertRamOptions(
        a.budget, predict=a.mode in ("tier+predict", "tier+coact"), io="pread" if a.mode == "tier-pread" else a.io,
        predictor="coact" if a.mode == "tier+coact" else "router")
    lm = load_model(a.conv, device="cpu", expert_ram=opts)
    m = lm.model
    if a.mode == "mmap+willneed":
        m.experts = WillneedExperts(m.experts, lm.converted)
    if a.mode == "tier-onecall":                 # A/B of per-expert completion: the layer waits for all its reads
        m.experts.stage = False
    tier = getattr(m.experts, "tier", None)
    toks = decode_tokens(a.model, lm, 1 + WARMUP + a.tokens)
    cache = m.new_cache(len(toks) + 1)
    prefill(m, cache, toks[:1])
    for t in toks[1:1 + WARMUP]:
        decode_one_token(m, cache, t)
    if a.mode == "baseline":
        from ktrun.experts.ram_tier import PAGE, ExpertRamTier
        rss = rss_anon()
        probe = ExpertRamTier(lm.converted, 1 << 40)          # reads nothing: the smallest budget it would take
        print(json.dumps({"rss_anon": rss, "min_budget": probe.layer_pages * PAGE}))
        probe.close()
        lm.close()
        return
    s0, io0 = dict(m.experts.stats) if tier else {}, read_bytes()
    hashes, peak_measured = [], 0
    t0 = time.perf_counter()
    for t in toks[1 + WARMUP:]:
        hashes.append(hashlib.sha256(decode_one_token(m, cache, t).numpy().tobytes()).hexdigest()[:12])
        if tier is not None:
            peak_measured = max(peak_measured, tier.measured_resident_bytes())
        if len(hashes) >= 2 and time.perf_counter() - t0 > a.max_run_s:
            break
    wall = time.perf_counter() - t0
    n = len(hashes)
    out = {"mode": a.mode, "tokens": n, "tok_s": n / wall, "disk_bytes_per_token": (read_bytes() - io0) / n,
           "step_hashes": hashes, "rss_anon": rss_anon()}
    if tier is not None:
        s1 = m.experts.stats

        def d(k):
            return s1[f"ram_tier_{k}"] - s0.get(f"ram_tier_{k}", 0)
        out.update({"tier_bytes_per_token": d("bytes_read") / n, "budget": s1["ram_tier_budget_bytes"],
                    "needed_bytes_per_token": (d("bytes_demand") + d("bytes_prefetch_used")) / n,
                    "demand_bytes_per_token": d("bytes_demand") / n,
                    "prefetch_bytes_per_token": d("bytes_prefetch") / n,
                    "peak_accounted": s1["ram_tier_peak_resident_bytes"], "peak_measured": peak_measured,
                    "hit_ratio": d("ram_hits") / max(1, d("demand_experts")),
                    "disk_read_gbps": d("bytes_read") / d("disk_busy_s") / 1e9 if d("disk_busy_s") else 0.0,
                    "disk_busy_share": d("disk_busy_s") / wall, "merged_reads_per_token": d("merged_reads") / n,
                    "wait_ms_per_token": 1e3 * d("demand_wait_s") / n, "io": s1["ram_tier_io"],
                    "staged_layers_per_token": d("staged_layers") / n,
                    "early_experts_per_token": d("early_experts") / n})
        if "ram_tier_pred_predicted" in s1:
            out.update({"prefetch_hit_ratio": d("prefetch_used") / max(1, d("prefetch_issued")),
                        "prefetch_throttled_calls": d("prefetch_throttled"),
                        "prefetch_cancelled": d("prefetch_cancelled"),
                        "precision": d("pred_correct") / max(1, d("pred_predicted")),
                        "recall": d("pred_correct") / max(1, d("pred_actual"))})
    lm.close()
    print(json.dumps(out))


def run_child(a, mode: str, budget: int, limits: Limits | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--conv", str(a.conv), "--tokens", str(a.tokens),
           "--budget", str(budget), "--io", a.io, "--model", a.model, "--max-run-s", str(a.max_run_s)]
    # every mode computes the shared expert outside the routed job, as the tier does (KTRUN_FUSE_SHARED, runtime/README.md):
    # the same bits in all of them, the same work beside the experts
    env = dict(os.environ, OMP_NUM_THREADS="1", KTRUN_FUSE_SHARED="0")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=limits.enter if limits else None,
                       check=False)
    if p.returncode != 0:
        return {"mode": mode, "failed": p.returncode, "stderr": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- the benchmark --------------------------------------------------------------------------------------------
def fmt(r: dict) -> str:
    return json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                       if k not in ("step_hashes", "stderr")} | ({"stderr": r["stderr"]} if "stderr" in r else {}))


def load_average() -> str:
    return f"{' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min; 2 cores)"


def measure_limits(a, files: list[Path], label: str, limits, after: bool = False) -> dict[int, float]:
    """The disk's sequential rate (GB/s at 1/4/8 reads in flight) under this setting's throttle, and (before the
    runs) the tier's reader alone on the same files."""
    if limits is None:
        disk = {n: disk_read_gbps(files, n) for n in (1, 4, 8)}
    else:
        with limits() as lim:                 # ~3 s of reads at the throttled rate per measurement
            r = run_child(a, "disk", min(1 << 30, int(3 * lim.groups[-1].bps)), lim)
        if "failed" in r:
            sys.exit(f"disk rate run failed: {r['stderr']}")
        disk = {int(n): v for n, v in r.items()}
    for n, v in disk.items():
        print(f"disk_sequential_read_{label}_{n}_in_flight{'_after' if after else ''}: {v:.3f} GB/s")
    if not after:
        for n in (2, 8):
            with (limits() if limits else Limits()) as lim:
                r = run_child(a, "reader", n, lim)
            if "failed" in r:
                sys.exit(f"reader run failed: {r['stderr']}")
            print(f"tier_reader_rate_{label}_{n}_experts_per_layer: {statistics.fmean(r['rates']):.3f} GB/s "
                  f"[{', '.join(f'{v:.3f}' for v in r['rates'])}] (cache dropped; vs sequential {max(disk.values()):.3f})")
    return disk


def throttle_check(a, files: list[Path], limits, bps: int) -> None:
    """What the blkio throttle holds back on this kernel: each way of reading, throttled and not."""
    n = min(64 << 20, int(1.5 * bps), sum(f.stat().st_size for f in files))
    free = {k: read_rate(files, k, n) for k in ("direct", "buffered", "mmap", "willneed")}
    with limits() as lim:
        r = run_child(a, "throttle-check", n, lim)
        served = lim.groups[-1].bytes_read()
    if "failed" in r:
        sys.exit(f"throttle check failed: {r['stderr']}")
    for k, v in r.items():
        print(f"throttle_check_{k}: {v * 1e3:.1f} MB/s throttled vs {free[k] * 1e3:.1f} MB/s not "
              f"(limit {bps / 1e6:.1f} MB/s, {n / 1e6:.1f} MB read each way)")
    print(f"throttle_check_blkio_bytes: {served} bytes charged to the throttled cgroup (4 x {n})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/ktrun-bench-expert-tier"))
    ap.add_argument("--model", default="synthetic", choices=("synthetic", "default"))
    ap.add_argument("--tokens", type=int, default=32)     # fewer: a tier still filling (12 tokens read 13.3 MB/token at 2x, 32 read 7.8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ratios", default="2,4", help="expert files / RAM cap, comma-separated")
    ap.add_argument("--throttle-mbps", default="0", help="disk read rates to run at, MB/s, comma-separated; 0 = the "
                    "disk as it is (e.g. 0,100: unthrottled, then held to 100 MB/s by a blkio cgroup)")
    ap.add_argument("--max-run-s", type=float, default=60.0, help="a run stops after this many seconds of decode")
    ap.add_argument("--io", default="direct", choices=("direct", "pread"))
    ap.add_argument("--modes", default=None, help=f"comma-separated, of {', '.join(ALL_MODES)}")
    ap.add_argument("--child", default=None)
    ap.add_argument("--conv", type=Path, help="an existing conversion of --model to use instead of building one")
    ap.add_argument("--budget", type=int, default=0)
    a = ap.parse_args()
    if a.child:
        a.mode = a.child
        {"reader": reader_child, "disk": probe_child, "throttle-check": probe_child}.get(a.child, child)(a)
        return
    if os.geteuid() != 0:
        sys.exit("bench_expert_tier: needs root (it creates cgroups)")
    install_cleanup()
    modes = tuple(m for m in (a.modes or ",".join(MODES if a.model == "synthetic" else DEFAULT_MODEL_MODES))
                  .split(",") if m)
    bad = [m for m in modes if m not in ALL_MODES or (a.model == "default" and m in MMAP_MODES)]
    if bad:
        sys.exit(f"--modes: {bad} not available; use {', '.join(ALL_MODES)} "
                 f"(--model default: {', '.join(m for m in ALL_MODES if m not in MMAP_MODES)})")
    throttles = [float(v) for v in a.throttle_mbps.split(",") if v]
    if a.conv is None:
        a.work.mkdir(parents=True, exist_ok=True)
        a.conv = build_model(a.work) if a.model == "synthetic" else build_default_model(a.work)
    files = expert_files(a.conv)
    total = sum(f.stat().st_size for f in files)
    device = whole_disk(files[0]) if any(throttles) else None
    print(f"model: {a.model}; expert_files: {total} bytes in {len(files)} files"
          + (f" on disk {device}" if device else ""))
    print(f"load_average_start: {load_average()}")
    print(f"bench_pid: {os.getpid()} (its cgroups: {group_name('*')})")
    drop_cache(files)
    base = run_child(a, "baseline", 0)
    if "failed" in base:
        sys.exit(f"baseline run failed: {base['stderr']}")
    print(f"process_anon_baseline: {base['rss_anon']} bytes (dense weights, torch, KV; outside the expert cap)")
    print(f"tier_min_budget: {base['min_budget']} bytes (one MoE layer's experts)")
    results: dict[tuple[str, int, str], list[dict]] = {}
    checked = False
    for mbps in throttles:
        bps = int(mbps * 1e6)
        label = f"{mbps:g}MBps" if bps else "unthrottled"

        def limits(mem: int | None = None, bps=bps) -> Limits | None:
            lim = Limits()
            if mem:
                lim.add(MemoryCgroup(group_name("memory"), mem))
            if bps:
                lim.add(BlkioThrottle(group_name("blkio"), device, bps))
            return lim
        print(f"\n## disk: {label}")
        if bps and not checked:
            throttle_check(a, files, limits, bps)
            checked = True
        disk = measure_limits(a, files, label, limits if bps else None)
        for ratio in (int(r) for r in a.ratios.split(",")):
            cap = total // ratio
            budget = max(cap, base["min_budget"])
            mem = base["rss_anon"] + MARGIN + cap if a.model == "synthetic" else None
            print(f"\n# {label}, expert files {ratio}x the cap: cap {cap} bytes, tier budget {budget} bytes"
                  + (f", cgroup limit {mem} bytes" if mem else ", no memory cgroup (the tier's budget is the cap)"))
            for rep in range(a.reps):
                for mode in (modes if rep % 2 == 0 else modes[::-1]):
                    if mode == "ram":                      # the all-in-RAM rate: the compute limit
                        warm_cache(files)
                        r = run_child(a, mode, budget)
                    else:
                        drop_cache(files)
                        with limits(mem) as lim:
                            r = run_child(a, mode, budget, lim)
                            for g in lim.groups:
                                if isinstance(g, MemoryCgroup):
                                    r.update(cgroup_peak=g.peak(), oom_kills=g.oom_kills(), limit=g.limit)
                                else:
                                    r.update(blkio_read_bytes=g.bytes_read())
                    results.setdefault((label, ratio, mode), []).append(r)
                    print(f"  run {label} {ratio}x {mode}: {fmt(r)}", flush=True)
        for n, v in measure_limits(a, files, label, limits if bps else None, after=True).items():
            disk[n] = max(disk[n], v)
        summarize(results, label, max(disk.values()))
    print(f"\nload_average_end: {load_average()}")
    print(f"logits_identical_across_modes: {int(logits_agree(results))}")


def logits_agree(results) -> bool:
    """Every run's step hashes agree with every other's on the steps both ran (all runs feed the same tokens)."""
    runs = [r["step_hashes"] for rs in results.values() for r in rs if "step_hashes" in r]
    if not runs or len(runs) < sum(len(rs) for rs in results.values()):
        return False
    ref = max(runs, key=len)
    return all(h == ref[:len(h)] for h in runs)


def summarize(results, label: str, disk_gbps: float) -> None:
    print(f"\n# summary, disk {label} (mean over reps)")
    print(f"disk_read_limit_{label}: {disk_gbps:.4f} GB/s (the best sequential rate measured for this setting)")
    ram = [r["tok_s"] for (lab, _, mode), rs in results.items() if lab == label and mode == "ram"
           for r in rs if "failed" not in r]
    ram_tps = statistics.fmean(ram) if ram else 0.0
    print(f"tok_s_all_in_ram_{label}: {ram_tps:.3f} tok/s (no cap, files in the page cache: the compute limit)")
    for (lab, ratio, mode), rs in results.items():
        if lab != label or mode == "ram":
            continue
        ok = [r for r in rs if "failed" not in r]
        tag = f"{label}_{ratio}x_{mode.replace('+', '_').replace('-', '_')}"
        print(f"runs_failed_{tag}: {len(rs) - len(ok)}")
        if not ok:
            continue

        def mean(k, ok=ok):
            return statistics.fmean(r[k] for r in ok)
        tps, bpt = mean("tok_s"), mean("disk_bytes_per_token")
        need = mean("needed_bytes_per_token") if "needed_bytes_per_token" in ok[0] else bpt
        runs = ", ".join(f"{r['tok_s']:.2f}" for r in ok)
        print(f"tok_s_{tag}: {tps:.3f} tok/s [{runs}]")
        print(f"disk_bytes_per_token_{tag}: {bpt / 1e6:.3f} MB")
        if bpt:
            disk_tps = disk_gbps * 1e9 / bpt
            print(f"disk_bound_ratio_{tag}: {tps / disk_tps:.3f} (of {disk_tps:.2f} tok/s the disk allows for "
                  f"{bpt / 1e6:.3f} MB/token)")
        if need:
            need_tps = disk_gbps * 1e9 / need
            bound = min(need_tps, ram_tps) if ram_tps else need_tps
            if need != bpt:
                print(f"needed_bytes_per_token_{tag}: {need / 1e6:.3f} MB (demand reads + prefetches then used)")
                print(f"needed_bound_ratio_{tag}: {tps / need_tps:.3f} (of {need_tps:.2f} tok/s the disk allows for "
                      f"the needed bytes)")
            print(f"bound_ratio_{tag}: {tps / bound:.3f} (of min(disk {need_tps:.2f}, all-in-RAM {ram_tps:.2f}) = "
                  f"{bound:.2f} tok/s; limit: {'disk' if not ram_tps or need_tps < ram_tps else 'compute'})")
            if "disk_read_gbps" in ok[0]:         # a throttled disk lets reads after an idle gap run faster
                fast = max(disk_gbps, mean("disk_read_gbps"))
                fast_tps = fast * 1e9 / need
                bound = min(fast_tps, ram_tps) if ram_tps else fast_tps
                print(f"conservative_bound_ratio_{tag}: {tps / bound:.3f} (the same with the disk's speed taken as "
                      f"the faster of its sequential rate and the rate this mode's reads ran at while in flight, "
                      f"{fast:.4f} GB/s: of {bound:.2f} tok/s)")
        for base_mode in (*MMAP_MODES, "tier"):
            if base_mode == "tier" and not mode.startswith("tier"):
                continue
            mm = [r["tok_s"] for r in results.get((label, ratio, base_mode), []) if "failed" not in r]
            if mode != base_mode and mm and not (base_mode == "mmap+willneed" and mode == "mmap"):
                print(f"vs_{base_mode.replace('+', '_')}_{tag}: {tps / statistics.fmean(mm):.2f}x"
                      + (" (the prediction's gain)" if base_mode == "tier" and "+" in mode else ""))
        if "cgroup_peak" in ok[0]:
            print(f"cgroup_peak_{tag}: {max(r['cgroup_peak'] for r in ok)} bytes (limit {ok[0]['limit']})")
            print(f"oom_kills_{tag}: {sum(r.get('oom_kills', 0) for r in rs)}")
        if "budget" in ok[0]:
            print(f"tier_peak_measured_{tag}: {max(r['peak_measured'] for r in ok)} bytes (budget {ok[0]['budget']})")
            print(f"tier_hit_ratio_{tag}: {mean('hit_ratio'):.4f}")
            print(f"tier_bytes_per_token_{tag}: demand {mean('demand_bytes_per_token') / 1e6:.3f} MB, prefetch "
                  f"{mean('prefetch_bytes_per_token') / 1e6:.3f} MB")
            print(f"tier_disk_busy_share_{tag}: {mean('disk_busy_share'):.3f} (of the decode time, >= 1 read in "
                  f"flight)")
            print(f"tier_disk_read_rate_{tag}: {mean('disk_read_gbps'):.4f} GB/s (while reads were in flight)")
            print(f"tier_demand_wait_per_token_{tag}: {mean('wait_ms_per_token'):.2f} ms")
            print(f"tier_experts_computed_before_reads_per_token_{tag}: {mean('early_experts_per_token'):.2f}")
            print(f"tier_merged_reads_per_token_{tag}: {mean('merged_reads_per_token'):.2f}")
        if "precision" in ok[0]:
            for k in ("prefetch_hit_ratio", "precision", "recall"):
                print(f"tier_{k}_{tag}: {mean(k):.4f}")


if __name__ == "__main__":
    main()
