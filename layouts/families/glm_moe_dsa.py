"""GLM-5 / GLM-5.1 / GLM-5.2 (model_type glm_moe_dsa): DeepSeek-V3.2's multi-head latent attention with DeepSeek
Sparse Attention (q LoRA, compressed-latent KV, RoPE on interleaved pairs of the qk_rope_head_dim dims; a lightning
indexer picks the index_topk keys each query attends to) and GLM's MoE (sigmoid scores plus e_score_correction_bias,
group-limited top-k (one group in the releases), routed_scaling_factor, n_shared_experts shared experts, the first
first_k_dense_replace layers dense, transformers' mlp_layer_types when present). The multi-token-prediction layer
after the main ones (num_nextn_predict_layers, layer 78 in the releases; index_share_for_mtp_iteration concerns only
it) is skipped and the converter says so.

What differs from DeepSeek-V3.2:
- the indexer ropes its first qk_rope_head_dim dims as interleaved pairs (`indexer_rope_interleave`: true in the
  releases, and transformers' GlmMoeDsaIndexer always does), where V3.2's indexer ropes halves;
- cross-layer index sharing (GLM-5.2's IndexShare): `indexer_types` says per layer "full" (the layer runs its
  indexer) or "shared" (it has no indexer tensors and attends to the keys the previous full layer selected for the
  same query). transformers derives it, when absent, from `index_topk_pattern` ("F"/"S" per layer) or else from
  `index_topk_freq` / `index_skip_topk_offset` (layer i is full when max(i - offset + 1, 0) % freq == 0; freq 1,
  GLM-5's default, makes every layer full). The first layer must be full.
- transformers' defaults: 1 expert group, index_n_heads 32, rms_norm_eps 1e-5, a 202752-position context.

Tensor names are V3.2's (self_attn.indexer.{wq_b, wk, k_norm, weights_proj}, the MLA and MoE names of DeepSeek-V3).
GGUF input: not read (llama.cpp's `glm-dsa` GGUFs exist; this family has no GGUF rows yet).
"""
from __future__ import annotations

import dataclasses

from . import deepseek_v2, deepseek_v32
from .config import Fields, ModelConfig
from .family import Family
from .hub_names import HubNames

# transformers GlmMoeDsaConfig's defaults for the fields we read
DEFAULTS = {"first_k_dense_replace": 3, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "n_shared_experts": 1, "q_lora_rank": 2048, "max_position_embeddings": 202752,
            "num_key_value_heads": 64, "rms_norm_eps": 1e-5, "index_topk": 2048, "index_head_dim": 128,
            "index_n_heads": 32, "index_topk_freq": 1, "index_skip_topk_offset": 2}
INDEXER_TYPES = ("full", "shared")


def _schedule(n_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))


def _pattern(f: Fields, n_layers: int) -> tuple[str, ...] | None:
    """`index_topk_pattern` ("FSSF...", or a list of "full" / "shared") -> per-layer types; None when absent."""
    pattern = f.get("index_topk_pattern", None)
    if pattern is None:
        return None
    letters = {"F": "full", "S": "shared"}
    if isinstance(pattern, str):
        f.check(set(pattern) <= set(letters), f"field 'index_topk_pattern' = {pattern!r} must be letters F (full) "
                                              f"and S (shared)")
        pattern = [letters[c] for c in pattern]
    f.check(isinstance(pattern, list) and len(pattern) == n_layers,
            f"field 'index_topk_pattern' must give one type per layer (num_hidden_layers={n_layers})")
    return tuple(pattern)


def _check_values(f: Fields, types: tuple) -> None:
    for i, t in enumerate(types):
        f.check(t in INDEXER_TYPES, f"field 'indexer_types'[{i}] = {t!r} is not one of 'full', 'shared'")


def indexer_types(f: Fields, n_layers: int) -> tuple[str, ...]:
    """Per layer "full" or "shared", as transformers' GlmMoeDsaConfig resolves it (indexer_types, else
    index_topk_pattern, else index_topk_freq / index_skip_topk_offset); a config whose explicit list disagrees with
    its own freq / offset or pattern is refused (the releases carry both; serving engines read the latter)."""
    freq = f.get("index_topk_freq", DEFAULTS["index_topk_freq"], cast=int)
    offset = f.get("index_skip_topk_offset", DEFAULTS["index_skip_topk_offset"], cast=int)
    f.check(freq >= 1, f"field 'index_topk_freq' = {freq} must be >= 1")
    derived, source = _pattern(f, n_layers), "index_topk_pattern"
    if derived is None:
        derived = _schedule(n_layers, freq, offset)
        source = f"index_topk_freq={freq} / index_skip_topk_offset={offset}"
    types = f.get("indexer_types", None)
    if types is None:
        types = derived
    else:
        f.check(isinstance(types, list) and len(types) == n_layers,
                f"field 'indexer_types' must list one type per layer (num_hidden_layers={n_layers}), got {types!r}")
        types = tuple(types)
        _check_values(f, types)
        explicit = any(f.raw.get(k) is not None for k in ("index_topk_pattern", "index_topk_freq",
                                                           "index_skip_topk_offset"))
        if explicit and types != derived:
            i = next(i for i, (a, b) in enumerate(zip(types, derived)) if a != b)
            raise f.error(f"field 'indexer_types'[{i}] = {types[i]!r} disagrees with {source}, which makes layer {i} "
                          f"{derived[i]!r}")
    _check_values(f, types)
    f.check(not types or types[0] == "full", "field 'indexer_types'[0] is 'shared': a shared layer reuses the "
                                             "previous full layer's selection, and layer 0 has none before it")
    return types


def parse(f: Fields) -> ModelConfig:
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        got = f.get(key, want)
        f.check(got == want, f"{key} {got!r}: GLM-5 routes by {want!r} (transformers' GlmMoeDsaTopkRouter is the only "
                             f"router it has)")
    # the MLA's own rope: interleaved pairs in every release (rope_interleave); transformers always interleaves it
    cfg = deepseek_v2.parse_mla(f, defaults=DEFAULTS, experts_alias="num_experts", scoring="sigmoid",
                                topk_method="noaux_tc", interleaved=bool(f.get("rope_interleave", True)), mtp=True)
    cfg = deepseek_v32.with_indexer(f, cfg, DEFAULTS)
    cfg = deepseek_v2.with_mlp_layer_types(f, cfg)
    return dataclasses.replace(cfg, indexer_types=indexer_types(f, cfg.num_layers),
                               index_rope_interleaved=bool(f.get("indexer_rope_interleave", True)))


FAMILY = Family(
    name="glm_moe_dsa", title="GLM-5 / 5.1 / 5.2", architectures=("GlmMoeDsaForCausalLM",), parse=parse,
    names=HubNames(deepseek_v32.ROWS, deepseek_v2.EXPERT_NAME, deepseek_v2.GATE_UP_DOWN, moe_prefix="mlp.",
                   shared_prefix="mlp.shared_experts.", mtp=True),
    runtime_module="glm_moe_dsa")
