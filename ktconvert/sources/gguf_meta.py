"""GGUF metadata (llama.cpp key names) -> a hub-style config.json dict, per GGUF architecture.

Only what the converter and ktrun need is mapped; a missing required key is an error naming it.
"""
from __future__ import annotations

import numpy as np

from ktconvert.sources.roles import SourceError


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


def _common(m: Meta, vocab_size: int) -> dict:
    cfg = {
        "vocab_size": vocab_size,
        "hidden_size": m.a("embedding_length"),
        "num_hidden_layers": m.a("block_count"),
        "num_attention_heads": m.a("attention.head_count"),
        "num_key_value_heads": m.a("attention.head_count_kv", m.a("attention.head_count")),
        "max_position_embeddings": m.a("context_length", 4096),
        "rms_norm_eps": m.a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": m.a("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id", None),
    }
    return cfg


def _deepseek2(m: Meta, cfg: dict, has_exp_probs_b: bool) -> dict:
    # DeepSeek-V3 / Kimi-K2: sigmoid gating (expert_gating_func 2) with a score-correction bias; V2: softmax (1).
    gating = m.a("expert_gating_func", 0)
    sigmoid = gating == 2 or (gating == 0 and has_exp_probs_b)
    nope_rope = m.a("attention.key_length_mla", None) or m.a("attention.key_length")
    rope_dim = m.a("rope.dimension_count")
    q_lora = m.a("attention.q_lora_rank", 0) or None
    cfg.update({
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "intermediate_size": m.a("feed_forward_length"),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "n_routed_experts": m.a("expert_count"),
        "num_experts_per_tok": m.a("expert_used_count"),
        "n_shared_experts": m.a("expert_shared_count", 0),
        "first_k_dense_replace": m.a("leading_dense_block_count", 0),
        "routed_scaling_factor": m.a("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(m.a("expert_weights_norm", False)),
        "n_group": m.a("expert_group_count", 1) or 1,
        "topk_group": m.a("expert_group_used_count", 1) or 1,
        "q_lora_rank": q_lora,
        "kv_lora_rank": m.a("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": nope_rope - rope_dim,
        "v_head_dim": m.a("attention.value_length_mla", None) or m.a("attention.value_length"),
        "moe_layer_freq": 1,
    })
    cfg["topk_method"] = "noaux_tc" if sigmoid else ("group_limited_greedy" if cfg["n_group"] > 1 else "greedy")
    if sigmoid:
        cfg["scoring_func"] = "sigmoid"
    if m.a("rope.scaling.type", "none") == "yarn":
        cfg["rope_scaling"] = {
            "type": "yarn", "rope_type": "yarn", "factor": m.a("rope.scaling.factor"),
            "original_max_position_embeddings": m.a("rope.scaling.original_context_length"),
            "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": m.a("rope.scaling.yarn_log_multiplier", 0.0) / 0.1,
        }
    return cfg


def _qwen3moe(m: Meta, cfg: dict, _has_exp_probs_b: bool) -> dict:
    cfg.update({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
        "head_dim": m.a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "intermediate_size": m.a("feed_forward_length", m.a("expert_feed_forward_length")),
        "moe_intermediate_size": m.a("expert_feed_forward_length"),
        "num_experts": m.a("expert_count"), "num_experts_per_tok": m.a("expert_used_count"),
        "norm_topk_prob": bool(m.a("expert_weights_norm", True)),
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    })
    return cfg


def _llama_moe(m: Meta, cfg: dict, _has_exp_probs_b: bool) -> dict:
    n_experts = m.a("expert_count", 0)
    if not n_experts:
        raise SourceError(f"{m.where}: GGUF architecture 'llama' without experts is a dense model; ktconvert "
                          f"converts Mixture-of-Experts models (Mixtral-style llama with expert_count > 0)")
    cfg.update({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "head_dim": m.a("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]),
        "intermediate_size": m.a("feed_forward_length"),
        "num_local_experts": n_experts, "num_experts_per_tok": m.a("expert_used_count"),
    })
    return cfg


BUILDERS = {"deepseek2": _deepseek2, "qwen3moe": _qwen3moe, "llama": _llama_moe}


def config_from_gguf(m: Meta, vocab_size: int, has_output: bool, has_exp_probs_b: bool) -> dict:
    if m.arch not in BUILDERS:
        raise SourceError(f"{m.where}: unsupported GGUF architecture {m.arch!r}; supported: "
                          f"{', '.join(sorted(BUILDERS))} (DeepSeek-V2/V3/Kimi-K2, Qwen3-MoE, Mixtral)")
    cfg = _common(m, vocab_size)
    cfg = BUILDERS[m.arch](m, cfg, has_exp_probs_b)
    cfg["tie_word_embeddings"] = not has_output
    return {k: v for k, v in cfg.items() if v is not None or k in ("q_lora_rank",)}
