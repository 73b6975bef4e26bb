"""Speculative decoding with n-gram drafts (ktrun.speculative) in the one decode loop.

- Greedy output is token-for-token the output without speculation: `generate()` and the batching Engine, on the
  default model and on fixture families of every cache kind (MLA: DeepSeek-V3; GQA: Qwen3-MoE; sliding window +
  sinks: gpt-oss; a DeltaNet recurrent state rolled back through its recorded per-position states: Qwen3-Next),
  alone, batched with other requests, and with the prefix cache; the runs draft, accept and reject tokens (so the
  cache is rolled back), and the KV blocks all go back to the pool.
- Sampled output keeps its distribution: the acceptance rule against a known distribution (chi-square over 60000
  draws), and end to end on the default model (token frequencies at the 2nd and 3rd generated position over 768
  seeds with and without speculation: a two-sample chi-square test, and total variation below 0.1).
- `ktrun serve --speculative ngram` answers with the same text as without (openai client, streamed and not), and
  reports the draft counts in its timings and /metrics.
"""
from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import openai
import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.generate import decode_one_token, generate, prefill
from ktrun.sampling import Sampler
from ktrun.speculative import NgramDrafter, SpeculativeConfig
from runtime_helpers import PROMPT, converted
from scipy import stats
from serve_helpers import ServerProcess, metric

BIN = Path(__import__("sys").executable).parent
NGRAM = SpeculativeConfig("ngram", 4, policy="fixed")   # every step drafts: the rollbacks are tested
# a file edited in place: the model's context repeats, so drafts come from it
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\n")
EDIT = CODE + "# the same, renamed\n" + CODE.replace("width", "w")[:60]


# -- the drafter and the acceptance rule ----------------------------------------------------------------------------
def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2], max_ngram=3, min_ngram=2)
    assert d.propose(3) == [3, 4, 5]            # suffix (1, 2) occurred at the start
    d.extend([3])                               # suffix (1, 2, 3): the 3-gram before (2, 3)'s later match
    assert d.propose(3) == [4, 5, 9]
    assert NgramDrafter([2, 3, 7, 2, 3, 8, 9, 2, 3]).propose(3) == [8, 9, 2]    # the latest occurrence wins
    assert d.propose(0) == []
    assert NgramDrafter([5, 6, 7]).propose(4) == []          # no earlier occurrence of the suffix
    assert NgramDrafter([5, 6, 5, 6]).propose(4) == [5, 6]   # the continuation stops at the context's end


def test_config_is_checked():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="MTP layer loaded"):      # mtp drafts need the model's MTP head
        SpeculativeConfig("mtp").drafter([1])
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculativeConfig("ngram", 0)
    assert SpeculativeConfig().drafter([1]) is None


