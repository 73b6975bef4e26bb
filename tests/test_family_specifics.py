"""What GLM-4.5, MiniMax-M2, DeepSeek-V3.2 and Kimi-K2 / K2.5 add beyond the registry's generic checks (those run on
every family through ktconvert.testing.ARCHS: conversion + verify, ktrun logits and 32-token greedy decoding against
transformers, quantized KL): the V3.2 indexer at prompts and decodes longer than index_topk with its keys in the
KV cache, the FP8 releases of MiniMax-M2 and V3.2, K2.5's vision tower skipped and said so, Kimi-K2 served with its
tiktoken tokenizer, K2.5's compressed-tensors int4 release taken over exactly, `inspect`, `pull`, and config errors
that name the field before any weight is read."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from discrete_choices import compare, force_transformers, prompt_and_greedy_with_choices
from fake_hub import FakeHub, FakeRepo
from ktlayouts.families import ConfigError, parse_config
from ktrun.engine import Engine, SamplingParams
from ktrun.models.kv_cache import Batch
from runtime_helpers import (
    INIT_SCALE,
    KTRUN,
    PROMPT,
    KimiReferenceTokenizer,
    build_checkpoint,
    build_conversion,
    converted,
    greedy_gaps,
    kl,
    reference_logits,
    shared_root,
    transformers_model,
)

from ktconvert.converted_reader import ConvertedDir
from ktconvert.sources import SourceError, open_source
from ktconvert.sources.roles import adapter_for
from ktconvert.testing import FIXTURES, make_checkpoint, make_model
from ktconvert.testing.quantized import EXPERTS_ONLY, compressed_tensors_checkpoint
from ktconvert.testing.tokenizer import KIMI_BASE_VOCAB, _write_kimi

KTCONVERT = [sys.executable, "-m", "ktconvert"]
NEW = ("glm4_moe", "minimax_m2", "deepseek_v32", "kimi_k25", "glm4_moe_lite")
LOGIT_ATOL, GREEDY_GAP = 1e-4, 1e-3        # reference experts, bf16 weights, float32 on both sides
# int8 experts vs FP8 ones: router scores within 1e-2 of the row's top score (as the int8 kernels' activations)
ROUTER_SCORE_BOUND = {"router": 1e-2, "router_group": 1e-2}


def _quantize(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(out), *args], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    return r


# --- DeepSeek-V3.2: the lightning indexer ------------------------------------------------------------------------

def test_v32_indexer_sparsifies_long_prompts_and_caches_its_keys(tmp_path_factory):
    """A 40-token prompt (index_topk 8) in one prefill, then 24 decode steps: logits equal transformers' at every
    position, the indexer really drops keys (a dense run differs), and the per-request cache holds the indexer's
    keys exactly as transformers' cache does."""
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v32")
    conv = converted(tmp_path_factory, "deepseek_v32", "bf16")
    eng = Engine(conv, ctx=256, use_kernels=False)
    cfg = eng.model.cfg
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (8, 8, 32)
    ids = eng.tokenizer.encode(PROMPT + " and then it jumps over the quick brown fox again and again")
    assert len(ids) > 4 * cfg.index_topk
    ref = transformers_model(src)
    cache = eng.model.new_cache(256)
    got = eng.model.forward(Batch.build([(cache, ids)], "cpu"), all_logits=True)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), use_cache=True)
    assert (got - out.logits[0]).abs().max() < LOGIT_ATOL
    pool = cache.pool                 # the request's KV blocks: per token kind (layers, blocks, block size, *width)
    assert pool.layout.token_shapes == ((cfg.kv_lora_rank + cfg.qk_rope_head_dim,), (cfg.index_head_dim,))
    for layer in range(cfg.num_layers):
        ours = pool.tokens[1][layer][cache.blocks].reshape(-1, cfg.index_head_dim)[: len(ids)]
        theirs = out.past_key_values.layers[layer].indexer_keys[0]
        assert torch.allclose(ours, theirs, atol=1e-5), layer
    dense = Engine(conv, ctx=256, use_kernels=False)
    dense.model.cfg = dataclasses.replace(cfg, index_topk=10_000)
    full = dense.model.forward(Batch.build([(dense.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (full - got).abs().max() > 1e-2, "the indexer selected every key: the test would not see sparsity"
    eng.add_request("long", ids, SamplingParams(max_tokens=24, ignore_eos=True))
    gen = []
    while eng.has_work():
        gen += [t for _r, t, _f in eng.step()]
    assert max(greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)) <= GREEDY_GAP


# --- FP8 releases -------------------------------------------------------------------------------------------------

def _dequantized_checkpoint(src: Path, out: Path) -> Path:
    """The FP8 checkpoint's weights as the FP8 reader dequantizes them, rounded to bf16 (the router bias kept f32),
    written as a plain hub checkpoint: what transformers runs as the reference of the FP8 conversion."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    with open_source(src) as s:
        tensors = {n: s.read(n).to(torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16)
                   for n in s.tensor_names() if not n.endswith("_scale_inv")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" and f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("arch", ["minimax_m2", "deepseek_v32"])
def test_fp8_release_converts_and_runs_as_its_dequantized_weights(tmp_path_factory, arch):
    """MiniMax-M2's FP8 release (quantization_config fmt float8_e4m3fn, modules_to_not_convert) and V3.2's (scale_fmt
    ue8m0: power-of-two block scales) go through the FP8 reader; ktrun's logits and greedy tokens on the conversion
    equal transformers' on the dequantized weights."""
    src = build_checkpoint(shared_root(tmp_path_factory), arch, fp8=True)
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and all(qc[k] == v for k, v in FIXTURES[arch].fp8_config.items())
    with open_source(src) as s:
        fp8 = [n for n in s.tensor_names() if s.info(n).dtype == "F8_E4M3"]
        assert any(".experts." in n for n in fp8) and any("self_attn" in n for n in fp8)
        if arch == "deepseek_v32":
            assert any("indexer" in n for n in fp8)
            scale = torch.from_numpy(s.read_raw(fp8[0] + "_scale_inv"))
            assert torch.equal(scale.log2(), scale.log2().round())
    conv = converted(tmp_path_factory, arch, "bf16", fp8=True)
    ref = transformers_model(_dequantized_checkpoint(src, shared_root(tmp_path_factory) / f"deq_{arch}"))
    eng = Engine(conv, ctx=256, use_kernels=False)
    ids = eng.tokenizer.encode(PROMPT + " and then it jumps over the quick brown fox again")
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (got - reference_logits(ref, ids)).abs().max() < LOGIT_ATOL
    eng.add_request("fp8", ids, SamplingParams(max_tokens=16, ignore_eos=True))
    gen = []
    while eng.has_work():
        gen += [t for _r, t, _f in eng.step()]
    assert max(greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)) <= GREEDY_GAP


_NO = dataclasses.make_dataclass("NoFormat", [("kind", str, None)])()


def test_glm47_flash_fp8_block_release_follows_transformers(tmp_path_factory, tmp_path):
    """GLM-4.7-Flash's FP8 releases (W8A8 FP8 with 128x128 weight blocks, compressed-tensors as llm-compressor writes
    them, router and lm_head BF16), written here by the compressed-tensors library: every MLA projection (kv_b_proj
    included), the dense layer, the shared and routed experts read as FP8 blocks; converted to int8 experts and BF16
    GPU layers, ktrun's next-token distributions and greedy tokens follow transformers on the same checkpoint (with
    ktrun's routing choices, each difference from transformers' own a near-tie: tests/discrete_choices.py)."""
    src = compressed_tensors_checkpoint(build_checkpoint(shared_root(tmp_path_factory), "glm4_moe_lite"),
                                        tmp_path / "ct", "FP8_BLOCK")
    w = json.loads((src / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (w["type"], w["num_bits"], w["strategy"], w["block_structure"]) == ("float", 8, "block", [128, 128])
    with open_source(src) as s:
        fp8 = {n.rsplit(".", 2)[-2] for n in s.tensor_names() if (s.quant_format(n) or _NO).kind == "fp8"}
    assert {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
            "down_proj"} <= fp8, fp8
    r = _quantize(src, tmp_path / "out", "--method", "int8-amx", "--expert-quantizer", "rtn", "--gpu-method", "bf16",
                  "--no-keep-mtp")
    assert "experts: 48 dequantized and re-quantized to int8-amx" in r.stderr, r.stderr
    assert "skipped" in r.stderr and "multi-token-prediction layer" in r.stderr
    eng = Engine(tmp_path / "out", ctx=256, use_kernels=False)
    cfg, ids = eng.model.cfg, eng.tokenizer.encode(PROMPT)
    got, choices, gen, gen_choices = prompt_and_greedy_with_choices(eng, ids, 16)
    ref = transformers_model(src)
    for p in ref.parameters():            # decompressed in the scales' dtype: compute in float32 as ktrun does
        if p.is_floating_point():
            p.data = p.data.float()
    with force_transformers(ref, cfg, choices) as own:
        want = reference_logits(ref, ids)
    ties = compare(choices, own)
    ties.check(ROUTER_SCORE_BOUND)
    d = kl(want, got)
    print(f"GLM-4.7-Flash FP8: {ties}; KL mean {d.mean():.2e} max {d.max():.2e}")
    # measured: KL mean 1.1e-5, max 1.7e-5, router scores within 6e-4, no flip, greedy gaps 0 (the int8
    # re-quantization of FP8 experts; float32 both sides)
    assert d.mean() < 1e-4 and d.max() < 1e-3, f"KL mean {d.mean():.2e} max {d.max():.2e}"
    with force_transformers(ref, cfg, gen_choices) as own:
        gaps = greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)
    ties = compare(gen_choices, own)
    ties.check(ROUTER_SCORE_BOUND)
    print(f"GLM-4.7-Flash FP8 continuation: {ties}; greedy gap max {max(gaps):.3g}")
    assert max(gaps) <= 1e-2, gaps


# --- Kimi-K2.5 and Kimi-K2 ----------------------------------------------------------------------------------------

def test_kimi_k25_converts_its_language_model_and_says_the_vision_tower_is_skipped(tmp_path_factory, tmp_path):
    src = build_checkpoint(shared_root(tmp_path_factory), "kimi_k25")
    r = _quantize(src, tmp_path / "out", "--method", "int4-amx", "--gpu-method", "bf16", "--quiet")
    with open_source(src) as s:
        vision = [n for n in s.tensor_names() if n.startswith(("vision_tower.", "mm_projector.", "model.mm_"))]
    assert vision and f"skipped {len(vision)} tensors: vision tower and multimodal projector" in r.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    dense = {n for f in manifest["files"].values() for n in f.get("tensors", {}) if f["kind"] in ("dense", "globals")}
    assert dense and all(n.startswith("language_model.") for n in dense)
    assert manifest["model_type"] == "kimi_k25" and manifest["experts"]["moe_layers"] == [1, 2]
    out = subprocess.run([*KTRUN, "generate", str(tmp_path / "out"), "--chat", "--prompt", "北京在哪里？",
                          "--max-tokens", "6", "--ignore-eos", "--json"], capture_output=True, text=True,
                         timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    ref = KimiReferenceTokenizer(src)
    want = ref.apply_chat_template([{"role": "user", "content": "北京在哪里？"}], add_generation_prompt=True)
    assert res["prompt_token_ids"] == want and len(res["token_ids"]) == 6


def test_kimi_k2_with_its_tiktoken_tokenizer_is_served(tmp_path_factory):
    """Kimi-K2 (model_type kimi_k2: DeepSeek-V3's tensors and math) as the hub ships it, tiktoken.model and no
    tokenizer.json: converted, tokenized as tiktoken does, greedy tokens = transformers' argmax."""
    root = shared_root(tmp_path_factory) / "kimi_k2"
    src = root / "src"
    dims = {"vocab_size": KIMI_BASE_VOCAB + 272, "bos_token_id": KIMI_BASE_VOCAB, "eos_token_id": KIMI_BASE_VOCAB + 1,
            "n_group": 1, "topk_group": 1}
    if not (src / "config.json").exists():
        make_checkpoint("deepseek_v3", src, init_scale=INIT_SCALE, **dims)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (src / f).unlink()
        _write_kimi(src, 1024)
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(model_type="kimi_k2", auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
        (src / "config.json").write_text(json.dumps(cfg, indent=2))
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    tok = KimiReferenceTokenizer(src)
    text = "Kimi: 混合专家 🚀 def f(x): return x"
    ids = eng.tokenizer.encode(text)
    assert ids == tok.encode(text) and eng.model.cfg.model_type == "deepseek_v3"
    assert eng.tokenizer.eos_token_id == KIMI_BASE_VOCAB + 1
    # transformers has no kimi_k2 config class (the hub's points at remote code): its DeepSeek-V3 class with the
    # same weights, which the factory wrote bit for bit
    ref = make_model("deepseek_v3", init_scale=INIT_SCALE, **dims)
    eng.add_request("k2", ids, SamplingParams(max_tokens=16, ignore_eos=True))
    gen = []
    while eng.has_work():
        gen += [t for _r, t, _f in eng.step()]
    assert max(greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)) <= GREEDY_GAP


def _pull(repo: str, commit: str, files: dict[str, bytes], tmp_path: Path) -> tuple[Path, set[str]]:
    """`ktconvert pull repo` (a real subprocess) from a loopback fake hub serving `files` at `commit`
    -> (the local directory, the repo-relative paths it holds)."""
    hub = FakeHub(repos={repo: FakeRepo(repo, {commit: files}, {"main": commit})}).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "KTCONVERT"))}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), KTCONVERT_HOME=str(tmp_path / "kt"),
                   HF_HUB_DISABLE_TELEMETRY="1")
        r = subprocess.run([*KTCONVERT, "pull", repo], env=env, capture_output=True, text=True, timeout=120,
                           check=False)
        assert r.returncode == 0, r.stderr
    finally:
        hub.stop()
    local = Path(r.stdout.strip())
    return local, {p.relative_to(local).as_posix() for p in local.rglob("*")
                   if p.is_file() and ".ktconvert" not in str(p)}


