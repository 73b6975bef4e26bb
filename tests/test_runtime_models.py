"""ktrun against transformers (the independent reference) on tiny fixture checkpoints converted with bf16 experts
and bf16 GPU layers: same tokens, same logits, same greedy choices, and batching that never mixes requests."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.models.kv_cache import Batch
from ktrun.ops.library import kernels_available
from runtime_helpers import (
    PROMPT,
    build_checkpoint,
    converted,
    greedy_gaps,
    reference_logits,
    shared_root,
    transformers_model,
    transformers_tokenizer,
)

from ktconvert.testing import ARCHS  # every registered family (tests/test_families.py)

# Reference experts: both sides compute in float32 from identical bf16 weights (observed max |diff| ~3e-6).
# Kernel experts: the bf16 kernel rounds activations to bf16 before vdpbf16ps (observed max |diff| ~6e-3).
LOGIT_ATOL = {"reference": 1e-4, "kernels": 3e-2}
GREEDY_GAP = {"reference": 1e-3, "kernels": 3e-2}   # our token's logit may trail transformers' argmax by this
BACKENDS = ["reference", pytest.param("kernels", marks=pytest.mark.skipif(
    not kernels_available(), reason="libktkernels / runtime/ops/moe.py not available on this machine"))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = {}

    def get(arch, backend="reference"):
        if (arch, backend) not in cache:
            src = build_checkpoint(shared_root(tmp_path_factory), arch)
            conv = converted(tmp_path_factory, arch, "bf16")
            if arch not in cache:
                cache[arch] = (transformers_model(src), transformers_tokenizer(src))
            eng = Engine(conv, ctx=256, max_batch=4, use_kernels=backend == "kernels")
            cache[arch, backend] = (src, eng, *cache[arch])
        return cache[arch, backend]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenization_matches_transformers(setup, arch):
    _src, eng, _ref, hf_tok = setup(arch)
    for text in (PROMPT, "", "  leading spaces and\nnewlines\t", "ünïcødé ✓ 123"):
        assert eng.tokenizer.encode(text) == hf_tok(text).input_ids, text
    assert eng.tokenizer.encode(PROMPT)[0] == hf_tok.bos_token_id or hf_tok.bos_token_id is None
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert eng.tokenizer.render_chat(msgs) == hf_tok.apply_chat_template(msgs, tokenize=False,
                                                                         add_generation_prompt=True)
    ref_ids = hf_tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert eng.tokenizer.apply_chat_template(msgs) == list(ref_ids)
    out_ids = eng.tokenizer.encode(PROMPT)
    assert eng.tokenizer.decode(out_ids) == hf_tok.decode(out_ids, skip_special_tokens=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_transformers(setup, arch, backend):
    _src, eng, ref, _tok = setup(arch, backend)
    ids = eng.tokenizer.encode(PROMPT)
    want = reference_logits(ref, ids)
    cache = eng.model.new_cache(256)
    # prefill in two chunks: the second reads the first's compressed/KV cache
    got = torch.cat([eng.model.forward(Batch.build([(cache, ids[:5])], "cpu"), all_logits=True),
                     eng.model.forward(Batch.build([(cache, ids[5:])], "cpu"), all_logits=True)])
    diff = (got - want).abs().max().item()
    assert diff < LOGIT_ATOL[backend], f"{arch} {backend}: max |logit diff| {diff:.3g} (logit scale {want.abs().max():.3g})"


def _run(eng: Engine, prompts: dict[str, list[int]], n: int, stagger: bool = False) -> dict[str, list[int]]:
    out = {k: [] for k in prompts}
    pending = list(prompts.items())
    if not stagger:
        for k, ids in pending:
            eng.add_request(k, ids, SamplingParams(max_tokens=n, ignore_eos=True))
        pending = []
    while eng.has_work() or pending:
        if pending:   # one new request joins per step, while the others are mid-decode
            k, ids = pending.pop(0)
            eng.add_request(k, ids, SamplingParams(max_tokens=n, ignore_eos=True))
        for rid, tok, _fin in eng.step():
            out[rid].append(tok)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_are_transformers_argmax(setup, arch, backend):
    _src, eng, ref, _tok = setup(arch, backend)
    ids = eng.tokenizer.encode(PROMPT)
    gen = _run(eng, {"a": ids}, 32)["a"]
    assert len(gen) == 32
    gaps = greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)
    assert max(gaps) <= GREEDY_GAP[backend], f"{arch} {backend}: per-position logit gaps {gaps}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "longcat_flash",
                                  "kimi_linear"])
def test_batched_decode_equals_running_alone(setup, arch, backend):
    _src, eng, _ref, _tok = setup(arch, backend)
    prompts = {"short": eng.tokenizer.encode("fox"), "long": eng.tokenizer.encode(PROMPT + " " + PROMPT),
               "mid": eng.tokenizer.encode("lazy dogs jump")}
    alone = {k: _run(eng, {k: v}, 12)[k] for k, v in prompts.items()}
    assert _run(eng, prompts, 12) == alone
    assert _run(eng, prompts, 12, stagger=True) == alone


def test_finish_reasons_and_abort(setup):
    _src, eng, _ref, _tok = setup("deepseek_v3")
    ids = eng.tokenizer.encode(PROMPT)
    eng.add_request("len", ids, SamplingParams(max_tokens=3, ignore_eos=True))
    # a prompt sharing no leading KV block with "len": with the prefix cache, a request whose next block another
    # request of the step computes waits a step (Engine._match_prefixes), and "gone" must start in the first step
    eng.add_request("gone", eng.tokenizer.encode("other words first. " + PROMPT),
                    SamplingParams(max_tokens=50, ignore_eos=True))
    steps = [eng.step()]
    eng.abort("gone")
    while eng.has_work():
        steps.append(eng.step())
    flat = [t for s in steps for t in s]
    assert [f for r, _t, f in flat if r == "len"] == [None, None, "length"]
    assert [r for r, _t, _f in flat].count("gone") == 1
    # EOS ends with "stop" unless ignore_eos: force it by making EOS the only allowed continuation
    first = _run(eng, {"x": ids}, 1)["x"][0]
    eng.eos_ids.add(first)
    try:
        eng.add_request("eos", ids, SamplingParams(max_tokens=5))
        assert eng.step() == [("eos", first, "stop")]
    finally:
        eng.eos_ids.discard(first)
    # a stop string ends the request ("stop") at the first token whose text completes it
    gen = _run(eng, {"g": ids}, 8)["g"]
    stop = eng.tokenizer.decode(gen[:5])[-2:]
    first = next(j for j in range(8) if stop in eng.tokenizer.decode(gen[: j + 1]))
    eng.add_request("st", ids, SamplingParams(max_tokens=8, stop=[stop], ignore_eos=True))
    out = []
    while eng.has_work():
        out += eng.step()
    assert [t for _r, t, _f in out] == gen[: first + 1] and out[-1][2] == "stop"
    with pytest.raises(ValueError, match="context limit"):
        eng.add_request("big", list(range(1, 100)) * 3, SamplingParams())


def test_seeded_sampling_is_reproducible(setup):
    _src, eng, _ref, _tok = setup("deepseek_v3")
    ids = eng.tokenizer.encode(PROMPT)

    def sample(seed):
        eng.add_request("s", ids, SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=seed,
                                                 ignore_eos=True))
        out = []
        while eng.has_work():
            out += [t for _r, t, _f in eng.step()]
        return out

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)          # 12 draws at temperature 1.5: a collision would be a broken seed


def test_long_prompt_prefilled_in_chunks(setup):
    """Prompts longer than the engine's one-forward budget are prefilled in chunks; same tokens as transformers."""
    from ktrun.engine import PREFILL_BATCH_TOKENS
    _src, eng, ref, _tok = setup("deepseek_v3")
    ids = [eng.tokenizer.bos_token_id] + torch.randint(3, 300, (PREFILL_BATCH_TOKENS + 40,),
                                                       generator=torch.Generator().manual_seed(1)).tolist()
    big = Engine(eng.model_dir, ctx=1024, max_batch=2, use_kernels=False)
    big.add_request("long", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    gen = []
    while big.has_work():
        gen += [t for _r, t, _f in big.step()]
    assert max(greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)) <= GREEDY_GAP["reference"]


