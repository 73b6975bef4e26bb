"""Conversion throughput (source GB/s) and peak RSS at 2, 4 and 8 layers (must stay flat), and the relative error of
int4/int8 with group 128 vs per-row scales on the same weights. Prints `name: value unit` lines.

Fixture: qwen3_moe with hidden 1024, expert intermediate 512, 32 experts -> ~100 MB of BF16 experts per layer; at 2
and 8 layers also the same checkpoint as compressed-tensors int4 group 32 (an already-quantized source), converted
exactly and re-quantized: its peak RSS must stay flat like the BF16 source's.
Each conversion runs in its own subprocess so ru_maxrss is that conversion's peak. Limits measured in this run:
memory copy bandwidth (the ceiling for any streaming pass) and the same conversion with 1 worker (the peer).

`--deepseek-v3 WORK` instead times whole `ktconvert quantize` runs on bench_vs_llamacpp.py's DeepSeek-V3-shaped
checkpoint (5.64 GB of bf16, written once into WORK): the calibrated default (`--method int4-amx --gpu-method
rtn-int4`) and `--expert-quantizer rtn`, alternated, each with its wall, user and system time and peak RSS; with
`--llama-cpp DIR` (a llama.cpp source tree with build/bin/llama-quantize) also llama.cpp's convert_hf_to_gguf.py
(bf16) + llama-quantize Q4_0 in the same rounds; then the KL of both conversions against the source in float32 on the
held-out calibration text (`ktconvert quantize --report-kl`'s protocol; with `--tile-forward` also the default with its
calibration forward on libktkernels' int4 tiles, KTCONVERT_CALIB_MATMUL=kernels, in the same rounds), whether the rtn
output is byte-identical
with 1 and 2 workers and whether the default's is byte-identical in every round. Every conversion's printed estimate
(ktconvert.estimate) is set against its wall time, and `make demo`'s conversion of the embedded default model is
timed the same way.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DIMS = {"hidden_size": 1024, "moe_intermediate_size": 512, "num_experts": 32, "intermediate_size": 1024,
            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}
LAYERS = (2, 4, 8)
QUANTIZED_LAYERS = (2, 8)   # a compressed-tensors int4 source of the same checkpoint, exact and re-quantized

# VmHWM (peak RSS of this process image) rather than ru_maxrss, which Linux carries over from the forking parent.
CHILD = r"""
import json, re, sys, time
from ktconvert.pipeline import ConvertOptions, convert
def hwm_kb():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))
src, out, workers, method, group = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
base = hwm_kb()
t, c = time.perf_counter(), time.process_time()
convert(src, out, ConvertOptions(method=method, group_size=group, workers=workers), show_progress=False)
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "cpu_seconds": time.process_time() - c, "peak_kb": hwm_kb(), "base_kb": base}))
"""


def copy_bandwidth_gbs() -> float:
    """Read+write bandwidth of a large numpy copy, counted as bytes read (the converter's streaming ceiling)."""
    a = np.ones(256 << 20, np.uint8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def run_convert(src: Path, out: Path, workers: int, method: str = "int4-amx", group: int = 128) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(src), str(out), str(workers), method, str(group)],
                       capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def quant_errors(src: Path) -> dict[str, float]:
    from ktlayouts.cpu_expert import MatrixGeometry, pack_expert_matrix, unpack_expert_matrix

    from ktconvert.sources import open_source

    rng = np.random.default_rng(0)
    with open_source(src) as s:
        mats = [s.read(s.arch.expert_tensor_name(0, e, p)).numpy() for e in range(4) for p in ("gate", "down")]
    # the same weights with a few input channels scaled up 8x: the outlier channels real checkpoints have
    outl = []
    for w in mats:
        w = w.copy()
        w[:, rng.choice(w.shape[1], 8, replace=False)] *= 8
        outl.append(w)
    out = {}
    for tag, ws in (("fixture", mats), ("outlier_channels", outl)):
        for bits in (4, 8):
            for g in (128, -1):
                num = den = 0.0
                for w in ws:
                    geom = MatrixGeometry(w.shape[0], w.shape[1], bits, g)
                    d = unpack_expert_matrix(*pack_expert_matrix(w, geom), geom)
                    num += float(np.sum((d - w).astype(np.float64) ** 2))
                    den += float(np.sum(w.astype(np.float64) ** 2))
                out[f"rel_error_int{bits}_{'g128' if g == 128 else 'per_row'}_{tag}"] = (num / den) ** 0.5
    return out


def quantized_source(src: Path, tmp: Path, n_layers: int, peaks: dict) -> None:
    """The same checkpoint as compressed-tensors int4 group 32 (written by the compressed-tensors library): converted
    exactly (int4-amx group 32, codes and scales taken over) and re-quantized (int4-amx group 128, each expert
    dequantized to float32 first); peak RSS must stay flat in the number of layers as for the BF16 source."""
    from ktconvert.testing.quantized import compressed_tensors_checkpoint

    ct = compressed_tensors_checkpoint(src, tmp / f"ct{n_layers}", "W4A16", group_size=32)
    nbytes = sum(p.stat().st_size for p in ct.glob("*.safetensors"))
    for tag, group in (("ct", 32), ("ctre", 128)):
        res = run_convert(ct, tmp / f"{tag}_out{n_layers}", 2, "int4-amx", group)
        peaks[f"{tag}{n_layers}"] = res["peak_kb"] / 1024
        what = "exact_int4_g32" if tag == "ct" else "requantized_int4_g128"
        print(f"convert_compressed_tensors_{n_layers}_layers_{what}_throughput: {nbytes / res['seconds'] / 1e9:.3f} "
              f"GB/s (of {nbytes / 1e6:.1f} MB stored)")
        print(f"convert_compressed_tensors_{n_layers}_layers_{what}_peak_rss: {res['peak_kb'] / 1024:.0f} MB")
        subprocess.run(["rm", "-rf", str(tmp / f"{tag}_out{n_layers}")], check=True)
    subprocess.run(["rm", "-rf", str(ct)], check=True)


def main() -> None:
    from ktconvert.testing import checkpoint_nbytes, make_checkpoint

    bw = copy_bandwidth_gbs()
    print(f"memory_copy_bandwidth: {bw:.2f} GB/s")
    with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
        tmp = Path(tmp)
        peaks = {}
        for n_layers in LAYERS:
            src = make_checkpoint("qwen3_moe", tmp / f"src{n_layers}", num_layers=n_layers, max_shard_bytes=1 << 30,
                                  **DIMS)
            nbytes = checkpoint_nbytes(src)
            res = run_convert(src, tmp / f"out{n_layers}", workers=2)
            gbs = nbytes / res["seconds"] / 1e9
            peaks[n_layers] = res["peak_kb"] / 1024
            print(f"convert_{n_layers}_layers_source_size: {nbytes / 1e6:.1f} MB")
            print(f"convert_{n_layers}_layers_throughput: {gbs:.3f} GB/s")
            print(f"convert_{n_layers}_layers_throughput_vs_memory_copy: {gbs / bw:.4f} ratio")
            print(f"convert_{n_layers}_layers_peak_rss: {peaks[n_layers]:.0f} MB")
            print(f"convert_{n_layers}_layers_rss_after_imports: {res['base_kb'] / 1024:.0f} MB")
            # CPU seconds per wall second: ~2 when both cores work (less when other processes share them)
            print(f"convert_{n_layers}_layers_cpu_per_wall: {res['cpu_seconds'] / res['seconds']:.2f} cores")
            if n_layers == LAYERS[1]:
                one = run_convert(src, tmp / f"out{n_layers}_w1", workers=1)
                print(f"convert_{n_layers}_layers_throughput_1_worker: {nbytes / one['seconds'] / 1e9:.3f} GB/s")
                print(f"convert_{n_layers}_layers_cpu_per_wall_1_worker: {one['cpu_seconds'] / one['seconds']:.2f} cores")
                print(f"convert_{n_layers}_layers_speedup_2_workers_vs_1: {one['seconds'] / res['seconds']:.2f} x")
            if n_layers in QUANTIZED_LAYERS:
                quantized_source(src, tmp, n_layers, peaks)
            if n_layers != LAYERS[0]:
                for p in (tmp / f"src{n_layers}", tmp / f"out{n_layers}"):
                    subprocess.run(["rm", "-rf", str(p)], check=True)
        print(f"convert_peak_rss_8_vs_2_layers: {peaks[LAYERS[-1]] / peaks[LAYERS[0]]:.3f} ratio")
        a, b = (peaks[f"ct{n}"] for n in QUANTIZED_LAYERS)
        print(f"convert_compressed_tensors_peak_rss_{QUANTIZED_LAYERS[1]}_vs_{QUANTIZED_LAYERS[0]}_layers: "
              f"{b / a:.3f} ratio")
        a, b = (peaks[f"ctre{n}"] for n in QUANTIZED_LAYERS)
        print(f"convert_compressed_tensors_requantized_peak_rss_{QUANTIZED_LAYERS[1]}_vs_{QUANTIZED_LAYERS[0]}_layers: "
              f"{b / a:.3f} ratio")
        for name, v in quant_errors(tmp / f"src{LAYERS[0]}").items():
            print(f"{name}: {v:.5f} relative")


# --- the DeepSeek-V3-shaped checkpoint: whole conversions, timed as child processes ------------------------------

OURS = {"default": [], "rtn": ["--expert-quantizer", "rtn"], "default-tiles": []}   # on top of int4-amx + rtn-int4
ENV = {"default-tiles": {"KTCONVERT_CALIB_MATMUL": "kernels"}}   # the calibration forward on libktkernels' int4 tiles


def timed(cmd: list[str], what: str, env: dict | None = None) -> dict:
    """Run cmd as a child (env: variables on top of ours); its wall, user and system seconds and peak RSS (wait4:
    that child's own usage)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{what} failed: {' '.join(map(str, cmd))}\n{out.decode(errors='replace')[-4000:]}")
    res = {"wall": wall, "user": ru.ru_utime, "sys": ru.ru_stime, "peak_mb": ru.ru_maxrss / 1024}
    est = ESTIMATE_LINE.search(out.decode(errors="replace"))       # ktconvert quantize logs its estimate first
    if est:
        res["estimate"] = float(est.group(3)) if est.group(3) else float(est.group(1)) * UNIT[est.group(2)]
    return res


ESTIMATE_LINE = re.compile(r"estimated conversion time on this machine: ([0-9.]+) (s|min|h)(?: = ([0-9]+) s)?")
UNIT = {"s": 1.0, "min": 60.0, "h": 3600.0}


def estimate_lines(name: str, runs: list[dict]) -> None:
    """The estimate `quantize` printed against the wall time of the same run (median over the runs, and the worst)."""
    ratios = [r["estimate"] / r["wall"] for r in runs if "estimate" in r]
    if ratios:
        print(f"{name}_estimate: {float(np.median([r['estimate'] for r in runs if 'estimate' in r])):.1f} s")
        print(f"{name}_estimate_over_wall: {float(np.median(ratios)):.2f} ratio")
        print(f"{name}_estimate_worst_error: {max(abs(x - 1) for x in ratios) * 100:.0f} %")


def convert_v3(src: Path, out: Path, mode: str, workers: int = 2) -> dict:
    cmd = [sys.executable, "-m", "ktconvert", "quantize", str(src), "-o", str(out), "--force", "--quiet", "--method",
           "int4-amx", "--gpu-method", "rtn-int4", "--workers", str(workers), *OURS[mode]]
    return timed(cmd, f"ktconvert quantize ({mode})", ENV.get(mode))


def llama_cpp_v3(src: Path, work: Path, tree: Path) -> dict:
    """llama.cpp's convert_hf_to_gguf.py (bf16) then llama-quantize Q4_0 (2 threads): the two children's sums."""
    from bench_vs_llamacpp import _CONVERT_WRAPPER, SHAPES

    bf16, q4 = work / "llamacpp-bf16.gguf", work / "llamacpp-q4_0.gguf"
    a = timed([sys.executable, "-c", _CONVERT_WRAPPER, str(tree / "convert_hf_to_gguf.py"), SHAPES["v3"].pre_tokenizer,
               str(src), "--outfile", str(bf16), "--outtype", "bf16"], "llama.cpp convert_hf_to_gguf")
    b = timed([str(tree / "build" / "bin" / "llama-quantize"), str(bf16), str(q4), "Q4_0", "2"], "llama-quantize")
    for f in (bf16, q4):
        f.unlink()
    return {"wall": a["wall"] + b["wall"], "user": a["user"] + b["user"], "sys": a["sys"] + b["sys"],
            "peak_mb": max(a["peak_mb"], b["peak_mb"]), "quantize_wall": b["wall"]}


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path and bytes except manifest.json (which records the run's options)."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"):
        h.update(str(f.relative_to(root)).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def kl_of(src: Path, outs: dict[str, Path]) -> dict[str, dict]:
    """Each conversion's KL against the source in float32 on the held-out calibration text (--report-kl's protocol;
    the float32 reference computed once)."""
    from ktrun.cli.cmd_perplexity import run_perplexity

    from ktconvert.report_kl import REPORT_CTX, heldout_chunks, write_reference
    from ktconvert.sources import open_source

    with tempfile.TemporaryDirectory(prefix="bench_convert_ref_") as tmp, open_source(src) as s:
        chunks, _ = heldout_chunks(s, None, REPORT_CTX)
        ref = Path(tmp) / "reference.logprobs"
        write_reference(s, chunks, ref)
        return {k: run_perplexity(o, None, chunks.shape[1], None, reference_path=ref, quiet=True)
                for k, o in outs.items()}


def deepseek_v3(work: Path, llama_cpp: Path | None, rounds: int, tile_forward: bool = False) -> None:
    from bench_vs_llamacpp import SHAPES, write_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    src = write_checkpoint(work / "v3-src", SHAPES["v3"], tiny=False)
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"v3_source_size: {nbytes / 1e9:.2f} GB")
    systems = ["rtn", "default"] + (["default-tiles"] if tile_forward else []) + (["llama.cpp"] if llama_cpp else [])
    from ktconvert.gpu.calib import calibration_matmul
    print(f"v3_default_calibration_matmul: {calibration_matmul()}")
    runs: dict[str, list[dict]] = {k: [] for k in systems}
    default_digests = []                  # each round's calibrated output: the same bytes every time?
    for r in range(rounds):
        for k in (systems if r % 2 == 0 else systems[::-1]):          # alternated: the machine is noisy
            res = llama_cpp_v3(src, work, llama_cpp) if k == "llama.cpp" else convert_v3(src, work / f"out-{k}", k)
            runs[k].append(res)
            if k == "default":
                default_digests.append(tree_digest(work / "out-default"))
            print(f"# round {r + 1} {k}: {res['wall']:.1f} s wall, {res['user']:.1f} s user, {res['sys']:.1f} s sys, "
                  f"{res['peak_mb']:.0f} MB peak RSS", flush=True)
    med = {k: {m: float(np.median([x[m] for x in v])) for m in v[0]} for k, v in runs.items()}
    for k, m in med.items():
        name = k.replace(".", "").replace("-", "_")
        print(f"v3_convert_{name}_wall: {m['wall']:.1f} s")
        print(f"v3_convert_{name}_source_rate: {nbytes / m['wall'] / 1e6:.0f} MB/s")
        print(f"v3_convert_{name}_user: {m['user']:.1f} s")
        print(f"v3_convert_{name}_sys: {m['sys']:.1f} s")
        print(f"v3_convert_{name}_sys_over_user: {m['sys'] / m['user']:.3f} ratio")
        print(f"v3_convert_{name}_peak_rss: {m['peak_mb']:.0f} MB")
    print(f"v3_default_over_rtn_wall: {med['default']['wall'] / med['rtn']['wall']:.2f} ratio")
    if tile_forward:
        print(f"v3_default_tiles_over_rtn_wall: {med['default-tiles']['wall'] / med['rtn']['wall']:.2f} ratio")
    for k in ("rtn", "default") + (("default-tiles",) if tile_forward else ()):
        estimate_lines(f"v3_convert_{k.replace('-', '_')}", runs[k])
    if llama_cpp:
        print(f"v3_llamacpp_quantize_wall: {med['llama.cpp']['quantize_wall']:.1f} s")
        print(f"v3_rtn_rate_over_llamacpp: {med['llama.cpp']['wall'] / med['rtn']['wall']:.2f} ratio")
    one = convert_v3(src, work / "out-rtn-1worker", "rtn", workers=1)
    print(f"v3_convert_rtn_1_worker_wall: {one['wall']:.1f} s")
    print(f"v3_convert_rtn_speedup_2_workers_vs_1: {one['wall'] / med['rtn']['wall']:.2f} x")
    same = tree_digest(work / "out-rtn-1worker") == tree_digest(work / "out-rtn")
    print(f"v3_rtn_1_vs_2_workers_identical: {int(same)} bool")
    print(f"v3_default_rounds_identical: {int(len(set(default_digests)) == 1)} bool ({len(default_digests)} rounds)")
    for k, summ in kl_of(src, {k: work / f"out-{k}" for k in systems if k != "llama.cpp"}).items():
        for m in ("kl_mean", "kl_p99", "top1_agreement"):
            print(f"v3_{k.replace('-', '_')}_{m}: {summ[m]:.6f} {'ratio' if m == 'top1_agreement' else 'nats'}")
    default_model(work, rounds)


def default_model(work: Path, rounds: int) -> None:
    """`make demo`'s conversion of the embedded default model (int4-amx experts, gptq-int4 GPU layers): its wall
    time against the estimate it printed."""
    from ktconvert.default_model.demo import DEFAULT_MODEL

    runs = []
    for _ in range(rounds):
        runs.append(timed([sys.executable, "-m", "ktconvert", "quantize", str(DEFAULT_MODEL), "-o",
                           str(work / "out-default-model"), "--method", "int4-amx", "--gpu-method", "gptq-int4",
                           "--force", "--quiet"], "ktconvert quantize (default model)"))
    print(f"default_model_convert_wall: {float(np.median([r['wall'] for r in runs])):.1f} s")
    estimate_lines("default_model_convert", runs)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepseek-v3", type=Path, metavar="WORK", help="time whole conversions of the DeepSeek-V3-shaped "
                    "checkpoint (written once into WORK; ~6 GB there, ~10 GB more while converting)")
    ap.add_argument("--llama-cpp", type=Path, metavar="DIR", help="llama.cpp source tree with build/bin/llama-quantize "
                    "(with --deepseek-v3: its convert + Q4_0 in the same rounds)")
    ap.add_argument("--rounds", type=int, default=1, help="alternated rounds (--deepseek-v3); medians are printed")
    ap.add_argument("--tile-forward", action="store_true", help="(--deepseek-v3) also the default with its "
                    "calibration forward on int4 tiles (KTCONVERT_CALIB_MATMUL=kernels) in the same rounds, and its KL")
    args = ap.parse_args()
    if args.deepseek_v3:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        deepseek_v3(args.deepseek_v3, args.llama_cpp, args.rounds, args.tile_forward)
    else:
        main()
