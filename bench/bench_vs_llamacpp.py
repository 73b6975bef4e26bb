"""ktrun vs llama.cpp on one DeepSeek-V3-shaped model, CPU only, measured in the same run, the two systems alternated.

The model (issue 14): hidden 7168, 128 heads, MLA with V3's ranks (q_lora 1536, kv_lora 512, rope 64, nope 128,
v 128), 3 MoE layers of 16 routed experts (intermediate 2048, top-8) plus one shared expert, vocab 768: every
per-layer shape is DeepSeek-V3's, only the layer and expert counts and the vocabulary are cut to fit this machine.
Random bf16 weights are written as a hub checkpoint (safetensors shards + config.json + tokenizer), then:

  ours:  `ktconvert quantize` (the real converter): int4 = int4-amx experts + rtn-int4 GPU layers + int4 head;
         int8 = int8-amx experts + rtn-int8 GPU layers + int8 head; run in this process by ktrun (load_model).
  peer:  llama.cpp's own convert_hf_to_gguf.py (bf16 GGUF) + llama-quantize (Q4_0, Q8_0), timed by llama-bench
         (with --llama-bench PATH --convert-script PATH; llama-quantize is taken from beside llama-bench).

Each round times every system once (tg32, pp64, pp512), the order flipped every round, and the machine's read
bandwidth; lines are means over rounds. Pairs: ktrun int4 vs llama.cpp Q4_0, ktrun int8 vs llama.cpp Q8_0. Without
the peer the limit is the roofline: weight bytes a decode step reads (the routed experts it selects, the dense part
as ktrun holds it in memory, the head) over the read bandwidth measured in the same run. Then the peak RSS of
`ktrun generate` on each conversion (a subprocess) against the issue's bound, and a `must_show` summary: every
target of issue 14 with the value measured in this run and met / missed (load average printed at start and end).

Artifacts are kept in --workdir and reused when complete (the checkpoint's config.json, a conversion's
manifest.json and a GGUF are written last): the first full-size run writes ~20 GB and takes ~15 min on 2 cores.

    .venv/bin/python bench/bench_vs_llamacpp.py                                 # against the roofline
    .venv/bin/python bench/bench_vs_llamacpp.py \\
        --llama-bench /work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench \\
        --convert-script /work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
    .venv/bin/python bench/bench_vs_llamacpp.py --tiny --rounds 1 --pp 16 --tg 4  # seconds: the test's configuration
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # torch's idle OpenMP threads must not spin on the kernels' CPUs

import numpy as np
import torch

# The issue's model: DeepSeek-V3's per-layer shapes (transformers DeepseekV3Config names), fewer layers and experts.
V3_SHAPE = {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
            "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
            "moe_intermediate_size": 2048, "intermediate_size": 18432, "n_routed_experts": 16,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "num_hidden_layers": 3, "vocab_size": 768}
# Seconds-sized twin for the test (same structure: MLA with q LoRA, shared expert, 3 MoE layers).
TINY_SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
              "kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
              "moe_intermediate_size": 256, "intermediate_size": 512, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "n_shared_experts": 1, "num_hidden_layers": 2, "vocab_size": 768}
# Every layer MoE, one routing group (V3's 8 groups are meaningless with 16 experts), no MTP layer (neither system
# runs it), V3's scaling.
COMMON = {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
          "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 4096}


# Issue 14's targets: (pair, test) -> minimum ratio ours / peer; decode step vs the roofline.
TARGETS = {("int4", "tg"): 1.2, ("int8", "tg"): 1.1, ("int4", "pp"): 2.0}
ROOFLINE_TARGET = 0.85
RSS_SLACK = 300e6   # peak RSS of `ktrun generate` <= converted directory + KV cache + 300 MB


@dataclass(frozen=True)
class Pair:
    name: str                  # ours: ktrun int4 / int8
    quantize_args: tuple       # ktconvert quantize flags
    peer_type: str             # llama-quantize type


PAIRS = (Pair("int4", ("--method", "int4-amx", "--gpu-method", "rtn-int4", "--quantize-head"), "Q4_0"),
         Pair("int8", ("--method", "int8-amx", "--gpu-method", "rtn-int8", "--quantize-head"), "Q8_0"))


# --- the checkpoint ------------------------------------------------------------------------------------------------

def write_checkpoint(out: Path, shape: dict, seed: int = 0) -> Path:
    """A hub-layout DeepSeek-V3 checkpoint of `shape` with random bf16 weights, one shard per layer (so memory stays
    at one layer: the full-size model is ~5.6 GB of bf16). Names and shapes come from transformers' own model class
    built on the meta device (no memory), split per expert as the hub ships them (ktconvert.testing.checkpoints).
    Linear weights ~ N(0, 1/K) keep activations O(1); norms are ones; the router bias is small noise (f32)."""
    if (out / "config.json").is_file():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ktconvert.testing.checkpoints import hub_state_dict, make_config
    from ktconvert.testing.files import F32_TENSORS, hub_config
    from ktconvert.testing.tokenizer import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = make_config("deepseek_v3", **shape, **COMMON, tie_word_embeddings=False)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    names = hub_state_dict(meta, "deepseek_v3")                      # hub name -> meta tensor (shape only)
    shards: dict[str, list[str]] = {}
    for name in names:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(layer, []).append(name)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, (key, members) in enumerate(shards.items()):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in members:
            shp = tuple(names[name].shape)
            if F32_TENSORS.match(name):
                t = (torch.randn(shp, generator=gen) * 0.05).float()
            elif name.endswith("norm.weight"):
                t = torch.ones(shp, dtype=torch.bfloat16)
            elif name.endswith("embed_tokens.weight"):
                t = torch.randn(shp, generator=gen).to(torch.bfloat16)
            else:
                t = (torch.randn(shp, generator=gen) * shp[-1] ** -0.5).to(torch.bfloat16)
            tensors[name] = t
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
        print(f"checkpoint: wrote {fname} ({key}: {sum(t.numel() for t in tensors.values()) / 1e6:.0f} M weights)",
              flush=True)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_tokenizer("deepseek_v3", out, model_max_length=COMMON["max_position_embeddings"])
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": config.bos_token_id,
                                                            "eos_token_id": config.eos_token_id}) + "\n")
    tmp = out / "config.json.tmp"                                    # last: its presence marks a complete checkpoint
    tmp.write_text(json.dumps(hub_config(config, "deepseek_v3", False), indent=2) + "\n")
    tmp.replace(out / "config.json")
    return out


# --- conversions ---------------------------------------------------------------------------------------------------

def run(cmd: list[str], what: str) -> None:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if r.returncode:
        sys.exit(f"{what} failed (exit {r.returncode}): {' '.join(map(str, cmd))}\n{r.stdout[-4000:]}")
    print(f"{what}: {time.perf_counter() - t0:.0f} s", flush=True)


def convert_ours(src: Path, out: Path, pair: Pair) -> Path:
    if not (out / "manifest.json").is_file():
        ktconvert = [sys.executable, "-m", "ktconvert"]
        run([*ktconvert, "quantize", str(src), "-o", str(out), "--force", "--quiet", *pair.quantize_args],
            f"ktconvert quantize {pair.name}")
    return out


# llama.cpp's converter identifies a BPE tokenizer by the hash of its output on a fixed text and refuses unknown
# ones; the fixture's tiny byte-level BPE is not among them. The tokenizer plays no part in llama-bench (random
# token ids), so the converter runs unchanged except that an unrecognized pre-tokenizer is named "deepseek-v3",
# which is what the real DeepSeek-V3 tokenizer gets.
_CONVERT_WRAPPER = """
import runpy, sys
from pathlib import Path
script = sys.argv.pop(1)
sys.path[:0] = [str(Path(script).parent), str(Path(script).parent / "gguf-py")]
from conversion import base
recognized = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return recognized(self, tokenizer)
    except NotImplementedError:
        return "deepseek-v3"
