"""One decode loop: `generate()` (one request, what `ktrun generate` runs) and the batching Engine (what `ktrun serve`
runs) give the same tokens and finish reasons for the same prompt, sampling parameters and stop strings, greedy and
seeded sampling, alone and inside a batch; and `load_model` hands both the same model, tokenizer and EOS ids."""
from __future__ import annotations

import pytest
from ktrun.engine import Engine, SamplingParams
from ktrun.generate import generate
from ktrun.loaded_model import load_model
from runtime_helpers import PROMPT, converted

PROMPTS = (PROMPT, "lazy dogs jump", "fox")


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def eng(request, tmp_path_factory):
    e = Engine(converted(tmp_path_factory, request.param, "bf16"), ctx=96, max_batch=8)
    yield e
    e.close()


def run_generate(eng: Engine, prompt_ids, params: SamplingParams):
    out = generate(eng.model, prompt_ids, params, eng.ctx, eng.eos_ids, decode_text=eng.tokenizer.decode)
    return out.tokens, out.finish_reason, out.text


def run_engine(eng: Engine, requests: dict[str, tuple[list[int], SamplingParams]], stagger: bool = False):
    """req_id -> (tokens, finish_reason); with stagger, one request joins per step while the others decode."""
    out = {k: ([], None) for k in requests}
    pending = list(requests.items())
    while pending or eng.has_work():
        for k, (ids, params) in (pending[:1] if stagger else pending):
            eng.add_request(k, ids, params)
        pending = pending[1:] if stagger else []
        for rid, tok, fin in eng.step():
            out[rid] = (out[rid][0] + [tok], fin)
    return out


def stop_across_tokens(eng: Engine, tokens: list[int]) -> str:
    """A 2-character stop string from the text of `tokens` that spans a token boundary (no U+FFFD in it)."""
    dec = eng.tokenizer.decode
    full = dec(tokens)
    for j in range(2, len(tokens)):
        cut = len(dec(tokens[:j]))
        s = full[cut - 1: cut + 1]
        if 0 < cut < len(full) and len(s) == 2 and "\ufffd" not in s and full.find(s) == cut - 1:
            return s
    pytest.skip("no stop string across a token boundary in this text")


def cases(eng: Engine) -> dict[str, tuple[list[int], SamplingParams]]:
    enc = eng.tokenizer.encode
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    base, _, _ = run_generate(eng, enc(PROMPT), greedy)
    stop = stop_across_tokens(eng, base)
    return {
        "greedy": (enc(PROMPT), greedy),
        "greedy_stop": (enc(PROMPT), SamplingParams(max_tokens=16, stop=["@@never", stop], ignore_eos=True)),
        "greedy_eos": (enc(PROMPTS[1]), SamplingParams(max_tokens=12)),
        "seeded": (enc(PROMPTS[1]), SamplingParams(max_tokens=12, temperature=1.2, top_k=40, top_p=0.95, seed=5,
                                                   ignore_eos=True)),
        "seeded_stop": (enc(PROMPTS[2]), SamplingParams(max_tokens=12, temperature=0.8, seed=11, stop=[stop],
                                                        ignore_eos=True)),
    }


def test_generate_and_engine_give_the_same_tokens(eng):
    want = {}
    for k, (ids, params) in cases(eng).items():
        tokens, finish, text = run_generate(eng, ids, params)
        want[k] = (tokens, finish)
        got = run_engine(eng, {k: (ids, params)})[k]
        assert got == want[k], k
        if params.stop and finish == "stop":                      # the text ends before the stop string
            full = eng.tokenizer.decode(tokens)
            assert min(i for i in (full.find(s) for s in params.stop) if i >= 0) == len(text), k
    assert want["greedy_stop"][1] == "stop" and len(want["greedy_stop"][0]) < 16
    assert want["greedy_stop"][0] == want["greedy"][0][: len(want["greedy_stop"][0])]
    # all at once, and joining one per step mid-decode: every request still gets exactly its solo result
    all_cases = cases(eng)
    assert run_engine(eng, all_cases) == want
    assert run_engine(eng, all_cases, stagger=True) == want


def test_load_model_gives_what_the_engine_runs(eng):
    with load_model(eng.model_dir, use_kernels=False) as lm:
        assert lm.eos_ids == eng.eos_ids and lm.name == eng.model_name == eng.model_dir.name
        assert lm.tokenizer.encode(PROMPT) == eng.tokenizer.encode(PROMPT)
        assert lm.converted.geometry == eng.converted.geometry and lm.model.cfg == eng.model.cfg
        ids, params = eng.tokenizer.encode(PROMPT), SamplingParams(max_tokens=6, ignore_eos=True)
        out = generate(lm.model, ids, params, eng.ctx, lm.eos_ids, decode_text=lm.tokenizer.decode)
        assert out.text == lm.tokenizer.decode(out.tokens) and len(out.tokens) == 6
