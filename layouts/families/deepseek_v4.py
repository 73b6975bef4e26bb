"""DeepSeek-V4 (model_type deepseek_v4: V4-Flash 284B / 13B active, V4-Pro): what its config.json and tensors say.

Per layer (all MoE, no dense MLP):
- Attention: shared-KV MQA (one `head_dim`=512 KV head read as key and value), q LoRA (`q_lora_rank`) with an
  unweighted RMSNorm per q head, partial interleaved RoPE on each head's trailing `qk_rope_head_dim` dims (undone on
  the output with the conjugate rotation), a learned sink logit per head, every query sees the last `sliding_window`
  keys, and a grouped low-rank output projection (`o_groups` groups of heads -> `o_lora_rank` each -> hidden).
  `layer_types` adds long-range memory per layer: "sliding_attention" nothing more; "heavily_compressed_attention"
  (HCA) a compressor that pools every `compress_rates[hca]` (128) tokens into one extra KV entry;
  "compressed_sparse_attention" (CSA) one that pools overlapping windows of 2 x `compress_rates[csa]` (4) tokens,
  of which a lightning indexer (`index_n_heads` x `index_head_dim`, its own compressor) picks `index_topk` per query.
  The sliding layers rope with `rope_theta`, the compressed ones with `compress_rope_theta` and the YaRN
  `rope_scaling` (attention factor 1).
- Hyper-connections (mHC): the residual is `hc_mult` streams; before attention and before the MoE, a projection of
  the normalized streams gives pre (collapse), post (expand) and comb (stream mixing, made doubly stochastic by
  `hc_sinkhorn_iters` Sinkhorn-Knopp iterations with floor `hc_eps`) weights; `hc_head_*` collapses the streams
  before the final norm.
- MoE: `n_routed_experts` experts (clamped SwiGLU: silu(min(g, swiglu_limit)) * clamp(u, +-swiglu_limit)) plus one
  shared expert of the same size; scores sqrt(softplus(logits)) (`scoring_func` "sqrtsoftplus"), normalized over the
  chosen k and scaled by `routed_scaling_factor`. `mlp_layer_types` "moe": top-k of scores + `ffn.gate.bias`;
  "hash_moe" (the first `num_hash_layers`): the experts are a fixed table `ffn.gate.tid2eid[token id]` (vocab, k).
- `num_nextn_predict_layers` MTP blocks ship as `mtp.N.*`: skipped (ktrun decodes without them).

The release's tensor names (DeepSeek's own, not transformers'; transformers' conversion_mapping "deepseek_v4" reads
them): `embed.weight`, `head.weight`, `norm.weight`, `hc_head_{fn,base,scale}`, `layers.N.{attn_norm,ffn_norm}.weight`,
`layers.N.hc_{attn,ffn}_{fn,base,scale}`, `layers.N.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}`,
`layers.N.attn.attn_sink`, `layers.N.attn.compressor.{wkv,wgate,ape,norm}`, `layers.N.attn.indexer.{wq_b,
weights_proj}` and `layers.N.attn.indexer.compressor.{wkv,wgate,ape,norm}`, `layers.N.ffn.gate.{weight,bias,tid2eid}`,
`layers.N.ffn.experts.E.{w1,w2,w3}.weight` (gate, down, up) and `layers.N.ffn.shared_experts.{w1,w2,w3}.weight`.
The release quantizes them (config.json quantization_config quant_method "fp8", scale_fmt "ue8m0", expert_dtype
"fp4"): Linear weights in FP8 128x128 blocks, routed experts in FP4 (E2M1 pairs per byte, one E8M0 scale per 32
inputs), each with its scale under `<module>.scale`.
GGUF: llama.cpp has no DeepSeek-V4 architecture (none here).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ExpertActivation, Fields, ModelConfig, RopeConfig, check_routing, token_ids
from .family import Family
from .hub_names import MTP_REASON, HubNames

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
# the legacy per-layer `compress_ratios` (the release's config.json): 0 = sliding only, else the layer's rate
LEGACY_RATIO_TYPES = {0: "sliding_attention", 4: CSA, 128: HCA}

# transformers DeepseekV4Config's defaults for the fields read here (tests/test_deepseek_v4.py checks them)
DEFAULTS = {"num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "partial_rotary_factor": 64 / 512,
            "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
            "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0, "compress_rates": {CSA: 4, HCA: 128}, "hc_mult": 4,
            "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6, "num_hash_layers": 3, "swiglu_limit": 10.0,
            "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
            "index_topk": 512, "num_nextn_predict_layers": 1, "rms_norm_eps": 1.0e-6}


@dataclass(frozen=True)
class DeepseekV4Settings:
    """What DeepSeek-V4 adds to ModelConfig (settings(cfg) reads it from cfg.raw, checked when parsed)."""
    head_dim: int                        # q / KV head dim (512)
    rope_dim: int                        # trailing rotary dims of each head (qk_rope_head_dim, 64)
    q_lora_rank: int
    o_groups: int                        # grouped output projection: groups of heads ...
    o_lora_rank: int                     # ... each projected to this many dims, then all to hidden
    compress_rates: dict                 # layer type -> tokens per compressed entry ({CSA: 4, HCA: 128})
    compress_rope: RopeConfig | None     # RoPE of the compressed layers and their compressors / indexer
    hc_mult: int                         # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]     # "hash_moe" | "moe" per layer
    swiglu_limit: float
    scoring: str                         # "sqrtsoftplus" | "softmax" | "sigmoid"

    def compress_rate(self, layer_type: str) -> int:
        """Tokens per compressed entry of a layer type (0: sliding only)."""
        return self.compress_rates.get(layer_type, 0)


def _layer_types(f: Fields, n_layers: int) -> tuple[str, ...]:
    """`layer_types`, else the release's per-layer `compress_ratios` (0 / 4 / 128, as transformers reads them), else
    transformers' default (2 HCA, then CSA / HCA alternating)."""
    if f.raw.get("layer_types") is None and f.raw.get("compress_ratios") is not None:
        ratios = f.raw["compress_ratios"]
        f.check(isinstance(ratios, list) and len(ratios) >= n_layers,
                f"field 'compress_ratios' must list a compression ratio per layer (num_hidden_layers={n_layers}), "
                f"got {ratios!r}")
        out = []
        for i, r in enumerate(ratios[:n_layers]):   # the release lists the MTP layer's too
            f.check(r in LEGACY_RATIO_TYPES, f"field 'compress_ratios'[{i}] = {r!r} is not one of 0 (sliding), 4 "
                                             f"(CSA), 128 (HCA)")
            out.append(LEGACY_RATIO_TYPES[r])
        return tuple(out)
    return f.layer_types(n_layers, LAYER_TYPES, lambda: tuple(
        [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]))