base.TextModel.get_vocab_base_pre = pre
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def convert_peer(src: Path, work: Path, convert_script: Path, quantize_bin: Path, qtype: str, threads: int) -> Path:
    bf16 = work / "llamacpp-bf16.gguf"
    out = work / f"llamacpp-{qtype}.gguf"
    if not out.is_file():
        if not bf16.is_file():
            tmp = bf16.with_suffix(".tmp.gguf")
            run([sys.executable, "-c", _CONVERT_WRAPPER, str(convert_script), str(src), "--outfile", str(tmp),
                 "--outtype", "bf16"], "llama.cpp convert_hf_to_gguf (bf16)")
            tmp.replace(bf16)
        tmp = out.with_suffix(".tmp.gguf")
        run([str(quantize_bin), str(bf16), str(tmp), qtype, str(threads)], f"llama-quantize {qtype}")
        tmp.replace(out)
    return out


# --- timing ----------------------------------------------------------------------------------------------------

# llama-bench flags added after the default configuration aborted (see peer_round), for the rest of the run
PEER_FALLBACK: list[str] = []


def peer_round(llama_bench: Path, gguf: Path, threads: int, tg: int, pps: list[int]) -> dict[str, float]:
    """One llama-bench repetition of tg and each pp (its own warm-up run first): test name -> tokens/s.

    With its default weight repacking, llama.cpp 0.3.36's build aborts on this model's graph on an AMX CPU
    (GGML_ASSERT(*cur_backend_id != -1) in ggml_backend_sched_split_graph: the per-head 3-D k_b/v_b products of
    MLA land in the AMX/repacked buffer type, which cannot run them); it then runs with `--repack 0` (the plain CPU
    buffer type for every weight), said in the output."""
    cmd = [str(llama_bench), "-m", str(gguf), "-t", str(threads), "-n", str(tg), "-p", ",".join(map(str, pps)),
           "-r", "1", "-o", "json", *PEER_FALLBACK]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, errors="replace")
    if r.returncode and not PEER_FALLBACK and "cur_backend_id != -1" in r.stderr:
        PEER_FALLBACK.extend(["--repack", "0"])
        print("llama-bench aborted in ggml_backend_sched_split_graph with its default weight repacking: running it "
              "with --repack 0 from now on", flush=True)
        return peer_round(llama_bench, gguf, threads, tg, pps)
    if r.returncode:
        sys.exit(f"llama-bench failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stderr[-4000:]}")
    res = {}
    for row in json.loads(r.stdout):
        name = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
        res[name] = float(row["avg_ts"])
    return res


