"""Reference next-token distributions of one model on a fixed token set (`ktrun perplexity --kl-divergence-base`,
`ktconvert quantize --report-kl`), so that another conversion can be scored against them (`--kl-divergence`).

A plain safetensors file (any reader opens it), written chunk by chunk so memory stays at one chunk:

    tokens     (n_chunks, ctx) I32                the chunk tokens as run (first token already BOS when the tokenizer
                                                  adds one: llama-perplexity's protocol)
    log_probs  (n_chunks, ctx - 1 - first, V) F32 log-softmax of the reference logits at positions first .. ctx-2
                                                  (each predicts the token after it), first = ctx // 2
    __metadata__["kt.logprobs"]                   JSON {"version", "ctx", "first", "n_chunks", "vocab", "source"}

Float32 log-probabilities, not llama.cpp's 16-bit quantized ones: the KL of a good 8-bit conversion (~1e-4) is of
the order of what that quantization (steps of ~2.4e-4 nats, tail below -16 nats dropped) would change.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .constants import FILE_ALIGN
from .converted_dir import ManifestError, read_safetensors_header

LOGPROBS_VERSION = 1
META_LOGPROBS = "kt.logprobs"


class LogprobsError(ValueError):
    """A reference file that is not a kt-logprobs file, or does not fit the run scored against it."""


def first_scored(ctx: int) -> int:
    """llama-perplexity scores the second half of each chunk: positions ctx//2 .. ctx-2 predict the next token."""
    return ctx // 2


@dataclass(frozen=True)
class LogprobsShape:
    n_chunks: int
    ctx: int
    vocab: int

    @property
    def first(self) -> int:
        return first_scored(self.ctx)

    @property
    def n_scored(self) -> int:
        return self.ctx - 1 - self.first


class LogprobsWriter:
    """Write the header first, then `add(tokens (ctx,), log_probs (n_scored, V))` once per chunk, in order; the file
    is complete (renamed from NAME.partial) at `close()`."""

    def __init__(self, path: str | Path, shape: LogprobsShape, source: str = ""):
        self.path, self.shape = Path(path), shape
        s = shape
        tok_bytes = s.n_chunks * s.ctx * 4
        tok_pad = -tok_bytes % FILE_ALIGN
        lp_bytes = s.n_chunks * s.n_scored * s.vocab * 4
        header = {"tokens": {"dtype": "I32", "shape": [s.n_chunks, s.ctx], "data_offsets": [0, tok_bytes]}}
        offset = tok_bytes
        if tok_pad:
            header["__pad__.0"] = {"dtype": "U8", "shape": [tok_pad], "data_offsets": [offset, offset + tok_pad]}
            offset += tok_pad
        header["log_probs"] = {"dtype": "F32", "shape": [s.n_chunks, s.n_scored, s.vocab],
                               "data_offsets": [offset, offset + lp_bytes]}
        meta = {"version": LOGPROBS_VERSION, "ctx": s.ctx, "first": s.first, "n_chunks": s.n_chunks,
                "vocab": s.vocab, "source": source}
        header["__metadata__"] = {META_LOGPROBS: json.dumps(meta, sort_keys=True)}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % FILE_ALIGN)
        self._data = 8 + len(raw)
        self._tok_off, self._lp_off = self._data, self._data + offset
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._f = open(self._partial, "wb")  # noqa: SIM115 (held open across add() calls, closed in close/abort)
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._data + offset + lp_bytes)
        self._next = 0

    def add(self, tokens: np.ndarray, log_probs: np.ndarray) -> None:
        s, i = self.shape, self._next
        if i >= s.n_chunks:
            raise LogprobsError(f"{self.path}: more than the {s.n_chunks} chunks planned")
        t = np.ascontiguousarray(tokens, dtype=np.int32)
        lp = np.ascontiguousarray(log_probs, dtype=np.float32)
        if t.shape != (s.ctx,) or lp.shape != (s.n_scored, s.vocab):
            raise LogprobsError(f"chunk {i}: tokens {t.shape} / log_probs {lp.shape}, expected ({s.ctx},) / "
                                f"({s.n_scored}, {s.vocab})")
        os.pwrite(self._f.fileno(), t.tobytes(), self._tok_off + i * s.ctx * 4)
        os.pwrite(self._f.fileno(), lp.tobytes(), self._lp_off + i * s.n_scored * s.vocab * 4)
        self._next += 1

    def close(self) -> None:
        if self._next != self.shape.n_chunks:
            self.abort()
            raise LogprobsError(f"{self.path}: {self._next} of {self.shape.n_chunks} chunks written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self._partial.unlink(missing_ok=True)


@dataclass
class Logprobs:
    """An opened reference file: tokens (n, ctx) int32 and log_probs (n, n_scored, V) float32, memory-mapped."""
    path: Path
    shape: LogprobsShape
    tokens: np.ndarray
    log_probs: np.ndarray
    source: str


def read_logprobs(path: str | Path) -> Logprobs:
    path = Path(path)
    if not path.is_file():
        raise LogprobsError(f"{path}: reference file does not exist (write it with --kl-divergence-base)")
    try:
        start, header = read_safetensors_header(path)
    except ManifestError as e:
        raise LogprobsError(str(e)) from None
    raw = (header.get("__metadata__") or {}).get(META_LOGPROBS)
    if raw is None or "tokens" not in header or "log_probs" not in header:
        raise LogprobsError(f"{path}: not a kt-logprobs file (no {META_LOGPROBS} metadata / tokens / log_probs)")
    meta = json.loads(raw)
    if meta.get("version", 0) > LOGPROBS_VERSION:
        raise LogprobsError(f"{path}: kt-logprobs version {meta['version']} is newer than this reader")
    shape = LogprobsShape(int(meta["n_chunks"]), int(meta["ctx"]), int(meta["vocab"]))
    want = {"tokens": ("I32", [shape.n_chunks, shape.ctx]),
            "log_probs": ("F32", [shape.n_chunks, shape.n_scored, shape.vocab])}
    size = path.stat().st_size
    out = {}
    for name, (dtype, dims) in want.items():
        h = header[name]
        if h["dtype"] != dtype or list(h["shape"]) != dims:
            raise LogprobsError(f"{path}: tensor {name} is {h['dtype']} {h['shape']}, metadata implies {dtype} {dims}")
        b, e = start + h["data_offsets"][0], start + h["data_offsets"][1]
        if e > size or e - b != int(np.prod(dims)) * 4:
            raise LogprobsError(f"{path}: tensor {name} (bytes {b}..{e}) does not fit the file ({size} bytes)")
        out[name] = np.memmap(path, dtype=np.int32 if dtype == "I32" else np.float32, mode="r", offset=b,
                              shape=tuple(dims))
    return Logprobs(path, shape, out["tokens"], out["log_probs"], str(meta.get("source", "")))