def test_pull_takes_tiktoken_and_leaves_remote_code(ckpt_dir, tmp_path):
    """`ktconvert pull` of a Kimi-K2.5-shaped repo: weights, configs, tiktoken.model, tokenizer_config.json and the
    chat template come; the tokenizer's and model's Python code, docs and images do not; then it converts."""
    src = ckpt_dir("kimi_k25")
    files = {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}
    files["chat_template.jinja"] = json.loads(files["tokenizer_config.json"])["chat_template"].encode()
    remote = {"tokenization_kimi.py": b"import tiktoken\n", "modeling_kimi_k25.py": b"import torch\n",
              "configuration_kimi_k25.py": b"class C: pass\n", "kimi_k25_vision_processing.py": b"x = 1\n",
              "README.md": b"# Kimi-K2.5 tiny\n", "figures/kimi-logo.png": b"\x89PNG\r\n", "docs/deploy.md": b"# d\n"}
    repo, commit = "moonshotai/Kimi-K2.5-tiny", "b" * 40
    local, got = _pull(repo, commit, {**files, **remote}, tmp_path)
    assert got == set(files)
    assert "tiktoken.model" in got and not got & set(remote)
    _quantize(local, tmp_path / "conv", "--method", "int8-amx", "--gpu-method", "bf16", "--quiet")