def peer_bytes_per_token(gguf: Path, top_k: int, n_experts: int) -> float:
    """Weight bytes llama.cpp reads per decoded token: every tensor but the embedding table (one row), the routed
    experts' stacked tensors (ffn_*_exps) at top_k / n_experts. Read with gguf-py (the format's own library)."""
    from gguf import GGUFReader

    total = 0.0
    for t in GGUFReader(str(gguf)).tensors:
        if t.name == "token_embd.weight":
            continue
        total += t.n_bytes * (top_k / n_experts if "_exps" in t.name else 1.0)
    return total


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    n = getattr(obj, "nbytes", 0)
    return int(n() if callable(n) else n)


class Ours:
    """A ktrun conversion loaded once in this process; one round = tg + each pp, timed as `ktrun bench` does."""

    def __init__(self, conv_dir: Path, pair: Pair, dtype):
        from ktrun.loaded_model import load_model

        self.pair, self.lm = pair, load_model(conv_dir, device="cpu", dtype=dtype)
        self.model = self.lm.model
        cfg, conv = self.model.cfg, self.lm.converted
        # Bytes one decode step reads: top_k experts per MoE layer, the dense part as held in memory (tensors or
        # packed Linears), not the embedding table (one row); counted after the warm-up (measure_bytes).
        expert_bytes = sum(_nbytes(shard[p][:2]) for shards in conv.experts.values() for shard in shards
                           for p in shard)
        self.expert_bytes_per_token = expert_bytes * cfg.top_k / cfg.num_experts if conv.experts else 0
        self.measure_bytes()
        self.gen = torch.Generator().manual_seed(0)

    def measure_bytes(self) -> None:
        """Dense bytes a decode step reads. MLA decode reads kv_b_proj as the absorbed copy attention derives from
        it on first use (ktrun.models.attention._absorbed, "kv_b_proj.absorbed" beside the weights), not as
        stored: once that copy exists, it is what is counted."""
        w = self.model.w
        total = 0
        for k, v in w.items():
            if k.endswith("embed_tokens.weight"):
                continue
            if k.endswith("kv_b_proj.weight") and k.replace(".weight", ".absorbed") in w:
                continue
            total += _nbytes(v)
        self.dense_bytes_per_token = total
        self.bytes_per_token = self.expert_bytes_per_token + self.dense_bytes_per_token

    def warm_up(self, tg: int, pp: int) -> None:
        from ktrun.cli.cmd_bench import bench_pp, bench_tg

        bench_pp(self.model, min(pp, 16), pp + 1, self.gen)
        bench_tg(self.model, min(tg, 4), tg + 2, self.gen)
        self.measure_bytes()
        self.touch_experts()

    def touch_experts(self) -> None:
        """Fault every expert page in (one byte per 4 KiB), untimed: after evict_page_cache, a page of an expert the
        warm-up did not route to would be read from disk inside a timed step; and a host that reclaims file pages
        left unread for a while (this machine's DAMON pageout scheme: 60 s) takes this conversion's expert pages while
        the other systems' rounds run, so each round starts with this."""
        for shards in self.lm.converted.experts.values():
            for shard in shards:
                for qw, sc, _geom in shard.values():
                    for a in (qw, sc):
                        if a is not None:
                            np.asarray(a).reshape(-1).view(np.uint8)[::4096].max()

    def round(self, tg: int, pps: list[int]) -> dict[str, float]:
        from ktrun.cli.cmd_bench import bench_pp, bench_tg, decode_breakdown

        ctx = max([tg + 1, *pps]) + 1
        self.touch_experts()
        wall, parts = bench_tg(self.model, tg, ctx, self.gen)
        res = {f"tg{tg}": tg / wall, "step_s": wall / tg}
        res.update({k: v for k, v in decode_breakdown([{**parts, "wall_s": wall}], tg).items()
                    if k != "step_ms"})
        for pp in pps:
            res[f"pp{pp}"] = pp / bench_pp(self.model, pp, ctx, self.gen)
        return res

    def close(self) -> None:
        self.lm.close()


