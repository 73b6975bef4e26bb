"""The one parser of the hot-expert options (ktrun.cli.hot_experts_option.hot_experts_from), for both command lines:
ktrun's (a placement chosen at load, dynamic options allowed, nothing given -> the conversion's own placement) and
`ktconvert quantize`'s (written=True: a placement written into the conversion needs --profile and one budget)."""
from __future__ import annotations

import click
import pytest
from ktlayouts.expert_placement import DEFAULT_STRATEGY
from ktrun.cli.hot_experts_option import hot_experts_from
from ktrun.defaults import DYNAMIC_WINDOW_TOKENS
from ktrun.experts.placement import Budget, HotExpertOptions


def kwargs(**given) -> dict:
    """A click command's kwargs as hot_experts_options() declares them, with `given` set."""
    kw = {"hot_profile": None, "hot_per_layer": None, "hot_ratio": None, "hot_gpu_mem": None, "hot_kv_mem": None,
          "hot_strategy": DEFAULT_STRATEGY, "hot_format": "auto", "other": 1}
    kw.update(given)
    return kw


@pytest.mark.parametrize("written", [False, True])
def test_nothing_given_is_none_and_only_hot_options_are_popped(written):
    kw = kwargs()
    assert hot_experts_from(kw, written=written) is None
    assert kw == {"other": 1}


@pytest.mark.parametrize("written", [False, True])
def test_a_profile_and_a_budget(written):
    kw = kwargs(hot_profile="p.json", hot_gpu_mem="24GB", hot_kv_mem="2GiB", hot_strategy="per-layer",
                hot_format="marlin")
    opts = hot_experts_from(kw, written=written)
    assert opts == HotExpertOptions(profile="p.json", budget=Budget(gpu_mem=24 * 10**9, kv_mem=2 * 2**30),
                                    strategy="per-layer", gpu_format="marlin", window=DYNAMIC_WINDOW_TOKENS)


@pytest.mark.parametrize("given", [{"hot_profile": "p.json"}, {"hot_per_layer": 4}, {"hot_ratio": 0.5}])
def test_written_needs_a_profile_and_one_budget(given):
    with pytest.raises(click.UsageError, match="needs --profile P and one of --gpu-experts"):
        hot_experts_from(kwargs(**given), written=True)
    # at load, ktrun takes either alone: a budget ranks by the conversion's placement or profile, a profile alone
    # applies with the written budget
    assert hot_experts_from(kwargs(**given)) is not None


def test_two_budgets_are_refused_naming_the_flags():
    with pytest.raises(click.UsageError, match="give one of --gpu-experts, --gpu-experts-ratio and --gpu-mem"):
        hot_experts_from(kwargs(hot_profile="p.json", hot_per_layer=2, hot_ratio=0.5), written=True)


def test_a_bad_size_names_its_flag():
    with pytest.raises(click.BadParameter, match="24 parsecs"):
        hot_experts_from(kwargs(hot_profile="p.json", hot_gpu_mem="24 parsecs"), written=True)


def test_format_or_dynamic_alone_apply_at_load_only():
    assert hot_experts_from(kwargs(hot_format="bf16"), written=True) is None
    opts = hot_experts_from(kwargs(hot_format="bf16"))
    assert opts is not None and opts.gpu_format == "bf16" and not opts.budget.given
    opts = hot_experts_from(kwargs(hot_dynamic=True, hot_window=512))
    assert opts.dynamic and opts.window == 512
