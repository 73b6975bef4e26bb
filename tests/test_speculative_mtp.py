"""Speculative decoding with drafts from the checkpoint's MTP layer (`--speculative mtp`, ktrun.mtp).

- The MTP block's forward (eh_proj over [enorm(embed(next token)), hnorm(h)], its decoder layer, shared_head) equals
  a reference built independently of ktrun: transformers' own decoder layer class loaded with the hub's layer-L
  tensors (transformers has no MTP forward), the rest in plain torch from the hub tensors.
- Greedy output is token-for-token the output without speculation, on every fixture family with an MTP layer:
  generate() with 1 and 3 drafts, and the batched Engine (prefix-cache hits: positions the block never saw, n = 2:
  forked caches). The fixtures' MTP layers are random, so each checkpoint's MTP layer is first made an "echo" of the
  main head (eh_proj = [0 | I], shared_head = the main norm and lm_head): it then drafts the main model's own last
  prediction again, which repeated output accepts, so drafts are accepted and rejected (rollbacks) in every run.
- Sampled output keeps its distribution: 768 seeded samples with and without MTP drafts, token frequencies at the
  2nd and 3rd generated position (a two-sample chi-square test; total variation below 0.2: the fixture's third
  token spreads over ~50 values, where two 768-sample histograms differ by ~0.14 from sampling alone).
- `ktrun generate --speculative mtp` (a real subprocess) prints the tokens of plain decoding, `ktrun bench` times it
  beside plain decoding (the same greedy tokens, the acceptance rate), and a conversion
  without MTP layers is refused naming the directory and the flags; `ktrun serve --speculative mtp` answers with the
  same text as without (openai client: completion, streamed completion, chat) and counts its drafts.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.generate import generate
from ktrun.loaded_model import load_model
from ktrun.speculative import SpeculativeConfig
from runtime_helpers import KTRUN, PROMPT, build_checkpoint, build_conversion, shared_root, transformers_model
from safetensors.torch import load_file, save_file
from serve_helpers import metric
from test_speculative import assert_same_law, run_engine, sampled_tokens, serve_texts

from ktconvert.testing import FIXTURES

MTP_ARCHS = [a for a, f in FIXTURES.items() if f.mtp]
PROMPTS = [" ".join([PROMPT] * 2), "fox dog fox dog fox", "lazy"]


def hub_tensors(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def echo_checkpoint(src: Path, out: Path) -> Path:
    """src with its MTP layer's eh_proj = [0 | I], shared_head = the main model's final norm and lm_head, and
    embed_tokens = the main one (so the conversion writes neither copy and the drafter uses the main tensors)."""
    if (out / "config.json").exists():
        return out
    shutil.copytree(src, out)
    L, H = (json.loads((src / "config.json").read_text())[k] for k in ("num_hidden_layers", "hidden_size"))
    t = hub_tensors(src)
    p = f"model.layers.{L}."
    new = {p + "eh_proj.weight": torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1),
           p + "shared_head.head.weight": t["lm_head.weight"], p + "shared_head.norm.weight": t["model.norm.weight"],
           p + "embed_tokens.weight": t["model.embed_tokens.weight"]}    # as DeepSeek-V3's release repeats them
    new = {k: v.clone() for k, v in new.items()}                    # safetensors refuses shared storage
    for f in sorted(out.glob("*.safetensors")):
        shard = load_file(f)
        if any(k in new for k in shard):
            save_file({k: new[k].to(v.dtype) if k in new else v for k, v in shard.items()}, f,
                      metadata={"format": "pt"})
    return out


def echo_conversion(tmp_path_factory, arch: str) -> Path:
    root = shared_root(tmp_path_factory)
    src = echo_checkpoint(build_checkpoint(root, arch), root / f"echo_{arch}")
    return build_conversion(src, root / f"conv_echo_{arch}", "int4-amx", gpu_method="rtn-int4")


# -- the MTP block against a reference --------------------------------------------------------------------------------
def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_mtp_block_follows_the_reference(arch, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM
    root = shared_root(tmp_path_factory)
    src = build_checkpoint(root, arch)
    conv = build_conversion(src, root / f"conv_mtp_ref_{arch}", "bf16", gpu_method="bf16")
    raw = json.loads((src / "config.json").read_text())
    L, eps = raw["num_hidden_layers"], raw.get("rms_norm_eps", 1e-6)
    hub = hub_tensors(src)
    p = f"model.layers.{L}."
    main = transformers_model(src)
    deeper = AutoModelForCausalLM.from_pretrained(src, config=AutoConfig.from_pretrained(src, num_hidden_layers=L + 1),
                                                  dtype=torch.float32).eval()   # loads layer L from the hub tensors
    with load_model(conv, use_kernels=False, mtp=True) as lm, torch.inference_mode():
        ids = lm.tokenizer.encode(PROMPT)
        h = main.model(torch.tensor([ids])).last_hidden_state[0]          # (T, H) after the final norm
        nxt, rows = ids[1:], h[:-1]                                         # position i: token i+1 and h_i
        n = len(nxt)
        e = hub.get(p + "embed_tokens.weight", hub["model.embed_tokens.weight"]).float()[nxt]
        u = torch.cat([rms(e, hub[p + "enorm.weight"], eps), rms(rows, hub[p + "hnorm.weight"], eps)], -1)
        u = u @ hub[p + "eh_proj.weight"].float().T
        pos = torch.arange(n)[None]
        mask = torch.full((1, 1, n, n), float("-inf")).triu(1)
        x_ref = deeper.model.layers[L](u[None], attention_mask=mask, position_ids=pos,
                                       position_embeddings=deeper.model.rotary_emb(u[None], pos))
        x_ref = (x_ref[0] if isinstance(x_ref, tuple) else x_ref)[0]
        logits_ref = rms(x_ref, hub[p + "shared_head.norm.weight"], eps) @ hub[p + "shared_head.head.weight"].float().T
        logits, x = lm.mtp.forward(lm.mtp.block.new_cache(64), nxt, rows)
    assert (x - x_ref).abs().max() < 1e-4
    assert (logits - logits_ref[-1]).abs().max() < 1e-4


def test_mtp_draft_in_one_call_has_the_python_steps_bits(default_converted, monkeypatch):
    """MtpHead.forward_batch on a few rows runs enorm / hnorm, eh_proj, the block's layer and the head on each request's
    last row in the block's one kt_decode_layers call (ABI 26, step_one_call.mtp_step): the same logits and output rows,
    bit for bit, as its own steps (one_call None), for two requests' last catch-up rows (after prompts of held-out
    code, where the default model's MTP layer takes its one-call attention) and their chained 1-row drafts."""
    import ktrun.models.step_one_call as soc
    from ktrun.generate import prefill

    import ktconvert
    code = (Path(ktconvert.__file__).parent / "data" / "default_model" / "heldout_eval.txt").read_text()
    taken = []
    real = soc.mtp_step
    monkeypatch.setattr(soc, "mtp_step", lambda *a: taken.append(real(*a)) or taken[-1])
    with load_model(default_converted, mtp=True) as lm, torch.inference_mode():
        head, m = lm.mtp, lm.model
        fields = head.one_call
        assert fields is not None                     # rtn-int4 eh_proj on the kernels: the call takes it
        mains = []
        for text in (code[1000:1400], code[5000:5500]):
            ids = lm.tokenizer.encode(text)
            c = m.new_cache(512)
            nxt = int(prefill(m, c, ids).argmax())
            mains.append((c, ids[1:] + [nxt], c.hidden[-1][1].clone()))   # token i + 1 and h_i at position i
        runs = {}
        for mode in ("steps", "call", "steps", "call"):
            head.one_call = None if mode == "steps" else fields
            caches = [head.block.new_cache(512) for _ in mains]
            head.forward_batch([(bc, ids[:-3], h[:-3]) for bc, (_, ids, h) in zip(caches, mains)])   # the prompts
            logits, xs = head.forward_batch([(bc, ids[-3:], h[-3:]) for bc, (_, ids, h) in zip(caches, mains)])
            d = [int(r.argmax()) for r in logits]
            logits2, xs2 = head.forward_batch([(bc, [t], x[-1:]) for bc, t, x in zip(caches, d, xs)])   # chained
            runs.setdefault(mode, []).append([logits, *xs, logits2, *xs2])
            for bc in caches:
                bc.release()
        head.one_call = fields
        for c, _, _ in mains:
            c.release()
    # each "call" forward of a few rows took the one call (the prompts' rows are more than a plan takes)
    assert [t is not None for t in taken] == [False, True, True] * 2
    for steps, call in zip(runs["steps"], runs["call"]):
        assert all(torch.equal(a, b) for a, b in zip(steps, call))
    assert all(torch.equal(a, b) for a, b in zip(runs["steps"][0], runs["steps"][1]))


