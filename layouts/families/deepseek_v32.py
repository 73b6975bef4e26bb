"""DeepSeek-V3.2 / V3.2-Exp (model_type deepseek_v32): DeepSeek-V3 (MLA with q LoRA, YaRN, sigmoid group-limited
routing with e_score_correction_bias, shared experts, first_k_dense_replace dense layers, MTP layers skipped) plus
DeepSeek Sparse Attention: in every layer a lightning indexer scores each query against all earlier tokens and the
MLA attention sees only the `index_topk` best (every earlier token while there are at most that many).

The indexer's tensors (hub names under self_attn.indexer.): `wq_b` (index_n_heads x index_head_dim, q_lora_rank) on
the MLA's normalized q LoRA activations, `wk` (index_head_dim, hidden) and its LayerNorm `k_norm` (weight and bias),
`weights_proj` (index_n_heads, hidden): per-head weights of the relu'd q.k scores. Its keys are cached per token.
GGUF: llama.cpp's converter does not write this architecture (its `deepseek2` has no indexer tensors).
"""
from __future__ import annotations

import dataclasses

from . import deepseek_v2
from .config import Fields, ModelConfig
from .family import Family
from .hub_names import LAYER, HubNames

ROWS = [
    (LAYER + r"self_attn\.indexer\.k_norm\.(weight|bias)$", "norm", None),
    (LAYER + r"self_attn\.indexer\.(wq_b|wk|weights_proj)\.weight$", "attention", None),
] + deepseek_v2.MLA_ROWS

# transformers DeepseekV32Config's defaults for the fields we read
DEFAULTS = {"first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "n_shared_experts": 1, "q_lora_rank": 1536, "max_position_embeddings": 163840,
            "num_key_value_heads": 128, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}


def parse(f: Fields) -> ModelConfig:
    cfg = deepseek_v2.parse_mla(f, defaults=DEFAULTS, experts_alias="num_experts", scoring="sigmoid",
                                topk_method="noaux_tc", interleaved=True, mtp=True)
    return deepseek_v2.with_mlp_layer_types(f, with_indexer(f, cfg, DEFAULTS))


def with_indexer(f: Fields, cfg: ModelConfig, defaults: dict) -> ModelConfig:
    """The lightning indexer's fields (index_n_heads, index_head_dim, index_topk; `defaults`: the family's
    transformers defaults), checked against the MLA's (V3.2 and GLM-5)."""
    f.check(cfg.q_lora_rank is not None, "q_lora_rank is null: the lightning indexer reads the q LoRA activations, "
                                         "so q_lora_rank must be set")
    heads = f.get("index_n_heads", defaults["index_n_heads"], cast=int)
    dim = f.get("index_head_dim", defaults["index_head_dim"], cast=int)
    topk = f.get("index_topk", defaults["index_topk"], cast=int)
    f.check(heads >= 1, f"index_n_heads={heads} must be >= 1")
    f.check(topk >= 1, f"index_topk={topk} must be >= 1")
    if cfg.qk_rope_head_dim is not None:
        f.check(cfg.qk_rope_head_dim <= dim, f"index_head_dim={dim} is smaller than qk_rope_head_dim="
                                             f"{cfg.qk_rope_head_dim} (the indexer ropes its first qk_rope_head_dim "
                                             f"dims)")
    return dataclasses.replace(cfg, index_n_heads=heads, index_head_dim=dim, index_topk=topk)


FAMILY = Family(
    name="deepseek_v32", title="DeepSeek-V3.2", architectures=("DeepseekV32ForCausalLM",), parse=parse,
    names=HubNames(ROWS, deepseek_v2.EXPERT_NAME, deepseek_v2.GATE_UP_DOWN, moe_prefix="mlp.",
                   shared_prefix="mlp.shared_experts.", mtp=True))