@pytest.mark.parametrize("draft", [0, 3])
def test_acceptance_rule_keeps_the_distribution(draft):
    """Accept the draft with probability p(draft), else sample p without it: P(x) = p(x). Draft 0 is the likeliest
    token (mostly accepted), draft 3 a rare one (mostly rejected)."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -30.0])
    params = SamplingParams(temperature=0.9, top_k=5, seed=3)
    p = torch.softmax(logits[:5].double() / 0.9, -1)         # top_k=5 drops the last token
    s = Sampler(params, [1])
    n = 60000
    counts = Counter(s.sample_or_accept(logits, [], draft)[0] for _ in range(n))
    assert counts[5] == 0
    obs = [counts[i] for i in range(5)]
    chi2 = stats.chisquare(obs, (p * n).tolist())
    assert chi2.pvalue > 1e-3, (obs, (p * n).tolist())
    greedy = Sampler(SamplingParams(), [1])
    assert greedy.sample_or_accept(logits, [], 0)[:2] == (0, True)
    assert greedy.sample_or_accept(logits, [], 2)[:2] == (0, False)


# -- greedy: the same tokens -----------------------------------------------------------------------------------------
def run_engine(eng: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    out = {k: [] for k in requests}
    for k, (ids, params) in requests.items():
        eng.add_request(k, ids, params)
    while eng.has_work():
        for rid, tok, _ in eng.step():
            out[rid].append(tok)
    return out


# A batched forward rounds differently from one request's (the float GEMMs see other row counts): greedy tokens of the
# batched Engine may leave generate()'s only where generate()'s own top two logits are this close (Kimi-Linear on the
# Intel AMX server, 2026-12-05: 4.4e-4 at the 9th token, the same before and after that session's work).
BATCH_TIE = 2e-3


def assert_greedy_or_near_tie(model, got: dict[str, list[int]], want: dict[str, list[int]],
                              requests: dict[str, tuple[list[int], SamplingParams]]) -> None:
    """got == want, or each request's first differing token is a near-tie of one request's own logits there: the
    logits generate() chose by, recomputed its way (the prompt's prefill, then one decode row per token). A prefill
    of the prompt and the tokens together rounds differently again: on an AMD Zen 3 (AVX2) it put Kimi-Linear's
    two candidates 4.2e-4 the other way round."""
    for k, w in want.items():
        g = got[k]
        if g == w:
            continue
        i = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        assert i < min(len(g), len(w)), f"{k}: {len(g)} tokens, generate() gave {len(w)}"
        cache = model.new_cache(256)
        try:
            logits = prefill(model, cache, requests[k][0])
            for tok in w[:i]:
                logits = decode_one_token(model, cache, tok)
            logits = logits.float()
        finally:
            cache.release()
        gap = (logits[w[i]] - logits[g[i]]).item()
        assert 0 <= gap <= BATCH_TIE, f"{k}: token {i} is {g[i]}, generate() chose {w[i]} by a logit gap of {gap:.2e}"


def check_greedy_identical(model_dir: Path, prompts: list[str], max_tokens: int = 40, expect_accepted: bool = True
                           ) -> tuple[int, int]:
    """generate() and the Engine (batched, with the prefix cache, twice so the second run reuses cached blocks) with
    n-gram drafts give the tokens of plain greedy decoding (the batched Engine's leave them only at a near-tie,
    BATCH_TIE); -> (drafted, accepted) of the generate() runs.
    expect_accepted=False: the model's text repeats no n-gram, so every draft is rejected (and rolled back)."""
    plain = Engine(model_dir, ctx=256, max_batch=len(prompts), prefix_cache=False)
    spec = Engine(model_dir, ctx=256, max_batch=len(prompts), speculative=NGRAM)
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        reqs = {f"r{i}": (plain.tokenizer.encode(p), params) for i, p in enumerate(prompts)}
        want = {k: generate(plain.model, ids, params, 256, set()).tokens for k, (ids, _) in reqs.items()}
        drafted = accepted = 0
        for k, (ids, _) in reqs.items():
            out = generate(spec.model, ids, params, 256, set(), speculative=NGRAM)
            assert out.tokens == want[k], k
            drafted, accepted = drafted + out.drafted, accepted + out.accepted
            assert out.steps == max_tokens - out.accepted        # every accepted draft saved a forward
        assert spec.model.kv_pool.used == 0                       # rolled-back blocks went back to the pool
        assert_greedy_or_near_tie(plain.model, run_engine(plain, reqs), want, reqs)
        for _ in range(2):                                        # the second run starts from cached blocks
            assert_greedy_or_near_tie(spec.model, run_engine(spec, reqs), want, reqs)
        assert spec.prefix_cache.stats()["hit_tokens"] > 0
        assert spec.stats["spec_draft_tokens"] > 0 and (spec.stats["spec_accepted_tokens"] > 0 or not expect_accepted)
        assert spec.stats["spec_acceptance_rate"] == spec.stats["spec_accepted_tokens"] / spec.stats[
            "spec_draft_tokens"]
        return drafted, accepted
    finally:
        plain.close()
        spec.close()


def test_default_model_greedy_identical(default_converted):
    drafted, accepted = check_greedy_identical(default_converted, [EDIT, CODE[:50], "import os\nimport sys\n"])
    assert 0 < accepted < drafted                                 # accepted and rejected drafts (rollbacks)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe", "gpt_oss", "qwen3_next"])
def test_fixture_families_greedy_identical(tmp_path_factory, arch):
    """MLA, GQA, sliding window + sinks, and a DeltaNet recurrent state (rolled back to the state recorded after
    the last accepted draft)."""
    model_dir = converted(tmp_path_factory, arch, "bf16")
    drafted, accepted = check_greedy_identical(model_dir, [" ".join([PROMPT] * 3), "fox dog fox dog fox", "lazy"])
    assert 0 < accepted < drafted


def test_rollback_frees_the_blocks_past_the_kept_length(default_converted):
    eng = Engine(default_converted, ctx=256, max_batch=1, prefix_cache=False, kv_block_size=4)
    try:
        cache = eng.model.new_cache(256)
        ids = eng.tokenizer.encode(CODE)
        from ktrun.generate import prefill, verify
        prefill(eng.model, cache, ids)
        n0, used0 = cache.length, eng.model.kv_pool.used
        verify(eng.model, [(cache, [ids[-1], *ids[:9]])])          # 10 rows: crosses two or three blocks
        assert cache.length == n0 + 10
        cache.keep(n0 + 1)
        assert cache.length == n0 + 1 and len(cache.tokens) == n0 + 1
        assert len(cache.blocks) == -(-(n0 + 1) // 4) and eng.model.kv_pool.used == used0 + len(cache.blocks) - -(
            -n0 // 4)
        assert sum(n for _, n in cache._runs) == len(cache.blocks)
        cache.release()
    finally:
        eng.close()


# -- sampled: the same distribution ----------------------------------------------------------------------------------
def sampled_tokens(eng: Engine, ids: list[int], seeds: range, n_choices: int) -> list[list[int]]:
    """The first 3 tokens of len(seeds) * n_choices sampled continuations (choice i of seed s uses seed s + i)."""
    out = []
    for s in seeds:
        params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s * n_choices, n=n_choices,
                                ignore_eos=True)
        eng.add_request("s", ids, params)
        got: dict[int, list[int]] = {}
        while eng.has_work():
            for o in eng.step():
                got.setdefault(o.index, []).append(o[1])
        out += got.values()
    return out


def assert_same_law(a: list[list[int]], b: list[list[int]], tv_max: float = 0.1) -> None:
    """Sampled continuations without (a) and with (b) drafts: at generated positions 2 and 3 (where drafts are
    verified) a two-sample chi-square test passes (p > 0.001) and the total variation is below tv_max (the sampling
    error of two 768-sample histograms: ~0.05 over a few tokens, ~0.1 over fifty)."""
    assert a != b                                  # the generator is used differently: other draws, same law
    for pos in (1, 2):
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        keys = sorted(set(ca) | set(cb))
        tv = 0.5 * sum(abs(ca[k] - cb[k]) for k in keys) / len(a)
        big = [k for k in keys if ca[k] + cb[k] >= 10]
        rest = [sum(ca[k] for k in keys if k not in big), sum(cb[k] for k in keys if k not in big)]
        table = [[ca[k] for k in big] + rest[:1], [cb[k] for k in big] + rest[1:]]
        table = [row for row in zip(*table) if sum(row) > 0]
        p = stats.chi2_contingency(list(zip(*table))).pvalue
        assert p > 1e-3 and tv < tv_max, (pos, p, tv, ca, cb)


def test_sampled_distribution_unchanged(default_converted):
    """768 seeded samples with and without drafts: at generated positions 2 and 3 (where drafts are verified) the
    token frequencies pass a two-sample chi-square test (p > 0.001) and differ by less than 0.1 in total variation
    (the sampling error of two 768-sample histograms over a few tokens is ~0.05)."""
    plain = Engine(default_converted, ctx=256, max_batch=64, prefix_cache=False)
    spec = Engine(default_converted, ctx=256, max_batch=64, prefix_cache=False, speculative=NGRAM)
    try:
        ids = plain.tokenizer.encode("x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny =")
        a = sampled_tokens(plain, ids, range(12), 64)
        b = sampled_tokens(spec, ids, range(12), 64)
        assert spec.stats["spec_accepted_tokens"] > 100 and spec.stats["spec_acceptance_rate"] < 0.95
        assert_same_law(a, b)
    finally:
        plain.close()
        spec.close()


# -- served ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served_model(ckpt_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("spec_serve") / "ds3-tiny"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(ckpt_dir("deepseek_v3")), "-o", str(out), "--quiet"],
                   check=True, capture_output=True)
    return out


