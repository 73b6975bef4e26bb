"""Quantization quality at equal bits, ktconvert + ktrun against llama.cpp and ik_llama.cpp, on the embedded default
model (or --model: bench/second_model.py trains a second shape, a small Qwen3-MoE), on two held-out texts, in one run.

llama.cpp side (a build from the llama-cpp-python sdist, see bench/README.md): its own converter makes a BF16 GGUF
of the default model, llama-quantize makes Q4_0 / Q4_K(_S/_M) / IQ4_XS / Q8_0 variants (whole model with BF16
embeddings and head, or only the routed experts, or only the other Linears), without and with an importance matrix
("-imatrix" rows: llama-imatrix over the calibration text our conversions use), llama-perplexity scores them.
ik_llama.cpp side (built from the ik-llama-cpp-python sdist, --ik-llama-dir): its own converter, llama-imatrix,
llama-quantize (IQ4_KSS / IQ4_KS / IQ4_K, whole model and experts only, with its imatrix) and llama-perplexity, KL
against its own BF16 GGUF. Our side: `ktconvert quantize` with the matching tensor sets, `ktrun perplexity`. All with
llama-perplexity's protocol on identical tokens (checked), on each of --texts: "stdlib", the held-out split of the
default model's data (the Python standard library files it did not train on), and "torch", the pinned torch's own
torch/nn/modules/*.py (code by other authors, in another style: a text independent of the training data); each
file is made once and scored on every text; --chunks chunks of --ctx tokens, BOS first, positions ctx/2 .. ctx-2
scored; KL of the next-token distribution against each tool's own BF16 model (llama.cpp / ik_llama.cpp: its BF16
GGUF; ours: the --method bf16 --gpu-method bf16 conversion), each through its own CPU runtime.

Bits per weight are counted over the quantized tensors only (codes + scales / block headers / ik_llama.cpp's per-row
scales, bits of stored data per logical weight); our tile and Marlin layouts pad shapes (default model: down K 160 ->
192, kv_b K 64 -> 128, ...), and those padding bits are shown separately (the GGUF blocks need no padding: a tensor
whose rows do not fit a 256-wide super-block falls back to another type, e.g. Q4_K -> Q5_0 or IQ4_KS -> IQ4_NL for
the experts' down_proj with K = 160; the types as stored are printed under the table). GPTQ / importance calibration
of our conversions and the tools' llama-imatrix read --calib (default: every 8th training-split file; never the
held-out files): ours 2048 tokens of its first three quarters (ktconvert's --calib-tokens default), llama-imatrix
all of it unless --imatrix-chunks says less.

    L=/work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp
    .venv/bin/python bench/bench_quant_vs_llamacpp.py --llama-quantize $L/build/bin/llama-quantize \\
        --llama-perplexity $L/build/bin/llama-perplexity --convert-script $L/convert_hf_to_gguf.py \\
        --ik-llama-dir /work/tools/ik_llama_cpp_python-0.1.5/vendor/ik_llama.cpp
    ... --chunks 16 --only experts          # quicker: fewer chunks, one tensor set
    ... --tools llama.cpp,ik_llama.cpp --configs imatrix   # only the imatrix rows of the peers
    ... --model /work/scratch/qwen3-small --configs '^(default|Q4_K_M-imatrix|IQ4_K.*)$'   # the second shape

Prints a markdown table per text, the stored GGUF types of each GGUF row, and
`quant.<text>.<set>.<tool>.<config>.{bpw,padding_bpw,kl_mean,kl_p99,top1,ppl}: value unit` lines (tool: ours,
llamacpp, ik_llamacpp).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "ktconvert" / "data" / "default_model"
PY = sys.executable

# GGUF tensor sets (llama.cpp names). kv_b_proj is split into attn_k_b / attn_v_b by the converter (ik_llama.cpp's
# converter keeps attn_kv_b beside them; its runtime picks per batch which it reads).
GGUF_SETS = {
    "experts": re.compile(r"ffn_(gate|up|down)_exps\.weight$"),
    "non-expert": re.compile(r"(attn_(q|k|v|q_a|q_b|kv_a_mqa|kv_b|k_b|v_b|output)|ffn_(gate|up|down)(_shexp)?)"
                             r"\.weight$"),
}
GGUF_SETS["whole"] = re.compile(f"{GGUF_SETS['experts'].pattern}|{GGUF_SETS['non-expert'].pattern}")
EXPERT_TYPE = "ffn_(gate|up|down)_exps=%s"
NON_EXPERT_TYPES = ["attn_(q|k|v|q_a|q_b|kv_a_mqa|kv_b|k_b|v_b|output)\\.weight=%s", "ffn_(gate|up|down)\\.weight=%s",
                    "ffn_(gate|up|down)_shexp=%s"]

# (set, config name, llama-quantize type, extra arguments, with the tool's imatrix). Rows for one tensor set quantize
# every tensor of the type (--pure: no k-quant mixture) and keep the other set BF16 (--tensor-type overrides; with
# BF16 as the main type llama-quantize ignores them); whole-model rows use llama-quantize's own mixtures. "-imatrix"
# rows quantize with the tool's own llama-imatrix run over the calibration text (--calib), as the GGUF uploads people
# download are made.
def _keep_bf16(patterns: list[str]) -> list[str]:
    return [a for p in patterns for a in ("--tensor-type", p % "bf16")]


LLAMA_ROWS = [
    ("experts", "Q4_0", "Q4_0", ["--pure", *_keep_bf16(NON_EXPERT_TYPES)], False),
    ("experts", "Q4_K", "Q4_K", ["--pure", *_keep_bf16(NON_EXPERT_TYPES)], False),
    ("experts", "Q4_K-imatrix", "Q4_K", ["--pure", *_keep_bf16(NON_EXPERT_TYPES)], True),
    ("experts", "IQ4_XS-imatrix", "IQ4_XS", ["--pure", *_keep_bf16(NON_EXPERT_TYPES)], True),
    ("non-expert", "Q4_0", "Q4_0", ["--pure", *_keep_bf16([EXPERT_TYPE])], False),
    ("whole", "Q4_0", "Q4_0", [], False),
    ("whole", "Q4_K_S", "Q4_K_S", [], False),
    ("whole", "Q4_K_M", "Q4_K_M", [], False),
    ("whole", "Q4_K_S-imatrix", "Q4_K_S", [], True),
    ("whole", "Q4_K_M-imatrix", "Q4_K_M", [], True),
    ("whole", "IQ4_XS-imatrix", "IQ4_XS", [], True),
    ("whole", "Q8_0", "Q8_0", [], False),
]


# ik_llama.cpp's llama-quantize has no --tensor-type and ignores its --custom-q rules under --pure, so a one-set row
# runs its mixture with --custom-q rules that name every quantized tensor: the set at the row's type, the rest BF16.
# Its IQ4_K* types need rows of a multiple of 256; a tensor that is not one falls back (IQ4_KS / IQ4_KSS -> IQ4_NL,
# IQ4_K -> Q5_0: the experts' down_proj with K = 160 here), counted in the bits as stored.
def _ik_experts_only(qtype: str) -> list[str]:
    return ["--custom-q", ",".join([EXPERT_TYPE % qtype.lower(), *(p % "bf16" for p in NON_EXPERT_TYPES)])]


# ik_llama.cpp's llama-perplexity and llama-imatrix process escape sequences in the text file by default (llama.cpp's
# turn that off themselves): the two characters backslash backslash inside a string literal of the held-out text
# became one backslash and every token after it shifted (chunk 23 of 64), so both run with --no-escape.
# ik_llama.cpp's llama-perplexity: its defaults (flash attention on, MLA mode 3, no run-time repacking: -rtr is off
# unless asked for); should a run crash, its other attention paths: without flash attention, then standard attention
# too (-mla 0). None has crashed here, so these have not been needed.
IK_FALLBACKS = [("its defaults", [], {}), ("-fa off", ["-fa", "off"], {}),
                ("-fa off -mla 0", ["-fa", "off", "-mla", "0"], {})]
# ik_llama.cpp's llama-imatrix aborts ("double free or corruption") with its fused MoE op on a Qwen3-MoE model
# (bench/second_model.py's; the DeepSeek-shaped default model runs with its defaults): then without it (-no-fmoe:
# the experts' up / gate / down as separate ops, the same activations collected).
IK_IMATRIX_FALLBACKS = [("its defaults", []), ("-no-fmoe", ["-no-fmoe"])]
IK_ROWS = [
    *[("experts", f"{t}-imatrix", t, _ik_experts_only(t), True) for t in ("IQ4_KSS", "IQ4_KS", "IQ4_K")],
    *[("whole", f"{t}-imatrix", t, [], True) for t in ("IQ4_KSS", "IQ4_KS", "IQ4_K")],
]
# (set, config name, ktconvert quantize arguments[, the model types it applies to]); the tensor set not named stays
# BF16. Experts: GPTQ on each expert's routed calibration tokens (--expert-quantizer auto) unless the name says rtn
# (the previous reference rule).
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
    # the measured mixed precision alone (--gpu-method auto: gptq-int4 g32 + int8 upgrades, here at budget 1)
    ("non-expert", "gptq-int4-g32+mix1", [*NE, "auto", "--gpu-mix-budget", "1"]),
    # what `ktconvert quantize SRC --method int4-amx` writes with no other flag (the defaults of this release):
    # int4 g64 f16 experts + gptq-int4 g32 GPU layers with the measured int8 upgrades (--gpu-mix-budget 0.5)
    ("whole", "default", ["--method", "int4-amx"]),
    # the measured rule at other budgets, and the same experts with hand-picked int8 Linears (--gpu-method-for)
    *[("whole", f"int4-g64-f16+gptq-int4-g32+mix{b}", ["--method", "int4-amx", "--gpu-mix-budget", b])
      for b in ("0.25", "0.75", "1", "1.25")],
    # (these name the default model's Linears: DeepSeek-shaped models only)
    *[("whole", f"int4-g64-f16+gptq-int4-g32+{tag}-int8", ["--method", "int4-amx", "--gpu-method", "gptq-int4",
                                                          *[a for t in targets for a in ("--gpu-method-for",
                                                                                        f"{t}=gptq-int8")]],
       ("deepseek_v3",))
      for tag, targets in (("l0down", ["model.layers.0.mlp.down_proj"]),
                           ("l0down-gate", ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj"]),
                           ("l0mlp", ["model.layers.0.mlp.*"]),
                           ("kv-a-b", ["*.kv_a_proj_with_mqa", "*.kv_b_proj"]))],
    ("whole", "int4-g32-sub6+gptq-int4-g32+mix1", ["--method", "int4-amx", "--group-size", "32", "--scale-dtype",
                                                   "sub6", "--gpu-mix-budget", "1"]),
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
    text: str               # which of --texts it was scored on
    tset: str
    tool: str
    config: str
    bpw: float
    padding_bpw: float
    kl_mean: float
    kl_p99: float
    top1: float
    ppl: float
    types: str = ""         # GGUF rows: the set's tensor types as stored (fallbacks included)
    note: str = ""          # GGUF rows: the llama-perplexity workaround it ran with, if any


def try_run(cmd: list[str], log: Path, env: dict | None = None) -> tuple[bool, str]:
    """Run a command, keeping its output in `log`: (exited 0, stdout + stderr)."""
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, check=False)
    log.write_text(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    print(f"# {time.perf_counter() - t:6.1f} s  {' '.join(str(c) for c in cmd)}"
          + (f"  -> exit {r.returncode}" if r.returncode else ""), file=sys.stderr, flush=True)
    return r.returncode == 0, r.stdout + r.stderr


def run(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Run a command, keeping its output in `log`; a failure prints the tail and stops the bench."""
    ok, out = try_run(cmd, log, env)
    if not ok:
        sys.exit(f"error: {' '.join(cmd[:3])} ... failed; tail of {log}:\n{out[-3000:]}")
    return out


