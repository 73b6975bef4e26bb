"""ModelConfig: one dataclass for what a family's config.json says, read by the converter and the runtime alike.

Each family file turns a config.json dict into a ModelConfig with a `Fields` reader. Three kinds of field:
- `need`: decides the converted files (layers, hidden size, experts, top-k, expert size); missing -> ConfigError,
  always. A silent default here would write a different model.
- `run`: needed only to run the forward (vocab, attention sizes, dense MLP size); missing -> ConfigError when
  parsing for the runtime, None when parsing for conversion (`for_runtime=False`), which never uses them.
- `get`: everything else takes the default of the family's transformers config class when absent (or null), e.g.
  DeepseekV3Config.first_k_dense_replace = 3, DeepseekV2Config's 0 (checked against transformers by
  tests/test_families.py). Token ids are the exception: absent stays None, since a made-up EOS id would cut
  generations short; generation_config.json and the tokenizer supply them.
Accepts both spellings seen in the wild: the hub's `rope_scaling` + `rope_theta` and transformers 5's
`rope_parameters`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import ConfigError

_ABSENT = object()


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
class LinearAttentionConfig:
    """Gated DeltaNet linear attention (Qwen3-Next): per layer a causal depthwise conv over q|k|v and a recurrent
    state (v_heads, k_head_dim, v_head_dim) instead of a KV cache."""
    conv_kernel: int                      # depthwise causal conv width over the q|k|v channels
    num_k_heads: int
    num_v_heads: int                      # a multiple of num_k_heads (q/k heads are shared by groups of v heads)
    k_head_dim: int
    v_head_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k (num_k_heads * k_head_dim each) and v (num_v_heads * v_head_dim)."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class ExpertActivation:
    """What a routed expert computes between its gate/up and down projections.

    "silu":  h = silu(g) * u                                        (most families)
    "swiglu_clamped" (gpt-oss, with per-expert biases on gate, up and down):
             g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g)
    "silu_clamped" (DeepSeek-V4, limit = swiglu_limit):
             g = min(g, limit), u = clamp(u, -limit, limit), h = silu(g) * u
    """
    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    bias: bool = False                    # gate/up/down biases per expert (gpt-oss: experts.gate_up_proj_bias ...)

    KINDS = ("silu", "swiglu_clamped", "silu_clamped")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"expert activation {self.kind!r} is not one of {', '.join(self.KINDS)}")


SILU = ExpertActivation()


@dataclass(frozen=True)
class SlidingAttention:
    """The GQA attention of a family's "sliding_attention" layers where it differs from its full-attention layers'
    beyond the window (MiMo-V2-Flash: twice the kv heads, its own RoPE theta, a sink logit per head)."""
    num_kv_heads: int
    rope: RopeConfig | None               # None when parsed for conversion
    sinks: bool                           # a learned sink logit per head joins each query's softmax


@dataclass(frozen=True)
class ModelConfig:
    model_type: str                       # the family's name (an alias such as kimi_k2 reads as deepseek_v3)
    num_layers: int                       # main decoder layers (multi-token-prediction layers not counted)
    hidden_size: int
    num_experts: int                      # routed experts per MoE layer
    top_k: int
    moe_intermediate_size: int            # one routed expert's intermediate size
    moe_layers: tuple[int, ...]           # which layers have routed experts (the rest are dense MLPs)
    attention: str                        # "mla" (DeepSeek latent attention) | "gqa"
    # needed only by the forward: None when parsed with for_runtime=False and config.json lacks them
    vocab_size: int | None
    num_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None                  # GQA head dim (qwen3 / mixtral); MLA: qk_rope_head_dim
    intermediate_size: int | None         # dense MLP
    rope: RopeConfig | None
    rms_norm_eps: float = 1e-6
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False                 # RMSNorm over q and k before RoPE (Qwen3, GLM-4.5, MiniMax-M2)
    qk_norm_scope: str = "head"           # "head": each head's dims (Qwen3, GLM); "projection": the whole q (k)
                                          # projection at once, all heads together (MiniMax-M2)
    sliding_window: int | None = None
    # MoE
    n_shared_experts: int = 0
    first_k_dense: int = 0                # deepseek: layers < this are dense MLP
    n_mtp_layers: int = 0                 # multi-token-prediction layers after the main ones (skipped)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    scoring: str = "softmax"              # "softmax" | "sigmoid": the router's scores (ktrun.models.generic)
    router_float32: bool = False          # softmax router logits from float32 x and weights (DeepSeek-V2's own);
                                          # False: in the activations' dtype (Qwen3-MoE, Mixtral)
    router_renormalizes: bool = True      # the softmax router honours norm_topk_prob (transformers' DeepSeek-V2
                                          # router reads it nowhere: False)
    topk_method: str = "greedy"           # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    # MLA (deepseek)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # hybrid linear attention (Qwen3-Next): "full_attention" | "linear_attention" per layer (empty: all full)
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttentionConfig | None = None
    # DeepSeek-V3.2's lightning indexer (sparse attention): per query, only the index_topk keys it scores highest
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    index_rope_interleaved: bool = False  # the indexer ropes interleaved pairs (GLM-5), not halves (V3.2)
    # GLM-5.2's index sharing: "full" | "shared" per layer; a shared layer runs no indexer and attends to the keys the
    # previous full layer selected (empty: every indexed layer selects its own)
    indexer_types: tuple[str, ...] = ()
    # gpt-oss: every other layer attends within a sliding window (layer_types "sliding_attention"), each head adds a
    # learned sink logit to its softmax; routed experts carry biases and a clamped SwiGLU (ExpertActivation)
    attention_sinks: bool = False
    expert_activation: ExpertActivation = field(default_factory=lambda: SILU)
    # LongCat-Flash: identity ("zero") experts the router may pick beside the routed ones (router ids num_experts ..
    # num_experts + zero_experts - 1); a token's zero experts add its MoE input times their weights, no weights
    zero_experts: int = 0
    # MiMo-V2-Flash: sliding layers' own kv heads, rope and sinks (attention_sinks then says whether the full layers
    # have sinks); values scaled by value_scale before attention; v_head_dim (above) is GQA's value head dim too
    sliding_attention: SlidingAttention | None = None
    value_scale: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

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


class Fields:
    """One config.json dict as a family's parse function reads it: every error names the file and the field."""

    def __init__(self, raw: dict, where: str, model_type: str, for_runtime: bool = True):
        self.raw, self.where, self.model_type, self.for_runtime = raw, where, model_type, for_runtime

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message} for model_type {self.model_type}")

    def _cast(self, key: str, value, cast):
        if cast is None or value is None:
            return value
        if cast in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise self.error(f"field {key!r} = {value!r} is not a number")
        if cast is int and value != int(value):
            raise self.error(f"field {key!r} = {value!r} is not an integer")
        return cast(value)

    def need(self, key: str, *alternatives: str, cast=int):
        """A required field (the first of key, *alternatives that is present and not null)."""
        for k in (key, *alternatives):
            if self.raw.get(k) is not None:
                return self._cast(k, self.raw[k], cast)
        alts = f" (or {', '.join(repr(a) for a in alternatives)})" if alternatives else ""
        raise self.error(f"missing required field {key!r}{alts}")

    def run(self, key: str, *alternatives: str, cast=int):
        """A field only the forward needs: required for the runtime, None for conversion when absent."""
        if self.for_runtime:
            return self.need(key, *alternatives, cast=cast)
        for k in (key, *alternatives):
            if self.raw.get(k) is not None:
                return self._cast(k, self.raw[k], cast)
        return None

    def get(self, key: str, default, cast=None, keep_null: bool = False):
        """An optional field: the transformers default when absent; null also reads as the default unless
        keep_null (fields where null means something, such as q_lora_rank: null = no q LoRA)."""
        value = self.raw.get(key, _ABSENT)
        if value is _ABSENT or (value is None and not keep_null):
            return default
        return self._cast(key, value, cast)

    def check(self, ok: bool, message: str) -> None:
        """An inconsistency between fields -> ConfigError naming them."""
        if not ok:
            raise self.error(message)

    def text_config(self, model_types: tuple[str, ...], default_type: str) -> Fields:
        """The text model's config of a multimodal release (text_config, whose model_type is one of model_types,
        default_type when absent) as a Fields reader whose errors name `text_config.<field>`."""
        text = self.raw.get("text_config")
        if not isinstance(text, dict):
            raise self.error("missing required field 'text_config' (the language model's config)" if text is None
                             else f"field 'text_config' = {text!r} is not an object")
        mt = text.get("model_type", default_type)
        if mt not in model_types:
            raise ConfigError(f"{self.where}: text_config.model_type {mt!r} is not one of {', '.join(model_types)} "
                              f"for model_type {self.model_type}")
        return Fields(text, f"{self.where} text_config", self.model_type, self.for_runtime)

    def layer_types(self, n_layers: int, allowed: tuple[str, ...], default) -> tuple[str, ...]:
        """`layer_types`: one of `allowed` per layer; default() (the family's pattern) when absent."""
        types = self.get("layer_types", None)
        if types is None:
            return default()
        self.check(isinstance(types, list) and len(types) == n_layers,
                   f"field 'layer_types' must list one type per layer (num_hidden_layers={n_layers}), got {types!r}")
        for i, t in enumerate(types):
            self.check(t in allowed, f"field 'layer_types'[{i}] = {t!r} is not one of {', '.join(allowed)}")
        return tuple(types)


