"""Architecture adapters: which hub tensor name plays which role, as data tables per model_type.

A table row is (regex, kind, proj map). Groups named `layer`, `expert` and `proj` are captured; `proj` is mapped
through the row's proj map (Mixtral's w1/w3/w2 -> gate/up/down). The first matching row wins, so specific rows
(norms inside attention) come before general ones (the rest of attention).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

KINDS = ("expert", "router", "router_bias", "shared_expert", "attention", "dense_mlp",
         "norm", "embedding", "head", "skip")
PROJS = ("gate", "up", "down")


class SourceError(Exception):
    """A checkpoint that cannot be read as claimed; the message names the file, tensor and byte offset at fault."""


@dataclass(frozen=True)
class TensorRole:
    kind: str
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None


_L = r"model\.layers\.(?P<layer>\d+)\."
_GUD = {"gate": "gate", "up": "up", "down": "down"}
_MIXTRAL_W = {"w1": "gate", "w3": "up", "w2": "down"}

# Rows shared by every table: things that never become part of the converted model's math.
_COMMON_SKIP = [
    (r".*\.weight_scale_inv$", "skip", None),   # FP8 block scales, consumed when their weight is read
    (r".*rotary_emb\.inv_freq$", "skip", None),  # rotary buffers some old checkpoints carry
    (r"model\.embed_tokens\.weight$", "embedding", None),
    (r"model\.norm\.weight$", "norm", None),
    (r"lm_head\.weight$", "head", None),
    (_L + r"(input_layernorm|post_attention_layernorm)\.weight$", "norm", None),
]

_DEEPSEEK_ROWS = _COMMON_SKIP + [
    (_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", _GUD),
    (_L + r"mlp\.gate\.weight$", "router", None),
    (_L + r"mlp\.gate\.e_score_correction_bias$", "router_bias", None),
    (_L + r"mlp\.shared_experts\.(?P<proj>gate|up|down)_proj\.weight$", "shared_expert", _GUD),
    (_L + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", _GUD),
    (_L + r"self_attn\.(q_a_layernorm|kv_a_layernorm)\.weight$", "norm", None),
    (_L + r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$", "attention", None),
]

_QWEN3_MOE_ROWS = _COMMON_SKIP + [
    (_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$", "expert", _GUD),
    (_L + r"mlp\.gate\.weight$", "router", None),
    (_L + r"mlp\.(?P<proj>gate|up|down)_proj\.weight$", "dense_mlp", _GUD),  # mlp_only_layers
    (_L + r"self_attn\.(q_norm|k_norm)\.weight$", "norm", None),
    (_L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$", "attention", None),
]

_MIXTRAL_ROWS = _COMMON_SKIP + [
    (_L + r"block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3)\.weight$", "expert", _MIXTRAL_W),
    (_L + r"block_sparse_moe\.gate\.weight$", "router", None),
    (_L + r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", "attention", None),
]

# DeepSeek's multi-token-prediction layer: extra tensors under model.layers.{num_hidden_layers}.
_MTP_ROW = (_L + r"(embed_tokens|enorm|hnorm|eh_proj|shared_head\.norm|shared_head\.head)\.weight$", "skip", None)


@dataclass(frozen=True)
class ArchSpec:
    """Everything that differs between model types, as data."""
    model_type: str
    rows: list
    expert_name: str              # format string with {layer} {expert} {proj}
    expert_proj_names: dict       # our proj -> the name's proj token
    n_experts_keys: tuple         # config keys, first present wins
    moe_intermediate_keys: tuple
    has_mtp: bool = False         # layers at index >= num_hidden_layers are MTP layers, skipped
    shared_expert_keys: tuple = ()
    compiled: list = field(default_factory=list, compare=False)


def _spec(model_type, rows, expert_name, proj_names, n_experts_keys, moe_i_keys, **kw) -> ArchSpec:
    spec = ArchSpec(model_type, rows, expert_name, proj_names, n_experts_keys, moe_i_keys, **kw)
    spec.compiled.extend((re.compile(p), kind, pm) for p, kind, pm in rows)
    return spec


_DEEPSEEK_EXPERT = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
SPECS = {
    "deepseek_v3": _spec("deepseek_v3", _DEEPSEEK_ROWS + [_MTP_ROW], _DEEPSEEK_EXPERT, _GUD,
                         ("n_routed_experts",), ("moe_intermediate_size",), has_mtp=True,
                         shared_expert_keys=("n_shared_experts",)),
    "deepseek_v2": _spec("deepseek_v2", _DEEPSEEK_ROWS, _DEEPSEEK_EXPERT, _GUD,
                         ("n_routed_experts",), ("moe_intermediate_size",), shared_expert_keys=("n_shared_experts",)),
    "qwen3_moe": _spec("qwen3_moe", _QWEN3_MOE_ROWS, _DEEPSEEK_EXPERT, _GUD,
                       ("num_experts", "num_local_experts"), ("moe_intermediate_size",)),
    "mixtral": _spec("mixtral", _MIXTRAL_ROWS, "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
                     {"gate": "w1", "up": "w3", "down": "w2"}, ("num_local_experts",), ("intermediate_size",)),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(SPECS))
# model_type values of checkpoints that are one of the above under another name (same tensor names and math).
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def _first(config: dict, keys: tuple, what: str, model_type: str):
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    raise SourceError(f"config.json for {model_type} lacks {what} (looked for {', '.join(keys)})")


class ArchAdapter:
    """Hub tensor names -> roles for one checkpoint's config."""

    def __init__(self, spec: ArchSpec, config: dict):
        self.spec = spec
        self.config = config
        self.model_type = spec.model_type
        mt = spec.model_type
        self.num_layers: int = int(_first(config, ("num_hidden_layers",), "num_hidden_layers", mt))  # without MTP
        self.hidden_size: int = int(_first(config, ("hidden_size",), "hidden_size", mt))
        self.n_experts: int = int(_first(config, spec.n_experts_keys, "the number of routed experts", mt))
        self.top_k: int = int(_first(config, ("num_experts_per_tok",), "num_experts_per_tok", mt))
        self.moe_intermediate_size: int = int(_first(config, spec.moe_intermediate_keys, "the expert size", mt))
        self.intermediate_size: int | None = config.get("intermediate_size")
        self.n_shared_experts: int = int(config.get(spec.shared_expert_keys[0]) or 0) if spec.shared_expert_keys else 0
        self.n_mtp_layers: int = int(config.get("num_nextn_predict_layers") or 0) if spec.has_mtp else 0
        self._moe_layers = self._compute_moe_layers()

    def _compute_moe_layers(self) -> list[int]:
        c, n = self.config, self.num_layers
        if self.model_type in ("deepseek_v3", "deepseek_v2"):
            first, freq = int(c.get("first_k_dense_replace") or 0), int(c.get("moe_layer_freq") or 1)
            return [i for i in range(n) if i >= first and i % freq == 0]
        if self.model_type == "qwen3_moe":
            step, dense = int(c.get("decoder_sparse_step") or 1), set(c.get("mlp_only_layers") or [])
            return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
        return list(range(n))

    def moe_layers(self) -> list[int]:
        return list(self._moe_layers)

    def expert_tensor_name(self, layer: int, expert: int, proj: str) -> str:
        if proj not in PROJS:
            raise ValueError(f"proj must be one of {PROJS}, got {proj!r}")
        return self.spec.expert_name.format(layer=layer, expert=expert, proj=self.spec.expert_proj_names[proj])

    def expert_tensor_names(self) -> list[str]:
        """Every routed-expert weight the config promises, in (layer, expert, proj) order."""
        return [self.expert_tensor_name(li, e, p) for li in self._moe_layers for e in range(self.n_experts)
                for p in PROJS]

    def classify(self, name: str) -> TensorRole:
        layer_m = re.match(r"model\.layers\.(\d+)\.", name)
        if layer_m and int(layer_m.group(1)) >= self.num_layers:
            layer = int(layer_m.group(1))
            if self.spec.has_mtp and layer < self.num_layers + max(self.n_mtp_layers, 1):
                return TensorRole("skip", layer)  # multi-token-prediction layer: not part of the main model
            raise SourceError(f"tensor {name}: layer {layer} is beyond num_hidden_layers={self.num_layers} "
                              f"({self.model_type})")
        for rx, kind, proj_map in self.spec.compiled:
            m = rx.match(name)
            if not m:
                continue
            g = m.groupdict()
            layer = int(g["layer"]) if g.get("layer") is not None else None
            if kind == "skip" and rx.pattern == _MTP_ROW[0]:
                break  # MTP-only names inside a main layer are not known
            role = TensorRole(kind, layer, int(g["expert"]) if g.get("expert") is not None else None,
                              proj_map[g["proj"]] if proj_map and g.get("proj") else None)
            self._check_role(name, role)
            return role
        raise SourceError(f"tensor {name}: unknown tensor name for model_type {self.model_type}")

    def _check_role(self, name: str, role: TensorRole) -> None:
        if role.kind == "expert":
            if role.layer not in self._moe_layers:
                raise SourceError(f"tensor {name}: routed expert in layer {role.layer}, which the config makes dense")
            if role.expert >= self.n_experts:
                raise SourceError(f"tensor {name}: expert {role.expert} >= n_experts={self.n_experts}")

    def __repr__(self) -> str:
        return (f"ArchAdapter({self.model_type}, layers={self.num_layers}, experts={self.n_experts}, "
                f"top_k={self.top_k}, hidden={self.hidden_size}, moe_intermediate={self.moe_intermediate_size})")


def adapter_for(config: dict) -> ArchAdapter:
    """The adapter for a parsed config.json; unsupported model_type -> SourceError listing the supported ones."""
    model_type = config.get("model_type")
    model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type not in SPECS:
        raise SourceError(f"unsupported model_type {config.get('model_type')!r} in config.json; supported: "
                          f"{', '.join(SUPPORTED_MODEL_TYPES)} (Kimi-K2 is read as deepseek_v3)")
    return ArchAdapter(SPECS[model_type], config)
