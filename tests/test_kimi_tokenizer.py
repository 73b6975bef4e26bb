"""Kimi-K2 / K2.5's tokenizer (tiktoken.model + tokenizer_config.json; its Python class is remote code, never run):
the converter's exact `tokenizers` conversion (ktlayouts.tiktoken_bpe) and ktrun give the token ids the `tiktoken`
package gives with the release tokenizer's spec (runtime_helpers.KimiReferenceTokenizer) on a varied corpus, and
render the chat template as transformers' own jinja renderer does."""
from __future__ import annotations

import json
import random
import shutil

import pytest
from ktlayouts import tiktoken_bpe
from ktrun.text.tokenizer import Tokenizer, TokenizerError
from runtime_helpers import KimiReferenceTokenizer, build_checkpoint, converted, shared_root

CORPUS = [
    "", " ", "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\t// C++\r\n#include <vector>\n",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;  -- sql",
    "混合专家模型把每个词元路由到少数几个专家。北京是中国的首都，上海是最大的城市。",
    "日本語のテキスト：カタカナ、ひらがな、漢字が混ざっています。한국어 문장도 있습니다.",
    "Emoji: 🚀🔥👍🏽 👨‍👩‍👧‍👦 🇯🇵 ✓ ✗ — naïve café, Ünïcødé; Ελληνικά, русский текст, עברית, العربية.",
    "It's we're they've I'm you'll he'd DON'T WON'T Let'S 12345 3.14159 0x1F 1,000,000 ½ ² ³",
    "   leading spaces\n\n\ntrailing spaces   \t\t\n", "a\u00a0b\u2028c\u2029d\x85e\u3000f\u200bg",
    "mixedCASEWords camelCase snake_case kebab-case SCREAMING_CASE ǅungla ǈ",
    "!!!???...,,,;;;::: ((([[[{{{}}}]]]))) <<<>>> @#$%^&*~`|\\/",
    "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>",
    "[BOS]text[EOS] <|reserved_token_500|> <|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>{}",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" * 3,
    "中文English混合mixed文本text123数字",
]


