"""Decode of a model whose expert files are larger than the RAM allowed to it, in the same run, under a memory cgroup:
plain mmap (the page cache decides), plain mmap with posix_fadvise(WILLNEED) readahead of whole experts (routed +
router-predicted), and the RAM tier (`--expert-ram`) without prediction, with the router predictor and with the
co-activation predictor (`--modes` adds tier-pread: buffered reads).

Model: a Qwen3-MoE-architecture checkpoint written here (random bf16 weights, hidden 1024, expert intermediate 1536,
64 experts, top-8, 8 layers; the dense part from ktconvert.testing), converted by `ktconvert quantize --method
int4-amx`: about 1.3 GB of expert files (kept in --work for later runs). Decode feeds the same seeded random
tokens in every run (a random model's greedy output repeats one token, which would make routing unrealistically
repetitive); 4 warm-up steps, then --tokens timed steps.

Each run is a fresh process moved into a memory cgroup (v1 memory.limit_in_bytes under /sys/fs/cgroup/memory, or
v2 memory.max where the memory controller is on the unified hierarchy; root only) after the page cache of the
expert files was dropped (posix_fadvise DONTNEED). The cap is for the experts: cgroup limit = the process's own
anonymous memory after loading (measured first, without a limit: dense weights, torch, KV) + 64 MiB + expert
files / ratio, for ratio 2 and 4; the tier's budget is expert files / ratio. Page cache counts against the limit.
Modes alternate within each repetition. Per run: tokens/s, bytes read from disk per token (/proc/self/io
read_bytes), the tier's hit ratios and prediction precision/recall, the tier's resident bytes measured by mincore
after every step against its budget, the cgroup's peak usage, OOM kills, and a hash of the timed logits (all modes
must agree: the tier is bit-identical to mmap).

Limits measured in the same run: the disk's sequential read speed (O_DIRECT, 8 MiB reads, 1, 4 and 8 in flight, cache
dropped; before and after the runs, the best one is the limit), the tier's reader alone on the same files (2 and 8
random experts per layer, cache dropped: does it read at the disk's rate?), the load average, and the all-in-RAM decode
rate (plain mmap without a cgroup, files in the page cache: the compute limit).
`disk_bound_ratio` = tok/s / (disk GB/s / disk bytes per token): the share of what the disk allows for the bytes
that came from disk; `bound_ratio` the same against min(that, all-in-RAM rate), since decode cannot beat compute.
`vs_mmap` = tok/s over plain mmap's under the same cap.

    .venv/bin/python bench/bench_expert_tier.py [--work /var/tmp/ktrun-bench-expert-tier] [--tokens 12] [--reps 2]
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

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 1024, "moe_intermediate_size": 1536, "num_experts": 64, "num_experts_per_tok": 8,
         "num_layers": 8}
# ram: plain mmap, no cgroup, files in the page cache; mmap+willneed: plain mmap plus posix_fadvise(WILLNEED) of
# each layer's routed experts as soon as it is routed and of the next layer's router-predicted ones (the page
# cache's own asynchronous readahead, in place of our reader); tier: --expert-ram without prediction;
# tier+predict: with the router predictor; tier+coact: with the co-activation predictor; tier-pread: buffered reads
MODES = ("ram", "mmap", "mmap+willneed", "tier", "tier+predict", "tier+coact")
ALL_MODES = (*MODES, "tier-pread", "tier-onecall")   # tier-onecall: no per-expert completion (one call per layer)
MARGIN = 64 << 20


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
    """Sequential O_DIRECT reads of the expert files (cache dropped first), `in_flight` reads at a time."""
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


# -- cgroups --------------------------------------------------------------------------------------------------
class MemoryCgroup:
    """A memory cgroup with a hard limit (v1 memory.limit_in_bytes, else v2 memory.max); removed on close."""

    def __init__(self, name: str, limit: int):
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "memory.limit_in_bytes").exists():
            self.path, self.v1 = v1 / name, True
        elif "memory" in (v2 / "cgroup.controllers").read_text().split():
            self.path, self.v1 = v2 / name, False
        else:
            raise RuntimeError("no memory cgroup controller found (v1 /sys/fs/cgroup/memory or v2 memory.max)")
        self.path.mkdir(exist_ok=True)
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        else:
            (self.path / "memory.max").write_text(str(limit))
        self.limit = limit

    def enter(self) -> None:
        """Move the calling process in (as a Popen preexec_fn: the child before it execs)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        f = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        p = self.path / f
        return int(p.read_text()) if p.exists() else -1

    def oom_kills(self) -> int:
        f = self.path / ("memory.oom_control" if self.v1 else "memory.events")
        for line in f.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def close(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


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
        from ktrun.expert_prediction import NextLayerPredictor
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
    `a.tokens` random experts at once (what a decode step misses), timed from issue to the last landing."""
    import random

    from ktrun.expert_tier import ExpertRamTier
    from ktrun.loaded_model import load_model
    lm = load_model(a.conv, device="cpu")
    c, rng, rates = lm.converted, random.Random(0), []
    for _ in range(3):
        tier = ExpertRamTier(c, 1 << 34)
        drop_cache(expert_files(a.conv))
        busy = 0.0
        for L in c.geometry.moe_layers:
            t0 = time.perf_counter()
            gs, each = tier.ensure_each(L, rng.sample(range(c.geometry.n_experts), a.tokens))
            tier.wait(each)
            busy += time.perf_counter() - t0
            tier.release(gs)
        rates.append(tier.counters["bytes_read"] / busy / 1e9)
        tier.close()
    lm.close()
    print(json.dumps({"rates": rates, "experts_per_layer": a.tokens}))


def child(a) -> None:
    import torch
    from ktrun.expert_ram_option import ExpertRamOptions
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
    toks = torch.randint(0, m.cfg.vocab_size, (5 + a.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = m.new_cache(len(toks) + 1)
    prefill(m, cache, toks[:1])
    for t in toks[1:5]:
        decode_one_token(m, cache, t)
    if a.mode == "baseline":
        print(json.dumps({"rss_anon": rss_anon()}))
        lm.close()
        return
    s0, io0 = dict(m.experts.stats) if tier else {}, read_bytes()
    digest, peak_measured = hashlib.sha256(), 0
    t0 = time.perf_counter()
    for t in toks[5:]:
        digest.update(decode_one_token(m, cache, t).numpy().tobytes())
        if tier is not None:
            peak_measured = max(peak_measured, tier.measured_resident_bytes())
    wall = time.perf_counter() - t0
    out = {"mode": a.mode, "tok_s": a.tokens / wall, "disk_bytes_per_token": (read_bytes() - io0) / a.tokens,
           "logits_sha256": digest.hexdigest()[:16], "rss_anon": rss_anon()}
    if tier is not None:
        s1 = m.experts.stats

        def d(k):
            return s1[f"ram_tier_{k}"] - s0.get(f"ram_tier_{k}", 0)
        out.update({"tier_bytes_per_token": d("bytes_read") / a.tokens, "budget": s1["ram_tier_budget_bytes"],
                    "peak_accounted": s1["ram_tier_peak_resident_bytes"], "peak_measured": peak_measured,
                    "hit_ratio": d("ram_hits") / max(1, d("demand_experts")),
                    "disk_read_gbps": d("bytes_read") / d("disk_busy_s") / 1e9 if d("disk_busy_s") else 0.0,
                    "wait_ms_per_token": 1e3 * d("demand_wait_s") / a.tokens, "io": s1["ram_tier_io"],
                    "staged_layers_per_token": d("staged_layers") / a.tokens,
                    "early_experts_per_token": d("early_experts") / a.tokens})
        if "ram_tier_pred_predicted" in s1:
            out.update({"prefetch_hit_ratio": d("prefetch_used") / max(1, d("prefetch_issued")),
                        "prefetch_throttled_calls": d("prefetch_throttled"),
                        "prefetch_cancelled": d("prefetch_cancelled"),
                        "precision": d("pred_correct") / max(1, d("pred_predicted")),
                        "recall": d("pred_correct") / max(1, d("pred_actual"))})
    lm.close()
    print(json.dumps(out))


def run_child(conv: Path, mode: str, tokens: int, budget: int, io: str, cg: MemoryCgroup | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--conv", str(conv), "--tokens", str(tokens),
           "--budget", str(budget), "--io", io]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=cg.enter if cg else None,
                       check=False)
    if p.returncode != 0:
        return {"mode": mode, "failed": p.returncode, "stderr": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# -- the benchmark --------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/ktrun-bench-expert-tier"))
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ratios", default="2,4")
    ap.add_argument("--io", default="direct", choices=("direct", "pread"))
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(ALL_MODES)}")
    ap.add_argument("--child", default=None)
    ap.add_argument("--conv", type=Path)
    ap.add_argument("--budget", type=int, default=0)
    a = ap.parse_args()
    if a.child:
        a.mode = a.child
        (reader_child if a.child == "reader" else child)(a)
        return
    if os.geteuid() != 0:
        sys.exit("bench_expert_tier: needs root (it creates memory cgroups)")
    a.work.mkdir(parents=True, exist_ok=True)
    conv = build_model(a.work)
    files = expert_files(conv)
    total = sum(f.stat().st_size for f in files)
    modes = tuple(m for m in a.modes.split(",") if m)
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        sys.exit(f"--modes: unknown {bad}; use {', '.join(ALL_MODES)}")
    print(f"expert_files: {total} bytes in {len(files)} files")
    print(f"load_average_start: {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min; 2 cores)")
    disk = {n: disk_read_gbps(files, n) for n in (1, 4, 8)}
    for n, v in disk.items():
        print(f"disk_sequential_read_{n}_in_flight: {v:.3f} GB/s")
    for n in (2, 8):
        r = run_child(conv, "reader", n, 0, a.io, None)
        if "failed" in r:
            sys.exit(f"reader run failed: {r['stderr']}")
        print(f"tier_reader_rate_{n}_experts_per_layer: {statistics.fmean(r['rates']):.3f} GB/s "
              f"[{', '.join(f'{v:.2f}' for v in r['rates'])}] (cache dropped; vs sequential {max(disk.values()):.3f})")
    drop_cache(files)
    base = run_child(conv, "baseline", 1, 0, a.io, None)
    if "failed" in base:
        sys.exit(f"baseline run failed: {base['stderr']}")
    print(f"process_anon_baseline: {base['rss_anon']} bytes (dense weights, torch, KV; outside the expert cap)")
    results: dict[tuple[int, str], list[dict]] = {}
    for ratio in (int(r) for r in a.ratios.split(",")):
        cap = total // ratio
        limit = base["rss_anon"] + MARGIN + cap
        print(f"\n# expert files {ratio}x the cap: cap {cap} bytes, cgroup limit {limit} bytes")
        for rep in range(a.reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                if mode == "ram":                      # the all-in-RAM rate: the compute limit
                    warm_cache(files)
                    r = run_child(conv, mode, a.tokens, cap, a.io, None)
                    results.setdefault((ratio, mode), []).append(r)
                    print(f"  run {ratio}x {mode}: {json.dumps(r)}", flush=True)
                    continue
                drop_cache(files)
                cg = MemoryCgroup(f"ktrun-bench-tier-{os.getpid()}", limit)
                try:
                    r = run_child(conv, mode, a.tokens, cap, a.io, cg)
                    r.update(cgroup_peak=cg.peak(), oom_kills=cg.oom_kills(), limit=limit)
                finally:
                    cg.close()
                results.setdefault((ratio, mode), []).append(r)
                print(f"  run {ratio}x {mode}: " + json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                                               for k, v in r.items()}), flush=True)
    for n, v in {n: disk_read_gbps(files, n) for n in (4, 8)}.items():     # the disk again, after the runs
        print(f"disk_sequential_read_{n}_in_flight_after: {v:.3f} GB/s")
        disk[n] = max(disk[n], v)
    disk_gbps = max(disk.values())
    print(f"load_average_end: {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min; 2 cores)")
    print(f"disk_read_limit: {disk_gbps:.3f} GB/s (the best sequential rate measured in this run)")
    print("\n# summary (mean over reps)")
    hashes = {r.get("logits_sha256") for rs in results.values() for r in rs}
    ram = [r["tok_s"] for (_, mode), rs in results.items() if mode == "ram" for r in rs if "failed" not in r]
    ram_tps = statistics.fmean(ram) if ram else 0.0
    print(f"tok_s_all_in_ram: {ram_tps:.3f} tok/s (no cap, files in the page cache: the compute limit)")
    print(f"logits_identical_across_modes: {int(len(hashes) == 1 and None not in hashes)}")
    for (ratio, mode), rs in results.items():
        if mode == "ram":
            continue
        ok = [r for r in rs if "failed" not in r]
        tag = f"{ratio}x_{mode.replace('+', '_').replace('-', '_')}"
        print(f"runs_failed_{tag}: {len(rs) - len(ok)}")
        if not ok:
            continue
        tps = statistics.fmean(r["tok_s"] for r in ok)
        bpt = statistics.fmean(r["disk_bytes_per_token"] for r in ok)
        print(f"tok_s_{tag}: {tps:.3f} tok/s")
        print(f"disk_bytes_per_token_{tag}: {bpt / 1e6:.2f} MB")
        if bpt:
            disk_tps = disk_gbps * 1e9 / bpt
            print(f"disk_bound_ratio_{tag}: {tps / disk_tps:.3f} (of {disk_tps:.2f} tok/s the disk allows)")
            bound = min(disk_tps, ram_tps) if ram_tps else disk_tps
            print(f"bound_ratio_{tag}: {tps / bound:.3f} (of min(disk, all-in-RAM) = {bound:.2f} tok/s)")
        for base_mode in ("mmap", "mmap+willneed"):
            mm = [r["tok_s"] for r in results.get((ratio, base_mode), []) if "failed" not in r]
            if mode != base_mode and mm and not (base_mode == "mmap+willneed" and mode == "mmap"):
                print(f"vs_{base_mode.replace('+', '_')}_{tag}: {tps / statistics.fmean(mm):.2f}x")
        print(f"cgroup_peak_{tag}: {max(r['cgroup_peak'] for r in ok)} bytes (limit {ok[0]['limit']})")
        print(f"oom_kills_{tag}: {sum(r['oom_kills'] for r in rs)}")
        if "budget" in ok[0]:
            print(f"tier_peak_measured_{tag}: {max(r['peak_measured'] for r in ok)} bytes "
                  f"(budget {ok[0]['budget']})")
            print(f"tier_hit_ratio_{tag}: {statistics.fmean(r['hit_ratio'] for r in ok):.4f}")
            print(f"tier_disk_read_rate_{tag}: {statistics.fmean(r['disk_read_gbps'] for r in ok):.3f} GB/s "
                  f"(while reads were in flight)")
            print(f"tier_demand_wait_per_token_{tag}: {statistics.fmean(r['wait_ms_per_token'] for r in ok):.2f} ms")
            print(f"tier_layers_computed_while_reading_per_token_{tag}: "
                  f"{statistics.fmean(r['staged_layers_per_token'] for r in ok):.2f}")
            print(f"tier_experts_computed_before_reads_per_token_{tag}: "
                  f"{statistics.fmean(r['early_experts_per_token'] for r in ok):.2f}")
        if "precision" in ok[0]:
            for k in ("prefetch_hit_ratio", "precision", "recall"):
                print(f"tier_{k}_{tag}: {statistics.fmean(r[k] for r in ok):.4f}")


if __name__ == "__main__":
    main()
