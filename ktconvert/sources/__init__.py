"""Conversion sources: a hub checkpoint directory (safetensors, BF16/F16/F32, DeepSeek FP8, or an already-quantized
release: compressed-tensors, GPTQ, AWQ, FP8 per channel, MX formats, in `quantized/`) or a GGUF file, each validated
at open and read lazily one tensor at a time under hub tensor names."""
from __future__ import annotations

from pathlib import Path

from ktconvert.sources.checkpoint import Source
from ktconvert.sources.gguf import GGUFSource
from ktconvert.sources.roles import SourceError
from ktconvert.sources.st_header import DTYPE_SIZES, TensorInfo

__all__ = ["DTYPE_SIZES", "GGUFSource", "Source", "SourceError", "TensorInfo", "open_source"]


def open_source(path):
    """Open a local checkpoint: a directory (config.json + safetensors shards) or a GGUF file / split set
    (ktconvert.sources.gguf.GGUFSource, same interface); validates everything up front."""
    p = Path(path)
    if p.suffix == ".gguf" and p.is_file():
        return GGUFSource(p)
    if not p.is_dir():
        raise SourceError(f"{p}: not a directory (nor a .gguf file)")
    return Source(p)
