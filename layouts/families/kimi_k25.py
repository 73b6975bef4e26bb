"""Kimi-K2.5 (model_type kimi_k25): Kimi-K2's text model (DeepSeek-V3: MLA, sigmoid routing with
e_score_correction_bias, shared experts) wrapped with a vision tower. config.json holds the text model's config
under `text_config` (its model_type kimi_k2 or deepseek_v3) beside `vision_config`; the checkpoint names the text
model's tensors under `language_model.` (language_model.model.layers.N..., language_model.lm_head.weight) and the
vision tower's under vision_tower. / mm_projector.: those are skipped (the converter says so in its log) and ktrun
serves the text model. The release's weights are compressed-tensors INT4 (an already-quantized source). GGUF:
llama.cpp's converter writes the text model as `deepseek2` (read back as DeepSeek-V3).
"""
from __future__ import annotations

import dataclasses

from . import deepseek_v2, deepseek_v3
from .config import Fields, ModelConfig
from .family import Family
from .hub_names import HubNames, prefixed

PREFIX = "language_model."
VISION = "vision tower and multimodal projector (ktrun serves Kimi-K2.5 as a text model)"
ROWS = [(r"(vision_tower|mm_projector|multi_modal_projector|model\.mm_projector|model\.vision_tower)\.", "skip",
         None, VISION)] + prefixed(deepseek_v2.MLA_ROWS, PREFIX)
TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")


def text_fields(f: Fields) -> Fields:
    return f.text_config(TEXT_MODEL_TYPES, "deepseek_v3")


def parse(f: Fields) -> ModelConfig:
    cfg = deepseek_v3.parse(text_fields(f))
    return dataclasses.replace(cfg, model_type=f.model_type, raw=f.raw)


FAMILY = Family(
    name="kimi_k25", title="Kimi-K2.5", architectures=("Kimi_K25ForConditionalGeneration",), parse=parse,
    names=HubNames(ROWS, PREFIX + deepseek_v2.EXPERT_NAME, deepseek_v2.GATE_UP_DOWN, moe_prefix="mlp.",
                   shared_prefix="mlp.shared_experts.", mtp=True, prefix=PREFIX), gguf=deepseek_v2.GGUF, text_config_key="text_config")
