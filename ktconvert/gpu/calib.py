"""Calibration for GPTQ: run the model one decoder layer at a time over calibration tokens, collecting Hessians.

Memory stays at about one layer: each decoder layer is built from the checkpoint's config with the transformers
model class (on the meta device, then its non-expert weights are loaded from the source), routed experts are read
from the source one expert at a time while they run, and only the hidden states of the calibration tokens
(S, L, H) are carried from layer to layer. Per layer:
  pass 1: forward with the layer's float weights, routed experts skipped (no quantized Linear consumes their
          output inside the layer); a pre-hook on every quantized Linear accumulates H = 2 X^T X / T;
  GPTQ:   each Linear is quantized with its Hessian and its weight replaced by the dequantized one;
  pass 2: full forward (routed experts included) with the quantized weights -> the next layer's inputs; with
          capture_experts, the MoE block's inputs (T, H) and routing (T, k) are kept for the routed-expert
          quantizer (ktconvert.quantizers.experts), one layer at a time.
The lm_head (opt-in) is quantized last, from the final norm of the last hidden states.

The calibration text is split once (split_calibration_text): its last quarter is held out, never used for
calibration, and `ktconvert quantize --report-kl` scores the conversion on it.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from ktlayouts import tiktoken_bpe
from ktlayouts.bf16 import bf16_bits_to_f32
from torch import nn

from ktconvert.gpu.rtn import QuantizedLinear
from ktconvert.read_buffer import ReadBuffer

log = logging.getLogger(__name__)

DEFAULT_CALIB = Path(__file__).resolve().parents[1] / "data" / "calib.txt"
_DROP_CONFIG_KEYS = ("quantization_config", "auto_map", "architectures", "model_type", "transformers_version")

# (name, W (N, K), H (K, K)) -> the quantized weight, or None to keep the float weight (reference runs)
QuantizeFn = Callable[[str, torch.Tensor, torch.Tensor], "QuantizedLinear | None"]


class CalibrationError(ValueError):
    """Calibration cannot run: a missing/empty calibration file, tokenizer, or tensor; the message names it."""


def read_calibration_text(path: str | Path | None) -> tuple[str, Path]:
    """The calibration text (path None -> the packaged ktconvert/data/calib.txt)."""
    p = Path(path) if path is not None else DEFAULT_CALIB
    flag = "--calib" if path is not None else "packaged calibration text"
    if not p.is_file():
        raise CalibrationError(f"{flag}: calibration file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"{flag}: cannot read calibration file {p} as UTF-8 text: {e}") from None
    if not text.strip():
        raise CalibrationError(f"{flag}: calibration file {p} is empty")
    return text, p


HELDOUT_FRACTION = 0.25


def split_calibration_text(text: str) -> tuple[str, str]:
    """(calibration part, held-out part): the held-out part is the last quarter of the text, cut at a line boundary
    (at the character position when there is none)."""
    at = int(len(text) * (1 - HELDOUT_FRACTION))
    nl = text.rfind("\n", 0, at)
    cut = nl + 1 if nl > 0 else at
    return text[:cut], text[cut:]


# Families whose decoder layers this driver cannot run one at a time from transformers' classes, and why
NOT_LAYERWISE = {"deepseek_v4": "its decoder layers carry hyper-connection residual streams and route hash layers by "
                                "token id, and its release names differ from transformers' module names"}


def check_layerwise(src) -> None:
    """CalibrationError when the checkpoint's family cannot be calibrated layer by layer (NOT_LAYERWISE)."""
    why = NOT_LAYERWISE.get(src.arch.model_type)
    if why is not None:
        raise CalibrationError(f"calibration does not run {src.arch.model_type} layer by layer ({why}); quantize "
                               f"without it: --gpu-method rtn-int4 / search-int4 / bf16, --expert-quantizer "
                               f"search / rtn")


