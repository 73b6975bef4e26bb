"""Hub tensor names -> roles, as data tables per family (the names the checkpoint's safetensors files use).

A table row is (regex, kind, proj map) or (regex, "skip", None, reason). Groups named `layer`, `expert` and `proj`
are captured; `proj` is mapped through the row's proj map (Mixtral's w1/w3/w2 -> gate/up/down). The first matching
row wins, so specific rows (norms inside attention) come before general ones (the rest of attention). A skip row's
reason says what the skipped tensors are (Kimi-K2.5's vision tower), for the converter's log. Layers at index >=
num_hidden_layers are multi-token-prediction (MTP) layers where the family has them, an error otherwise. An MTP layer
(DeepSeek's layout, also GLM-4.x's: a decoder layer plus enorm, hnorm, eh_proj, shared_head.norm, shared_head.head and
embed_tokens under `model.layers.L.`) is skipped, or with keep_mtp classified like a main layer, its role marked mtp.

A family whose text model sits under a prefix in the checkpoint (Kimi-K2.5: `language_model.model.layers.N...`,
`language_model.lm_head.weight`) builds its table with `prefixed(rows, prefix)` and sets `prefix`; `layer(i)`,
`embed`, `final_norm` and `head` give the names the forward reads, with the prefix. One whose decoder sits deeper
than `model.` (Qwen3.5-MoE: `model.language_model.layers.N...` beside `lm_head.weight`) sets `model_root`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .config import ModelConfig
from .errors import TensorNameError

# shared_expert_gate: Qwen3-Next's (1, H) sigmoid gate on the shared expert, kept unquantized as the router is
# expert_bias: gpt-oss's per-expert gate/up and down biases (E, 2I) / (E, H), kept whole beside the router (the
# kernels add them; they are not quantized)
# kept: a small non-Linear tensor kept exactly as stored, float32 as float32 and integers as integer values
# (DeepSeek-V4's hyper-connection mixers, attention sinks, compressor position biases and hash-routing table tid2eid)
KINDS = ("expert", "router", "router_bias", "shared_expert", "shared_expert_gate", "attention", "dense_mlp",
         "norm", "embedding", "head", "expert_bias", "kept", "skip")
PROJS = ("gate", "up", "down")

LAYER = r"model\.layers\.(?P<layer>\d+)\."
GATE_UP_DOWN = {"gate": "gate", "up": "up", "down": "down"}

# Rows shared by every table: things that never become part of the converted model's math, and the globals.
COMMON_ROWS = [
    (r".*\.weight_scale_inv$", "skip", None),   # FP8 block scales, consumed when their weight is read
    (r".*rotary_emb\.inv_freq$", "skip", None),  # rotary buffers some old checkpoints carry
    (r"model\.embed_tokens\.weight$", "embedding", None),
    (r"model\.norm\.weight$", "norm", None),
    (r"lm_head\.weight$", "head", None),
    (LAYER + r"(input_layernorm|post_attention_layernorm)\.weight$", "norm", None),
]


MTP_REASON = "multi-token-prediction layer (ktrun decodes without it)"
# an MTP layer's own tensors beside its decoder layer (after the layer prefix): (regex, kind)
MTP_EXTRA_ROWS = [(r"(enorm|hnorm|shared_head\.norm)\.weight$", "norm"),
                  (r"eh_proj\.weight$", "attention"),            # (H, 2H) Linear: a GPU layer like attention's
                  (r"shared_head\.head\.weight$", "head"),
                  (r"embed_tokens\.weight$", "embedding")]


@dataclass(frozen=True)
class TensorRole:
    kind: str
    layer: int | None = None
    expert: int | None = None
    proj: str | None = None
    # skip rows: what the skipped tensor is (said in logs and inspect; not part of the role's identity)
    reason: str | None = field(default=None, compare=False)
    mtp: bool = False                       # part of a multi-token-prediction layer (classified with keep_mtp)


def prefixed(rows: list, prefix: str) -> list:
    """A table for a text model under `prefix` (a plain string, e.g. "language_model.")."""
    return [(re.escape(prefix) + row[0], *row[1:]) for row in rows]


@dataclass(frozen=True)
class FusedExperts:
    """A family whose checkpoint stores a MoE layer's routed experts as one tensor per projection, under the layer
    prefix. gpt-oss, unquantized: gate_up (E, H, 2I) and down (E, I, H), input dimension first (x @ W,
    input_first); MXFP4 (quantization_config quant_method "mxfp4"): <name>_blocks (E, N, K/32, 16) uint8 (two E2M1
    values a byte, low nibble first) and <name>_scales (E, N, K/32) uint8 E8M0, output dimension first (N = 2I,
    K = H for gate_up; N = H, K = I for down). Qwen3.5-MoE: gate_up (E, 2I, H) and down (E, H, I), output dimension
    first (transformers' Qwen3_5MoeExperts, as the releases store them). interleaved: gate and up alternate along 2I
    (gate = even rows, up = odd rows; gpt-oss), else gate is the first I rows and up the last I (Qwen3.5).
    optional: checkpoints of the family may instead carry per-expert names (transformers' save_pretrained writes
    Qwen3.5-MoE that way); a layer without the fused tensors is read per expert.
    The converter reads each expert's gate/up/down as the (N, K) logical weights the `expert_name` of HubNames
    names (names of its own: the hub has no per-expert tensors)."""
    gate_up: str = "mlp.experts.gate_up_proj"
    down: str = "mlp.experts.down_proj"
    interleaved: bool = True
    input_first: bool = True
    optional: bool = False

    def bias_names(self, layer_prefix: str) -> tuple[str, str]:
        """(gate_up bias (E, 2I), down bias (E, H)) of the layer whose tensors start with layer_prefix."""
        return f"{layer_prefix}{self.gate_up}_bias", f"{layer_prefix}{self.down}_bias"

    def split_gate_up(self, a):
        """(..., 2I) gate_up values (a bias, or x @ W) -> (gate (..., I), up (..., I))."""
        g, u = self.gate_up_rows(a.shape[-1] // 2)
        return a[..., g], a[..., u]

    def gate_up_rows(self, intermediate: int) -> tuple[slice, slice]:
        """(gate rows, up rows) of the fused gate_up in Linear orientation (2I, H): where writing a checkpoint in the
        family's layout puts each expert's gate and up (transposed to (H, 2I) when input_first)."""
        if self.interleaved:
            return slice(0, 2 * intermediate, 2), slice(1, 2 * intermediate, 2)
        return slice(0, intermediate), slice(intermediate, 2 * intermediate)


@dataclass(frozen=True)
class HubNames:
    """Everything about one family's hub tensor names, as data."""
    rows: list                              # (regex, kind, proj map), first match wins
    expert_name: str                        # format string with {layer} {expert} {proj}
    expert_projs: dict                      # our proj -> the name's proj token
    moe_prefix: str = "mlp."                # the MoE block inside a layer: router at <moe_prefix>gate.weight
    shared_prefix: str | None = None        # shared experts inside a layer, or None
    mtp: bool = False                       # layers at index >= num_hidden_layers are MTP layers (DeepSeek's
                                            # layout), skipped unless classified with keep_mtp
    prefix: str = ""                        # the text model's name prefix in the checkpoint (Kimi-K2.5)
    router: str = "gate"                    # the router Linear inside the MoE block: <moe_prefix><router>.weight
    fused_experts: FusedExperts | None = None   # experts stored fused per layer (gpt-oss), else per expert
    model_root: str = "model."              # where the decoder (layers, embed_tokens, norm) sits under prefix:
                                            # Qwen3.5-MoE's "model.language_model." (lm_head stays at the top)
    embed_name: str = "embed_tokens.weight"  # the embedding under model_root (DeepSeek-V4's release: embed.weight)
    head_name: str = "lm_head.weight"       # the output head under prefix (DeepSeek-V4's release: head.weight)
    compiled: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        for row in self.rows:
            p, kind = row[0], row[1]
            if kind not in KINDS:
                raise ValueError(f"hub name row {p!r}: kind {kind!r} is not one of {KINDS}")
            if len(row) not in (3, 4) or (len(row) == 4 and kind != "skip"):
                raise ValueError(f"hub name row {p!r}: (regex, kind, proj map) or (regex, 'skip', None, reason)")
        self.compiled.extend((re.compile(r[0]), r[1], r[2], r[3] if len(r) == 4 else None) for r in self.rows)

    @property
    def layer_re(self) -> str:
        return re.escape(self.prefix + self.model_root) + r"layers\.(\d+)\."

    # names the forward reads (hub names, with the family's prefix)
    def layer(self, i: int) -> str:
        """Prefix of decoder layer i's tensors, e.g. 'model.layers.3.'."""
        return f"{self.prefix}{self.model_root}layers.{i}."

    def router_weight(self, i: int) -> str:
        """Layer i's router weight, e.g. 'model.layers.3.mlp.gate.weight'."""
        return f"{self.layer(i)}{self.moe_prefix}{self.router}.weight"

    @property
    def embed(self) -> str:
        return f"{self.prefix}{self.model_root}{self.embed_name}"

    @property
    def final_norm(self) -> str:
        return f"{self.prefix}{self.model_root}norm.weight"

    @property
    def head(self) -> str:
        return f"{self.prefix}{self.head_name}"

    def expert_tensor_name(self, layer: int, expert: int, proj: str) -> str:
        if proj not in PROJS:
            raise ValueError(f"proj must be one of {PROJS}, got {proj!r}")
        return self.expert_name.format(layer=layer, expert=expert, proj=self.expert_projs[proj])

    def mtp_layers(self, cfg: ModelConfig) -> list[int]:
        """Indices of the MTP layers the config declares (num_nextn_predict_layers after the main ones)."""
        return list(range(cfg.num_layers, cfg.num_layers + cfg.n_mtp_layers)) if self.mtp else []

    def classify(self, name: str, cfg: ModelConfig, keep_mtp: bool = False) -> TensorRole:
        """The role of one hub tensor under this config; TensorNameError naming the tensor when it has none.
        keep_mtp: an MTP layer's tensors get their role (marked mtp) instead of "skip"."""
        layer_m = re.match(self.layer_re, name)
        if layer_m and int(layer_m.group(1)) >= cfg.num_layers:
            layer = int(layer_m.group(1))
            if keep_mtp and layer in self.mtp_layers(cfg):
                return self._mtp_role(name, layer, cfg)
            if self.mtp and layer < cfg.num_layers + max(cfg.n_mtp_layers, 1):
                return TensorRole("skip", layer, reason=MTP_REASON)  # not part of the main model
            raise TensorNameError(f"tensor {name}: layer {layer} is beyond num_hidden_layers={cfg.num_layers} "
                                  f"({cfg.model_type})")
        return self._main_role(name, cfg)

    def _mtp_role(self, name: str, layer: int, cfg: ModelConfig) -> TensorRole:
        """An MTP layer's tensor: its own extras (enorm, eh_proj, ...), else what the same name is in a main layer
        (an MTP layer's routed experts follow the family's MoE rule: no check against cfg.moe_layers)."""
        rest = name[len(self.layer(layer)):]
        for rx, kind in MTP_EXTRA_ROWS:
            if re.match(rx, rest):
                return TensorRole(kind, layer, mtp=True)
        role = self._main_role(name, dataclasses.replace(cfg, num_layers=layer + 1, moe_layers=(layer,)))
        return dataclasses.replace(role, mtp=True)

    def _main_role(self, name: str, cfg: ModelConfig) -> TensorRole:
        for rx, kind, proj_map, reason in self.compiled:
            m = rx.match(name)
            if not m:
                continue
            g = m.groupdict()
            role = TensorRole(kind, int(g["layer"]) if g.get("layer") is not None else None,
                              int(g["expert"]) if g.get("expert") is not None else None,
                              proj_map[g["proj"]] if proj_map and g.get("proj") else None, reason)
            if kind == "expert":
                if role.layer not in cfg.moe_layers:
                    raise TensorNameError(f"tensor {name}: routed expert in layer {role.layer}, which the config "
                                          f"makes dense")
                if role.expert is not None and role.expert >= cfg.num_experts:   # None: a fused tensor
                    raise TensorNameError(f"tensor {name}: expert {role.expert} >= n_experts={cfg.num_experts}")
            return role
        raise TensorNameError(f"tensor {name}: unknown tensor name for model_type {cfg.model_type}")
