"""Which hub tensor plays which role in one checkpoint: the family registry (ktlayouts.families, where every family's
config fields and tensor names are described once) bound to the checkpoint's config.json, with the registry's
errors re-raised as SourceError (same messages)."""
from __future__ import annotations

from contextlib import contextmanager

from ktlayouts.families import (
    KINDS,
    MODEL_TYPE_ALIASES,
    PROJS,
    SUPPORTED_MODEL_TYPES,
    Family,
    FamilyError,
    Fields,
    ModelConfig,
    TensorRole,
    family_for,
)

__all__ = ["KINDS", "MODEL_TYPE_ALIASES", "PROJS", "SUPPORTED_MODEL_TYPES", "ArchAdapter", "SourceError", "TensorRole",
           "adapter_for", "as_source_error"]


class SourceError(Exception):
    """A checkpoint that cannot be read as claimed; the message names the file, tensor and byte offset at fault."""


@contextmanager
def as_source_error():
    """Registry errors (a ValueError family in ktlayouts) surface in the converter as SourceError."""
    try:
        yield
    except FamilyError as e:
        raise SourceError(str(e)) from None


class ArchAdapter:
    """Hub tensor names -> roles for one checkpoint's config (parsed for conversion: fields only the forward needs
    may be absent)."""

    def __init__(self, family: Family, config: dict, where: str = "config.json"):
        self.family, self.config = family, config
        with as_source_error():
            self.cfg: ModelConfig = family.parse(Fields(config, where, family.name, for_runtime=False))
        c = self.cfg
        self.model_type: str = c.model_type
        self.num_layers: int = c.num_layers                  # without MTP layers
        self.hidden_size: int = c.hidden_size
        self.n_experts: int = c.num_experts
        self.top_k: int = c.top_k
        self.moe_intermediate_size: int = c.moe_intermediate_size
        self.intermediate_size: int | None = c.intermediate_size
        self.n_shared_experts: int = c.n_shared_experts
        self.n_mtp_layers: int = c.n_mtp_layers

    def moe_layers(self) -> list[int]:
        return list(self.cfg.moe_layers)

    def mtp_layers(self, names=None) -> list[int]:
        """The multi-token-prediction layers the config declares (DeepSeek's layout, at num_hidden_layers); with
        names (the checkpoint's tensor names), only those it holds in that layout (their eh_proj: a GGUF's NextN
        blocks, under llama.cpp's names, are not)."""
        layers = self.family.names.mtp_layers(self.cfg)
        if names is None:
            return layers
        names = set(names)
        return [li for li in layers if self.family.names.layer(li) + "eh_proj.weight" in names]

    def expert_tensor_name(self, layer: int, expert: int, proj: str) -> str:
        return self.family.names.expert_tensor_name(layer, expert, proj)

    def expert_tensor_names(self) -> list[str]:
        """Every routed-expert weight the config promises, in (layer, expert, proj) order."""
        return [self.expert_tensor_name(li, e, p) for li in self.cfg.moe_layers for e in range(self.n_experts)
                for p in PROJS]

    def classify(self, name: str, keep_mtp: bool = False) -> TensorRole:
        """keep_mtp: an MTP layer's tensors get their role (marked mtp) instead of "skip"."""
        with as_source_error():
            return self.family.names.classify(name, self.cfg, keep_mtp)

    def __repr__(self) -> str:
        return (f"ArchAdapter({self.model_type}, layers={self.num_layers}, experts={self.n_experts}, "
                f"top_k={self.top_k}, hidden={self.hidden_size}, moe_intermediate={self.moe_intermediate_size})")


def adapter_for(config: dict, where: str = "config.json") -> ArchAdapter:
    """The adapter for a parsed config.json; unsupported model_type -> SourceError listing the supported ones."""
    with as_source_error():
        family = family_for(config, where)
    return ArchAdapter(family, config, where)
