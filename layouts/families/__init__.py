"""ktlayouts.families: every model family ktconvert converts and ktrun runs, each described once, in its own file.

A family file (deepseek_v3.py, qwen3_moe.py, ...) defines `FAMILY`, a `Family`: its model_type, aliases and
architecture class names; how its config.json becomes a `ModelConfig` (MoE layers, experts, routing, attention
kind, rope; errors naming the field); its hub tensor names and their roles; its GGUF architecture (tensor names,
metadata -> config.json) when llama.cpp converts it; and the name of the ktrun module that runs its forward.
Family files are discovered here (every module of this package that is not a helper), not listed by hand.
Torch-free: on-disk knowledge only, imported by the converter and the runtime alike.

One rule resolves a config.json to its family: model_type names it (or one of its aliases: Kimi-K2's "kimi_k2" is
deepseek_v3); `architectures[0]` is used only when model_type is absent, and must agree with it when both name a
family.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path

from .config import SILU, ExpertActivation, Fields, LinearAttentionConfig, ModelConfig, RopeConfig, yarn_mscale
from .errors import ConfigError, FamilyError, TensorNameError
from .family import ATTENTION_KINDS, Family
from .gguf_names import GGUFArch
from .hub_names import KINDS, PROJS, FusedExperts, TensorRole

__all__ = [
    "ATTENTION_KINDS",
    "FAMILIES",
    "GGUF_ARCHS",
    "KINDS",
    "MODEL_TYPE_ALIASES",
    "PROJS",
    "SILU",
    "SUPPORTED_GGUF_ARCHS",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "ExpertActivation",
    "Family",
    "FamilyError",
    "Fields",
    "FusedExperts",
    "GGUFArch",
    "LinearAttentionConfig",
    "ModelConfig",
    "RopeConfig",
    "TensorNameError",
    "TensorRole",
    "family_for",
    "get_family",
    "gguf_arch",
    "load_config",
    "parse_config",
    "yarn_mscale",
]

_HELPERS = {"config", "errors", "family", "gguf_names", "hub_names"}


def _discover() -> dict[str, Family]:
    out = {}
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if mod.name in _HELPERS or mod.name.startswith("_"):
            continue
        fam = getattr(importlib.import_module(f"{__name__}.{mod.name}"), "FAMILY", None)
        if not isinstance(fam, Family) or fam.name != mod.name:
            raise ImportError(f"ktlayouts/families/{mod.name}.py must define FAMILY = Family(name={mod.name!r}, ...) "
                              f"(helpers start with an underscore)")
        out[fam.name] = fam
    return out


FAMILIES: dict[str, Family] = _discover()
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))
MODEL_TYPE_ALIASES: dict[str, str] = {a: f.name for f in FAMILIES.values() for a in f.aliases}


def _index(keys_of) -> dict:
    out = {}
    for fam in FAMILIES.values():
        for key in keys_of(fam):
            if key in out and out[key] is not fam:
                raise ImportError(f"ktlayouts.families: {key!r} is claimed by both {out[key].name} and {fam.name}")
            out[key] = fam
    return out


_BY_MODEL_TYPE = _index(lambda f: f.model_types)
_BY_ARCHITECTURE = _index(lambda f: f.architectures)


def _gguf_index() -> dict[str, GGUFArch]:
    out = {}
    for fam in FAMILIES.values():
        g = fam.gguf
        if g is not None:
            if g.name in out and out[g.name] is not g:
                raise ImportError(f"ktlayouts.families: GGUF architecture {g.name!r} is defined twice")
            out[g.name] = g
    return out


GGUF_ARCHS: dict[str, GGUFArch] = _gguf_index()
SUPPORTED_GGUF_ARCHS: tuple[str, ...] = tuple(sorted(GGUF_ARCHS))


def _supported() -> str:
    aliases = ", ".join(f"{a} as {n}" for a, n in sorted(MODEL_TYPE_ALIASES.items()))
    return ", ".join(SUPPORTED_MODEL_TYPES) + (f" (also read: {aliases})" if aliases else "")


def get_family(model_type: str, where: str = "config.json") -> Family:
    """The family of a model_type (its name or an alias)."""
    fam = _BY_MODEL_TYPE.get(model_type)
    if fam is None:
        raise ConfigError(f"{where}: unsupported model_type {model_type!r}; supported: {_supported()}")
    return fam


def family_for(raw: dict, where: str = "config.json") -> Family:
    """The family a config.json dict describes (the one rule in this module's docstring)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    archs = raw.get("architectures") or [None]
    arch = archs[0] if isinstance(archs, list) and archs else None
    by_arch = _BY_ARCHITECTURE.get(arch) if isinstance(arch, str) else None
    model_type = raw.get("model_type")
    if model_type is None:
        if by_arch is None:
            raise ConfigError(f"{where}: missing required field 'model_type'; supported: {_supported()}")
        return by_arch
    fam = get_family(model_type, where)
    if by_arch is not None and by_arch is not fam:
        raise ConfigError(f"{where}: model_type {model_type!r} is {fam.name}, but architectures[0] {arch!r} is "
                          f"{by_arch.name}; the two fields disagree")
    return fam


def parse_config(raw: dict, where: str = "config.json", *, for_runtime: bool = True) -> ModelConfig:
    """config.json dict -> ModelConfig. for_runtime=False (the converter) lets fields only the forward needs be
    absent (they read as None); everything that decides the converted files is required either way."""
    fam = family_for(raw, where)
    return fam.parse(Fields(raw, where, fam.name, for_runtime))


def load_config(path: str | Path, *, for_runtime: bool = True) -> ModelConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return parse_config(raw, str(path), for_runtime=for_runtime)


def gguf_arch(name: str, where: str) -> GGUFArch:
    """The registered GGUF architecture `general.architecture` names."""
    g = GGUF_ARCHS.get(name)
    if g is None:
        titles = {a: ", ".join(f.title for f in FAMILIES.values() if f.gguf is GGUF_ARCHS[a]) for a in GGUF_ARCHS}
        raise ConfigError(f"{where}: unsupported GGUF architecture {name!r}; supported: "
                          + ", ".join(f"{a} ({titles[a]})" for a in SUPPORTED_GGUF_ARCHS))
    return g
