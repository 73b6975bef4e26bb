"""n-gram speculative decoding on every model family: the same greedy tokens with and without drafts.

tests/test_speculative.py covers the default model and four families whose caches differ most (MLA, GQA, sliding
window + sinks, a DeltaNet state rolled back); this file runs the same check (generate() and the batched Engine with
the prefix cache, drafts accepted and rejected) on every other fixture family, so a family whose attention, indexer or
recurrent state does not roll back cleanly fails here.
"""
from __future__ import annotations

import pytest
from runtime_helpers import PROMPT, converted
from test_speculative import check_greedy_identical

from ktconvert.testing.families import ARCHS

COVERED = ("deepseek_v3", "qwen3_moe", "gpt_oss", "qwen3_next")      # test_speculative.py
# fixtures whose greedy text repeats no n-gram of these prompts (a recurrent state keeps the whole context in play):
# every draft is rejected, so they check the rejected drafts' roll-back only
NO_REPEATS = ("kimi_linear",)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in COVERED])
def test_every_family_greedy_identical_with_ngram_drafts(tmp_path_factory, arch):
    model_dir = converted(tmp_path_factory, arch, "bf16")
    drafted, accepted = check_greedy_identical(model_dir, [" ".join([PROMPT] * 3), "fox dog fox dog fox", "lazy"],
                                               expect_accepted=arch not in NO_REPEATS)
    assert drafted > 0 and accepted < drafted and (accepted > 0 or arch in NO_REPEATS)