def _fuzz(n: int, seed: int = 0) -> list[str]:
    """Random strings over many character classes (letters of several scripts and cases, digits, Han, kana,
    emoji and modifiers, marks, whitespace kinds, punctuation, special-token text)."""
    rng = random.Random(seed)
    pools = ["abcxyzABCXYZ", "0123456789", " \t\n\r\u00a0\u3000", ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
             "混合专家模型北京中国字", "ひらがなカタカナ", "한국어", "éüñçÀÉǅǈß", "αβγΔΩабвЖЯ", "🚀🔥👍🏽🇯🇵‍", "\u0301\u0308",
             "'s 're 've 'll 'd 'm 't", "<|im_end|>", "[EOS]"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            pool = rng.choice(pools)
            parts.append(pool if pool.startswith(("<|", "[")) else "".join(rng.choice(pool)
                                                                          for _ in range(rng.randint(1, 6))))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(hub checkpoint dir, converted dir) of the Kimi-K2.5 fixture (bf16 experts)."""
    return build_checkpoint(shared_root(tmp_path_factory), "kimi_k25"), converted(tmp_path_factory, "kimi_k25", "bf16")


def test_token_ids_equal_tiktoken_on_a_varied_corpus(kimi):
    src, conv = kimi
    ref = KimiReferenceTokenizer(src)
    ours = Tokenizer(conv)                          # the converted directory's tokenizer.json
    from_hub = Tokenizer(src)                       # a hub directory with tiktoken.model only
    texts = CORPUS + _fuzz(400)
    bad = [t for t in texts if ours.encode(t) != ref.encode(t) or from_hub.encode(t) != ref.encode(t)]
    assert not bad, [(t, ours.encode(t), ref.encode(t)) for t in bad[:3]]
    for t in texts:                                  # and back: byte-exact decoding, special tokens kept
        assert ours.decode(ours.encode(t), skip_special_tokens=False) == ref.decode(ref.encode(t)) == t
    assert ours.bos_token_id == ref.special["[BOS]"] and ours.eos_token_id == ref.eos_token_id
    assert ours.encode("hello")[0] != ours.bos_token_id and ref.bos_token_id is None     # Kimi adds no BOS
    assert ours.vocab_size == len(ref.enc._mergeable_ranks) + 256


def test_converted_directory_carries_both_tokenizer_files(kimi):
    src, conv = kimi
    assert not (src / "tokenizer.json").exists() and (src / "tiktoken.model").is_file()
    assert (conv / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    manifest = json.loads((conv / "manifest.json").read_text())
    assert {"tokenizer.json", "tiktoken.model", "tokenizer_config.json"} <= set(manifest["files"])


def test_chat_template_rendered_as_transformers_renders_it(kimi):
    src, conv = kimi
    ref, ours = KimiReferenceTokenizer(src), Tokenizer(conv)
    conversations = [
        [{"role": "user", "content": "hi there"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "北京在哪里？"},
         {"role": "assistant", "content": "中国。"}, {"role": "user", "content": "thanks 🚀"}],
        [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                                                              "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}],
    ]
    for msgs in conversations:
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.render_chat(msgs, add_generation_prompt=gen) == want
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == ref.encode(want)
    ids = ours.apply_chat_template(conversations[0])
    assert ids.count(ref.special["<|im_end|>"]) == 2 and ids[-1] == ref.special["<|im_middle|>"]


def test_bad_tiktoken_files_are_named(kimi, tmp_path):
    src, _ = kimi
    d = shutil.copytree(src, tmp_path / "k", ignore=shutil.ignore_patterns("*.safetensors"))
    lines = (d / "tiktoken.model").read_text().splitlines()
    (d / "tiktoken.model").write_text("\n".join(lines[1:]) + "\n")          # byte 0x00 gone
    with pytest.raises(TokenizerError, match=r"tiktoken.model: .*single byte 0x00 has no rank"):
        Tokenizer(d)
    (d / "tiktoken.model").write_text("\n".join(lines[:5] + ["not-base64!! 5"] + lines[6:]) + "\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model: line 6 is not 'base64 rank'"):
        Tokenizer(d)
    (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "SomeOtherTikToken"}))
    with pytest.raises(TokenizerError, match="tokenizer_class 'SomeOtherTikToken'.*remote code, which is never run"):
        Tokenizer(d)
    assert tiktoken_bpe.KNOWN_CLASSES == {"TikTokenTokenizer": tiktoken_bpe.KIMI_PATTERN}


def test_a_vocabulary_trained_by_tiktoken_itself_converts_exactly(tmp_path):
    """The fixture's ranks come from a `tokenizers` trainer; here tiktoken's own BPE trainer (its educational
    bpe_train, with Kimi's regex) learns a vocabulary of 700 on code, prose, CJK, emoji and fuzz text, so tokens that
    several merge orders reach are its, not ours. The converted tokenizer.json gives tiktoken's ids on unseen text
    (other fuzz, a whole Python source file) and on the training text."""
    import base64
    import inspect

    import tiktoken
    from runtime_helpers import KIMI_PAT_STR
    from tiktoken._educational import bpe_train
    from tokenizers import Tokenizer as HFTokenizer

    train = "\n".join(CORPUS * 2 + _fuzz(150, seed=1)) + inspect.getsource(tiktoken.core)[:6000]
    ranks = bpe_train(train, 700, KIMI_PAT_STR, visualise=None)
    assert sorted(ranks.values()) == list(range(700))
    (tmp_path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                     for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    cfg = {"tokenizer_class": "TikTokenTokenizer",
           "added_tokens_decoder": {"700": {"content": "[BOS]", "special": True},
                                    "702": {"content": "<|im_end|>", "special": True}}}
    ours = HFTokenizer.from_str(tiktoken_bpe.tokenizer_json(tmp_path / "tiktoken.model", cfg))
    names = {i: f"<|reserved_token_{i}|>" for i in range(700, 700 + 256)} | {700: "[BOS]", 702: "<|im_end|>"}
    special = {c: i for i, c in names.items()}       # as Kimi's class: 256 reserved tokens after the vocabulary
    ref = tiktoken.Encoding(name="kimi-like", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=special)
    texts = [train, inspect.getsource(tiktoken_bpe), *CORPUS, *_fuzz(1000, seed=7)]
    bad = [t for t in texts if ours.encode(t, add_special_tokens=False).ids != ref.encode(t, allowed_special="all")]
    assert not bad, [(t[:60], ours.encode(t, add_special_tokens=False).ids[:12],
                      ref.encode(t, allowed_special="all")[:12]) for t in bad[:3]]
    assert max(len(t) for t in ranks) >= 6            # the vocabulary really merges (long tokens exist)
