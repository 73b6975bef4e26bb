"""Quantization quality at equal bits, ktconvert + ktrun against llama.cpp, on the embedded default model, in one run.

llama.cpp side (a build from the llama-cpp-python sdist, see bench/README.md): its own converter makes a BF16 GGUF
of the default model, llama-quantize makes Q4_0 / Q4_K(_S/_M) / Q8_0 variants (whole model with BF16 embeddings and
head, or only the routed experts, or only the other Linears), llama-perplexity scores them. Our side: `ktconvert
quantize` with the matching tensor sets, `ktrun perplexity`. Both with llama-perplexity's protocol on identical
tokens (checked): the held-out split of the default model's data (the Python standard library files it did not
train on), --chunks chunks of --ctx tokens, BOS first, positions ctx/2 .. ctx-2 scored; KL of the next-token
distribution against each tool's own BF16 model (llama.cpp: its BF16 GGUF; ours: the --method bf16 --gpu-method
bf16 conversion).

Bits per weight are counted over the quantized tensors only (codes + scales / block headers, bits of stored data per
logical weight); our tile and Marlin layouts pad shapes (default model: down K 160 -> 192, kv_b K 64 -> 128, ...), and
those padding bits are shown separately (llama.cpp's blocks need no padding: a tensor whose rows do not fit a
K-quant super-block falls back to another type, e.g. Q4_K -> Q5_0 for the experts' down_proj with K = 160).
GPTQ / importance calibration of our conversions uses --calib (default: every 8th training-split file; never the
held-out files). llama.cpp runs without an imatrix (its k-quants as `llama-quantize` applies them by default).

    .venv/bin/python bench/bench_quant_vs_llamacpp.py \\
        --llama-quantize  /work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize \\
        --llama-perplexity /work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-perplexity \\
        --convert-script  /work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
    ... --chunks 16 --only experts          # quicker: fewer chunks, one tensor set

Prints a markdown table and `quant.<set>.<tool>.<config>.{bpw,padding_bpw,kl_mean,kl_p99,top1,ppl}: value unit` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "ktconvert" / "data" / "default_model"
PY = sys.executable

# GGUF tensor sets (llama.cpp names). kv_b_proj is split into attn_k_b / attn_v_b by the converter.
GGUF_SETS = {
    "experts": re.compile(r"ffn_(gate|up|down)_exps\.weight$"),
    "non-expert": re.compile(r"(attn_(q|q_a|q_b|kv_a_mqa|k_b|v_b|output)|ffn_(gate|up|down)(_shexp)?)\.weight$"),
}
GGUF_SETS["whole"] = re.compile(f"{GGUF_SETS['experts'].pattern}|{GGUF_SETS['non-expert'].pattern}")
EXPERT_TYPE = "ffn_(gate|up|down)_exps=%s"
NON_EXPERT_TYPES = ["attn_(q|q_a|q_b|kv_a_mqa|k_b|v_b|output)\\.weight=%s", "ffn_(gate|up|down)\\.weight=%s",
                    "ffn_(gate|up|down)_shexp=%s"]

# (set, config name, llama-quantize type, extra arguments). Rows for one tensor set quantize every tensor of the type
# (--pure: no k-quant mixture) and keep the other set BF16 (--tensor-type overrides; with BF16 as the main type
# llama-quantize ignores them); whole-model rows use llama-quantize's own mixtures.
def _keep_bf16(patterns: list[str]) -> list[str]:
    return [a for p in patterns for a in ("--tensor-type", p % "bf16")]


LLAMA_ROWS = [
    ("experts", "Q4_0", "Q4_0", ["--pure", *_keep_bf16(NON_EXPERT_TYPES)]),
    ("experts", "Q4_K", "Q4_K", ["--pure", *_keep_bf16(NON_EXPERT_TYPES)]),
    ("non-expert", "Q4_0", "Q4_0", ["--pure", *_keep_bf16([EXPERT_TYPE])]),
    ("whole", "Q4_0", "Q4_0", []),
    ("whole", "Q4_K_S", "Q4_K_S", []),
    ("whole", "Q4_K_M", "Q4_K_M", []),
    ("whole", "Q8_0", "Q8_0", []),
]
# (set, config name, ktconvert quantize arguments); the tensor set not named stays BF16. Experts: GPTQ on each
# expert's routed calibration tokens (--expert-quantizer auto) unless the name says rtn (the previous reference rule).
E4, G16 = ["--method", "int4-amx", "--gpu-method", "bf16"], ["--scale-dtype", "f16"]
NE = ["--method", "bf16", "--gpu-method"]
OUR_ROWS = [
    ("experts", "int4-g32-f32-rtn", [*E4, "--group-size", "32", "--scale-dtype", "f32", "--expert-quantizer", "rtn"]),
    ("experts", "int4-g32-f32", [*E4, "--group-size", "32", "--scale-dtype", "f32"]),
    ("experts", "int4-g32-bf16", [*E4, "--group-size", "32", "--scale-dtype", "bf16"]),
    ("experts", "int4-g32-f16", [*E4, "--group-size", "32", *G16]),
    ("experts", "int4-g64-f16", [*E4, "--group-size", "64", *G16]),
    ("experts", "int4-g128-f16", [*E4, "--group-size", "128", *G16]),
    # two-level scales (layout version 3): a float16 super-scale per 256 input channels, a 6-bit sub-scale per 32
    ("experts", "int4-g32-sub6", [*E4, "--group-size", "32", "--scale-dtype", "sub6"]),
    ("non-expert", "rtn-int4-g32", [*NE, "rtn-int4", "--gpu-group-size", "32"]),
    ("non-expert", "search-int4-g32", [*NE, "search-int4", "--gpu-group-size", "32"]),
    ("non-expert", "gptq-int4-g128", [*NE, "gptq-int4", "--gpu-group-size", "128"]),
    ("non-expert", "gptq-int4-g32", [*NE, "gptq-int4", "--gpu-group-size", "32"]),
    # what `ktconvert quantize SRC --method int4-amx` writes with no other flag (the defaults of this release)
    ("whole", "default", ["--method", "int4-amx"]),
    # candidates for that default: expert group / scale dtype x GPU-layer group
    ("whole", "int4-g128-f32+gptq-int4-g128", ["--method", "int4-amx", "--group-size", "128", "--scale-dtype", "f32",
                                               "--gpu-method", "gptq-int4", "--gpu-group-size", "128"]),
    *[("whole", f"int4-g{eg}-f16+gptq-int4-g{gg}", ["--method", "int4-amx", "--group-size", str(eg), *G16,
                                                    "--gpu-method", "gptq-int4", "--gpu-group-size", str(gg)])
      for eg, gg in ((128, 128), (64, 64), (128, 32), (64, 32), (32, 64), (32, 32))],
    ("whole", "int4-g32-sub6+gptq-int4-g32", ["--method", "int4-amx", "--group-size", "32", "--scale-dtype", "sub6",
                                              "--gpu-method", "gptq-int4", "--gpu-group-size", "32"]),
    ("whole", "int8-g32-f16+search-int8-g32", ["--method", "int8-amx", "--group-size", "32", *G16, "--gpu-method",
                                               "search-int8", "--gpu-group-size", "32"]),
]


@dataclass
class Row:
    tset: str
    tool: str
    config: str
    bpw: float
    padding_bpw: float
    kl_mean: float
    kl_p99: float
    top1: float
    ppl: float
    seconds: float


def run(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Run a command, keeping its output in `log`; a failure prints the tail and stops the bench."""
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, check=False)
    log.write_text(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    if r.returncode:
        sys.exit(f"error: {' '.join(cmd[:3])} ... exited {r.returncode}; tail of {log}:\n{r.stderr[-3000:]}")
    print(f"# {time.perf_counter() - t:6.1f} s  {' '.join(str(c) for c in cmd)}", file=sys.stderr, flush=True)
    return r.stdout + r.stderr


def wanted(args, config: str) -> bool:
    return args.configs is None or re.search(args.configs, config) is not None


# --- texts ------------------------------------------------------------------------------------------------------

def write_texts(work: Path, calib: Path | None) -> tuple[Path, Path]:
    from ktconvert.default_model import data

    train, heldout = data.split_files(data.default_stdlib_dir())
    text = work / "heldout.txt"
    text.write_text("".join(p.read_text(encoding="utf-8") for p in heldout), encoding="utf-8")
    if calib is None:
        calib = work / "calib.txt"
        calib.write_text("".join(p.read_text(encoding="utf-8") for p in train[::8]), encoding="utf-8")
    return text, calib


# --- llama.cpp --------------------------------------------------------------------------------------------------

CONVERT_SHIM = r"""
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.path.insert(0, str(Path(script).parent))
import conversion.base as base
# The default model's tokenizer is a GPT-2-style byte-level BPE (tokenizers' ByteLevel pre-tokenizer with the GPT-2
# regex) trained by this project; the converter identifies pre-tokenizers by the hash of a test string's tokens, so it
# does not know ours. "gpt-2" is the llama.cpp pre-tokenizer with that regex (the bench checks identical tokens).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def gguf_bits(path: Path, tset: str) -> float:
    from gguf import GGUFReader

    bits = n = 0
    for t in GGUFReader(str(path)).tensors:
        if GGUF_SETS[tset].search(t.name):
            bits += 8 * int(t.n_bytes)
            n += int(t.n_elements)
    return bits / n


def llama_kld(out: str) -> dict[str, float]:
    def grab(pattern):
        m = re.search(pattern, out)
        if not m:
            sys.exit(f"error: llama-perplexity output lacks {pattern!r}")
        return float(m.group(1))
    return {"ppl": grab(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), "kl_mean": grab(r"Mean\s+KLD:\s*([-\d.e]+)"),
            "kl_p99": grab(r"99\.0%\s+KLD:\s*([-\d.e]+)"), "top1": grab(r"Same top p:\s*([\d.]+)") / 100}


def llama_tokens(kld_file: Path) -> np.ndarray:
    """Tokens stored in llama-perplexity's --kl-divergence-base file (the original stream, before BOS replacement)."""
    with open(kld_file, "rb") as f:
        head = f.read(20)
        if head[:8] != b"_logits_":
            sys.exit(f"error: {kld_file} is not a llama-perplexity logits file")
        ctx, _vocab, n = struct.unpack("<Iii", head[8:])
        return np.frombuffer(f.read(4 * n * ctx), dtype=np.int32).reshape(n, ctx)


def llama_rows(args, work: Path, text: Path, only: set[str]) -> tuple[list[Row], np.ndarray, float]:
    shim = work / "convert_shim.py"
    shim.write_text(CONVERT_SHIM)
    env = dict(os.environ, PYTHONPATH=str(Path(args.convert_script).parent / "gguf-py"))
    bf16 = work / "llama-bf16.gguf"
    run([PY, str(shim), args.convert_script, str(args.model), "--outtype", "bf16", "--outfile", str(bf16)],
        work / "llama-convert.log", env=env)
    ppl_args = ["-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads), "-b", str(args.ctx),
                "-f", str(text)]
    base = work / "llama-bf16.kld"
    out = run([args.llama_perplexity, "-m", str(bf16), *ppl_args, "--kl-divergence-base", str(base)],
              work / "llama-ppl-bf16.log")
    base_ppl = float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1))
    rows = []
    for tset, name, qtype, overrides in LLAMA_ROWS:
        if tset not in only or not wanted(args, name):
            continue
        q = work / f"llama-{tset}-{name}.gguf"
        extra = ["--token-embedding-type", "bf16", "--output-tensor-type", "bf16", *overrides]
        t0 = time.perf_counter()
        run([args.llama_quantize, *extra, str(bf16), str(q), qtype, str(args.threads)], work / f"{q.stem}.quant.log")
        for _attempt in range(3):   # its asynchronous logger has lost the closing statistics at exit on a loaded machine
            out = run([args.llama_perplexity, "-m", str(q), *ppl_args[:-2], "--kl-divergence-base", str(base),
                       "--kl-divergence"], work / f"{q.stem}.ppl.log")
            if "Mean    KLD" in out:
                break
        k = llama_kld(out)
        rows.append(Row(tset, "llama.cpp", name, gguf_bits(q, tset), 0.0, k["kl_mean"], k["kl_p99"], k["top1"],
                        k["ppl"], time.perf_counter() - t0))
    return rows, llama_tokens(base), base_ppl


