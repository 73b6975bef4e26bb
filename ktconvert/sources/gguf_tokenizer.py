"""Tokenizer files (tokenizer.json, tokenizer_config.json) rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

Supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`), which covers DeepSeek, Qwen and Llama-3-style
vocabularies. The pre-tokenizer is chosen by `tokenizer.ggml.pre`; an unknown one is an error naming it.
Tokens llama.cpp added only to pad the vocabulary to the embedding size (type UNUSED) are left out.
"""
from __future__ import annotations

import json

from ktconvert.sources.roles import SourceError

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> split regex ahead of the byte-level mapping (None: GPT-2's own regex inside ByteLevel).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# Qwen3.5's and o200k's (gpt-oss, MiniMax-M2) regexes as their tokenizer.json spells them (llama-vocab.cpp quotes them)
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# glm4: llama.cpp's CHATGLM4 pre-tokenizer is Llama-3's regex
PRE_TOKENIZERS = {"default": None, "gpt2": None, "gpt-2": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "qwen2": _QWEN2, "glm4": _LLAMA3, "qwen35": _QWEN35, "gpt-4o": _O200K, "minimax-m2": _O200K}


def _pre_tokenizer(pre: str, where: str):
    from tokenizers import Regex, pre_tokenizers
    if pre not in PRE_TOKENIZERS:
        raise SourceError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
                          f"{', '.join(sorted(PRE_TOKENIZERS))}")
    rx = PRE_TOKENIZERS[pre]
    if rx is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(rx), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_files(meta, model_max_length: int) -> dict[str, bytes]:
    """{file name: bytes} for tokenizer.json and tokenizer_config.json; meta is a gguf_meta.Meta."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    where = meta.where
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise SourceError(f"{where}: tokenizer.ggml.model {kind!r} is not supported (byte-level BPE 'gpt2' only)")
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != UNUSED}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), where)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, ty in enumerate(types) if ty == CONTROL])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
           "bos_token": bos, "eos_token": eos, "pad_token": token("padding"), "unk_token": token("unknown"),
           "clean_up_tokenization_spaces": False, "model_max_length": model_max_length}
    template = meta.get("tokenizer.chat_template", None)
    if template:
        cfg["chat_template"] = template
    return {"tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": (json.dumps(cfg, indent=2, ensure_ascii=False) + "\n").encode()}
