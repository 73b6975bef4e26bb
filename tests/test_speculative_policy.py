"""The adaptive draft length (ktrun.speculative DraftLength / VerifyCost, `--draft-policy adaptive`, the default):
each step drafts the k in 0 .. --draft-tokens with the most expected tokens per unit of step cost, from the request's
recent acceptance and the measured cost of a verified row and of drafting a token.

- DraftLength: the evidence of a verified draft (j accepted of k: j successes in min(k, j + 1) trials), forgetting
  half of it per step, the lengths it chooses at high and low acceptance and cost, and the probe after idle steps
  (later when a drafted token costs more).
- VerifyCost: medians of the timings (a cold step does not move them), the prior until enough are in, the nearest
  batch size measured.
- On the default model: greedy output with the adaptive policy is plain decoding's; where drafting cannot pay (a
  measured row cost far above a step's) a run drafts nothing, and `ktrun generate --draft-policy` is parsed.
"""
from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from ktrun.generate import generate
from ktrun.loaded_model import load_model
from ktrun.sampling import SamplingParams
from ktrun.speculative import (
    ACCEPTANCE_PRIOR,
    COST_MIN_TIMINGS,
    PROBE_EVERY,
    ROW_COST_PRIOR,
    DraftLength,
    SpeculativeConfig,
    VerifyCost,
)

BIN = Path(sys.executable).parent
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\n")
EDIT = CODE + "# the same, renamed\n" + CODE.replace("width", "w")[:60]


def test_evidence_is_per_tried_token_and_fades():
    d = DraftLength(4)
    assert d.acceptance == ACCEPTANCE_PRIOR
    d.update(4, 2)                               # tokens 1, 2 accepted, token 3 tried and rejected, token 4 untried
    assert (d.hits, d.trials) == (2, 3)
    d.update(4, 4)                               # the earlier evidence counts half
    assert (d.hits, d.trials) == (1 + 4, 1.5 + 4)
    d.update(0, 0)                               # a step that drafted nothing: only the fading
    assert (d.hits, d.trials) == (2.5, 2.75)


def test_lengths_follow_acceptance_and_cost():
    fresh = DraftLength(4)
    # the prior 0.5 at the prior cost: 1 token (1.5 / 1.25) beats 2 (1.75 / 1.5) and none (1)
    assert fresh.size(ROW_COST_PRIOR) == 1
    assert DraftLength(4).size(0.0) == 4         # free rows: as many as allowed
    copying = DraftLength(4)
    for _ in range(4):
        copying.update(4, 4)
    assert copying.acceptance > 0.9 and copying.size(ROW_COST_PRIOR) == 4
    assert copying.size(5.0) == 0                # each row costs five steps: never worth it
    rejecting = DraftLength(4)
    for _ in range(3):
        rejecting.update(rejecting.size(ROW_COST_PRIOR) or 1, 0)
    assert rejecting.acceptance < 0.2 and rejecting.size(ROW_COST_PRIOR) == 0


@pytest.mark.parametrize("cost", [0.5, 2.0])
def test_idle_steps_end_in_a_probe_later_when_drafting_costs_more(cost):
    d = DraftLength(4)
    sizes = []
    for _ in range(200):
        sizes.append(d.size(cost))
        d.update(sizes[-1], 0)
    probes = [i for i, k in enumerate(sizes) if k]
    every = int(PROBE_EVERY * max(1.0, cost / ROW_COST_PRIOR))
    assert all(sizes[i] == 1 for i in probes) and len(probes) == len(sizes) // every
    assert probes[0] == every - 1 and all(b - a == every for a, b in itertools.pairwise(probes))


def test_costs_are_medians_with_a_prior_until_measured():
    c = VerifyCost()
    assert c.per_token(1) == ROW_COST_PRIOR
    for _ in range(COST_MIN_TIMINGS):
        c.observe_step(1, 0, 0.001)              # plain steps of one request: 1 ms
    assert c.per_token(1) == ROW_COST_PRIOR      # no verify rows timed yet
    for _ in range(COST_MIN_TIMINGS):
        c.observe_step(1, 2, 0.0014)             # 2 drafted rows add 0.4 ms: 0.2 ms a row
    assert c.per_token(1) == pytest.approx(0.2)
    c.observe_step(1, 0, 0.010)                  # a cold step: the median does not move
    assert c.per_token(1) == pytest.approx(0.2)
    for _ in range(COST_MIN_TIMINGS):
        c.observe_draft(4, 0.0004)               # drafting: 0.1 ms a token
    assert c.per_token(1) == pytest.approx(0.3)
    assert c.per_token(3) == pytest.approx(0.3)  # batch 3 not timed: the nearest size measured
    for _ in range(COST_MIN_TIMINGS):
        c.observe_step(4, 0, 0.002)
    assert c.per_token(3) == pytest.approx(0.15)


def test_default_model_greedy_identical_and_no_drafts_where_they_cannot_pay(default_converted):
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    with load_model(default_converted, device="cpu") as lm:
        ids = lm.tokenizer.encode(EDIT)
        plain = generate(lm.model, ids, params, 256, set())
        adaptive = SpeculativeConfig("ngram", 4)
        out = generate(lm.model, ids, params, 256, set(), speculative=adaptive)
        assert out.tokens == plain.tokens and out.drafted > 0
        assert out.steps == params.max_tokens - out.accepted            # every accepted draft saved a forward
        costly = SpeculativeConfig("ngram", 4)
        for rows, seconds in ((0, 1e-4), (1, 1.0)):                       # a verified row: 10,000 plain steps
            for _ in range(COST_MIN_TIMINGS):
                costly.cost.observe_step(1, rows, seconds)
        out = generate(lm.model, ids, params, 256, set(), speculative=costly)
        assert out.tokens == plain.tokens and out.drafted == 0 and out.steps == params.max_tokens


def test_cli_takes_the_policy(default_converted):
    for policy in ("fixed", "adaptive"):
        r = subprocess.run([str(BIN / "ktrun"), "generate", str(default_converted), "--prompt", EDIT, "--max-tokens",
                            "16", "--speculative", "ngram", "--draft-policy", policy], capture_output=True, text=True,
                           timeout=300, check=False)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([str(BIN / "ktrun"), "generate", str(default_converted), "--prompt", "x", "--speculative",
                        "ngram", "--draft-policy", "greedy"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 2 and "--draft-policy" in r.stderr


def test_mtp_drafts_start_from_the_heads_share_of_a_step_and_never_probe():
    class Head:                                   # MtpHead's one field the policy reads
        step_share = 0.4                          # the default model: one layer and a head of 4 layers and a head

    spec = SpeculativeConfig("mtp", 2).with_mtp(Head())
    assert spec.cost.per_token(1) == pytest.approx(ROW_COST_PRIOR + 0.4)
    d = spec.draft_length()
    assert not d.probe and d.size(spec.cost.per_token(1)) == 0    # 1.5 tokens for 1.65 steps: no drafts
    assert all(d.size(spec.cost.per_token(1)) == 0 for _ in range(10 * PROBE_EVERY))
    assert SpeculativeConfig("ngram", 2).draft_length().probe
    for _ in range(COST_MIN_TIMINGS):
        spec.cost.observe_step(1, 0, 1e-3)
        spec.cost.observe_draft(1, 1e-4)         # timed drafts replace the share: 0.1 of a step
    assert spec.cost.per_token(1) == pytest.approx(ROW_COST_PRIOR + 0.1)
    assert SpeculativeConfig("mtp", 2, policy="fixed").draft_length() is None