# --- ours -------------------------------------------------------------------------------------------------------

def our_bits(conv: Path, tset: str) -> tuple[float, float]:
    """(bits per logical weight of the quantized tensors in `tset`, padding bits per logical weight)."""
    m = json.loads((conv / "manifest.json").read_text())
    logical_bits = stored_bits = weights = 0
    ex = m["experts"]
    if tset in ("experts", "whole"):
        e, h, i, bits, g = ex["n_experts"], ex["hidden"], ex["intermediate"], ex["bits"], ex["group_size"]
        per_layer = 3 * e * h * i
        weights += per_layer * len(ex["moe_layers"])
        for rel, f in m["files"].items():
            if f["kind"] == "expert":
                stored_bits += 8 * sum(t["nbytes"] for n, t in f["tensors"].items() if not n.startswith("__pad__"))
        scale_bits = 0 if bits == 16 else _scale_bits(m)
        for _ in ex["moe_layers"]:
            for n, k in ((i, h), (i, h), (h, i)):
                groups = 0 if bits == 16 else (1 if g == -1 else -(-k // g))
                if ex.get("scale_dtype") == "sub6":      # two-level: 6 bits a group, 16 per (started) super-block of 8
                    logical_bits += e * (n * k * bits + n * (6 * groups + 16 * -(-groups // 8)))
                else:
                    logical_bits += e * (n * k * bits + n * groups * scale_bits)
    if tset in ("non-expert", "whole"):
        for rel, f in m["files"].items():
            quantized: dict[str, dict] = {}
            for name, t in f.get("tensors", {}).items():
                if t["layout"].startswith("gpu-") and not name.endswith(".weight_shape"):
                    base, part = name.rsplit(".", 1)
                    quantized.setdefault(base, {})[part] = t
            shapes = _weight_shapes(conv / rel) if quantized else {}
            for base, parts in quantized.items():
                n, k = shapes[base]
                bits = 4 if parts["qweight"]["layout"].endswith("int4") else 8
                k_pad = parts["qweight"]["shape"][0] * (16 if "marlin" in parts["qweight"]["layout"] else 32 // bits)
                groups = parts["scales"]["shape"][0]
                n_groups = 1 if groups == 1 else -(-k // (k_pad // groups))
                weights += n * k
                logical_bits += n * k * bits + n * n_groups * 16
                stored_bits += 8 * sum(p["nbytes"] for key, p in parts.items() if key in ("qweight", "scales"))
    return logical_bits / weights, (stored_bits - logical_bits) / weights


def _scale_bits(manifest: dict) -> int:
    for f in manifest["files"].values():
        for name, t in f.get("tensors", {}).items():
            if name.endswith(".scales") and t["layout"].startswith("cpu-expert"):
                return {"F32": 32, "F16": 16, "BF16": 16, "U8": 8}[t["dtype"]]   # U8: two-level (see our_bits)
    return 32


def _weight_shapes(path: Path) -> dict[str, tuple[int, int]]:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return {n[: -len(".weight_shape")]: tuple(int(v) for v in f.get_tensor(n)) for n in f.keys()  # noqa: SIM118
                if n.endswith(".weight_shape")}


def ktrun_lines(out: str) -> dict[str, float]:
    return {k.strip(): float(v) for k, v in (ln.split(":", 1) for ln in out.splitlines()
                                             if re.match(r"^(ppl|ppl_base|kl_\w+|top1_agreement): ", ln))}


def our_rows(args, work: Path, text: Path, calib: Path, only: set[str]) -> tuple[list[Row], np.ndarray, float]:
    from safetensors.numpy import load_file

    conv_bf16 = work / "ours-bf16"
    run([PY, "-m", "ktconvert", "quantize", str(args.model), "-o", str(conv_bf16), "--method", "bf16",
         "--gpu-method", "bf16", "--force", "--quiet"], work / "ours-bf16.convert.log")
    base = work / "ours-bf16.logprobs"
    ppl = ["--text", str(text), "--ctx", str(args.ctx), "--chunks", str(args.chunks)]
    out = run([PY, "-m", "ktrun", "perplexity", str(conv_bf16), *ppl, "--kl-divergence-base", str(base)],
              work / "ours-bf16.ppl.log")
    base_ppl = ktrun_lines(out)["ppl"]
    rows = []
    for tset, name, conv_args in OUR_ROWS:
        if tset not in only or not wanted(args, name):
            continue
        conv = work / f"ours-{tset}-{name.split()[0]}"
        t0 = time.perf_counter()
        run([PY, "-m", "ktconvert", "quantize", str(args.model), "-o", str(conv), *conv_args, "--calib", str(calib),
             *args.our_extra, "--force", "--quiet"], work / f"{conv.name}.convert.log")
        out = run([PY, "-m", "ktrun", "perplexity", str(conv), *ppl, "--kl-divergence", str(base)],
                  work / f"{conv.name}.ppl.log")
        k = ktrun_lines(out)
        bpw, pad = our_bits(conv, tset)
        rows.append(Row(tset, "ours", name, bpw, pad, k["kl_mean"], k["kl_p99"], k["top1_agreement"], k["ppl"],
                        time.perf_counter() - t0))
    return rows, load_file(str(base))["tokens"], base_ppl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env_dir = os.environ.get("LLAMA_CPP_DIR")       # a llama.cpp checkout with build/bin (bench/README.md)
    ap.add_argument("--llama-quantize", default=env_dir and f"{env_dir}/build/bin/llama-quantize")
    ap.add_argument("--llama-perplexity", default=env_dir and f"{env_dir}/build/bin/llama-perplexity")
    ap.add_argument("--convert-script", default=env_dir and f"{env_dir}/convert_hf_to_gguf.py",
                    help="llama.cpp's convert_hf_to_gguf.py (gguf-py beside it); all three default from $LLAMA_CPP_DIR")
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib", type=Path, default=None, help="calibration text for our conversions")
    ap.add_argument("--only", default="experts,non-expert,whole", help="comma-separated tensor sets")
    ap.add_argument("--tools", default="ours,llama.cpp", help="comma-separated: ours, llama.cpp")
    ap.add_argument("--configs", default=None, help="regular expression: only rows whose config name matches "
                    "(both tools; e.g. 'Q4_K|f16\\+gptq')")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the files here (default: a temp dir)")
    ap.add_argument("--our-extra", nargs=argparse.REMAINDER, default=[],
                    help="extra `ktconvert quantize` arguments for every one of our rows (last on the line)")
    args = ap.parse_args()
    tools = set(args.tools.split(","))
    if "llama.cpp" in tools and not all((args.llama_quantize, args.llama_perplexity, args.convert_script)):
        print("bench.quant_vs_llamacpp: skipped (no llama.cpp build: pass --llama-quantize, --llama-perplexity and "
              "--convert-script, or set LLAMA_CPP_DIR; see bench/README.md)")
        return
    only = set(args.only.split(","))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kt_vs_llama_") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text, calib = write_texts(work, args.calib)
        ours, our_tokens, our_base_ppl = our_rows(args, work, text, calib, only) if "ours" in tools else ([], None, 0)
        theirs, their_tokens, their_base_ppl = (llama_rows(args, work, text, only) if "llama.cpp" in tools
                                                else ([], our_tokens, 0))
        our_tokens = their_tokens if our_tokens is None else our_tokens
    # llama.cpp keeps the original first token of each chunk in its file; ours holds the BOS that was run
    same = np.array_equal(our_tokens[:, 1:], their_tokens[:, 1:]) and np.array_equal(our_tokens[0], their_tokens[0])
    print(f"# {our_tokens.shape[0]} chunks x {our_tokens.shape[1]} tokens of {text.name} (held-out stdlib files), "
          f"identical tokens in both tools: {same}; BF16 ppl ours {our_base_ppl:.4f}, llama.cpp {their_base_ppl:.4f}")
    if not same:
        sys.exit("error: the two tools tokenized the text differently; the comparison would not be fair")
    rows = sorted(ours + theirs, key=lambda r: (["experts", "non-expert", "whole"].index(r.tset), r.tool, r.bpw))
    print("\n| tensors quantized | tool | config | bits/weight | + padding | KL mean | KL p99 | top-1 | ppl |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.tset} | {r.tool} | {r.config} | {r.bpw:.3f} | {r.padding_bpw:.3f} | {r.kl_mean:.5f} | "
              f"{r.kl_p99:.4f} | {r.top1:.4f} | {r.ppl:.3f} |")
    print()
    for r in rows:
        key = f"quant.{r.tset}.{'llamacpp' if r.tool != 'ours' else 'ours'}.{r.config}"
        print(f"{key}.bpw: {r.bpw:.4f} bits/weight")
        print(f"{key}.padding_bpw: {r.padding_bpw:.4f} bits/weight")
        print(f"{key}.kl_mean: {r.kl_mean:.6f} nats/token")
        print(f"{key}.kl_p99: {r.kl_p99:.5f} nats/token")
        print(f"{key}.top1: {r.top1:.4f} fraction")
        print(f"{key}.ppl: {r.ppl:.4f} ppl")
    print(f"quant.bf16.ours.ppl: {our_base_ppl:.4f} ppl")
    print(f"quant.bf16.llamacpp.ppl: {their_base_ppl:.4f} ppl")
    print(f"bench.quant_vs_llamacpp.seconds: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
