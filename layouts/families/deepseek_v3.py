"""DeepSeek-V3 / R1 and Kimi-K2 (model_type kimi_k2: the same tensors and math): V2's MLA attention with YaRN,
sigmoid routing with e_score_correction_bias and group-limited top-k (noaux_tc), routed_scaling_factor, shared
experts, first_k_dense_replace dense layers, and multi-token-prediction layers after the main ones (skipped).
GGUF: llama.cpp's `deepseek2` (defined with DeepSeek-V2)."""
from __future__ import annotations

from . import deepseek_v2
from .config import Fields, ModelConfig
from .family import Family

# transformers DeepseekV3Config's defaults for the fields we read
DEFAULTS = {"first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "n_shared_experts": 1, "q_lora_rank": 1536, "max_position_embeddings": 4096,
            "num_key_value_heads": 128}


def parse(f: Fields) -> ModelConfig:
    # transformers' DeepSeek-V3 always routes by sigmoid + noaux_tc, whatever scoring_func / topk_method say
    return deepseek_v2.parse_mla(f, defaults=DEFAULTS, experts_alias="num_local_experts", scoring="sigmoid",
                                 topk_method="noaux_tc", interleaved=bool(f.get("rope_interleave", True)), mtp=True)


FAMILY = Family(
    name="deepseek_v3", title="DeepSeek-V3 / R1, Kimi-K2", architectures=("DeepseekV3ForCausalLM",),
    aliases=("kimi_k2",), parse=parse, names=deepseek_v2.hub_names(mtp=True),
    gguf=deepseek_v2.GGUF)