def test_pull_takes_glm47_flash_shards_and_chat_template(ckpt_dir, tmp_path):
    """`ktconvert pull` of a GLM-4.7-Flash-shaped repo: safetensors shards (the MTP layer's tensors in their own
    shard) and their index, config.json, generation_config.json, tokenizer.json, tokenizer_config.json and the chat
    template as a chat_template.jinja file (as the GLM releases ship it, tokenizer_config.json without one) come;
    README, LICENSE, .gitattributes, images and a pickled copy do not. The pull converts (the MTP layer skipped and
    said so, chat_template.jinja kept) and ktrun renders chats with it as transformers does."""
    from ktrun.text.tokenizer import Tokenizer
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from ktconvert.testing.files import write_shards
    src = ckpt_dir("glm4_moe_lite")
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp = f"model.layers.{n_layers}."
    repo_dir = tmp_path / "repo"
    repo_dir.mkdir()
    main = {n: t for n, t in tensors.items() if not n.startswith(mtp)}
    write_shards({**main, **{n: t for n, t in tensors.items() if n.startswith(mtp)}}, repo_dir,
                 max_shard_bytes=sum(t.numel() * t.element_size() for t in main.values()))
    index = json.loads((repo_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) == 2 and {index[n] for n in tensors if n.startswith(mtp)} == {shards[-1]}
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    template = tok_cfg.pop("chat_template")
    files = {p.name: p.read_bytes() for p in sorted(repo_dir.iterdir())}
    files.update({"config.json": (src / "config.json").read_bytes(),
                  "generation_config.json": json.dumps({"eos_token_id": [0], "pad_token_id": 0}).encode(),
                  "tokenizer.json": (src / "tokenizer.json").read_bytes(),
                  "tokenizer_config.json": json.dumps(tok_cfg).encode(), "chat_template.jinja": template.encode()})
    extra = {"README.md": b"# GLM-4.7-Flash tiny\n", "LICENSE": b"MIT\n", ".gitattributes": b"*.safetensors lfs\n",
             "pytorch_model.bin": b"pickle", "resources/bench.png": b"\x89PNG\r\n"}
    repo, commit = "zai-org/GLM-4.7-Flash-tiny", "c" * 40
    local, got = _pull(repo, commit, {**files, **extra}, tmp_path)
    assert got == set(files)
    q = _quantize(local, tmp_path / "conv", "--method", "bf16", "--no-keep-mtp")
    n_mtp = sum(n.startswith(mtp) for n in tensors)
    assert f"skipped {n_mtp} tensors: multi-token-prediction layer" in q.stderr, q.stderr
    assert (tmp_path / "conv" / "chat_template.jinja").read_text() == template
    messages = [{"role": "user", "content": "What is MLA?"}]
    want = AutoTokenizer.from_pretrained(local).apply_chat_template(messages, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert Tokenizer(tmp_path / "conv").apply_chat_template(messages) == want


# --- inspect ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", NEW)
def test_inspect_reports_parameters_by_role(ckpt_dir, arch):
    src = ckpt_dir(arch)
    r = subprocess.run([*KTCONVERT, "inspect", str(src), "--gpu-mem", "1GB", "--cpu-mem", "1GB"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    with open_source(src) as s:
        a = s.arch
        by_role: dict[str, int] = {}
        for n in s.tensor_names():
            role = a.classify(n)
            if role.kind != "skip":
                by_role[role.kind] = by_role.get(role.kind, 0) + int(torch.Size(s.info(n).shape).numel())
    assert f"architecture: {arch}, {a.num_layers} layers, {len(a.moe_layers())} MoE layers, {a.n_experts} routed " \
           f"experts (top {a.top_k})" in r.stdout
    for kind, n in by_role.items():
        assert f"  {kind:<14} {n:>16,d}" in r.stdout, (kind, r.stdout)
    assert "router_bias" in by_role and ("shared_expert" in by_role) == (arch != "minimax_m2")
    assert ("not converted" in r.stdout or "MTP layer(s)" in r.stdout) == (arch != "minimax_m2")  # MTP / vision
    assert "GPU fits" in r.stdout and "CPU fits" in r.stdout


# --- config errors: the field is named, before any weight is read --------------------------------------------------

def _hub_config(ckpt_dir, arch: str) -> dict:
    return json.loads((ckpt_dir(arch) / "config.json").read_text())


@pytest.mark.parametrize("arch, change, field", [
    ("glm4_moe", {"n_routed_experts": None}, "'n_routed_experts'"),
    ("glm4_moe", {"n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
    ("glm4_moe", {"topk_group": 3}, "topk_group=3 must be in 1..n_group=2"),
    ("glm4_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ("glm4_moe", {"partial_rotary_factor": 0}, "'partial_rotary_factor' = 0"),
    ("glm4_moe", {"num_key_value_heads": 2}, "num_attention_heads=5 is not a multiple of num_key_value_heads=2"),
    ("minimax_m2", {"num_local_experts": None}, "'num_local_experts'"),
    ("minimax_m2", {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ("minimax_m2", {"shared_intermediate_size": 64}, "shared_intermediate_size=64"),
    ("minimax_m2", {"attn_type_list": [0, 1]}, "attn_type_list"),
    ("minimax_m2", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("minimax_m2", {"rotary_dim": 33}, "'rotary_dim' gives 33"),
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank is null"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk=0"),
    ("deepseek_v32", {"n_group": 8, "topk_group": 2}, "n_group=8 leaves fewer than 2"),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ("glm4_moe_lite", {"n_routed_experts": None}, "'n_routed_experts'"),
    ("glm4_moe_lite", {"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
    ("glm4_moe_lite", {"partial_rotary_factor": 0.5}, "'partial_rotary_factor' gives 8 rotary dims"),
    ("glm4_moe_lite", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ("kimi_k25", {"text_config": None}, "'text_config'"),
    ("kimi_k25", {"text_config": {"model_type": "qwen3_moe"}}, "text_config.model_type 'qwen3_moe'"),
    ("kimi_k25", {"text_config.num_experts_per_tok": 99}, "text_config: num_experts_per_tok=99"),
])
def test_config_errors_name_the_field(ckpt_dir, arch, change, field):
    raw = _hub_config(ckpt_dir, arch)
    for k, v in change.items():
        where = raw
        if "." in k:
            outer, k = k.split(".")
            where = raw[outer]
        if v is None:
            where.pop(k, None)
        else:
            where[k] = v
    if arch == "deepseek_v32" and "q_lora_rank" in change:
        raw["q_lora_rank"] = None          # null (not absent): the field is present and says "no q LoRA"
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("(", r"\(")):
        parse_config(raw)
    with pytest.raises(SourceError, match=field.replace("[", r"\[").replace("(", r"\(")):
        adapter_for(raw)


def test_bad_config_fails_the_cli_before_reading_weights(ckpt_dir, tmp_path):
    src = shutil.copytree(ckpt_dir("minimax_m2"), tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_local_experts"] = 6          # the checkpoint holds 8 experts per layer: config and router disagree
    (src / "config.json").write_text(json.dumps(cfg))
    for shard in src.glob("*.safetensors"):  # any weight read would now fail differently (zeroed data)
        raw = bytearray(shard.read_bytes())
        n = int.from_bytes(raw[:8], "little") + 8
        shard.write_bytes(bytes(raw[:n]) + b"\xff" * (len(raw) - n))
    r = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "expert 6 >= n_experts=6" in r.stderr and "block_sparse_moe.experts.6" in r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- GLM variants' attention options (release configs: tests/test_release_configs.py) -------------------------

def test_glm45_air_without_qk_norm_and_bias_matches_transformers(tmp_path_factory):
    """GLM-4.5-Air's attention: no q/k norm, no q/k/v bias (the fixture has both, as GLM-4.5 / 4.6)."""
    root = shared_root(tmp_path_factory) / "glm_air"
    src = make_checkpoint("glm4_moe", root / "src", init_scale=INIT_SCALE, use_qk_norm=False, attention_bias=False)
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    assert not eng.model.cfg.qk_norm and not eng.model.cfg.attention_bias
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (got - reference_logits(transformers_model(src), ids)).abs().max() < LOGIT_ATOL


def test_glm47_flash_with_attention_bias_matches_transformers(tmp_path_factory):
    """GLM-4.7-Flash with attention_bias (false in the release; transformers' option): q_a_proj, kv_a_proj_with_mqa
    and o_proj biases are converted in full precision and applied (the fixture has none)."""
    root = shared_root(tmp_path_factory) / "glm47_flash_bias"
    src = make_checkpoint("glm4_moe_lite", root / "src", init_scale=INIT_SCALE, attention_bias=True)
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    assert sum(".self_attn." in n and n.endswith(".bias") for n in eng.model.w) == 3 * eng.model.cfg.num_layers
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (got - reference_logits(transformers_model(src), ids)).abs().max() < LOGIT_ATOL


# --- Kimi-K2.5's release format: compressed-tensors int4 experts under language_model. ----------------------------

@pytest.mark.parametrize("nested", [False, True], ids=["top-level", "in-text_config"])
def test_kimi_k25_compressed_tensors_int4_release_is_taken_over_exactly(tmp_path_factory, tmp_path, nested):
    """Kimi-K2.5 (like K2-Thinking) ships its routed experts as compressed-tensors pack-quantized int4, group 32,
    the rest BF16, all under language_model.; the quantization_config may sit at the top level or in text_config.
    Written here by the compressed-tensors library itself (ktconvert.testing.quantized): --method auto takes the
    codes over exactly, the vision tower is skipped, and ktrun follows transformers on the same checkpoint
    (transformers decompresses with the library; its experts are ours rounded once to bf16)."""
    root = shared_root(tmp_path_factory) / "kimi_k25_ct"
    bf16 = root / "bf16"
    if not (bf16 / "config.json").exists():      # moe_intermediate_size 96: group 32 divides every expert K
        make_checkpoint("kimi_k25", bf16, init_scale=INIT_SCALE, moe_intermediate_size=96)
    src = compressed_tensors_checkpoint(bf16, tmp_path / "ct", "W4A16", group_size=32, targets=(EXPERTS_ONLY,))
    if nested:
        cfg = json.loads((src / "config.json").read_text())
        cfg["text_config"]["quantization_config"] = cfg.pop("quantization_config")
        (src / "config.json").write_text(json.dumps(cfg))
    r = _quantize(src, tmp_path / "out", "--method", "auto", "--gpu-method", "bf16")
    assert "--method auto: int4-amx --group-size 32 (exact target of compressed-tensors int4 g32)" in r.stderr
    assert "experts: 48 taken over exactly from compressed-tensors int4 g32" in r.stderr, r.stderr
    assert "skipped 23 tensors: vision tower and multimodal projector" in r.stderr
    eng = Engine(tmp_path / "out", ctx=256, use_kernels=False)
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    ref = transformers_model(src)
    for p in ref.parameters():               # decompressed in the scales' bf16: compute in float32 as ktrun does
        if p.is_floating_point():
            p.data = p.data.float()
    conv = ConvertedDir(tmp_path / "out")
    ours = conv.read_expert(1, 5)
    sd = ref.state_dict()
    conv.close()
    assert torch.equal(sd["model.language_model.layers.1.mlp.experts.down_proj"][5],
                       torch.from_numpy(ours["down"]).bfloat16().float())
    want = reference_logits(ref, ids)
    d = kl(want, got)
    assert d.mean() < 1e-4 and (got - want).abs().max() < 3e-2, f"KL mean {d.mean():.2e}, max |diff| " \
                                                               f"{(got - want).abs().max():.3g}"
    eng.add_request("k25", ids, SamplingParams(max_tokens=32, ignore_eos=True))
    gen = []
    while eng.has_work():
        gen += [t for _r, t, _f in eng.step()]
    gaps = greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)
    assert len(gen) == 32 and max(gaps) <= 3e-2, gaps
    eng.close()


def test_glm45_fp8_compressed_tensors_release_follows_transformers(tmp_path_factory, tmp_path):
    """GLM-4.5-FP8 / 4.6-FP8 ship compressed-tensors FP8 (e4m3) weights with one scale per output channel (FP8_DYNAMIC; the
    activation scheme does not concern a weight reader), router and lm_head left BF16; written here by the
    compressed-tensors library itself. Converted to int8 experts and BF16 GPU layers (FP8 is not an integer grid: the
    log says so), q/k/v biases kept: ktrun's next-token distributions follow transformers on the same checkpoint."""
    src = compressed_tensors_checkpoint(build_checkpoint(shared_root(tmp_path_factory), "glm4_moe"), tmp_path / "ct",
                                        "FP8_DYNAMIC")
    qc = json.loads((src / "config.json").read_text())["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert qc["quant_method"] == "compressed-tensors" and (w["type"], w["num_bits"], w["strategy"]) == \
        ("float", 8, "channel")
    r = _quantize(src, tmp_path / "out", "--method", "int8-amx", "--gpu-method", "bf16",
                  "--no-keep-mtp")
    assert "experts: 48 dequantized and re-quantized to int8-amx" in r.stderr and "not an integer grid" in r.stderr
    eng = Engine(tmp_path / "out", ctx=256, use_kernels=False)
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    eng.close()
    ref = transformers_model(src)
    for p in ref.parameters():
        if p.is_floating_point():
            p.data = p.data.float()
    d = kl(reference_logits(ref, ids), got)
    # measured: mean 2.6e-5, max 4.9e-5 (the int8 re-quantization of FP8 experts; attention in float32 both sides)
    assert d.mean() < 1e-4 and d.max() < 1e-3, f"KL mean {d.mean():.2e} max {d.max():.2e}"
