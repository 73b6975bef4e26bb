"""Structured output: `response_format` json_object / json_schema enforced by xgrammar on the logits of every step.

xgrammar (the grammar engine vLLM and SGLang use) compiles a JSON schema against the model's vocabulary once per
schema (cached), and a per-sequence matcher masks every token that cannot continue valid output; once the value is
complete only EOS is allowed. xgrammar installs from PyPI as a CPU wheel and reads our tokenizer.json (byte-level BPE
and sentencepiece byte-fallback vocabularies) through transformers' fast-tokenizer wrapper. Whitespace between JSON
tokens is not allowed (any_whitespace=False): a model cannot pad its output with newlines until max_tokens.
A schema xgrammar cannot compile is a 400 naming the reason.
"""
from __future__ import annotations

import json
import re
import threading

from .protocol import ApiError

_lock = threading.Lock()
_compilers: dict[int, object] = {}     # id(tokenizer) -> xgrammar.GrammarCompiler


def _compiler(tok, vocab_size: int, stop_ids: list[int]):
    import xgrammar as xgr

    with _lock:
        key = id(tok)
        if key not in _compilers:
            backend = getattr(tok, "backend", None)             # ktrun.text.tokenizer.Tokenizer: a `tokenizers` object
            if backend is not None:
                from transformers import PreTrainedTokenizerFast

                info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                          vocab_size=vocab_size, stop_token_ids=stop_ids)
            else:                              # a byte vocabulary (ids 0-255; the rest special), as the test fakes use
                vocab = [bytes([i]) for i in range(256)] + [f"<special_{i}>".encode() for i in range(256, vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_ids)
            _compilers[key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return _compilers[key]


def compile_response_format(fmt, tok, vocab_size: int, stop_ids: list[int]):
    """response_format -> a compiled grammar (None for type 'text'). Raises ApiError 400 for a schema that does not
    compile. Slow for big schemas: call it off the event loop."""
    if fmt is None or fmt.type == "text":
        return None
    comp = _compiler(tok, vocab_size, sorted(stop_ids))
    try:
        if fmt.type == "json_object":
            return comp.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
        schema = fmt.json_schema.schema_
        return comp.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                        strict_mode=fmt.json_schema.strict is not False)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ApiError(400, f"response_format: this JSON schema is not supported: {_reason(e)}",
                       code="invalid_parameter", param="response_format") from None


# what xgrammar's C++ logging puts before a message: "[18:01:15] /project/cpp/json_schema_converter.cc:5088: "
_LOG_PREFIX = re.compile(r"^\s*\[\d{1,2}:\d{2}:\d{2}\]\s+\S+:\d+:\s*")


def _reason(e: Exception) -> str:
    """xgrammar's message without its log prefix (time, source file and line) or a C++ stack trace."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(e).splitlines()]
    lines = [x for x in lines if x and not x.lower().startswith("stack trace")]
    return (lines[0] if lines else type(e).__name__)[:300]


class GrammarProcessor:
    """A logits processor (output_ids, logits) -> logits for one sequence: accepts the tokens generated since the
    last call, then masks the tokens the grammar does not allow next (runs in the engine's step)."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.seen = 0

    def __call__(self, output_ids: list[int], logits):
        for t in output_ids[self.seen:]:
            self.matcher.accept_token(int(t))
        self.seen = len(output_ids)
        if self.matcher.is_terminated():
            return logits
        self.matcher.fill_next_token_bitmask(self.mask)
        self._xgr.apply_token_bitmask_inplace(logits, self.mask.to(logits.device))
        return logits


def processor_factory(compiled):
    """SamplingParams.logits_processors entry: one GrammarProcessor per sequence (each of n choices its own)."""
    return lambda: GrammarProcessor(compiled)