def wanted(args, config: str) -> bool:
    return args.configs is None or re.search(args.configs, config) is not None


# --- texts ------------------------------------------------------------------------------------------------------

# The held-out texts (--texts): name -> what it is. Neither was trained on by any model the bench reads (the default
# model and bench/second_model.py both train on the standard library's training split).
TEXTS = {
    "stdlib": "the held-out split of the Python standard library files (every 20th file, never trained on)",
    "torch": "torch's own torch/nn/modules/*.py (torch is pinned in pyproject.toml): code by other authors in "
             "another style (type hints, math in docstrings), independent of the training text",
}


def torch_text() -> str:
    """The installed torch's torch/nn/modules/*.py, sorted by name, concatenated (read as files: torch is not
    imported). The same bytes wherever the pinned torch is installed; main prints its size and hash."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: --texts torch reads torch's own sources, and torch is not installed here")
    folder = Path(next(iter(spec.submodule_search_locations))) / "nn" / "modules"
    files = sorted(folder.glob("*.py"))
    if not files:
        sys.exit(f"error: --texts torch: no *.py files in {folder}")
    return "".join(p.read_text(encoding="utf-8") for p in files)


def write_texts(work: Path, names: list[str], calib: Path | None) -> tuple[dict[str, Path], Path]:
    """{text name: file} for --texts, and the calibration text (default: every 8th training-split file)."""
    from ktconvert.default_model import data

    train, heldout = data.split_files(data.default_stdlib_dir())
    texts = {}
    for name in names:
        if name not in TEXTS:
            sys.exit(f"error: --texts {name!r}: the texts are {', '.join(TEXTS)}")
        texts[name] = work / f"heldout-{name}.txt"
        body = "".join(p.read_text(encoding="utf-8") for p in heldout) if name == "stdlib" else torch_text()
        texts[name].write_text(body, encoding="utf-8")
    if calib is None:
        calib = work / "calib.txt"
        calib.write_text("".join(p.read_text(encoding="utf-8") for p in train[::8]), encoding="utf-8")
    return texts, calib


# --- llama.cpp and ik_llama.cpp ---------------------------------------------------------------------------------

# One shim for both converters (no file of either tool is changed). The default model's tokenizer is a GPT-2-style
# byte-level BPE (tokenizers' ByteLevel pre-tokenizer with the GPT-2 regex) trained by this project; the converters
# identify pre-tokenizers by the hash of a test string's tokens, so they do not know ours. "gpt-2" is the llama.cpp
# pre-tokenizer with that regex (the bench checks identical tokens). llama.cpp keeps its model classes in
# conversion/; ik_llama.cpp's converter is one file (class Model), and its gguf-py's SpecialVocab writes
# tokenizer.ggml.add_sep_token through a key its own constants.py lacks (Keys.Tokenizer.ADD_SEP: an AttributeError
# for any tokenizer_config.json, ours included), so the shim adds that key under the name ik's C++ reads.
CONVERT_SHIM = r"""
import importlib.util, runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.path.insert(0, str(Path(script).parent))
sys.argv = [script] + sys.argv[2:]
gpt2 = lambda self, tokenizer: "gpt-2"
if (Path(script).parent / "conversion" / "base.py").is_file():
    import conversion.base as base
    base.TextModel.get_vocab_base_pre = gpt2
    runpy.run_path(script, run_name="__main__")