def test_deepseek_v3_yarn_rope_matches_transformers(tmp_path_factory):
    """YaRN as the hub ships it (rope_scaling with factor, mscale != mscale_all_dim) on positions past the original
    context: interpolated frequencies, cos/sin attention factor and the softmax mscale^2 all as transformers."""
    from runtime_helpers import INIT_SCALE, build_conversion

    from ktconvert.testing import make_checkpoint
    root = shared_root(tmp_path_factory) / "yarn"
    src = make_checkpoint("deepseek_v3", root / "src", init_scale=INIT_SCALE, max_position_embeddings=640,
                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                           "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                           "mscale": 0.707, "mscale_all_dim": 1.0})
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    assert eng.model.cfg.rope.kind == "yarn" and eng.model.rope.attn_factor != 1.0
    ids = eng.tokenizer.encode(PROMPT + " " + PROMPT)           # ~20 tokens: past the original 16 positions
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    want = reference_logits(transformers_model(src), ids)
    assert (got - want).abs().max() < LOGIT_ATOL["reference"]


def test_mixtral_sliding_window_matches_transformers(tmp_path_factory):
    """A sliding window shorter than the prompt, in prefill and in decode steps past it."""
    from runtime_helpers import INIT_SCALE, build_conversion

    from ktconvert.testing import make_checkpoint
    root = shared_root(tmp_path_factory) / "window"
    src = make_checkpoint("mixtral", root / "src", init_scale=INIT_SCALE, sliding_window=6)
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    assert eng.model.cfg.sliding_window == 6
    ids = eng.tokenizer.encode(PROMPT)
    ref = transformers_model(src)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (got - reference_logits(ref, ids)).abs().max() < LOGIT_ATOL["reference"]
    gen = _run(eng, {"w": ids}, 8)["w"]
    assert max(greedy_gaps(reference_logits(ref, ids + gen), len(ids), gen)) <= GREEDY_GAP["reference"]


def test_qwen3_moe_mlp_only_layers_matches_transformers(tmp_path_factory):
    """mlp_only_layers: layer 0 is a dense MLP, layer 1 MoE."""
    from runtime_helpers import INIT_SCALE, build_conversion

    from ktconvert.testing import make_checkpoint
    root = shared_root(tmp_path_factory) / "mlp_only"
    src = make_checkpoint("qwen3_moe", root / "src", init_scale=INIT_SCALE, mlp_only_layers=[0])
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    assert eng.model.cfg.moe_layers == (1,)
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (got - reference_logits(transformers_model(src), ids)).abs().max() < LOGIT_ATOL["reference"]


def test_deepseek_v2_group_limited_greedy_with_q_lora_matches_transformers(tmp_path_factory):
    """DeepSeek-V2 (full, not Lite): q_lora_rank set, group_limited_greedy routing, routed_scaling_factor."""
    from runtime_helpers import INIT_SCALE, build_conversion

    from ktconvert.testing import make_checkpoint
    root = shared_root(tmp_path_factory) / "v2_groups"
    src = make_checkpoint("deepseek_v2", root / "src", init_scale=INIT_SCALE, topk_method="group_limited_greedy",
                          n_group=4, topk_group=2, q_lora_rank=48, routed_scaling_factor=1.7)
    eng = Engine(build_conversion(src, root / "conv"), ctx=256, use_kernels=False)
    assert eng.model.cfg.topk_method == "group_limited_greedy" and eng.model.cfg.q_lora_rank == 48
    ids = eng.tokenizer.encode(PROMPT)
    got = eng.model.forward(Batch.build([(eng.model.new_cache(256), ids)], "cpu"), all_logits=True)
    assert (got - reference_logits(transformers_model(src), ids)).abs().max() < LOGIT_ATOL["reference"]
