"""Sampling beyond temperature/top-k/top-p: penalties, logit_bias and min_p against the formulas written out by hand
(OpenAI's presence/frequency penalty, the CTRL repetition penalty as transformers applies it); logprobs; and in the
Engine: n choices sharing one prefill (choice i = a request of its own with seed + i), prompt logprobs equal to the
model's log-softmax over the prompt, stop_token_ids, the same penalties in generate() and the Engine."""
from __future__ import annotations

import pytest
import torch
from ktrun.engine import Engine, SamplingParams
from ktrun.generate import generate
from ktrun.models.kv_cache import Batch
from ktrun.sampling import Sampler, filter_logits, token_logprobs
from runtime_helpers import PROMPT, converted


def test_penalties_and_bias_follow_the_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5])
    prompt, out = [0], [3, 3, 2]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={4: 1.5})
    got = Sampler(p, prompt).shape(logits, out)
    want = logits.clone()
    for t in (0, 2, 3):                                         # prompt or output: CTRL repetition penalty
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    for t, count in ((3, 2), (2, 1)):                           # output only: OpenAI presence + frequency
        want[t] -= 0.25 * count + 0.5
    want[4] += 1.5
    assert torch.allclose(got, want)
    assert torch.equal(Sampler(SamplingParams(), prompt).shape(logits, out), logits)   # nothing set: unchanged


def test_min_p_and_logprobs():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits, 0, 1.0, min_p=0.2)).tolist()
    assert kept == [True, True, True, False]                    # 0.05 < 0.2 x 0.5
    lp = token_logprobs(logits, 2, 2)
    assert lp.logprob == pytest.approx(torch.log(torch.tensor(0.15)).item(), abs=1e-6)
    assert [t for t, _ in lp.top] == [0, 1]
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = Engine(converted(tmp_path_factory, "deepseek_v3", "bf16"), ctx=96, max_batch=8)
    yield e
    e.close()


def run(eng, ids, params):
    eng.add_request("r", ids, params)
    outs = []
    while eng.has_work():
        outs += eng.step()
    return outs


def test_n_choices_share_the_prefill_and_equal_solo_seeds(eng):
    ids = eng.tokenizer.encode(PROMPT)
    p0 = eng.stats["prompt_tokens"]
    outs = run(eng, ids, SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True))
    assert eng.stats["prompt_tokens"] - p0 == len(ids)            # one prefill for three choices
    for i in range(3):
        solo = [o[1] for o in run(eng, ids, SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i,
                                                            ignore_eos=True))]
        assert [o[1] for o in outs if o.index == i] == solo
    assert sorted(o.index for o in outs if o[2]) == [0, 1, 2]
    assert eng.kv_cache_bytes() == 0


def test_prompt_logprobs_are_the_models_log_softmax(eng):
    ids = eng.tokenizer.encode(PROMPT)
    outs = run(eng, ids, SamplingParams(max_tokens=2, prompt_logprobs=3, logprobs=2))
    cache = eng.model.new_cache(96)
    ref = torch.log_softmax(eng.model.forward(Batch.build([(cache, ids)], eng.model.device), all_logits=True), -1)
    pl = outs[0].prompt_logprobs
    assert [e.token for e in pl] == ids[1:]
    assert [e.logprob for e in pl] == pytest.approx([ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)],
                                                    abs=1e-5)
    assert [len(e.top) for e in pl] == [3] * len(pl) and outs[1].prompt_logprobs is None
    assert outs[0].logprobs.logprob == pytest.approx(ref[-1, outs[0][1]].item(), abs=1e-5)


def test_stop_token_ids_and_penalties_in_both_loops(eng):
    ids = eng.tokenizer.encode(PROMPT)
    free = [o[1] for o in run(eng, ids, SamplingParams(max_tokens=8, ignore_eos=True))]
    stop_at = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    outs = run(eng, ids, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[free[stop_at]]))
    assert [o[1] for o in outs] == free[:stop_at + 1] and outs[-1][2] == "stop"
    params = SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
                            repetition_penalty=1.5, logit_bias={5: 2.0})
    engine_toks = [o[1] for o in run(eng, ids, params)]
    gen = generate(eng.model, ids, params, eng.ctx, eng.eos_ids)
    assert gen.tokens == engine_toks and engine_toks != run_plain(eng, ids)


def run_plain(eng, ids):
    return [o[1] for o in run(eng, ids, SamplingParams(max_tokens=10, ignore_eos=True))]