else:
    import gguf
    if not hasattr(gguf.Keys.Tokenizer, "ADD_SEP"):
        gguf.Keys.Tokenizer.ADD_SEP = "tokenizer.ggml.add_sep_token"
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = mod
    spec.loader.exec_module(mod)
    mod.Model.get_vocab_base_pre = gpt2
    mod.main()
"""

# Each GGUF is read with its own tool's gguf-py (ik_llama.cpp's types are unknown to llama.cpp's).
GGUF_TENSORS = r"""
import json, sys
from gguf import GGUFReader
r = GGUFReader(sys.argv[1])
print(json.dumps({"alignment": int(r.alignment), "tensors": [
    [t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes), int(t.data_offset), int(t.shape[0])]
    for t in r.tensors]}))
"""
# Bytes per row that ik_llama.cpp's row-scaled types store before a row's blocks (ggml.c's row_meta_size: one float
# scale per row for IQ4_KS / IQ4_KSS / IQ5_KS, ...); gguf-py's n_bytes counts the blocks only. gguf_tensors checks
# every tensor's size against the offsets in the file, so a type missing here stops the bench instead of being
# under-counted.
ROW_META = {"IQ1_S_R4": 2, "IQ1_M_R4": 2, "IQ1_BN": 2, "IQ2_BN": 4, "IQ2_BN_R4": 4, "IQ4_KS": 4, "IQ4_KS_R4": 4,
            "IQ5_KS_R4": 4, "IQ4_KSS": 4, "IQ5_KS": 4, "Q8_KV": 8, "Q8_KV_R8": 4, "IQ2_KS": 2, "IQ1_KT": 4,
            "IQ2_KT": 4, "IQ3_KT": 4, "IQ4_KT": 4, "IQ3_KS": 2, "IQ2_KL": 2}


@dataclass
class Peer:
    """One GGUF tool: its converter, quantizer, importance-matrix and perplexity programs, and its rows."""
    name: str            # printed in the table
    key: str             # in the quant.<set>.<key>.<config> lines
    prefix: str          # of its files in the workdir
    convert_script: str
    quantize: str
    perplexity: str
    imatrix: str | None  # None: its -imatrix rows are skipped
    rows: list
    imatrix_out: list[str]  # its llama-imatrix's output file name and format arguments
    text_args: list[str]    # what its llama-perplexity and llama-imatrix need to read a text file as it is
    trace_log: bool         # they write a trace log, llama.log in the working directory unless told where
    # (what, extra llama-perplexity arguments, environment), in order: its defaults first, then workarounds for
    # crashes (llama.cpp: its documented LLAMA_ARG_REPACK=0); peer_perplexity moves on to the next one when a run fails
    fallbacks: list[tuple[str, list[str], dict]]
    level: int = 0          # the one in use
    # (what, extra llama-imatrix arguments): its defaults first, then workarounds for a crash (tried in order)
    imatrix_fallbacks: list[tuple[str, list[str]]] = field(default_factory=lambda: [("its defaults", [])])

    @property
    def note(self) -> str:
        return self.fallbacks[self.level][0] if self.level else ""

    def common_args(self, work: Path) -> list[str]:
        """Arguments of its llama-perplexity and llama-imatrix: the text as it is, the trace log in the workdir."""
        return [*self.text_args, *(["--log-file", str(work / f"{self.prefix}-trace")] if self.trace_log else [])]

    @property
    def gguf_py(self) -> str:
        return str(Path(self.convert_script).parent / "gguf-py")


def gguf_tensors(peer: Peer, path: Path) -> list[dict]:
    """Name, type, weights and stored bytes of every tensor of a GGUF file (its own tool's gguf-py reads it)."""
    out = subprocess.run([PY, "-c", GGUF_TENSORS, str(path)], capture_output=True, text=True, check=False,
                         env=dict(os.environ, PYTHONPATH=peer.gguf_py))
    if out.returncode:
        sys.exit(f"error: {peer.name}'s gguf-py could not read {path}:\n{out.stderr[-2000:]}")
    info = json.loads(out.stdout)
    align = info["alignment"]
    tensors = [{"name": n, "type": t, "n": n_el, "bytes": nb + ROW_META.get(t, 0) * (n_el // ne0), "offset": off}
               for n, t, n_el, nb, off, ne0 in info["tensors"]]
    ends = sorted(t["offset"] for t in tensors)[1:] + [path.stat().st_size]
    for t, end in zip(sorted(tensors, key=lambda t: t["offset"]), ends):
        if not t["bytes"] <= end - t["offset"] < t["bytes"] + align:
            sys.exit(f"error: {path}: {t['name']} ({t['type']}) spans {end - t['offset']} bytes in the file, the "
                     f"bits count says {t['bytes']}: a row-scaled type missing from ROW_META?")
    return tensors


def _counted(tensors: list[dict], tset: str) -> list[dict]:
    """The set's tensors, each logical weight once. ik_llama.cpp's files keep attn_kv_b beside its split copies
    attn_k_b / attn_v_b; with its defaults (MLA 3, flash attention) a batch of >= 128 tokens, as every batch of this
    bench, multiplies by attn_kv_b (decode steps by the copies), so that is the one counted."""
    names = {t["name"] for t in tensors}
    return [t for t in tensors if GGUF_SETS[tset].search(t["name"]) and not (
        re.search(r"attn_[kv]_b\.weight$", t["name"]) and re.sub(r"attn_[kv]_b", "attn_kv_b", t["name"]) in names)]


def gguf_bits(tensors: list[dict], tset: str) -> float:
    chosen = _counted(tensors, tset)
    return sum(8 * t["bytes"] for t in chosen) / sum(t["n"] for t in chosen)


def gguf_types(tensors: list[dict], tset: str) -> str:
    """'IQ4_KS 6, IQ4_NL 3': the types of the counted tensors as stored (shows llama-quantize's fallbacks)."""
    counts: dict[str, int] = {}
    for t in _counted(tensors, tset):
        counts[t["type"]] = counts.get(t["type"], 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def check_kept(tensors: list[dict], tset: str, path: Path) -> None:
    """A one-set row must leave every Linear of the other set BF16 (the row's name says which set it measures)."""
    other = {"experts": "non-expert", "non-expert": "experts"}.get(tset)
    bad = [f"{t['name']} {t['type']}" for t in tensors
           if other and GGUF_SETS[other].search(t["name"]) and t["type"] != "BF16"]
    if bad:
        sys.exit(f"error: {path}: tensors outside the '{tset}' set were quantized: {', '.join(bad[:6])}")


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


def peer_perplexity(peer: Peer, args_: list[str], log: Path, expect: str) -> str:
    """llama-perplexity with the workaround in use; when it crashes, the tool's next documented workaround (kept for
    the runs after, and printed). A run whose output lacks `expect` runs again, up to 3 times: llama.cpp's
    asynchronous logger has lost the closing lines at exit on a loaded machine."""
    out = ""
    for level in range(peer.level, len(peer.fallbacks)):
        what, extra, env = peer.fallbacks[level]
        for _attempt in range(3):
            ok, out = try_run([peer.perplexity, *args_, *extra], log, env=dict(os.environ, **env))
            if not ok or expect in out:
                break
        if ok:
            if level != peer.level:
                print(f"# {peer.name}: llama-perplexity failed with {peer.fallbacks[peer.level][0]} (log {log.name}); "
                      f"from here on it runs with {what}", flush=True)
                peer.level = level
            return out
    sys.exit(f"error: {peer.name}'s llama-perplexity failed with every workaround "
             f"({', '.join(f[0] for f in peer.fallbacks[peer.level:])}); tail of {log}:\n{out[-3000:]}")


def peer_bf16(peer: Peer, args, work: Path, fallback_gguf: Path | None) -> Path:
    """The tool's own BF16 GGUF from its own converter; when that fails, fallback_gguf (another tool's), said so."""
    shim = work / "convert_shim.py"
    shim.write_text(CONVERT_SHIM)
    bf16 = work / f"{peer.prefix}-bf16.gguf"
    ok, out = try_run([PY, str(shim), peer.convert_script, str(args.model), "--outtype", "bf16", "--outfile",
                       str(bf16)], work / f"{peer.prefix}-convert.log", env=dict(os.environ, PYTHONPATH=peer.gguf_py))
    if ok:
        return bf16
    if fallback_gguf is None:
        sys.exit(f"error: {peer.name}'s converter failed; tail of {work / f'{peer.prefix}-convert.log'}:\n"
                 f"{out[-3000:]}")
    print(f"# {peer.name}: its converter failed on the default model (log {peer.prefix}-convert.log); its rows "
          f"quantize llama.cpp's BF16 GGUF ({fallback_gguf.name})", flush=True)
    return fallback_gguf


def peer_rows(peer: Peer, args, work: Path, texts: dict[str, Path], calib: Path, only: set[str],
              fallback_gguf: Path | None = None) -> tuple[list[Row], dict[str, np.ndarray], dict[str, float], Path]:
    """Every row of the tool, each GGUF scored on every text: (rows, {text: tokens}, {text: BF16 ppl}, BF16 GGUF)."""
    bf16 = peer_bf16(peer, args, work, fallback_gguf)

    def ppl_args(text: str) -> list[str]:
        return ["-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads), "-b", str(args.ctx),
                *peer.common_args(work), "-f", str(texts[text])]

    bases, tokens, base_ppl = {}, {}, {}
    for text in texts:
        bases[text] = work / f"{peer.prefix}-bf16.{text}.kld"
        log = work / f"{peer.prefix}-ppl-bf16.{text}.log"
        out = peer_perplexity(peer, [*ppl_args(text), "-m", str(bf16), "--kl-divergence-base", str(bases[text])],
                              log, "Final estimate")
        # llama.cpp: "Final estimate: PPL = x"; ik_llama.cpp: "Final estimate: PPL over N chunks for n_ctx=C = x"
        m = re.search(r"Final estimate: PPL(?: over \d+ chunks for n_ctx=\d+)? = ([\d.]+)", out)
        if m is None:
            sys.exit(f"error: {peer.name}'s llama-perplexity printed no final estimate (log {log.name})")
        base_ppl[text], tokens[text] = float(m.group(1)), llama_tokens(bases[text])
    todo = [r for r in peer.rows if r[0] in only and wanted(args, r[1])]
    imatrix = None
    if any(r[4] for r in todo):
        if peer.imatrix is None or not Path(peer.imatrix).is_file():
            print(f"# {peer.name}: no llama-imatrix ({peer.imatrix}); its -imatrix rows are skipped", flush=True)
            todo = [r for r in todo if not r[4]]
        else:
            imatrix = work / peer.imatrix_out[0]
            chunks = ["--chunks", str(args.imatrix_chunks)] if args.imatrix_chunks > 0 else []
            t0 = time.perf_counter()
            log = work / f"{peer.prefix}-imatrix.log"
            for what, extra in peer.imatrix_fallbacks:
                ok, out = try_run([peer.imatrix, "-m", str(bf16), "-f", str(calib), "-o", str(imatrix),
                                   *peer.imatrix_out[1:], "-c", str(args.ctx), "-b", str(args.ctx), "-t",
                                   str(args.threads), *chunks, *peer.common_args(work), *extra], log)
                if ok:
                    break
                log.rename(log.with_suffix(f".failed-{what.replace(' ', '_')}.log"))
            else:
                sys.exit(f"error: {peer.name}'s llama-imatrix failed with every workaround; tail of {log}:\n"
                         f"{out[-3000:]}")
            print(f"# {peer.name}: llama-imatrix over {calib.name} ({args.imatrix_chunks if chunks else 'all'} "
                  f"chunks of {args.ctx} tokens) in {time.perf_counter() - t0:.0f} s"
                  + (f", with {what} (it failed with its defaults)" if extra else ""), flush=True)
    rows = []
    for tset, name, qtype, overrides, with_imatrix in todo:
        q = work / f"{peer.prefix}-{tset}-{name}.gguf"
        extra = ["--token-embedding-type", "bf16", "--output-tensor-type", "bf16", *overrides]
        if with_imatrix:
            extra += ["--imatrix", str(imatrix)]
        run([peer.quantize, *extra, str(bf16), str(q), qtype, str(args.threads)], work / f"{q.stem}.quant.log")
        tensors = gguf_tensors(peer, q)
        check_kept(tensors, tset, q)
        for text in texts:
            out = peer_perplexity(peer, [*ppl_args(text), "-m", str(q), "--kl-divergence-base", str(bases[text]),
                                         "--kl-divergence"], work / f"{q.stem}.{text}.ppl.log", "Same top p:")
            k = llama_kld(out)
            rows.append(Row(text, tset, peer.name, name, gguf_bits(tensors, tset), 0.0, k["kl_mean"], k["kl_p99"],
                            k["top1"], k["ppl"], gguf_types(tensors, tset), peer.note))
    return rows, tokens, base_ppl, bf16


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


def our_rows(args, work: Path, texts: dict[str, Path], calib: Path, only: set[str],
             ) -> tuple[list[Row], dict[str, np.ndarray], dict[str, float]]:
    """Every row of ours, each conversion scored on every text: (rows, {text: tokens}, {text: BF16 ppl})."""
    from safetensors.numpy import load_file

    family = json.loads((args.model / "config.json").read_text()).get("model_type")
    conv_bf16 = work / "ours-bf16"
    run([PY, "-m", "ktconvert", "quantize", str(args.model), "-o", str(conv_bf16), "--method", "bf16",
         "--gpu-method", "bf16", "--force", "--quiet"], work / "ours-bf16.convert.log")

    def ppl(text: str) -> list[str]:
        return ["--text", str(texts[text]), "--ctx", str(args.ctx), "--chunks", str(args.chunks)]

    bases, tokens, base_ppl = {}, {}, {}
    for text in texts:
        bases[text] = work / f"ours-bf16.{text}.logprobs"
        out = run([PY, "-m", "ktrun", "perplexity", str(conv_bf16), *ppl(text), "--kl-divergence-base",
                   str(bases[text])], work / f"ours-bf16.{text}.ppl.log")
        base_ppl[text], tokens[text] = ktrun_lines(out)["ppl"], load_file(str(bases[text]))["tokens"]
    rows = []
    for tset, name, conv_args, *families in OUR_ROWS:
        if tset not in only or not wanted(args, name) or (families and family not in families[0]):
            continue
        conv = work / f"ours-{tset}-{name.split()[0]}"
        run([PY, "-m", "ktconvert", "quantize", str(args.model), "-o", str(conv), *conv_args, "--calib", str(calib),
             *args.our_extra, "--force", "--quiet"], work / f"{conv.name}.convert.log")
        bpw, pad = our_bits(conv, tset)
        for text in texts:
            out = run([PY, "-m", "ktrun", "perplexity", str(conv), *ppl(text), "--kl-divergence", str(bases[text])],
                      work / f"{conv.name}.{text}.ppl.log")
            k = ktrun_lines(out)
            rows.append(Row(text, tset, "ours", name, bpw, pad, k["kl_mean"], k["kl_p99"], k["top1_agreement"],
                            k["ppl"]))
    return rows, tokens, base_ppl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env_dir = os.environ.get("LLAMA_CPP_DIR")       # a llama.cpp checkout with build/bin (bench/README.md)
    ap.add_argument("--llama-quantize", default=env_dir and f"{env_dir}/build/bin/llama-quantize")
    ap.add_argument("--llama-perplexity", default=env_dir and f"{env_dir}/build/bin/llama-perplexity")
    ap.add_argument("--llama-imatrix", default=None,
                    help="llama.cpp's llama-imatrix for the -imatrix rows (default: beside --llama-quantize)")
    ap.add_argument("--convert-script", default=env_dir and f"{env_dir}/convert_hf_to_gguf.py",
                    help="llama.cpp's convert_hf_to_gguf.py (gguf-py beside it); all three default from $LLAMA_CPP_DIR")
    ap.add_argument("--ik-llama-dir", default=os.environ.get("IK_LLAMA_CPP_DIR"),
                    help="an ik_llama.cpp tree with build/bin/{llama-quantize,llama-perplexity,llama-imatrix}, "
                         "convert_hf_to_gguf.py and gguf-py (default: $IK_LLAMA_CPP_DIR; none: no ik_llama.cpp rows)")
    ap.add_argument("--model", type=Path, default=MODEL_DIR,
                    help="a hub checkpoint (default: the embedded default model; bench/second_model.py trains a "
                         "second shape)")
    ap.add_argument("--texts", default=",".join(TEXTS),
                    help="comma-separated held-out texts, each row scored on each: " + "; ".join(
                        f"{k}: {v}" for k, v in TEXTS.items()))
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--imatrix-chunks", type=int, default=0,
                    help="chunks of --ctx tokens of the calibration text llama-imatrix reads (0: all of it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib", type=Path, default=None,
                    help="calibration text for our conversions and the tools' llama-imatrix")
    ap.add_argument("--only", default="experts,non-expert,whole", help="comma-separated tensor sets")
    ap.add_argument("--tools", default="ours,llama.cpp,ik_llama.cpp",
                    help="comma-separated: ours, llama.cpp, ik_llama.cpp")
    ap.add_argument("--configs", default=None, help="regular expression: only rows whose config name matches "
                    "(every tool; e.g. 'Q4_K|f16\\+gptq', 'imatrix')")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the files here (default: a temp dir)")
    ap.add_argument("--our-extra", nargs=argparse.REMAINDER, default=[],
                    help="extra `ktconvert quantize` arguments for every one of our rows (last on the line)")
    args = ap.parse_args()
    tools = set(args.tools.split(","))
    if "llama.cpp" in tools and not all((args.llama_quantize, args.llama_perplexity, args.convert_script)):
        print("bench.quant_vs_llamacpp: skipped (no llama.cpp build: pass --llama-quantize, --llama-perplexity and "
              "--convert-script, or set LLAMA_CPP_DIR; see bench/README.md)")
        return
    peers = []
    if "llama.cpp" in tools:
        imatrix = args.llama_imatrix or str(Path(args.llama_quantize).parent / "llama-imatrix")
        peers.append(Peer("llama.cpp", "llamacpp", "llama", args.convert_script, args.llama_quantize,
                          args.llama_perplexity, imatrix, LLAMA_ROWS, ["llama-imatrix.gguf"], [], False,
                          # its CPU backend's repacked buffers have aborted on whole-model GGUFs (bench/README.md)
                          [("its defaults", [], {}), ("LLAMA_ARG_REPACK=0", [], {"LLAMA_ARG_REPACK": "0"})]))
    if "ik_llama.cpp" in tools:
        ik = Path(args.ik_llama_dir) if args.ik_llama_dir else None
        if ik is None or not all((ik / "build" / "bin" / b).is_file() for b in ("llama-quantize", "llama-perplexity")):
            print(f"# ik_llama.cpp: no rows (no build at {ik}/build/bin: pass --ik-llama-dir or set IK_LLAMA_CPP_DIR; "
                  f"see bench/README.md)", flush=True)
        else:
            b = ik / "build" / "bin"
            peers.append(Peer("ik_llama.cpp", "ik_llamacpp", "ik", str(ik / "convert_hf_to_gguf.py"),
                              str(b / "llama-quantize"), str(b / "llama-perplexity"), str(b / "llama-imatrix"),
                              IK_ROWS, ["ik-imatrix.dat"], ["--no-escape"], True, IK_FALLBACKS,
                              imatrix_fallbacks=IK_IMATRIX_FALLBACKS))
    only = set(args.only.split(","))
    t0 = time.perf_counter()
    rows: list[Row] = []
    tokens: dict[str, dict[str, np.ndarray]] = {}      # tool -> text -> (chunks, ctx) tokens
    base_ppl: dict[str, dict[str, float]] = {}         # tool -> text -> BF16 ppl
    with tempfile.TemporaryDirectory(prefix="kt_vs_llama_") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        texts, calib = write_texts(work, args.texts.split(","), args.calib)
        if "ours" in tools:
            ours, tokens["ours"], base_ppl["ours"] = our_rows(args, work, texts, calib, only)
            rows += ours
        llama_bf16 = None
        for peer in peers:
            theirs, tokens[peer.key], base_ppl[peer.key], bf16 = peer_rows(peer, args, work, texts, calib, only,
                                                                           llama_bf16)
            llama_bf16 = llama_bf16 or bf16
            rows += theirs
        digests = {t: hashlib.sha256(p.read_bytes()).hexdigest()[:12] for t, p in texts.items()}
        sizes = {t: p.stat().st_size for t, p in texts.items()}
    model = json.loads((args.model / "config.json").read_text())
    print(f"# model: {args.model.name} ({model.get('model_type')}); calibration: {calib.name}")
    names = {"ours": "ours", "llamacpp": "llama.cpp", "ik_llamacpp": "ik_llama.cpp"}
    for text in texts:
        # llama-perplexity keeps the original first token of each chunk in its file; ours holds the BOS that was run
        ref_key, ref = next((k, v[text]) for k, v in tokens.items())
        same = {k: np.array_equal(ref[:, 1:], t[text][:, 1:]) and (k == ref_key or "ours" not in (k, ref_key)
                                                                  or np.array_equal(ref[0], t[text][0]))
                for k, t in tokens.items()}
        print(f"# text {text}: {TEXTS[text]}; {sizes[text]} bytes, sha256 {digests[text]}; {ref.shape[0]} chunks x "
              f"{ref.shape[1]} tokens, identical tokens in {', '.join(names[k] for k in tokens)}: "
              f"{all(same.values())}; BF16 ppl " + ", ".join(f"{names[k]} {v[text]:.4f}" for k, v in base_ppl.items()))
        if not all(same.values()):
            sys.exit(f"error: the tools tokenized text {text} differently; the comparison would not be fair")
    rows.sort(key=lambda r: (list(texts).index(r.text), ["experts", "non-expert", "whole"].index(r.tset), r.tool,
                             r.bpw))
    for text in texts:
        print(f"\n{text}:\n")
        print("| tensors quantized | tool | config | bits/weight | + padding | KL mean | KL p99 | top-1 | ppl |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if r.text == text:
                print(f"| {r.tset} | {r.tool} | {r.config} | {r.bpw:.3f} | {r.padding_bpw:.3f} | {r.kl_mean:.5f} | "
                      f"{r.kl_p99:.4f} | {r.top1:.4f} | {r.ppl:.3f} |")
    print()
    keys = {"ours": "ours", "llama.cpp": "llamacpp", "ik_llama.cpp": "ik_llamacpp"}
    for r in rows:
        if r.types and r.text == next(iter(texts)):
            print(f"# {r.tset} {r.tool} {r.config}: {r.types}" + (f"; llama-perplexity with {r.note}" if r.note
                                                                 else ""))
    for r in rows:
        key = f"quant.{r.text}.{r.tset}.{keys[r.tool]}.{r.config}"
        print(f"{key}.bpw: {r.bpw:.4f} bits/weight")
        print(f"{key}.padding_bpw: {r.padding_bpw:.4f} bits/weight")
        print(f"{key}.kl_mean: {r.kl_mean:.6f} nats/token")
        print(f"{key}.kl_p99: {r.kl_p99:.5f} nats/token")
        print(f"{key}.top1: {r.top1:.4f} fraction")
        print(f"{key}.ppl: {r.ppl:.4f} ppl")
    for k, v in base_ppl.items():
        for text, p in v.items():
            print(f"quant.{text}.bf16.{k}.ppl: {p:.4f} ppl")
    print(f"bench.quant_vs_llamacpp.seconds: {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
