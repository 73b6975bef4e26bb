"""The batched greedy pick of a decode step (sampling.greedy_tokens, sequence.advance_all) takes the same tokens as
sampling each row on its own (sample_token at temperature 0, Sequence.advance), on ties, NaN, infinities and signed
zeros too, and leaves every other kind of sequence to advance()."""
from __future__ import annotations

import torch
from ktrun.sampling import SamplingParams, greedy_tokens
from ktrun.sequence import Sequence, advance_all

V = 4096


def _hard_rows(n: int = 400) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = []
    for k in range(n):
        r = torch.randn(V, generator=g)
        kind = k % 8
        pick = torch.randint(0, V, (4,), generator=g)
        if kind == 1:
            r[pick] = r.max() + 1                      # several maxima: the first one wins
        elif kind == 2:
            r[pick[:2]] = float("nan")                 # NaN counts as the largest value
        elif kind == 3:
            r[:] = float("-inf")
        elif kind == 4:
            r[pick] = float("inf")
        elif kind == 5:
            r = torch.round(r)                         # many ties
        elif kind == 6:
            r[:] = 0.0
            r[7] = -0.0
        elif kind == 7:
            r[pick[:2]] = float("nan")
            r[pick[2:]] = float("inf")
        rows.append(r)
    return torch.stack(rows)


def _one_by_one(logits: torch.Tensor) -> list[int]:
    return [int(torch.argmax(row.float().cpu())) for row in logits]


def test_greedy_tokens_equal_the_argmax_of_each_row():
    logits = _hard_rows()
    assert greedy_tokens(logits) == _one_by_one(logits)                        # float32: numpy's argmax
    assert greedy_tokens(logits[::3]) == _one_by_one(logits[::3])              # a strided view
    half = logits.to(torch.bfloat16)
    assert greedy_tokens(half) == _one_by_one(half)                            # other dtypes: torch's
    with torch.inference_mode():                                               # what a forward returns
        inf = logits.clone()
    assert greedy_tokens(inf) == _one_by_one(inf)


def _sequences(eos: int) -> list[Sequence]:
    kinds = [SamplingParams(max_tokens=6, temperature=0),
             SamplingParams(max_tokens=6, temperature=0.8, seed=3),
             SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3),
             SamplingParams(max_tokens=6, temperature=0, logprobs=2),
             SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[5]),
             SamplingParams(max_tokens=6, temperature=0, top_k=3)]
    return [Sequence([1, 2, 3], p, None, 64, {eos}, req_id=f"r{i}") for i, p in enumerate(kinds)]


def test_advance_all_takes_what_advance_takes():
    g = torch.Generator().manual_seed(1)
    eos = 9
    batched, single = _sequences(eos), _sequences(eos)
    assert [s.sampler.plain_greedy for s in batched] == [True, False, False, False, True, True]
    for step in range(6):
        live = [i for i, s in enumerate(batched) if not s.finish_reason]
        if not live:
            break
        logits = torch.randn(len(live), V, generator=g)
        logits[0, eos] = 100.0 if step == 4 else logits[0, eos]                 # the first live one ends on EOS
        logits[:, 5] += 3.0 * (step == 1)                                       # a stop token id, for one of them
        got = advance_all([batched[i] for i in live], logits)
        want = [single[i].advance(logits[j:j + 1], []) for j, i in enumerate(live)]
        for a, b in zip(got, want):
            assert [(t, None if lp is None else (lp.token, lp.logprob, lp.top), d) for t, lp, d in a] == \
                   [(t, None if lp is None else (lp.token, lp.logprob, lp.top), d) for t, lp, d in b]
    for a, b in zip(batched, single):
        assert (a.tokens, a.finish_reason, a.steps) == (b.tokens, b.finish_reason, b.steps)
    assert all(s.finish_reason for s in batched)
