"""What every conversion source shares: its tensor table and the lookups on it."""
from __future__ import annotations

from pathlib import Path

from ktconvert.sources.roles import SourceError


class SourceBase:
    """What every conversion source shares: a table of tensors (`self._infos`: hub name -> info with .nbytes) and
    its lookups. Subclasses: Source (safetensors directory), ktconvert.sources.gguf.GGUFSource."""

    path: Path
    _infos: dict

    def info(self, name: str):
        try:
            return self._infos[name]
        except KeyError:
            raise SourceError(f"{self.path}: no tensor named {name}") from None

    def source_nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint (headers excluded)."""
        return sum(i.nbytes for i in self._infos.values())

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
