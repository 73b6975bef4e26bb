"""ktrun start-up time as expert bytes grow: expert files are mapped, not read, so load time should stay flat.

Builds DeepSeek-V3-architecture fixture checkpoints with a growing number of routed experts (same dense part),
converts them (int4-amx), then times `ktrun.loader.load_converted` (best of reps) and counts the bytes it reads
(read() syscalls plus page faults, i.e. mapped pages touched). Prints `name: value unit` lines; the ratio compares the largest
model's load time against the smallest's, and load time against the time a plain read of the expert files takes
(the peer measured in the same run).

    .venv/bin/python bench/bench_load.py [--experts 8,64,256] [--reps 5]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import resource
import tempfile
import time
from pathlib import Path


def touched_bytes() -> int:
    """Bytes this process has read(): rchar, plus pages it faulted in (mapped file pages touched), 4 KiB each."""
    rchar = next(int(ln.split()[1]) for ln in Path("/proc/self/io").read_text().splitlines() if ln.startswith("rchar:"))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return rchar + (ru.ru_minflt + ru.ru_majflt) * resource.getpagesize()


def build(root: Path, n_experts: int) -> Path:
    from ktconvert.pipeline import ConvertOptions, convert
    from ktconvert.testing import make_checkpoint
    src, out = root / f"src{n_experts}", root / f"conv{n_experts}"
    with contextlib.redirect_stderr(io.StringIO()):
        make_checkpoint("deepseek_v3", src, hidden_size=256, moe_intermediate_size=512, n_routed_experts=n_experts,
                        n_group=4, topk_group=2, num_experts_per_tok=4, intermediate_size=512,
                        max_shard_bytes=64 << 20)
        convert(src, out, ConvertOptions(method="int4-amx"), show_progress=False)
    return out


def expert_bytes(conv: Path) -> int:
    return sum(f.stat().st_size for f in (conv / "experts").glob("*.safetensors"))


def time_load(conv: Path, reps: int) -> tuple[float, float, int]:
    """(best wall seconds, best CPU seconds of this process, bytes touched) of load_converted."""
    from ktrun.loader import load_converted
    best, cpu, read = float("inf"), float("inf"), 0
    load_converted(conv, device="cpu")          # warm-up: first-call costs (imports, allocator) are not load time
    for _ in range(reps):
        gc.collect()       # the previous load's objects go now, not as a collection inside the timed load
        gc.disable()
        r0, c0, t0 = touched_bytes(), time.process_time(), time.perf_counter()
        m = load_converted(conv, device="cpu")
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        gc.enable()
        if dt < best:
            best, read = dt, touched_bytes() - r0
        cpu = min(cpu, dc)
        del m
    return best, cpu, read


def time_read(conv: Path) -> float:
    t0 = time.perf_counter()
    for f in (conv / "experts").glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", default="8,64,256", help="comma-separated routed-expert counts")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    counts = [int(x) for x in args.experts.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        convs = [build(Path(tmp), e) for e in counts]
        best = [(float("inf"), float("inf"), 0)] * len(convs)
        for _ in range(args.reps):      # sizes interleaved: background load on a shared machine hits all alike
            for i, conv in enumerate(convs):
                t, cpu, read = time_load(conv, 1)
                best[i] = (t, best[i][1], read) if t < best[i][0] else best[i]
                best[i] = (best[i][0], min(best[i][1], cpu), best[i][2])
        rows = [(e, expert_bytes(c), t, read, time_read(c), cpu) for e, c, (t, cpu, read) in zip(counts, convs, best)]
        for e, nb, t, read, tr, cpu in rows:
            print(f"load_e{e}_expert_bytes: {nb / 1e6:.1f} MB")
            print(f"load_e{e}_time: {t * 1e3:.1f} ms")
            print(f"load_e{e}_cpu_time: {cpu * 1e3:.1f} ms")
            print(f"load_e{e}_bytes_touched_by_load: {read / 1e6:.2f} MB")
            print(f"load_e{e}_plain_read_of_expert_files: {tr * 1e3:.1f} ms")
        (_, b0, t0, _, _, c0), (_, b1, t1, _, tr1, c1) = rows[0], rows[-1]
        print(f"load_expert_bytes_growth: {b1 / b0:.1f} x")
        print(f"load_time_growth: {t1 / t0:.2f} x")
        print(f"load_cpu_time_growth: {c1 / c0:.2f} x")
        print(f"load_time_vs_plain_read_largest: {t1 / tr1:.3f} ratio")


if __name__ == "__main__":
    main()