def _mlp_layer_types(f: Fields, n_layers: int) -> tuple[str, ...]:
    types = f.get("mlp_layer_types", None)
    if types is None:
        n_hash = f.get("num_hash_layers", DEFAULTS["num_hash_layers"], cast=int)
        f.check(n_hash >= 0, f"num_hash_layers={n_hash} must be >= 0")
        return tuple(["hash_moe"] * min(n_layers, n_hash) + ["moe"] * max(0, n_layers - n_hash))
    f.check(isinstance(types, list) and len(types) == n_layers,
            f"field 'mlp_layer_types' must list one type per layer (num_hidden_layers={n_layers}), got {types!r}")
    for i, t in enumerate(types):
        f.check(t in MLP_LAYER_TYPES, f"field 'mlp_layer_types'[{i}] = {t!r} is not one of "
                                      f"{', '.join(MLP_LAYER_TYPES)}")
    return tuple(types)


def _compress_rates(f: Fields) -> dict:
    rates = dict(DEFAULTS["compress_rates"])
    given = f.get("compress_rates", None)
    if given is not None:
        f.check(isinstance(given, dict) and set(given) <= {CSA, HCA},
                f"field 'compress_rates' = {given!r} must map {CSA!r} / {HCA!r} to a rate")
        rates.update(given)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if f.raw.get(legacy) is not None:
            rates[kind] = f.get(legacy, None, cast=int)
    for kind, r in rates.items():
        f.check(isinstance(r, int) and not isinstance(r, bool) and r >= 1,
                f"field 'compress_rates'[{kind!r}] = {r!r} must be an integer >= 1")
    return rates


