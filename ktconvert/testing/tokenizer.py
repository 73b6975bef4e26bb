"""Tiny deterministic tokenizers for the fixture checkpoints (byte-level BPE trained on a fixed text, no download).

Each family gets (by its fixture entry's tokenizer style) the special tokens and a chat template shaped like its hub tokenizer's, with the special
tokens at the ids its config names (bos/eos).

The "kimi" style is Kimi-K2's tiktoken tokenizer as the hub ships it: `tiktoken.model` (base64 token bytes and rank
per line, ranks trained here by byte-level BPE) and tokenizer_config.json (special tokens in added_tokens_decoder at
the ids right after the base vocabulary, 256 reserved of them, the chat template), no tokenizer.json.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from ktconvert.testing.families import FIXTURES

TOKENIZER_VOCAB = 300  # the model vocab (checkpoints.VOCAB_SIZE) is larger: padded, as on the hub

_DS_BOS, _DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DEEPSEEK = {
    "special": [_DS_BOS, _DS_EOS, "<｜User｜>", "<｜Assistant｜>"],
    "bos": _DS_BOS, "eos": _DS_EOS, "pad": _DS_EOS, "unk": None,
    "chat_template": (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{{ m['content'] }}"
        "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
        "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"),
}
STYLES = {   # ktconvert.testing.families.FixtureFamily.tokenizer
    "deepseek": _DEEPSEEK,
    "chatml": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "unk": None,
        "chat_template": (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")},
    "glm": {     # GLM-4.5: [gMASK]<sop> prefix, <|role|> headers, <|endoftext|> (id 0) ends text
        "special": ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                    "<|assistant|>", "<|observation|>"],
        "bos": None, "eos": "<|endoftext|>", "pad": "<|endoftext|>", "unk": None,
        "chat_template": (
            "[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")},
    "mistral": {
        "special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>", "eos": "</s>", "pad": None, "unk": "<unk>",
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")},
}

# Kimi-K2-shaped special tokens: offset from the base vocabulary -> content (the other reserved ids of the 256 are
# <|reserved_token_N|>), and a chat template shaped like the release's (system prompt by default, role headers
# <|im_user|>user<|im_middle|>..., every message closed by <|im_end|>, tool calls in a section of their own).
KIMI_BASE_VOCAB = 400           # 256 bytes + 144 merges
KIMI_N_SPECIAL = 256
KIMI_SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
                14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]",
                255: "[PAD]"}
KIMI_CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}"
    "{{- message['content'] or '' -}}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- elif message['role'] == 'tool' -%}## Return of {{ message['tool_call_id'] }}\n{{ message['content'] }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")
# config.json token ids of tokenizer styles whose special tokens follow the trained vocabulary
TOKEN_IDS = {"kimi": {"bos_token_id": KIMI_BASE_VOCAB, "eos_token_id": KIMI_BASE_VOCAB + 1,
                      "pad_token_id": KIMI_BASE_VOCAB + 255}}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A mixture of experts routes every token to a few experts and adds their outputs.",
    "Hello, world! What is the capital of France? The capital of France is Paris.",
    "one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9",
    "def main():\n    print('hello')\n",
    "Large language models predict the next token from the tokens before it.",
]
# more scripts for the Kimi vocabulary (its pre-tokenizer keeps Han runs whole)
_KIMI_CORPUS = _CORPUS + [
    "混合专家模型把每个词元路由到少数几个专家。北京是中国的首都。", "日本語のテキストも少し。カタカナとひらがな。",
    "Emoji: 🚀🔥👍🏽 ✓ — naïve café, Ünïcødé; Ελληνικά, русский текст.",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C++\nx = {'key': [1, 2, 3]}\n\tif x: return None",
    "It's we're they've I'm you'll he'd DON'T 12345 3.14159 0x1F",
]


def build_tokenizer(arch: str):
    """A `tokenizers.Tokenizer` for `arch` (deterministic: same arch -> same bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = STYLES[FIXTURES[arch].tokenizer]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 8, trainer)
    if spec["bos"]:  # the hub tokenizers of these models prepend BOS
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def kimi_ranks() -> dict[bytes, int]:
    """Byte-level BPE ranks for a Kimi-style tiktoken.model: the 256 single bytes first (rank = byte value), then
    each merge's token in the order the trainer learned them (deterministic)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=KIMI_BASE_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_KIMI_CORPUS * 8, trainer)
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(byte_of[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    if len(ranks) != KIMI_BASE_VOCAB:
        raise RuntimeError(f"kimi fixture vocabulary: {len(ranks)} tokens, expected {KIMI_BASE_VOCAB}")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what tokenizers' ByteLevel uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def kimi_special_tokens() -> dict[int, str]:
    """id -> content of all 256 reserved special tokens (after the base vocabulary)."""
    return {KIMI_BASE_VOCAB + i: KIMI_SPECIAL.get(i, f"<|reserved_token_{KIMI_BASE_VOCAB + i}|>")
            for i in range(KIMI_N_SPECIAL)}


def _write_kimi(out_dir: Path, model_max_length: int) -> None:
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(kimi_ranks().items(), key=lambda x: x[1])]
    (out_dir / "tiktoken.model").write_text("\n".join(lines) + "\n")
    special = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for i, c in kimi_special_tokens().items()}
    cfg = {
        "added_tokens_decoder": special,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "chat_template": KIMI_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "tokenizer_class": "TikTokenTokenizer",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer(arch: str, out_dir, model_max_length: int = 1024) -> None:
    """tokenizer.json + tokenizer_config.json (with chat template) into out_dir (Kimi: tiktoken.model instead of
    tokenizer.json, as the hub ships it)."""
    if FIXTURES[arch].tokenizer == "kimi":
        return _write_kimi(Path(out_dir), model_max_length)
    spec = STYLES[FIXTURES[arch].tokenizer]
    out_dir = Path(out_dir)
    build_tokenizer(arch).save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(spec["bos"]),
        "add_eos_token": False,
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "pad_token": spec["pad"],
        "unk_token": spec["unk"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": spec["chat_template"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
