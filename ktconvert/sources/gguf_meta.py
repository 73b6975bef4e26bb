"""GGUF metadata (llama.cpp key names) as typed values, and the hub-style config.json built from it.

How each architecture's keys map to config.json is family knowledge (ktlayouts.families, each family's GGUFArch);
this module reads the values out of gguf-py's fields, with errors naming the file and the key.
"""
from __future__ import annotations

import numpy as np
from ktlayouts.families import gguf_arch
from ktlayouts.families.gguf_names import config_from_gguf as _config_from_gguf

from ktconvert.sources.roles import SourceError, as_source_error


class Meta:
    """Typed access to a GGUF file's key/value metadata with errors that name the file and key."""

    def __init__(self, fields: dict, where: str):
        self.fields, self.where = fields, where
        self.arch = self.get("general.architecture")

    def get(self, key: str, default=...):
        f = self.fields.get(key)
        if f is None:
            if default is ...:
                raise SourceError(f"{self.where}: GGUF metadata key {key} is missing")
            return default
        value = f.contents()
        # GGUF stores float32: give back the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)
        return float(str(np.float32(value))) if isinstance(value, float) else value

    def a(self, key: str, default=...):
        """An architecture-scoped key, e.g. a('block_count') -> '<arch>.block_count'."""
        return self.get(f"{self.arch}.{key}", default)


def config_from_gguf(m: Meta, vocab_size: int, has_output: bool, names: frozenset) -> dict:
    with as_source_error():
        return _config_from_gguf(gguf_arch(m.arch, m.where), m, vocab_size, has_output, names)