def _rope_params(f: Fields) -> tuple[dict, dict]:
    """(main, compress) rope parameters: transformers 5's nested rope_parameters {"main", "compress"}, else the hub's
    rope_theta / compress_rope_theta and rope_scaling (YaRN, for the compressed layers only)."""
    rp = f.raw.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return rp["main"], rp["compress"]
    flat = dict(f.raw.get("rope_scaling") or {k: v for k, v in rp.items() if k not in ("main", "compress")})
    main = {"rope_type": "default", "rope_theta": f.get("rope_theta", DEFAULTS["rope_theta"], cast=float)}
    compress = {**flat, "rope_theta": f.get("compress_rope_theta", DEFAULTS["compress_rope_theta"], cast=float)}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    return main, compress


def _rope(f: Fields, params: dict, dim: int, key: str) -> RopeConfig:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    f.check(kind in ("default", "yarn"), f"field {key!r}: rope type {kind!r} is not supported (default, yarn)")
    theta = params.get("rope_theta")
    f.check(isinstance(theta, (int, float)) and theta > 0, f"field {key!r}: rope_theta = {theta!r} must be > 0")
    if kind == "default":
        return RopeConfig(theta=float(theta), dim=dim, interleaved=True)
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    f.check(isinstance(factor, (int, float)) and factor >= 1, f"field {key!r}: YaRN factor = {factor!r} must be >= 1")
    f.check(isinstance(original, int) and original >= 1,
            f"field {key!r}: YaRN needs original_max_position_embeddings, got {original!r}")
    # V4 does not scale cos / sin by YaRN's mscale: attention factor 1 unless the config says otherwise
    return RopeConfig(theta=float(theta), dim=dim, kind="yarn", factor=float(factor), original_max_position=original,
                      beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                      attention_factor=float(params.get("attention_factor", 1.0)),
                      truncate=bool(params.get("truncate", True)), interleaved=True)


def settings(cfg: ModelConfig, where: str = "config.json", for_runtime: bool = True) -> DeepseekV4Settings:
    """The V4 settings of a parsed config (its raw config.json fields)."""
    return _settings(Fields(cfg.raw, where, cfg.model_type, for_runtime), cfg.num_layers, cfg.num_heads)


