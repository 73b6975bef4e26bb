"""safetensors shard headers, parsed and validated without trusting them (never unpickled).

A shard is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (plus an
optional __metadata__), then the tensor bytes; data_offsets are relative to the end of the header.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ktconvert.sources.roles import SourceError

DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1,    # E8M0: MX / DeepSeek-V4 scales
               "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8}      # integers: parts of quantized Linears only
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str            # safetensors dtype string: BF16, F16, F32, F8_E4M3, I8 ... I64
    shape: tuple
    file: Path
    offset: int           # absolute byte offset of the data in `file`
    nbytes: int


def parse_shard(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """Validate one shard's header and layout; returns its tensors and the data start offset."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError(f"{path}: file is {size} bytes, too short for a safetensors header (8 bytes)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SourceError(f"{path}: header length {n} at byte offset 0 does not fit in the {size}-byte file "
                                  f"(truncated or not a safetensors file)")
            raw = f.read(n)
    except OSError as e:
        raise SourceError(f"{path}: cannot read shard: {e}") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"{path}: corrupt safetensors header (bytes 8..{8 + n}): {e}") from e
    if not isinstance(header, dict):
        raise SourceError(f"{path}: corrupt safetensors header (bytes 8..{8 + n}): not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise SourceError(f"{path}: tensor {name}: header entry lacks dtype/shape/data_offsets")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise SourceError(f"{path}: tensor {name}: unsupported dtype {dtype} "
                              f"(supported: {', '.join(DTYPE_SIZES)})")
        if (not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape)
                or not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)):
            raise SourceError(f"{path}: tensor {name}: malformed shape {shape} or data_offsets {offs}")
        begin, end = offs
        want = math.prod(shape) * DTYPE_SIZES[dtype]
        if end - begin != want:
            raise SourceError(f"{path}: tensor {name}: data_offsets {offs} hold {end - begin} bytes, "
                              f"but {dtype}{shape} needs {want}")
        spans.append((begin, end, name))
        tensors[name] = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, want)
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise SourceError(f"{path}: tensor {name}: data starts at byte offset {data_start + begin}, expected "
                              f"{data_start + pos} (offsets not contiguous: gap or overlap)")
        pos = end
    expected_size = data_start + pos
    if size != expected_size:
        last = spans[-1][2] if spans else "(none)"
        what = "truncated" if size < expected_size else "has trailing bytes"
        raise SourceError(f"{path}: shard {what}: expected {expected_size} bytes, file has {size} "
                          f"(last tensor {last} ends at byte offset {expected_size})")
    return tensors, data_start