# -- greedy: the same tokens -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_greedy_identical_with_mtp_drafts(arch, tmp_path_factory):
    conv = echo_conversion(tmp_path_factory, arch)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with load_model(conv, mtp=True) as lm:
        assert lm.mtp.head is lm.model.lm_head and lm.mtp.embed is lm.model.w[lm.model.names.embed]
        drafted = accepted = 0
        for prompt in PROMPTS:
            ids = lm.tokenizer.encode(prompt)
            want = generate(lm.model, ids, params, 256, set()).tokens
            for k in (1, 3):
                out = generate(lm.model, ids, params, 256, set(), speculative=SpeculativeConfig("mtp", k, policy="fixed").with_mtp(
                    lm.mtp))
                assert out.tokens == want, (prompt, k)
                assert out.steps == len(want) - out.accepted          # every accepted draft saved a forward
                drafted, accepted = drafted + out.drafted, accepted + out.accepted
        assert 0 < accepted < drafted                                 # accepted and rejected drafts
        assert lm.model.kv_pool.used == 0 and lm.mtp.block.kv_pool.used == 0   # every block went back


def test_engine_greedy_identical_with_mtp_drafts(tmp_path_factory):
    """Batched requests (drafted together: one batched MTP forward per draft position), a shared prompt prefix (the
    second run starts from cached blocks, which the MTP block never ran: its cache starts after them) and n = 2
    choices (forked caches, each with its own MTP drafter)."""
    conv = echo_conversion(tmp_path_factory, "deepseek_v3")
    plain = Engine(conv, ctx=256, max_batch=6, prefix_cache=False)
    spec = Engine(conv, ctx=256, max_batch=6, speculative=SpeculativeConfig("mtp", 2, policy="fixed"), kv_block_size=4)
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        reqs = {f"r{i}": (plain.tokenizer.encode(p), params) for i, p in enumerate(PROMPTS)}
        want = run_engine(plain, reqs)
        for _ in range(2):
            assert run_engine(spec, reqs) == want
        assert spec.prefix_cache.stats()["hit_tokens"] > 0
        assert 0 < spec.stats["spec_accepted_tokens"] < spec.stats["spec_draft_tokens"]
        # the running requests draft together: one MTP forward per draft position per step, not one per request
        assert spec.loaded.mtp.block.timing["forwards"] <= 2 * spec.stats["decode_steps"]
        two = SamplingParams(max_tokens=16, ignore_eos=True, n=2)
        ids = plain.tokenizer.encode(PROMPTS[1])
        spec.add_request("n2", ids, two)
        got = {0: [], 1: []}
        while spec.has_work():
            for out in spec.step():
                got[out.index].append(out[1])
        base = generate(plain.model, ids, SamplingParams(max_tokens=16, ignore_eos=True), 256, set()).tokens
        assert got[0] == got[1] == base
    finally:
        plain.close()
        spec.close()