def token_ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else (int(v),)


def parse_rope(f: Fields, dim: int | None, default_theta: float, max_position: int,
               interleaved: bool = False) -> RopeConfig | None:
    """rope_parameters / rope_scaling + rope_theta -> RopeConfig (None when parsing for conversion)."""
    if not f.for_runtime:
        return None
    raw = f.raw
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta"))
    theta = default_theta if theta is None else theta
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{f.where}: rope type {kind!r} is not supported (default, yarn)")
    if kind == "default":
        return RopeConfig(theta=float(theta), dim=dim, interleaved=interleaved)
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if not factor:
        f.check(bool(original), "missing required field 'rope_scaling.factor' (or "
                                "'rope_scaling.original_max_position_embeddings')")
        factor = max_position / original
    return RopeConfig(
        theta=float(theta), dim=dim, kind="yarn", factor=float(factor),
        original_max_position=int(original or max_position),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        attention_factor=params.get("attention_factor"), truncate=bool(params.get("truncate", True)),
        interleaved=interleaved)


def check_routing(f: Fields, n_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1,
                  grouped: bool = False, experts_key: str = "n_routed_experts", sigmoid_groups: bool = False,
                  group_key: str = "n_group") -> None:
    """Expert count, top-k and group counts agree (before any weight is read). sigmoid_groups: the sigmoid router's
    group scores sum each group's top 2, so every group needs 2 experts."""
    f.check(n_experts >= 0, f"{experts_key}={n_experts} is negative")
    if n_experts == 0:
        return
    f.check(1 <= top_k <= n_experts, f"num_experts_per_tok={top_k} must be in 1..{experts_key}={n_experts}")
    if sigmoid_groups:
        f.check(n_experts // n_group >= 2, f"{experts_key}={n_experts} / {group_key}={n_group} leaves fewer than 2 "
                                           f"experts per group (group scores sum each group's top 2)")
    if not grouped:
        return
    f.check(n_group >= 1 and n_experts % n_group == 0,
            f"{experts_key}={n_experts} is not a multiple of n_group={n_group}")
    f.check(1 <= topk_group <= n_group, f"topk_group={topk_group} must be in 1..n_group={n_group}")
    f.check(top_k <= topk_group * (n_experts // n_group),
            f"num_experts_per_tok={top_k} > topk_group={topk_group} groups x {n_experts // n_group} experts each")


def rotary_dims(f: Fields, head_dim: int | None, default_factor: float = 1.0) -> int | None:
    """Rotary dims per head of a partial-rotary family: `rotary_dim` (MiniMax-M2's hub configs), else
    head_dim x `partial_rotary_factor` (GLM's hub configs at the top level, transformers 5 inside
    rope_parameters), else head_dim x the family's transformers default."""
    if head_dim is None:
        return None
    if f.raw.get("rotary_dim") is not None:
        dim = f.get("rotary_dim", head_dim, cast=int)
        key = "rotary_dim"
    else:
        params = f.raw.get("rope_parameters") or f.raw.get("rope_scaling") or {}
        factor = params.get("partial_rotary_factor", f.raw.get("partial_rotary_factor"))
        factor = default_factor if factor is None else factor
        f.check(isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1,
                f"field 'partial_rotary_factor' = {factor!r} must be in (0, 1]")
        dim, key = int(head_dim * factor), "partial_rotary_factor"
    f.check(0 < dim <= head_dim and dim % 2 == 0, f"field {key!r} gives {dim} rotary dims per head; they must be "
                                                  f"even and in 1..head_dim={head_dim}")
    return dim


def gqa_heads(f: Fields, hidden: int, kv_heads_default: int | None) -> tuple[int | None, int | None, int | None]:
    """(num_heads, num_kv_heads, head_dim) of a GQA family; kv heads default to the family's transformers default
    (None: as many as query heads), head_dim to hidden / heads."""
    nh = f.run("num_attention_heads")
    if nh is None:
        return None, None, None
    nkv = f.get("num_key_value_heads", kv_heads_default or nh, cast=int)
    f.check(nh % nkv == 0, f"num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}")
    return nh, nkv, f.get("head_dim", hidden // nh, cast=int)
