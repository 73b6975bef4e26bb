"""ktrun's tokenizer vs transformers' AutoTokenizer on variants of the BOS/EOS configuration; sampling filters."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from ktrun.sampling import SamplingParams, filter_logits, make_generator, sample_token
from ktrun.tokenizer import Tokenizer
from runtime_helpers import PROMPT, build_checkpoint, shared_root, transformers_tokenizer

# (tokenizer_config.json edits, tokenizer.json post_processor: "keep" | None) -> BOS/EOS as transformers decides
# (v5 drops add_bos_token / add_eos_token when tokenizer.json exists: its post-processor alone decides)
VARIANTS = {
    "add_bos_true": ({"add_bos_token": True}, "keep"),
    "add_bos_false_post_processor_still_adds": ({"add_bos_token": False}, "keep"),
    "no_flags_post_processor_decides": ({"add_bos_token": None, "add_eos_token": None}, "keep"),
    "no_flags_no_post_processor": ({"add_bos_token": None, "add_eos_token": None}, None),
    "add_eos_true_ignored": ({"add_bos_token": True, "add_eos_token": True}, "keep"),
    "add_bos_true_no_post_processor": ({"add_bos_token": True}, None),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bos_eos_rules_match_transformers(tmp_path_factory, tmp_path, variant):
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, d / name)
    edits, post = VARIANTS[variant]
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    for k, v in edits.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if post is None:
        tj = json.loads((d / "tokenizer.json").read_text())
        tj["post_processor"] = None
        (d / "tokenizer.json").write_text(json.dumps(tj))
    ours, ref = Tokenizer(d), transformers_tokenizer(d)
    for text in (PROMPT, "", "x y"):
        assert ours.encode(text) == ref(text).input_ids, (variant, text)
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids


def test_top_k_top_p_filters():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert torch.isfinite(filter_logits(logits, 2, 1.0)).tolist() == [True, True, False, False, False]
    p = torch.softmax(logits, -1)                      # [0.636, 0.234, 0.086, 0.032, 0.012]
    assert p[0] < 0.7 < p[0] + p[1]
    assert torch.isfinite(filter_logits(logits, 0, 0.7)).tolist() == [True, True, False, False, False]
    assert torch.isfinite(filter_logits(logits, 0, 0.5)).tolist() == [True, False, False, False, False]
    gen = make_generator(0)
    draws = {sample_token(logits, SamplingParams(temperature=1.0, top_k=3), gen) for _ in range(300)}
    assert draws == {0, 1, 2}
    assert sample_token(logits, SamplingParams(), None) == 0          # temperature 0: argmax
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