def evict_page_cache(paths: list[Path]) -> None:
    """Drop these files' (or directories' files') clean pages from the page cache (posix_fadvise DONTNEED). Pages
    ktconvert / llama-quantize just wrote sit there as 4 KiB folios and would stay so; read again through ktrun's
    expert mapping (MADV_HUGEPAGE, ktrun.loader) they come back as 2 MiB folios mapped as 2 MiB pages, which is what
    a run after a reboot gets. The GGUFs are evicted too, so each system reads its files its own way."""
    for root in paths:
        for f in [root] if root.is_file() else [q for q in root.rglob("*") if q.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


# Peak RSS of the ktrun process itself (VmHWM at exit), not of this benchmark's process.
_HWM = ("import atexit, sys; atexit.register(lambda: print('VmHWM', open('/proc/self/status').read()"
        ".split('VmHWM:')[1].split()[0], file=sys.stderr)); from ktrun.cli import main; main()")


def generate_peak_rss(conv: Path, ctx: int, tokens: int) -> tuple[int, int]:
    """-> (peak RSS bytes of `ktrun generate` on conv, bytes of its KV cache at ctx): a subprocess, greedy tokens."""
    cfg = json.loads((conv / "config.json").read_text())
    kv = cfg["num_hidden_layers"] * ctx * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4   # float32 latent
    r = subprocess.run([sys.executable, "-c", _HWM, "generate", str(conv), "--prompt", "The quick brown fox",
                        "--max-tokens", str(tokens), "--ignore-eos", "--ctx", str(ctx), "--json"],
                       capture_output=True, text=True, errors="replace", check=False)
    if r.returncode:
        sys.exit(f"ktrun generate failed (exit {r.returncode}) on {conv}\n{r.stderr[-3000:]}")
    return int(r.stderr.rsplit("VmHWM", 1)[1].split()[0]) * 1024, kv


def read_bandwidth(ours: list[Ours]) -> float:
    """The machine's read bandwidth, bytes/s, by the kernels' own probe (the pool's threads), best of 3, over a
    buffer 4x the last-level cache (ktrun.ops.library.stream_probe_bytes)."""
    for o in ours:
        moe = getattr(o.model.experts, "moe", None)
        if moe is not None:
            return moe.measure_read_bandwidth(reps=3)
    from ktrun.ops.moe import MoEKernels

    k = MoEKernels()
    try:
        return k.measure_read_bandwidth(reps=3)
    finally:
        k.close()


def mean_sd(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ktrun-bench-vs-llamacpp"),
                    help="where the checkpoint, conversions and GGUFs are written (and reused)")
    ap.add_argument("--tiny", action="store_true", help="a seconds-sized model of the same structure (tests)")
    ap.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary (llama-quantize beside it)")
    ap.add_argument("--convert-script", type=Path, help="llama.cpp's convert_hf_to_gguf.py (gguf-py beside it)")
    ap.add_argument("--pairs", default="int4,int8", help="which pairs: int4 (vs Q4_0), int8 (vs Q8_0)")
    ap.add_argument("--threads", type=int, default=2, help="threads of both systems (torch + kernel pool for ktrun)")
    ap.add_argument("--torch-threads", default=None,
                    help="torch intra-op threads of ktrun, comma-separated to compare several in the same run "
                         "(alternated like the systems; default: --threads)")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--pp", default="64,512", help="comma-separated prompt lengths")
    ap.add_argument("--rounds", type=int, default=3, help="alternation rounds")
    ap.add_argument("--prepare-only", action="store_true", help="write the checkpoint and conversions, time nothing")
    ap.add_argument("--dense-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="ktrun's dense part on the CPU (auto: the runtime's default)")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs of `ktrun generate`")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="do not evict the weight files from the page cache before loading (see evict_page_cache)")
    ap.add_argument("--rss-ctx", type=int, default=4096, help="--ctx of the `ktrun generate` RSS runs")
    args = ap.parse_args(argv)
    if (args.llama_bench is None) != (args.convert_script is None):
        ap.error("--llama-bench and --convert-script go together")
    peer = args.llama_bench is not None
    quantize_bin = args.llama_bench.with_name("llama-quantize") if peer else None
    for p in (args.llama_bench, args.convert_script, quantize_bin) if peer else ():
        if not p.is_file():
            ap.error(f"{p}: not found")
    pairs = [p for p in PAIRS if p.name in args.pairs.split(",")]
    pps = [int(x) for x in args.pp.split(",") if x]
    shape = TINY_SHAPE if args.tiny else V3_SHAPE
    tts = [int(x) for x in (args.torch_threads or str(args.threads)).split(",")]
    torch.set_num_threads(tts[0])
    load0 = os.getloadavg()

    work = args.workdir / ("tiny" if args.tiny else "v3")
    src = write_checkpoint(work / "hf", shape)
    convs = {p.name: convert_ours(src, work / f"ktrun-{p.name}", p) for p in pairs}
    ggufs = {p.name: convert_peer(src, work, args.convert_script, quantize_bin, p.peer_type, args.threads)
             for p in pairs} if peer else {}
    if args.prepare_only:
        return

    if not args.keep_page_cache:   # both systems' weights start out of the page cache, as after a reboot
        evict_page_cache([*convs.values(), *ggufs.values()])
    dtype = None if args.dense_dtype == "auto" else getattr(torch, args.dense_dtype)
    ours = {p.name: Ours(convs[p.name], p, dtype) for p in pairs}
    for o in ours.values():
        o.warm_up(args.tg, max(pps))
    tests = [f"tg{args.tg}"] + [f"pp{n}" for n in pps]
    res: dict[str, dict[str, list[float]]] = {}
    bws = []

    def add(system: str, r: dict) -> None:
        for k, v in r.items():
            res.setdefault(system, {}).setdefault(k, []).append(v)

    def ours_name(p: Pair, tt: int) -> str:
        return f"ktrun_{p.name}" + (f"_torch{tt}" if len(tts) > 1 else "")

    for rnd in range(args.rounds):
        bws.append(read_bandwidth(list(ours.values())))
        for p in pairs:
            sides = [("ours", tt) for tt in tts] + ([("peer", 0)] if peer else [])
            for side, tt in sides if rnd % 2 == 0 else sides[::-1]:
                if side == "ours":
                    torch.set_num_threads(tt)
                    add(ours_name(p, tt), ours[p.name].round(args.tg, pps))
                else:
                    add(f"llamacpp_{p.peer_type.lower()}", peer_round(args.llama_bench, ggufs[p.name], args.threads,
                                                                      args.tg, pps))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)

    bw = statistics.fmean(bws)
    o0 = next(iter(ours.values()))
    pool_threads = getattr(getattr(o0.model.experts, "moe", None), "n_threads", "?")
    for o in ours.values():
        o.close()
    rss = {} if args.no_rss else {p.name: generate_peak_rss(convs[p.name], args.rss_ctx, args.tg) for p in pairs}
    cfg = o0.model.cfg
    print(f"model: deepseek_v3-shaped{' (tiny)' if args.tiny else ''}: hidden {cfg.hidden_size}, {cfg.num_heads} "
          f"MLA heads (q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}), {cfg.num_layers} MoE layers x "
          f"{cfg.num_experts} experts (top-{cfg.top_k}, I {shape['moe_intermediate_size']}) + shared, "
          f"vocab {cfg.vocab_size}; {args.threads} threads (llama.cpp; ktrun's kernel pool has "
          f"{pool_threads}), torch threads {args.torch_threads or args.threads}, "
          f"{args.rounds} alternated rounds; ktrun dense part: {o0.lm.converted.gpu_weights or 'dense'} "
          f"({str(o0.lm.converted.dtype)[6:]})")
    if PEER_FALLBACK:
        print(f"llamacpp_flags: {' '.join(PEER_FALLBACK)} (its default repacking aborts on this model here)")
    print(f"read_bandwidth: {mean_sd([b / 1e9 for b in bws])} GB/s")
    print(f"load_average: {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end (1 min)")
    summary = []
    for p in pairs:
        o, peer_name = ours[p.name], f"llamacpp_{p.peer_type.lower()}"
        names = [ours_name(p, tt) for tt in tts]
        for t in tests:
            for name in names:
                print(f"{t}_{name}: {mean_sd(res[name][t])} tok/s")
            if peer:
                print(f"{t}_{peer_name}: {mean_sd(res[peer_name][t])} tok/s")
                for name in names:
                    ratio = statistics.fmean(res[name][t]) / statistics.fmean(res[peer_name][t])
                    print(f"{t}_{name}_over_{peer_name}: {ratio:.3f} ratio")
                    want = TARGETS.get((p.name, t[:2]))
                    if want is not None:
                        summary.append((f"{t} {name} / {peer_name}", ratio, want))
        print(f"ktrun_{p.name}_weight_bytes_per_token: {o.bytes_per_token / 1e6:.1f} MB")
        print(f"ktrun_{p.name}_expert_bytes_per_token: {o.expert_bytes_per_token / 1e6:.1f} MB")
        print(f"ktrun_{p.name}_dense_and_head_bytes_per_token: {o.dense_bytes_per_token / 1e6:.1f} MB")
        print(f"ktrun_{p.name}_roofline_step: {o.bytes_per_token / bw * 1e3:.2f} ms")
        for name in names:
            step = statistics.fmean(res[name]["step_s"])
            print(f"{name}_decode_step: {step * 1e3:.2f} ms")
            print(f"{name}_roofline_over_step: {o.bytes_per_token / bw / step:.3f} ratio")
            summary.append((f"decode step of {name} at the roofline (bytes / measured bandwidth / step)",
                            o.bytes_per_token / bw / step, ROOFLINE_TARGET))
            for part in ("experts_wait", "attention", "router_shared_dense_mlp", "head_norm_embed", "loop_overhead"):
                print(f"{name}_step_{part}: {statistics.fmean(res[name][part + '_ms']):.2f} ms")
        if peer:
            pb = peer_bytes_per_token(ggufs[p.name], cfg.top_k, cfg.num_experts)
            pstep = 1 / statistics.fmean(res[peer_name][f"tg{args.tg}"])
            print(f"{peer_name}_weight_bytes_per_token: {pb / 1e6:.1f} MB")
            print(f"{peer_name}_decode_step: {pstep * 1e3:.2f} ms")
            print(f"{peer_name}_roofline_over_step: {pb / bw / pstep:.3f} ratio")
        if p.name in rss:
            peak, kv = rss[p.name]
            limit = dir_bytes(convs[p.name]) + kv + RSS_SLACK
            print(f"ktrun_{p.name}_generate_peak_rss: {peak / 1e6:.1f} MB")
            print(f"ktrun_{p.name}_generate_rss_limit: {limit / 1e6:.1f} MB (directory + KV at --ctx {args.rss_ctx} "
                  f"+ 300 MB)")
            summary.append((f"ktrun generate peak RSS / limit, {p.name}", peak / limit, None))
    print("\nmust_show (issue 14): value, target, met")
    for what, value, want in summary:
        met = value <= 1.0 if want is None else value >= want
        print(f"  {what}: {value:.3f} (target {'<= 1' if want is None else f'>= {want}'}) "
              f"{'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
