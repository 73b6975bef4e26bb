"""Tokenizer of a converted (or hub) directory: `tokenizer.json` through `tokenizers`, special tokens and the chat
template from `tokenizer_config.json` (or `chat_template.jinja`), rendered with jinja2 the way transformers does.
A directory without a chat template gets the built-in DeepSeek-V3 one when its vocabulary has DeepSeek's chat
tokens (chat_templates.py). A directory with Kimi's `tiktoken.model` and no tokenizer.json (ktconvert writes one; a
hand-copied directory may lack it) gets the exact `tokenizers` conversion of it (ktlayouts.tiktoken_bpe).

BOS/EOS follow transformers (v5) loading a directory with tokenizer.json: add_bos_token / add_eos_token in
tokenizer_config.json are dropped and tokenizer.json's post-processor alone decides (none = no special tokens).
Chat prompts are rendered to text and encoded without special tokens (the template writes BOS itself), as
apply_chat_template does.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from ktlayouts import tiktoken_bpe
from ktlayouts.files import OutsideRootError, allowed_roots, resolve_inside
from tokenizers import Tokenizer as HFTokenizer

from .chat_templates import builtin_template

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tiktoken.model")


class TokenizerError(ValueError):
    pass


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, the other 68 are shifted to U+0100 onward in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, shift = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + shift)] = b
            shift += 1
    return out


_BYTE_OF_CHAR = _byte_level_chars()


def _token_str(v) -> str | None:
    if v is None:
        return None
    return v.get("content") if isinstance(v, dict) else str(v)


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _json_file(path: Path) -> dict:
    """A JSON object file, or {} when absent; TokenizerError naming the file when it does not parse."""
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:     # bad UTF-8 or JSON
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(out, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return out


def _check_links(d: Path) -> None:
    """The files read here resolve inside the folder (or its hub cache): none is a link to elsewhere."""
    roots = allowed_roots(d)
    for name in FILES:
        p = d / name
        if p.is_symlink():
            try:
                resolve_inside(p, roots)
            except OutsideRootError as e:
                raise TokenizerError(str(e)) from None


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        _check_links(d)
        tj = d / "tokenizer.json"
        try:
            converted = tiktoken_bpe.tokenizer_files(d)        # tiktoken.model only (Kimi): converted exactly
        except tiktoken_bpe.TiktokenError as e:
            raise TokenizerError(str(e)) from None
        if converted:
            self._tok = HFTokenizer.from_str(converted["tokenizer.json"].decode())
        elif tj.is_file():
            self._tok = HFTokenizer.from_file(str(tj))
        else:
            raise TokenizerError(f"{d}: tokenizer.json is missing (ktrun reads fast tokenizers, and tiktoken.model "
                                 f"for Kimi)")
        cfg = _json_file(d / "tokenizer_config.json")
        stm = _json_file(d / "special_tokens_map.json")
        self.special_tokens = {k: _token_str(cfg.get(k, stm.get(k))) for k in SPECIAL_KEYS}
        self.special_tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        self.bos_token_id = self._id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id(self.special_tokens.get("eos_token"))
        self.chat_template = self._find_template(d, cfg)
        self.chat_template_source = "model directory" if self.chat_template else None
        if self.chat_template is None:       # none shipped: a built-in one when the vocabulary fits (DeepSeek-V3)
            builtin = builtin_template(self._tok.get_vocab(with_added_tokens=True))
            if builtin:
                self.chat_template_source, self.chat_template = f"built-in {builtin[0]}", builtin[1]
        self._compiled = None
        self._byte_level: bool | None = None
        self._added = set(self._tok.get_added_tokens_decoder())

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @staticmethod
    def _find_template(d: Path, cfg: dict) -> str | None:
        """chat_template.jinja wins over tokenizer_config.json's entry (as transformers loads them)."""
        if (d / "chat_template.jinja").is_file():
            return (d / "chat_template.jinja").read_text(encoding="utf-8")
        t = cfg.get("chat_template")
        if isinstance(t, list):   # [{"name": "default", "template": ...}, ...]
            named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
            t = named.get("default")
        return t

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (for libraries that build on it, e.g. the grammar of structured output)."""
        return self._tok

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece can be part of a character)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self._byte_level is None:
            dec = json.loads(self._tok.to_str()).get("decoder") or {}
            kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) or []}
            self._byte_level = "ByteLevel" in kinds
        if self._byte_level and self._tok.token_to_id(piece) not in self._added:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:   # sentencepiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    **kwargs) -> str:
        """The conversation as the model's template writes it; `tools` (OpenAI tool definitions) go to the template
        as transformers passes them; other keyword arguments are template variables (e.g. enable_thinking)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer_config.json 'chat_template'); "
                                 "use a plain prompt instead of --chat")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        ctx = {**self.special_tokens, **kwargs}
        return self._compiled.render(messages=messages, tools=tools or None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **ctx)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs):
        """Like transformers: render, then encode without adding special tokens."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text