def serve_texts(model_dir: Path, extra: list[str], prompt: str) -> tuple[list[str], ServerProcess]:
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(model_dir), "--port", "0", "--ctx", "256", "--max-batch", "4",
                       *extra], timeout=180)
    client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=32, temperature=0)
    chunks = list(client.completions.create(model=model_dir.name, prompt=prompt, max_tokens=32, temperature=0,
                                            stream=True))
    chat = client.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=24, temperature=0)
    texts = [r.choices[0].text, "".join(c.choices[0].text for c in chunks if c.choices),
             chat.choices[0].message.content]
    s.timings = r.model_extra.get("timings") or {}
    return texts, s


def test_served_text_same_with_speculation(served_model):
    prompt = " ".join([PROMPT] * 3)
    want, s = serve_texts(served_model, [], prompt)
    assert s.stop() == 0, s.stderr
    got, s = serve_texts(served_model, ["--speculative", "ngram", "--draft-tokens", "4"], prompt)
    try:
        assert got == want
        assert got[0] == got[1]
        assert s.timings.get("draft_n", 0) > 0 and 0 <= s.timings["draft_n_accepted"] <= s.timings["draft_n"]
        assert metric(s, "ktrun_engine_spec_draft_tokens") > 0
    finally:
        assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


def test_verify_rows_have_the_bits_of_plain_decode(tmp_path_factory):
    """The default model with RTN int4 experts and Linears on the kernels, on bench_speculative.py's code-editing
    prompt: when a verify forward's rows took torch's masked attention, the greedy tokens with drafts left plain
    decoding's at token 80 (a near tie that other sums broke the other way). Each verify row of the absorbed MLA path
    now runs over its causal prefix in kt_mla_attend_batch, with the bits of its token decoded alone, so n-gram and
    MTP drafts give plain decoding's tokens."""
    import sys

    from ktrun.loaded_model import load_model
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_speculative import DEFAULT_MODEL, prompts

    out = tmp_path_factory.mktemp("rtn") / "default-rtn"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(DEFAULT_MODEL), "-o", str(out), "--gpu-method", "rtn-int4",
                    "--expert-quantizer", "rtn", "--quiet"], check=True, capture_output=True)
    with load_model(out, device="cpu", mtp=True) as lm:
        ids = lm.tokenizer.encode(prompts(1500)["edit"])
        params = SamplingParams(max_tokens=96, ignore_eos=True)
        plain = generate(lm.model, ids, params, len(ids) + 100, set()).tokens
        for spec in (NGRAM, SpeculativeConfig("mtp", 2, policy="fixed").with_mtp(lm.mtp)):
            out_ = generate(lm.model, ids, params, len(ids) + 100, set(), speculative=spec)
            assert out_.tokens == plain, (spec.method, next(i for i, (a, b) in enumerate(zip(plain, out_.tokens))
                                                            if a != b))
            assert out_.accepted > 0