def tokenizer_for(src):
    """The checkpoint's tokenizer.json (a GGUF source rebuilds it from its metadata)."""
    from tokenizers import Tokenizer

    if hasattr(src, "side_files"):
        raw = src.side_files().get("tokenizer.json")
        if raw is not None:
            return Tokenizer.from_str(raw.decode() if isinstance(raw, bytes) else raw), f"{src.path} (GGUF metadata)"
    tok_path = Path(src.path) / "tokenizer.json"
    converted = tiktoken_bpe.tokenizer_files(src.path)        # Kimi's tiktoken.model without tokenizer.json
    if converted:
        return Tokenizer.from_str(converted["tokenizer.json"].decode()), Path(src.path) / "tiktoken.model"
    if not tok_path.is_file():
        raise CalibrationError(f"GPTQ calibration needs the checkpoint's tokenizer: {tok_path} does not exist "
                               f"(use --gpu-method rtn-int4 to quantize without calibration)")
    return Tokenizer.from_file(str(tok_path)), tok_path


def calibration_tokens(src, text: str, n_tokens: int, seq_len: int, seed: int) -> torch.Tensor:
    """Tokenize with the checkpoint's tokenizer -> (S, L) int64 windows, chosen deterministically by seed."""
    tokenizer, tok_path = tokenizer_for(src)
    vocab_size = int(text_model_of(src)[0]["vocab_size"])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise CalibrationError("calibration text tokenizes to zero tokens")
    ids = np.asarray(ids, dtype=np.int64)
    if ids.max() >= vocab_size:
        raise CalibrationError(f"{tok_path}: token id {int(ids.max())} >= vocab_size {vocab_size} of config.json")
    seq_len = min(seq_len, len(ids))
    windows = len(ids) // seq_len
    rng = np.random.default_rng(seed)
    pick = np.sort(rng.permutation(windows)[: max(1, min(windows, n_tokens // seq_len))])
    return torch.from_numpy(np.stack([ids[w * seq_len:(w + 1) * seq_len] for w in pick]))


def embedding_rows(src, ids: torch.Tensor) -> torch.Tensor:
    """Embeddings of `ids` (S, L) -> (S, L, H) float32, reading only those rows of the table from the file."""
    from ktconvert.sources import Source

    embed = src.arch.family.names.embed
    info = src.info(embed)
    np_dtype = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}.get(info.dtype)
    if np_dtype is None or not isinstance(src, Source):
        return src.read(embed)[ids]
    table = np.memmap(info.file, dtype=np_dtype, mode="r", offset=info.offset, shape=tuple(info.shape))
    uniq, inv = np.unique(ids.numpy(), return_inverse=True)
    rows = np.asarray(table[uniq])
    if info.dtype == "BF16":
        rows = bf16_bits_to_f32(rows)
    rows = torch.from_numpy(rows.astype(np.float32))
    return rows[torch.from_numpy(inv.reshape(ids.shape))]


def text_model_of(src) -> tuple[dict, str]:
    """(config.json dict, transformers model_type) of the checkpoint's text model: the checkpoint's own, or for a
    wrapped one its text_config and the family that dict names (Kimi-K2.5: kimi_k2 -> deepseek_v3), or transformers'
    own text config type (Qwen3.5-MoE: qwen3_5_moe_text), whose decoder layers calibration runs."""
    from ktlayouts.families import family_for

    family = src.arch.family
    if family.text_config_key is None:
        return src.config, src.arch.model_type
    from ktlayouts.families import ConfigError
    from transformers import CONFIG_MAPPING
    text = family.text_config(src.config)
    try:
        return text, family_for({"model_type": "deepseek_v3", **text}).name
    except ConfigError:      # a text model_type that is transformers' own text config (Qwen3.5's qwen3_5_moe_text)
        if text.get("model_type") in CONFIG_MAPPING:
            return text, text["model_type"]
        raise


PADDED_SDPA = "ktconvert_sdpa"


def _sdpa_padded_values(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention with value heads narrower than the query/key heads (MLA: v_head_dim 128 against
    192) zero-padded to their size and the output cut back. query / key: (S, heads, L, Dqk), value: (S, heads, L, Dv).
    Why: torch's CPU flash kernel takes one head size; with two, sdpa runs its math path, the (L, L) scores of every
    head materialized: 3-5x slower here, a third of the DeepSeek-V3-shaped calibration forward. The padded columns
    give zero outputs, cut off: the same attention, summed in the flash kernel's order."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dv, dqk = value.shape[-1], query.shape[-1]
    if dv >= dqk:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query, key, torch.nn.functional.pad(value, (0, dqk - dv)),
                                          attention_mask, **kwargs)
    return out[..., :dv], weights           # out: (S, L, heads, Dqk)


def hf_config(config: dict, model_type: str):
    """The transformers config of a checkpoint; model_type is its family's name (ktlayouts.families: aliases such as
    kimi_k2 are already resolved), which is also the transformers model_type."""
    from transformers import CONFIG_MAPPING, AttentionInterface

    cfg = CONFIG_MAPPING[model_type](**{k: v for k, v in config.items() if k not in _DROP_CONFIG_KEYS})
    # sdpa drops gpt-oss's attention sinks: its layers run the eager attention, with an explicit mask (_forward);
    # the others sdpa, narrower value heads padded (_sdpa_padded_values, registered with transformers by name)
    # unless the model's code tests the name (DeepSeek-V3.2's and GLM-5's indexers mask keys only under "sdpa")
    AttentionInterface.register(PADDED_SDPA, _sdpa_padded_values)
    sdpa = "sdpa" if _tests_attention_name(cfg) else PADDED_SDPA
    cfg._attn_implementation = "eager" if getattr(cfg, "swiglu_limit", None) is not None else sdpa
    return cfg


def check_transformers_classes(config: dict, model_type: str) -> None:
    """That transformers has the checkpoint's config class (built from config.json: KeyError / ValueError / TypeError
    where it cannot be) and a modeling module beside it, found but not imported: that import (~2 s) is the
    calibration forward's, on its own thread (ktconvert.quantizers.experts.prefetch_layers), or the estimate's,
    overlapping its samples (ktconvert.estimate)."""
    import importlib.util

    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type](**{k: v for k, v in config.items() if k not in _DROP_CONFIG_KEYS})
    modeling = type(cfg).__module__.replace(".configuration_", ".modeling_")
    if importlib.util.find_spec(modeling) is None:
        raise CalibrationError(f"transformers has no modeling module {modeling} for {model_type!r}")


def _tests_attention_name(cfg) -> bool:
    """Whether the config's transformers modeling module compares config._attn_implementation with a name."""
    mod = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
    return re.search(r"_attn_implementation\s*(==|!=|in\b|not\s+in\b)", inspect.getsource(mod)) is not None


def _model_classes(cfg):
    """(DecoderLayer, RotaryEmbedding, RMSNorm) classes beside the config class. A text config of a wrapped model
    (Qwen3_5MoeTextConfig) names some of them without its "Text" (Qwen3_5MoeDecoderLayer). RotaryEmbedding is None
    for a model without one (Kimi Linear: no layer applies RoPE)."""
    mod = importlib.import_module(type(cfg).__module__.replace(".configuration_", ".modeling_"))
    prefix = type(cfg).__name__[: -len("Config")]

    def cls(kind: str, optional: bool = False):
        for p in (prefix, prefix.removesuffix("Text")):
            if hasattr(mod, p + kind):
                return getattr(mod, p + kind)
        if optional:
            return None
        raise CalibrationError(f"calibration: transformers' {mod.__name__} has no {prefix}{kind}")
    return cls("DecoderLayer"), cls("RotaryEmbedding", optional=mod.__name__.endswith("kimi_linear")), cls("RMSNorm")


def _gate_fn(experts: nn.Module):
    """h = f(g, u) of a transformers experts module: silu(g) * u through its act_fn, or gpt-oss's clamped SwiGLU
    through the module's own _apply_gate (which takes gate and up interleaved)."""
    if hasattr(experts, "act_fn"):
        return lambda g, u: experts.act_fn(g) * u
    return lambda g, u: experts._apply_gate(torch.stack([g, u], dim=-1).flatten(-2))


PRIOR_SAMPLE = 256      # tokens of a layer whose down inputs give the expert quantizer's prior mean


def prior_rows(x: torch.Tensor) -> torch.Tensor:
    """The evenly spaced sample of a layer's tokens X (T, H) whose down inputs give the routed-expert quantizer's
    prior (ktconvert.quantizers.experts): (~PRIOR_SAMPLE, H)."""
    return x[:: max(1, x.shape[0] // PRIOR_SAMPLE)]


class StreamingExperts(nn.Module):
    """Drop-in for a transformers fused-experts module: reads each routed expert from the source when hit (and, for
    a family with expert biases, gpt-oss, the layer's biases once)."""

    def __init__(self, src, layer: int, gate_fn, tiles=None, buffer: ReadBuffer | None = None):
        super().__init__()
        self.src, self.layer, self.gate_fn = src, layer, gate_fn
        self.tiles = tiles                    # a calib_kernels.TileMatmuls: the experts' products on int4 tiles
        self.buffer = buffer if buffer is not None else ReadBuffer()     # the float32 experts are read into it
        # (one reused buffer: an expert's matrices are above glibc's mmap threshold, fresh pages each time otherwise)
        self.biases = None
        fam = src.arch.family
        if src.arch.cfg.expert_activation.bias:
            gu, d = fam.names.fused_experts.bias_names(fam.names.layer(layer))
            bg, bu = fam.names.fused_experts.split_gate_up(src.read(gu))
            self.biases = (bg, bu, src.read(d))                   # (E, I), (E, I), (E, H)
        self.enabled = True
        self.captured: list | None = None     # a list: (hidden_states, top_k_index) of every call are appended
        # with captured on: expert -> its down_proj inputs act(x gate^T) * (x up^T) of its routed tokens, in token
        # order, call after call (what the forward computes anyway; the expert quantizer's importance of down)
        self.activations: dict[int, list[torch.Tensor]] = {}
        # with captured on: expert -> its down_proj inputs on the evenly spaced sample of the call's tokens the
        # expert quantizer's prior reads (prior_rows), from the same gate / up product as its routed tokens
        self.prior: dict[int, torch.Tensor] = {}

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # hidden_states: (T, H); top_k_index / top_k_weights: (T, top_k)
        out = torch.zeros_like(hidden_states)
        if not self.enabled:
            return out
        if self.captured is not None:
            self.captured.append((hidden_states.detach().clone(), top_k_index.detach().clone()))
        arch = self.src.arch
        # under bf16 autocast the matmuls take bf16 weights: read them so (a BF16 checkpoint's bits as stored), not
        # widened to float32 and cast back every call (the same products, a sixth less time per layer)
        bf16 = torch.is_autocast_enabled("cpu") and hasattr(self.src, "read_bf16") and \
            torch.get_autocast_dtype("cpu") == torch.bfloat16
        # the prior's sample rows ride along in each expert's gate / up product (first call only: the sample is of
        # all the layer's tokens, which one call holds); the expert quantizer otherwise multiplies them itself, in
        # float32 (that was ~7% of the calibrated default's CPU time on bench_convert.py's DeepSeek-V3 shape)
        sample = prior_rows(hidden_states) if self.captured is not None and len(self.captured) == 1 else None
        for e in torch.unique(top_k_index).tolist():
            tok, pos = torch.where(top_k_index == e)
            names = [arch.expert_tensor_name(self.layer, e, p) for p in ("gate", "up", "down")]
            # float32: into the one reused buffer (its matrices are read, used and dropped before the next expert)
            gate, up, down = (self.src.read_bf16(n) for n in names) if bf16 else self.buffer.read(self.src, names)
            x = hidden_states[tok]
            n = x.shape[0]
            a_s = None
            if self.tiles is not None and self.tiles.takes_expert(gate, down):
                bias = None if self.biases is None else tuple(b[e].float() for b in self.biases)
                a, y, a_s = self.tiles.expert(x.float(), gate.float(), up.float(), down.float(), self.gate_fn, bias,
                                              sample)
            else:
                rows = x if sample is None else torch.cat([x, sample.to(x.dtype)])     # (n [+ S], H)
                bg, bu, bd = (None,) * 3 if self.biases is None else (b[e].to(x.dtype) for b in self.biases)
                g, u = rows @ gate.T, rows @ up.T
                a_all = self.gate_fn(g, u) if bg is None else self.gate_fn(g + bg, u + bu)
                a = a_all[:n]
                y = a @ down.T if bd is None else a @ down.T + bd
                a_s = None if sample is None else a_all[n:]
            if a_s is not None:
                self.prior[e] = a_s
            if self.captured is not None:
                self.activations.setdefault(e, []).append(a)
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None].to(y.dtype)).to(out.dtype))
        return out


# module names of a MoE block's router (nn.Linear in some transformers families): never on the tiles
ROUTER_MODULES = ("gate", "router")


# transformers module keys the checkpoint stores as several tensors, concatenated along dim 0 (Kimi Linear's q/k/v
# short convs)
JOINED_KEYS = {"self_attn.conv1d.weight": ("self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
                                           "self_attn.v_conv1d.weight")}


def _checkpoint_name(prefix: str, key: str, names: set[str]) -> str:
    # Mixtral-style block_sparse_moe; Kimi Linear's forget-gate tensors sit beside the attention's projections
    for cand in (prefix + key, prefix + "block_sparse_moe." + key[4:] if key.startswith("mlp.") else None,
                 prefix + key.replace(".forget_gate.", ".") if ".forget_gate." in key else None,
                 # MiMo-V2-Flash's release names its sinks attention_sink_bias
                 prefix + "self_attn.attention_sink_bias" if key == "self_attn.sinks" else None):
        if cand in names:
            return cand
    raise CalibrationError(f"calibration: the layer needs tensor {prefix + key}, which the checkpoint lacks")


class LayerwiseGptq:
    """Quantizes the checkpoint's Linear weights chosen by `is_target(hub name)` layer by layer, on demand."""

    def __init__(self, src, tokens: torch.Tensor, quantize_fn: QuantizeFn, is_target: Callable[[str], bool],
                 quantize_head: bool = False, capture_experts: bool = False, matmul_dtype: torch.dtype = torch.float32,
                 tiles=None):
        """matmul_dtype: bfloat16 runs the layers' matmuls under torch's CPU autocast (weights are bf16 in most
        checkpoints: only the activations are rounded), see calibration_matmul. tiles: a calib_kernels.TileMatmuls
        on which the Linears not quantized here and the routed experts run (int4 tiles)."""
        self.src, self.tokens, self.quantize_fn, self.is_target = src, tokens, quantize_fn, is_target
        self.matmul_dtype, self.tiles = matmul_dtype, tiles
        self.read_buffer = ReadBuffer()          # every layer's StreamingExperts read their experts into it
        self.layer_buffer = ReadBuffer()         # each layer's float32 tensors (_build_layer)
        self.quantize_head, self.capture_experts = quantize_head, capture_experts
        self.expert_captures: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # layer -> (X (T, H), ids (T, k))
        self.expert_acts: dict[int, dict[int, torch.Tensor]] = {}     # layer -> expert -> (n_e, I) down inputs
        self.expert_prior: dict[int, dict[int, torch.Tensor]] = {}    # layer -> expert -> (S, I) prior rows
        check_layerwise(src)
        self.cfg = hf_config(*text_model_of(src))
        self.hub = src.arch.family.names                              # layer prefix, embed / norm / head names
        self.layer_cls, rotary_cls, self.norm_cls = _model_classes(self.cfg)
        self.names = set(src.tensor_names())
        self.next_layer = 0
        self.hidden: torch.Tensor | None = None                      # (S, L, H) inputs of next_layer
        self.topk: torch.Tensor | None = None                        # GLM-5.2: the last full layer's key selection
        self.results: dict[str, tuple[int, QuantizedLinear]] = {}    # hub name -> (layer, result)
        s, seq = tokens.shape
        self.position_ids = torch.arange(seq)[None].expand(s, seq)
        self.rotary = rotary_cls(config=self.cfg) if rotary_cls is not None else None
        self.stats = {"layers": 0, "linears": 0, "seconds": 0.0}
        # called after pass 1 of every layer with Linears to quantize, before they are quantized (ktconvert.gpu.
        # sensitivity): on_layer(layer index, {hub: nn.Linear}, {hub: H}, pass-1 output, () -> a new pass-1 output)
        self.on_layer: Callable | None = None

    def result(self, name: str, layer: int | None) -> QuantizedLinear:
        """The quantized weight `name` of decoder layer `layer` (None: lm_head); runs layers as needed."""
        target = self.cfg.num_hidden_layers if layer is None else layer
        for k in [k for k, (li, _) in self.results.items() if li < target]:
            del self.results[k]          # earlier layers not asked for (already written by a resumed run)
        if name not in self.results:
            if target < self.next_layer:
                raise CalibrationError(f"{name}: layer {target} was calibrated already; encode layers in order")
            while self.next_layer <= target:
                self._run_layer(self.next_layer) if self.next_layer < self.cfg.num_hidden_layers else self._run_head()
        if name not in self.results:
            raise CalibrationError(f"{name}: not a Linear that calibration quantizes")
        return self.results.pop(name)[1]

    def run_layers(self, last: int) -> None:
        """Run the decoder layers not run yet up to `last` (a pass that only measures: ktconvert.gpu.sensitivity;
        the checkpoint's last layer with targets, not the config's count: LongCat-Flash's counts sublayers)."""
        while self.next_layer <= min(last, self.cfg.num_hidden_layers - 1):
            self._run_layer(self.next_layer)

    def expert_inputs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(X (T, H) float32 inputs of MoE layer `layer`'s routed experts, ids (T, k) the experts each token is
        routed to) over all calibration tokens; runs layers as needed (capture_experts must be on)."""
        if not self.capture_experts:
            raise CalibrationError("expert inputs were not captured (capture_experts is off)")
        for k in [k for k in self.expert_captures if k < layer]:
            del self.expert_captures[k]
        if layer not in self.expert_captures:
            if layer < self.next_layer:
                raise CalibrationError(f"MoE layer {layer} was calibrated already; quantize experts in layer order")
            while self.next_layer <= layer:
                self._run_layer(self.next_layer)
        if layer not in self.expert_captures:
            raise CalibrationError(f"layer {layer} has no routed experts to calibrate")
        self.expert_acts = {k: v for k, v in self.expert_acts.items() if k >= layer}
        return self.expert_captures.pop(layer)

    def expert_activations(self, layer: int) -> dict[int, torch.Tensor]:
        """expert -> (n_e, I) its down_proj inputs over its routed calibration tokens (rows in the order of
        expert_inputs' tokens routed to it), as the calibration forward computed them; after expert_inputs(layer)."""
        return self.expert_acts.pop(layer, {})

    def expert_prior_rows(self, layer: int) -> dict[int, torch.Tensor]:
        """expert -> (S, I) its down_proj inputs on the prior's sample of the layer's tokens (prior_rows of
        expert_inputs' X), as the forward computed them (empty where the layer's tokens came in several calls: the
        quantizer computes them itself)."""
        self.expert_prior = {k: v for k, v in self.expert_prior.items() if k >= layer}
        return self.expert_prior.pop(layer, {})

    @torch.no_grad()
    def _run_layer(self, li: int) -> None:
        t0 = time.perf_counter()
        if self.hidden is None:
            self.hidden = embedding_rows(self.src, self.tokens)
        layer = self._build_layer(li)
        pos_emb = self._position_embeddings(li)
        linears = {}
        for mod_name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear):
                hub = _checkpoint_name(self.hub.layer(li), mod_name + ".weight", self.names)
                if self.is_target(hub):
                    linears[hub] = mod
        from ktconvert.gpu.gptq import HessianAccumulator
        accs = {hub: HessianAccumulator(m.in_features) for hub, m in linears.items()}
        self._put_on_tiles(layer, linears)
        hooks = [m.register_forward_pre_hook(lambda _m, args, a=accs[h]: a.add(args[0])) for h, m in linears.items()]
        experts = [m for m in layer.modules() if isinstance(m, StreamingExperts)]
        for e in experts:
            e.enabled = False
        ref = self._forward(layer, pos_emb) if linears else None     # pass 1: Hessians
        for h in hooks:
            h.remove()
        if self.on_layer is not None and linears:
            self.on_layer(li, linears, {h: a.h for h, a in accs.items()}, ref,
                          lambda lay=layer: self._forward(lay, pos_emb))
        for hub, mod in linears.items():
            q = self.quantize_fn(hub, mod.weight.detach(), accs.pop(hub).h)
            if q is not None:
                mod.weight.copy_(q.dequantize()[: mod.out_features, : mod.in_features])
                self.results[hub] = (li, q)
        for e in experts:
            e.enabled = True
            e.captured = [] if self.capture_experts else None
        self.hidden = self._forward(layer, pos_emb)                   # pass 2: quantized layer -> next inputs
        for e in experts:
            if e.captured:
                self.expert_captures[li] = (torch.cat([x for x, _ in e.captured]),
                                            torch.cat([i for _, i in e.captured]))
                self.expert_acts[li] = {ex: torch.cat(rows) for ex, rows in e.activations.items()}
                if len(e.captured) == 1 and e.prior:
                    self.expert_prior[li] = e.prior
            e.captured, e.activations, e.prior = None, {}, {}
        del layer
        dt = time.perf_counter() - t0
        self.stats["layers"] += 1
        self.stats["linears"] += len(linears)
        self.stats["seconds"] += dt
        log.info("GPTQ layer %d: %d Linear weights quantized over %d calibration tokens in %.1f s",
                 li, len(linears), self.tokens.numel(), dt)
        self.next_layer += 1

    def _put_on_tiles(self, layer: nn.Module, targets: dict[str, nn.Linear]) -> list[str]:
        """With tiles: the layer's Linears other than the targets (whose Hessians need the float inputs) and a
        router (its choices stay the float ones) run on int4 tiles from now on -> their module names."""
        if self.tiles is None:
            return []
        self.tiles.reset_layer_ids()
        skip = set(map(id, targets.values()))
        return [name for name, mod in layer.named_modules()
                if isinstance(mod, nn.Linear) and id(mod) not in skip
                and name.rsplit(".", 1)[-1] not in ROUTER_MODULES and self.tiles.on_linear(mod)]

    def _position_embeddings(self, li: int):
        """cos/sin of the calibration positions for layer li; None for a model without RoPE. MiMo-V2-Flash's
        rotary takes the layer's kind (its RoPE theta differs between sliding and full layers)."""
        if self.rotary is None:
            return None
        if "layer_type" in inspect.signature(self.rotary.forward).parameters:
            return self.rotary(self.hidden, self.position_ids, self.cfg.layer_types[li])
        return self.rotary(self.hidden, self.position_ids)

    def _forward(self, layer, pos_emb) -> torch.Tensor:
        mask = None                          # causal attention (sdpa's is_causal)
        if hasattr(getattr(layer, "self_attn", None), "indexer"):
            # DeepSeek-V3.2's indexer scores against an explicit mask: (S, 1, L, L) bool, True = may attend
            s, seq = self.tokens.shape
            mask = torch.ones(seq, seq, dtype=torch.bool).tril().expand(s, 1, seq, seq)
        elif hasattr(getattr(layer, "self_attn", None), "sinks"):
            # gpt-oss (eager attention): an additive causal mask, within the layer's sliding window if it has one
            s, seq = self.tokens.shape
            q, k = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
            allowed = k <= q
            window = getattr(layer.self_attn, "sliding_window", None)
            if window:
                allowed &= k > q - window
            mask = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf")).expand(s, 1, seq, seq)
            mask = mask.to(self.hidden.dtype)
        attn = getattr(layer, "self_attn", None)
        shares = hasattr(attn, "skip_topk")       # GLM-5.2: layers hand their indexer's selection to the next ones
        kw = {"prev_topk_indices": self.topk} if shares else {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.matmul_dtype == torch.bfloat16):
            out = layer(self.hidden, attention_mask=mask, position_ids=self.position_ids, position_embeddings=pos_emb,
                        **kw)
        if shares:
            self.topk = out[1]                    # a shared layer returns the selection it was given
        return out[0] if isinstance(out, tuple) else out

    def _build_layer(self, li: int) -> nn.Module:
        with torch.device("meta"):
            layer = self.layer_cls(self.cfg, layer_idx=li)
        moe = getattr(layer, "mlp", None)
        if moe is not None and hasattr(moe, "experts"):
            moe.experts = StreamingExperts(self.src, li, _gate_fn(moe.experts), self.tiles, self.read_buffer)
        prefix = self.hub.layer(li)
        # Under bf16 autocast a Linear's matmul takes its weight in bf16: the Linears not quantized here are read so
        # (a BF16 checkpoint's bits as stored, read_bf16) rather than widened to float32 and cast back in every call,
        # the same products without a layer's worth of fresh float32 pages (on bench_convert.py's DeepSeek-V3-shaped
        # checkpoint that widening and its page faults were ~6% of the calibrated default's CPU time).
        bf16 = self.matmul_dtype == torch.bfloat16 and hasattr(self.src, "read_bf16")
        linear_weights = {n + ".weight" for n, m in layer.named_modules() if isinstance(m, nn.Linear)} if bf16 else ()

        plain: dict[str, str] = {}                 # key -> checkpoint name, read as float32 into the layer buffer

        def read(k: str) -> torch.Tensor | None:
            parts = JOINED_KEYS.get(k)
            if parts and prefix + k not in self.names and all(prefix + p in self.names for p in parts):
                return torch.cat([self.src.read(prefix + p) for p in parts])
            name = _checkpoint_name(prefix, k, self.names)
            if k in linear_weights and not self.is_target(name):
                return self.src.read_bf16(name)
            plain[k] = name
            return None
        state = {k: read(k) for k in layer.state_dict()}
        # the float32 tensors into one buffer reused layer after layer (a layer's worth of fresh pages otherwise,
        # zeroed by the kernel: ktconvert.read_buffer); the previous layer is gone by now (_run_layer drops it)
        state.update(zip(plain, self.layer_buffer.read(self.src, list(plain.values()))))
        state = {k: t.reshape(v.shape) for (k, t), v in zip(state.items(), layer.state_dict().values())}
        layer.load_state_dict(state, assign=True, strict=True)
        meta = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if meta:
            raise CalibrationError(f"calibration: layer {li} has tensors the checkpoint does not define: {meta}")
        return layer.eval()

    @torch.no_grad()
    def _run_head(self) -> None:
        head = self.hub.head
        if self.quantize_head and head in self.names and self.is_target(head):
            norm = self.norm_cls(self.cfg.hidden_size, eps=self.cfg.rms_norm_eps)
            norm.weight.copy_(self.src.read(self.hub.final_norm))
            from ktconvert.gpu.gptq import HessianAccumulator
            acc = HessianAccumulator(self.cfg.hidden_size)
            acc.add(norm(self.hidden))
            self.results[head] = (self.next_layer, self.quantize_fn(head, self.src.read(head), acc.h))
        self.next_layer += 1


MATMUL_ENV = "KTCONVERT_CALIB_MATMUL"     # auto (default) | float32 | bfloat16 | kernels
MATMULS = ("float32", "bfloat16", "kernels")


def calibration_matmul() -> str:
    """How the expert-only calibration forward multiplies: "bfloat16" where the CPU has bf16 dot products
    (AVX512-BF16, AMX: torch's bf16 GEMM runs ~2x its float32 one, 390 vs 192 GFLOPS on 2 Zen 4 cores), else
    "float32"; KTCONVERT_CALIB_MATMUL=float32 / bfloat16 / kernels chooses. On bench_convert.py's DeepSeek-V3-shaped
    checkpoint the conversion's KL against the source was 0.033035 with bfloat16 and 0.033142 with float32 (the same
    within noise) at 0.8x the wall time. "kernels" (libktkernels' int4 tiles, ktconvert.gpu.calib_kernels) is not
    chosen by itself: 0.89x the float32 default's wall time on 2 Zen 3 cores, KL 0.033122 vs 0.033158 there, but on
    the trained default model 0.004171 (experts on tiles) / 0.004286 (every Linear) vs 0.004110 (bench/README.md)."""
    want = os.environ.get(MATMUL_ENV, "auto")
    if want not in ("auto",) + MATMULS:
        raise CalibrationError(f"{MATMUL_ENV}={want!r}: choose auto, {', '.join(MATMULS)}")
    if want == "kernels":
        from ktrun.ops.library import kernels_available
        if not kernels_available():
            raise CalibrationError(f"{MATMUL_ENV}=kernels: libktkernels is not available (build it: make kernels)")
    if want == "auto":
        native = any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))
        want = "bfloat16" if native else "float32"
    return want


def make_calibrator(src, calib: str | None, n_tokens: int, seq_len: int, seed: int, quantize_fn: QuantizeFn,
                    is_target: Callable[[str], bool], quantize_head: bool = False,
                    capture_experts: bool = False, matmul: str = "float32") -> LayerwiseGptq:
    """A LayerwiseGptq over the calibration part of the text (--calib FILE or the packaged one); matmul: one of
    MATMULS (calibration_matmul)."""
    text, path = read_calibration_text(calib)
    part, _ = split_calibration_text(text)
    tokens = calibration_tokens(src, part, n_tokens, seq_len, seed)
    log.info("calibration: %d sequences x %d tokens from %s (its last quarter held out for --report-kl)",
             tokens.shape[0], tokens.shape[1], path)
    tiles = None
    if matmul == "kernels":
        from ktconvert.gpu.calib_kernels import TileMatmuls
        tiles = TileMatmuls()
    dtype = torch.bfloat16 if matmul == "bfloat16" else torch.float32
    return LayerwiseGptq(src, tokens, quantize_fn, is_target, quantize_head, capture_experts, dtype, tiles)
