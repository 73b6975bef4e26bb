"""Tiny deterministic tokenizers for the fixture checkpoints (byte-level BPE trained on a fixed text, no download).

Each family gets (by its fixture entry's tokenizer style) the special tokens and a chat template shaped like its hub tokenizer's, with the special
tokens at the ids its config names (bos/eos).
"""
from __future__ import annotations

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
    "mistral": {
        "special": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>", "eos": "</s>", "pad": None, "unk": "<unk>",
        "chat_template": (
            "{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
            "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")},
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A mixture of experts routes every token to a few experts and adds their outputs.",
    "Hello, world! What is the capital of France? The capital of France is Paris.",
    "one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9",
    "def main():\n    print('hello')\n",
    "Large language models predict the next token from the tokens before it.",
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


def write_tokenizer(arch: str, out_dir, model_max_length: int = 1024) -> None:
    """tokenizer.json + tokenizer_config.json (with chat template) into out_dir."""
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