def _settings(f: Fields, n_layers: int, n_heads: int | None) -> DeepseekV4Settings:
    def g(key, cast=int):
        return f.get(key, DEFAULTS[key], cast=cast)

    head_dim, q_rank, o_groups, o_rank = g("head_dim"), g("q_lora_rank"), g("o_groups"), g("o_lora_rank")
    f.check(head_dim >= 2, f"head_dim={head_dim} must be >= 2")
    f.check(q_rank >= 1, f"q_lora_rank={q_rank} must be >= 1 (DeepSeek-V4 always has a q LoRA)")
    f.check(o_groups >= 1 and o_rank >= 1, f"o_groups={o_groups} and o_lora_rank={o_rank} must be >= 1")
    if n_heads is not None:
        f.check((n_heads * head_dim) % o_groups == 0, f"o_groups={o_groups} does not divide num_attention_heads="
                                                      f"{n_heads} x head_dim={head_dim} (the grouped output "
                                                      f"projection splits the heads' outputs into o_groups)")
    if f.raw.get("qk_rope_head_dim") is not None:
        rope_dim = f.get("qk_rope_head_dim", None, cast=int)
    else:
        factor = f.get("partial_rotary_factor", DEFAULTS["partial_rotary_factor"], cast=float)
        rope_dim = int(head_dim * factor)
    f.check(0 < rope_dim <= head_dim and rope_dim % 2 == 0,
            f"qk_rope_head_dim / partial_rotary_factor gives {rope_dim} rotary dims per head; they must be even and "
            f"in 1..head_dim={head_dim}")
    index_dim = g("index_head_dim")
    f.check(rope_dim <= index_dim, f"index_head_dim={index_dim} is smaller than qk_rope_head_dim={rope_dim} (the "
                                   f"indexer ropes its trailing qk_rope_head_dim dims)")
    rates = _compress_rates(f)
    hc, iters, eps = g("hc_mult"), g("hc_sinkhorn_iters"), g("hc_eps", float)
    f.check(hc >= 1, f"hc_mult={hc} must be >= 1")
    f.check(iters >= 1, f"hc_sinkhorn_iters={iters} must be >= 1")
    f.check(eps > 0, f"hc_eps={eps} must be > 0")
    limit = g("swiglu_limit", float)
    f.check(limit > 0, f"swiglu_limit={limit} must be > 0")
    scoring = f.get("scoring_func", DEFAULTS["scoring_func"])
    f.check(scoring in SCORING, f"field 'scoring_func' = {scoring!r} is not one of {', '.join(SCORING)}")
    compress_rope = None
    if f.for_runtime:
        _, compress = _rope_params(f)
        compress_rope = _rope(f, compress, rope_dim, "rope_scaling")
    return DeepseekV4Settings(
        head_dim=head_dim, rope_dim=rope_dim, q_lora_rank=q_rank, o_groups=o_groups, o_lora_rank=o_rank,
        compress_rates=rates, compress_rope=compress_rope, hc_mult=hc, hc_sinkhorn_iters=iters, hc_eps=eps,
        mlp_layer_types=_mlp_layer_types(f, n_layers), swiglu_limit=limit, scoring=scoring)


def parse(f: Fields) -> ModelConfig:
    n_layers, hidden = f.need("num_hidden_layers"), f.need("hidden_size")
    n_experts, top_k = f.need("n_routed_experts", "num_local_experts"), f.need("num_experts_per_tok")
    check_routing(f, n_experts, top_k)
    f.check(n_experts >= 1, f"n_routed_experts={n_experts}: every DeepSeek-V4 layer is MoE")
    n_shared = f.get("n_shared_experts", DEFAULTS["n_shared_experts"], cast=int)
    f.check(n_shared == 1, f"n_shared_experts={n_shared}: DeepSeek-V4 has exactly one shared expert per layer "
                           f"(moe_intermediate_size wide)")
    nh = f.run("num_attention_heads")
    nkv = f.get("num_key_value_heads", DEFAULTS["num_key_value_heads"], cast=int)
    f.check(nkv == 1, f"num_key_value_heads={nkv}: DeepSeek-V4's attention reads one shared KV head")
    s = _settings(f, n_layers, nh)
    types = _layer_types(f, n_layers)
    window = f.get("sliding_window", DEFAULTS["sliding_window"], cast=int)
    f.check(window >= 1, f"sliding_window={window} must be >= 1")
    heads = f.get("index_n_heads", DEFAULTS["index_n_heads"], cast=int)
    topk = f.get("index_topk", DEFAULTS["index_topk"], cast=int)
    f.check(heads >= 1, f"index_n_heads={heads} must be >= 1")
    f.check(topk >= 1, f"index_topk={topk} must be >= 1")
    max_position = f.get("max_position_embeddings", DEFAULTS["max_position_embeddings"], cast=int)
    main_rope = None
    if f.for_runtime:
        main, _ = _rope_params(f)
        main_rope = _rope(f, main, s.rope_dim, "rope_theta")
    return ModelConfig(
        model_type=f.model_type, num_layers=n_layers, hidden_size=hidden, num_experts=n_experts, top_k=top_k,
        moe_intermediate_size=f.need("moe_intermediate_size"), moe_layers=tuple(range(n_layers)), attention="gqa",
        vocab_size=f.run("vocab_size"), num_heads=nh, num_kv_heads=1, head_dim=s.head_dim,
        intermediate_size=None,           # no dense MLP; the shared expert is moe_intermediate_size wide
        rope=main_rope, rms_norm_eps=f.get("rms_norm_eps", DEFAULTS["rms_norm_eps"], cast=float),
        max_position=max_position, tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        attention_bias=bool(f.get("attention_bias", False)), sliding_window=window,
        n_shared_experts=n_shared, n_mtp_layers=f.get("num_nextn_predict_layers",
                                                      DEFAULTS["num_nextn_predict_layers"], cast=int),
        norm_topk_prob=bool(f.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
        routed_scaling_factor=f.get("routed_scaling_factor", DEFAULTS["routed_scaling_factor"], cast=float),
        scoring=s.scoring, topk_method="noaux_tc", q_lora_rank=s.q_lora_rank, qk_rope_head_dim=s.rope_dim,
        layer_types=types, index_n_heads=heads, index_head_dim=f.get("index_head_dim", DEFAULTS["index_head_dim"],
                                                                     cast=int),
        index_topk=topk, attention_sinks=True, bos_token_id=f.raw.get("bos_token_id"),
        eos_token_ids=token_ids(f.raw.get("eos_token_id")), raw=f.raw,
        # the routed experts' clamped SwiGLU, in the kernels (KT_ACT_SILU_CLAMPED) and the torch executors alike
        expert_activation=ExpertActivation("silu_clamped", limit=s.swiglu_limit))


# --- hub tensor names (the release's own) ----------------------------------------------------------------------
L = r"layers\.(?P<layer>\d+)\."
W123 = {"w1": "gate", "w3": "up", "w2": "down"}
COMPRESSOR = r"(compressor|indexer\.compressor)\."
ROWS = [
    (r"mtp\.\d+\..*", "skip", None, MTP_REASON),          # the release's MTP blocks (mtp.N.*)
    (r".*\.scale$", "skip", None),                         # FP8 / FP4 scales, consumed when their weight is read
    (r"embed\.weight$", "embedding", None),
    (r"head\.weight$", "head", None),
    (r"norm\.weight$", "norm", None),
    (r"hc_head_(fn|base|scale)$", "kept", None),
    (L + r"(attn_norm|ffn_norm)\.weight$", "norm", None),
    (L + r"hc_(attn|ffn)_(fn|base|scale)$", "kept", None),
    (L + r"ffn\.experts\.(?P<expert>\d+)\.(?P<proj>w[123])\.weight$", "expert", W123),
    (L + r"ffn\.gate\.weight$", "router", None),
    (L + r"ffn\.gate\.bias$", "router_bias", None),
    (L + r"ffn\.gate\.tid2eid$", "kept", None),
    (L + r"ffn\.shared_experts\.(?P<proj>w[123])\.weight$", "shared_expert", W123),
    (L + r"attn\.(q_norm|kv_norm)\.weight$", "norm", None),
    (L + r"attn\." + COMPRESSOR + r"norm\.weight$", "norm", None),
    (L + r"attn\." + COMPRESSOR + r"ape$", "kept", None),
    (L + r"attn\.attn_sink$", "kept", None),
    (L + r"attn\." + COMPRESSOR + r"(wkv|wgate)\.weight$", "attention", None),
    (L + r"attn\.indexer\.(wq_b|weights_proj)\.weight$", "attention", None),
    (L + r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$", "attention", None),
]

NAMES = HubNames(ROWS, "layers.{layer}.ffn.experts.{expert}.{proj}.weight", {"gate": "w1", "up": "w3", "down": "w2"},
                 moe_prefix="ffn.", shared_prefix="ffn.shared_experts.", model_root="", embed_name="embed.weight",
                 head_name="head.weight")


FAMILY = Family(
    name="deepseek_v4", title="DeepSeek-V4 (Flash, Pro)", architectures=("DeepseekV4ForCausalLM",), parse=parse,
    names=NAMES, runtime_module="deepseek_v4")