def test_sampled_distribution_unchanged_with_mtp_drafts(tmp_path_factory):
    conv = echo_conversion(tmp_path_factory, "deepseek_v3")
    plain = Engine(conv, ctx=256, max_batch=64, prefix_cache=False)
    spec = Engine(conv, ctx=256, max_batch=64, prefix_cache=False, speculative=SpeculativeConfig("mtp", 2, policy="fixed"))
    try:
        ids = plain.tokenizer.encode(PROMPTS[1])
        a = sampled_tokens(plain, ids, range(12), 64)
        b = sampled_tokens(spec, ids, range(12), 64)
        assert 0 < spec.stats["spec_accepted_tokens"] < spec.stats["spec_draft_tokens"]
        assert_same_law(a, b, tv_max=0.2)      # ~50 values at position 3: ~0.14 from sampling alone
    finally:
        plain.close()
        spec.close()


# -- the command line ------------------------------------------------------------------------------------------------
def ktrun_generate(conv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KTRUN, "generate", str(conv), "--prompt", PROMPTS[1], "--max-tokens", "24",
                           "--ignore-eos", "--json", *args], capture_output=True, text=True, timeout=300, check=False)


def test_ktrun_generate_speculative_mtp(tmp_path_factory, tmp_path):
    conv = echo_conversion(tmp_path_factory, "deepseek_v3")
    plain = ktrun_generate(conv)
    spec = ktrun_generate(conv, "--speculative", "mtp", "--draft-tokens", "3", "--draft-policy", "fixed")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["token_ids"] == b["token_ids"] and 0 <= b["accepted_tokens"] <= b["draft_tokens"] and b["draft_tokens"]
    bench = subprocess.run([*KTRUN, "bench", str(conv), "--pp", "16", "--tg", "16", "--reps", "1", "--speculative",
                            "mtp", "--draft-tokens", "2", "--draft-policy", "fixed"], capture_output=True, text=True, timeout=300, check=False)
    assert bench.returncode == 0, bench.stderr
    assert "spec_greedy_tokens_identical: True" in bench.stdout and "spec_acceptance_rate: " in bench.stdout
    no_mtp = build_conversion(build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3"), tmp_path / "no_mtp",
                              "bf16", keep_mtp=False)
    r = ktrun_generate(no_mtp, "--speculative", "mtp")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert str(no_mtp) in r.stderr and "--speculative mtp" in r.stderr and "--no-keep-mtp" in r.stderr, r.stderr


def test_served_text_same_with_mtp_drafts(tmp_path_factory):
    conv = echo_conversion(tmp_path_factory, "deepseek_v3")
    prompt = " ".join([PROMPT] * 2)
    want, s = serve_texts(conv, [], prompt)
    assert s.stop() == 0, s.stderr
    got, s = serve_texts(conv, ["--speculative", "mtp", "--draft-tokens", "2", "--draft-policy", "fixed"], prompt)
    try:
        assert got == want and got[0] == got[1]
        assert s.timings.get("draft_n", 0) > 0 and 0 <= s.timings["draft_n_accepted"] <= s.timings["draft_n"]
        assert metric(s, "ktrun_engine_spec_draft_tokens") > 0
    finally:
        assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr
