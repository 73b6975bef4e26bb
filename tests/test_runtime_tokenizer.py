"""ktrun's tokenizer vs transformers' AutoTokenizer on variants of the BOS/EOS configuration; sampling filters."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from ktrun.sampling import SamplingParams, filter_logits, make_generator, sample_token
from ktrun.text.tokenizer import Tokenizer
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


# DeepSeek-V3's conversation format, written out by hand from its hub chat template (the independent reference):
# BOS, system texts hoisted and joined by a blank line, <｜User｜>/<｜Assistant｜> turns, answers closed by EOS.
_B, _E, _U, _A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```"
         "<｜tool▁call▁end｜>")
DEEPSEEK_V3_CASES = [
    ([{"role": "user", "content": "hi"}], True, f"{_B}{_U}hi{_A}"),
    ([{"role": "user", "content": "hi"}], False, f"{_B}{_U}hi"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "4"}, {"role": "system", "content": "Now verbose."},
      {"role": "user", "content": "3+3?"}], True,
     f"{_B}Be brief.\n\nNow verbose.{_U}2+2?{_A}4{_E}{_U}3+3?{_A}"),
    ([{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "20C"}], True,
     (f"{_B}{_U}weather?{_A}<｜tool▁calls▁begin｜>{_CALL}<｜tool▁calls▁end｜>{_E}"
     "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>\n"
     "<｜tool▁output▁begin｜>20C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")),
    ([{"role": "user", "content": "weather?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}] * 2},
      {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}], True,
     (f"{_B}{_U}weather?{_A}<｜tool▁calls▁begin｜>{_CALL}\n{_CALL}<｜tool▁calls▁end｜>{_E}"
     f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>Sunny.{_E}{_A}")),
]


@pytest.mark.parametrize("case", range(len(DEEPSEEK_V3_CASES)))
def test_builtin_deepseek_v3_chat_template(tmp_path_factory, tmp_path, case):
    """A DeepSeek-V3 conversion without a chat template renders chats in DeepSeek-V3's format; transformers rendering
    the same template text gives the same string and the same token ids."""
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer(d)
    assert ours.chat_template_source == "built-in deepseek_v3"
    msgs, gen_prompt, want = DEEPSEEK_V3_CASES[case]
    assert ours.render_chat(msgs, add_generation_prompt=gen_prompt) == want
    ref = transformers_tokenizer(d)
    assert ref.apply_chat_template(msgs, chat_template=ours.chat_template, tokenize=False,
                                   add_generation_prompt=gen_prompt) == want
    ref_ids = ref.apply_chat_template(msgs, chat_template=ours.chat_template, add_generation_prompt=gen_prompt)
    ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
    assert ours.apply_chat_template(msgs, add_generation_prompt=gen_prompt) == list(ref_ids)
    assert ours.encode(want, add_special_tokens=False)[0] == ours.bos_token_id      # BOS written by the template


def test_no_builtin_template_for_other_vocabularies(tmp_path_factory, tmp_path):
    src = build_checkpoint(shared_root(tmp_path_factory), "qwen3_moe")
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(d).render_chat([{"role": "user", "content": "hi"}])


def test_chat_template_file_wins_over_tokenizer_config(tmp_path_factory, tmp_path):
    """chat_template.jinja next to a tokenizer_config.json template: both sides render the file's template."""
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, d / name)
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                                           "\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    msgs = [{"role": "user", "content": "hi"}]
    want = transformers_tokenizer(d).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "[user] hi" in want and Tokenizer(d).render_chat(msgs) == want
