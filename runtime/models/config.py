"""ModelConfig: the architecture hyper-parameters ktrun needs, parsed and validated from a hub `config.json`.

Accepts both spellings seen in the wild: the hub's `rope_scaling` + `rope_theta` and transformers 5's
`rope_parameters`. Field names follow the hub config of each architecture.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MODEL_TYPES = {"deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral"}
DEFAULT_THETA = {"mixtral": 1_000_000.0}


class ConfigError(ValueError):
    """config.json describes something ktrun cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int                              # rotary dims per head
    kind: str = "default"                 # "default" | "yarn"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True
    interleaved: bool = False             # rotate (x0, x1), (x2, x3) pairs (DeepSeek) instead of halves


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int                         # GQA head dim (qwen3 / mixtral)
    intermediate_size: int                # dense MLP
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense: int = 0                # deepseek: layers < this are dense MLP
    moe_layers: tuple[int, ...] = ()      # resolved: which layers have routed experts
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scoring: str = "softmax"              # "softmax" | "sigmoid"
    topk_method: str = "greedy"           # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    # MLA (deepseek)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_mla(self) -> bool:
        return self.model_type in ("deepseek_v2", "deepseek_v3")

    @property
    def softmax_scale(self) -> float:
        """Attention logit scale, YaRN's mscale(factor, mscale_all_dim)^2 folded in as transformers does."""
        d = self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim
        s = d ** -0.5
        r = self.rope
        if r.kind != "default" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            s = s * m * m
        return s


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope(cfg: dict, model_type: str, dim: int) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", DEFAULT_THETA.get(model_type, 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"config.json: rope type {kind!r} is not supported (default, yarn)")
    interleaved = model_type == "deepseek_v2" or (model_type == "deepseek_v3" and cfg.get("rope_interleave", True))
    if kind == "default":
        return RopeConfig(theta=float(theta), dim=dim, interleaved=interleaved)
    return RopeConfig(
        theta=float(theta), dim=dim, kind="yarn",
        factor=float(params.get("factor") or cfg["max_position_embeddings"] / params["original_max_position_embeddings"]),
        original_max_position=int(params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleaved=interleaved)


def _eos(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def _first(cfg: dict, *keys: str):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise KeyError(keys[0])


def parse_config(cfg: dict, where: str = "config.json") -> ModelConfig:
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:   # e.g. Kimi-K2: model_type "kimi_k2", architecture DeepseekV3ForCausalLM
        mt = ARCHITECTURES.get((cfg.get("architectures") or [""])[0], mt)
    if mt not in MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; ktrun runs {sorted(MODEL_TYPES)}")
    try:
        L, H, nh = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
        common = dict(  # noqa: C408
            model_type=mt, vocab_size=cfg["vocab_size"], hidden_size=H, num_layers=L, num_heads=nh,
            num_kv_heads=cfg.get("num_key_value_heads") or nh, intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=_eos(cfg.get("eos_token_id")), raw=cfg)
        if mt in ("deepseek_v3", "deepseek_v2"):
            v3 = mt == "deepseek_v3"
            k0 = cfg.get("first_k_dense_replace", 3 if v3 else 0)
            freq = cfg.get("moe_layer_freq", 1)
            E = _first(cfg, "n_routed_experts", "num_local_experts")
            return ModelConfig(
                **common, head_dim=cfg["qk_rope_head_dim"], rope=_rope(cfg, mt, cfg["qk_rope_head_dim"]),
                num_experts=E, top_k=cfg["num_experts_per_tok"], moe_intermediate_size=cfg["moe_intermediate_size"],
                n_shared_experts=cfg.get("n_shared_experts") or 0, first_k_dense=k0,
                moe_layers=tuple(i for i in range(L) if E and i >= k0 and i % freq == 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
                scoring="sigmoid" if v3 else "softmax",
                topk_method="noaux_tc" if v3 else (cfg.get("topk_method") or "greedy"),
                n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                v_head_dim=cfg["v_head_dim"])
        hd = cfg.get("head_dim") or H // nh
        if mt == "qwen3_moe":
            E, step, only = _first(cfg, "num_experts", "num_local_experts"), cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
            return ModelConfig(
                **common, head_dim=hd, rope=_rope(cfg, mt, hd), num_experts=E, top_k=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                moe_layers=tuple(i for i in range(L) if i not in only and E > 0 and (i + 1) % step == 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window") else None)
        E = _first(cfg, "num_local_experts", "num_experts")
        return ModelConfig(
            **common, head_dim=hd, rope=_rope(cfg, mt, hd), num_experts=E, top_k=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["intermediate_size"], moe_layers=tuple(range(L)), norm_topk_prob=True,
            sliding_window=cfg.get("sliding_window"))
    except KeyError as e:
        raise ConfigError(f"{where}: missing required field {e.args[0]!r} for model_type {mt}") from None


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return parse_config(cfg, str(path))
