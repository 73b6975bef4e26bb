"""Family: everything on-disk about one model family, in one object (each lives in its own file beside this one)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import Fields, ModelConfig
from .gguf_names import GGUFArch
from .hub_names import HubNames

ATTENTION_KINDS = ("mla", "gqa")


@dataclass(frozen=True)
class Family:
    name: str                                 # canonical model_type, e.g. "deepseek_v3"
    title: str                                # for people: "DeepSeek-V3 / R1, Kimi-K2"
    architectures: tuple[str, ...]            # config.json "architectures" class names of this family
    parse: Callable[[Fields], ModelConfig]    # config.json fields -> ModelConfig (errors name the field)
    names: HubNames                           # hub tensor names and roles
    runtime_module: str = "generic"           # ktrun.models.<runtime_module> runs it (a name: ktlayouts never
                                              # imports ktrun); "generic" picks attention and router from the
                                              # ModelConfig: only a family with new math names a module of its own
    aliases: tuple[str, ...] = ()             # other model_type values read as this family (same tensors, math)
    gguf: GGUFArch | None = None              # llama.cpp's architecture for it, when llama.cpp converts it
    text_config_key: str | None = None        # config.json key holding the text model's config (Kimi-K2.5's
                                              # "text_config"), None: the text model's fields are at the top
    text_architecture: str | None = None      # transformers' / vLLM's text-only class of a multimodal release
                                              # (Qwen3.5-MoE's Qwen3_5MoeForCausalLM): what an export of the text
                                              # model (the vision tower is never converted) declares

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def text_config(self, raw: dict) -> dict:
        """The config.json dict of the text model (what transformers' text model class and quantization_config of
        the weights are read from): raw itself, or raw[text_config_key]."""
        if self.text_config_key is None:
            return raw
        sub = raw.get(self.text_config_key)
        return sub if isinstance(sub, dict) else {}
