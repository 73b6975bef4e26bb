"""Write a hub-layout fixture checkpoint as a GGUF file the way llama.cpp's convert_hf_to_gguf does (test helper).

Names come from gguf-py's own TensorNameMap (llama.cpp's naming, independent of ktconvert's reader); experts are
stacked into `blk.N.ffn_*_exps` (E, rows, cols); metadata through GGUFWriter's add_* methods; Mixtral's q/k rows are
permuted as llama.cpp does for the llama architecture; DeepSeek's kv_b_proj is written split into attn_k_b/attn_v_b
as newer llama.cpp converters do. GLM-4.5 (`glm4moe`) keeps its NextN (MTP) layer as an extra block with its
`nextn.*` tensors and counts it in block_count, as llama.cpp's Glm4MoeModel does; MiniMax-M2 (`minimax-m2`) writes
rotary_dim as the rope dimension and the expert size as expert_feed_forward_length. `qtype` applies to 2-D weight
matrices whose rows fit its block size; norms, router and biases stay F32 (as llama.cpp keeps them).

The newer architectures follow their converter classes in llama.cpp's convert_hf_to_gguf (conversion/*.py), on
float32 copies as it computes: Qwen3-Next (`qwen3next`, Qwen3NextModel) stores A_log as -exp(A_log), renames dt_bias,
squeezes the conv kernel, adds 1 to every RMSNorm weight but the DeltaNet's, and regroups in_proj_qkvz into attn_qkv +
attn_gate; Qwen3.5-MoE (`qwen35moe`, Qwen3_5MoeTextModel) does the same to its four in_proj Linears and reorders
the value heads from grouped-by-key-head to tiled (_LinearAttentionVReorderBase); gpt-oss (`gpt-oss`, GptOssModel)
splits the fused experts and their biases into gate / up / down stacks (even / odd rows) and repacks MXFP4 blocks
into ggml's MXFP4 (transform_nibble_layout); GLM-4.7-Flash (Glm4MoeLiteModel) is written as `deepseek2` with its
NextN block, the MLA head counts of DeepseekV2Model and the GLM pre-tokenizer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer

from ktconvert.sources import open_source

GGUF_ARCH = {"deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
             "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
             "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE, "minimax_m2": gguf.MODEL_ARCH.MINIMAXM2,
             "glm4_moe_lite": gguf.MODEL_ARCH.DEEPSEEK2, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT,
             "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE, "gpt_oss": gguf.MODEL_ARCH.GPT_OSS}
KEEPS_MTP = ("glm4_moe", "glm4_moe_lite")        # converters that keep the NextN block as blk.<num_hidden_layers>
PRE_TOKENIZER = {"glm4_moe": "glm4", "glm4_moe_lite": "glm4"}      # what get_vocab_base_pre names GLM's tokenizer
# MTP-only tensor names, mapped as llama.cpp's tensor map does for every architecture with NextN blocks (the gguf-py
# release lists them for glm4moe only)
NEXTN_MAP = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, 64)


def _blocks(cfg: dict) -> int:
    """block_count as llama.cpp writes it (GLM-4.5 / 4.7-Flash: the NextN layers too)."""
    return cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) if cfg["model_type"] in KEEPS_MTP else 0)
Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp LlamaModel.permute: (n_head, 2, hd/2, cols) -> swap -> rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(wr: gguf.GGUFWriter, cfg: dict) -> None:
    mt = cfg["model_type"]
    if mt in ("qwen3_next", "qwen3_5_moe", "gpt_oss", "glm4_moe_lite"):
        _metadata_newer(wr, cfg)
        return
    wr.add_block_count(_blocks(cfg))
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    wr.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    wr.add_expert_used_count(cfg["num_experts_per_tok"])
    if mt.startswith("deepseek"):
        wr.add_feed_forward_length(cfg["intermediate_size"])
        wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        wr.add_expert_count(cfg["n_routed_experts"])
        wr.add_expert_shared_count(cfg["n_shared_experts"])
        wr.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        wr.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
        wr.add_expert_weights_norm(bool(cfg.get("norm_topk_prob", False)))
        wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if mt == "deepseek_v3" else gguf.ExpertGatingFuncType.SOFTMAX)
        wr.add_expert_group_count(cfg.get("n_group") or 1)
        wr.add_expert_group_used_count(cfg.get("topk_group") or 1)
        if cfg.get("q_lora_rank"):
            wr.add_q_lora_rank(cfg["q_lora_rank"])
        wr.add_kv_lora_rank(cfg["kv_lora_rank"])
        wr.add_key_length(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        wr.add_value_length(cfg["v_head_dim"])
        wr.add_rope_dimension_count(cfg["qk_rope_head_dim"])
        if rope.get("rope_type") == "yarn":
            wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            wr.add_rope_scaling_factor(rope["factor"])
            wr.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            wr.add_rope_scaling_yarn_log_mul(0.1 * rope.get("mscale_all_dim", 0.0))
    elif mt == "glm4_moe":
        hd = cfg["head_dim"]
        wr.add_feed_forward_length(cfg["intermediate_size"])
        wr.add_rope_dimension_count(int(hd * cfg["partial_rotary_factor"]))
        wr.add_key_length(hd)
        wr.add_value_length(hd)
        wr.add_expert_count(cfg["n_routed_experts"])
        wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        wr.add_expert_shared_count(cfg["n_shared_experts"])
        wr.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        wr.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
        wr.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
        wr.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
        wr.add_expert_group_count(cfg["n_group"])            # llama.cpp's converter leaves these out: GLM's are 1
        wr.add_expert_group_used_count(cfg["topk_group"])
    elif mt == "minimax_m2":
        wr.add_feed_forward_length(cfg["intermediate_size"])
        wr.add_expert_count(cfg["num_local_experts"])
        wr.add_expert_feed_forward_length(cfg["intermediate_size"])
        wr.add_rope_dimension_count(cfg["rotary_dim"])
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
    elif mt == "qwen3_moe":
        wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        wr.add_expert_count(cfg["num_experts"])
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
    else:  # mixtral as llama
        wr.add_feed_forward_length(cfg["intermediate_size"])
        wr.add_expert_count(cfg["num_local_experts"])


def _rope(cfg: dict) -> dict:
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type"))
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def _metadata_newer(wr: gguf.GGUFWriter, cfg: dict) -> None:
    """TextModel.set_gguf_parameters and the architecture's own additions, key for key."""
    mt, rope = cfg["model_type"], _rope(cfg)
    wr.add_block_count(_blocks(cfg))
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):
        wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(1 if mt == "glm4_moe_lite" else cfg["num_key_value_heads"])   # MLA written as MQA
    if rope.get("rope_type") == "yarn":
        wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        wr.add_rope_scaling_factor(rope["factor"])
        wr.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        wr.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        wr.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if "mrope_section" in rope:
        wr.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0, 0][:4])
    wr.add_rope_freq_base(float(rope["rope_theta"]))
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_expert_count(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg["n_routed_experts"])
    wr.add_expert_used_count(cfg["num_experts_per_tok"])
    if mt == "glm4_moe_lite":                 # DeepseekV2Model + Glm4MoeLiteModel (no scoring_func: no gating key)
        wr.add_expert_group_count(cfg["n_group"])
        wr.add_expert_group_used_count(cfg["topk_group"])
        wr.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        wr.add_vocab_size(cfg["vocab_size"])
        wr.add_q_lora_rank(cfg["q_lora_rank"])
        r, rd = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        wr.add_kv_lora_rank(r)
        wr.add_key_length(r + rd)
        wr.add_value_length(r)
        wr.add_key_length_mla(cfg["qk_nope_head_dim"] + rd)
        wr.add_value_length_mla(cfg["v_head_dim"])
        wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        wr.add_expert_shared_count(cfg["n_shared_experts"])
        wr.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob"):
            wr.add_expert_weights_norm(True)
        wr.add_rope_dimension_count(rd)
        if cfg.get("num_nextn_predict_layers"):
            wr.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
        return
    wr.add_key_length(cfg["head_dim"])
    wr.add_value_length(cfg["head_dim"])
    if mt == "gpt_oss":
        wr.add_sliding_window(cfg["sliding_window"])
        wr.add_expert_feed_forward_length(cfg["intermediate_size"])
        return
    # Qwen2MoeModel + Qwen3NextModel
    wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    wr.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    wr.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    wr.add_ssm_state_size(cfg["linear_key_head_dim"])
    wr.add_ssm_group_count(cfg["linear_num_key_heads"])
    wr.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    wr.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    if cfg.get("layer_types"):                # gguf-py's add_recurrent_layers is newer than its PyPI release
        wr.add_array(f"{wr.arch}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    wr.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    wr.add_rope_dimension_count(int(cfg["head_dim"] * rope.get("partial_rotary_factor",
                                                               cfg.get("partial_rotary_factor", 0.25))))


def _tile_v_heads(w: np.ndarray, axis: int, cfg: dict, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled, along `axis`."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(nk, nv // nk, head_dim, *rest).swapaxes(0, 1).reshape(nv * head_dim, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def _linear_attention(name: str, w: np.ndarray, cfg: dict) -> list[tuple[str, np.ndarray]]:
    """Qwen3NextModel.modify_tensors (and, for Qwen3.5, the value-head reorder before it): HF-style names out."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, h = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["hidden_size"]
    if cfg["model_type"] == "qwen3_5_moe" and nk != nv and "linear_attn." in name:
        qk = 2 * nk * dk
        if ".in_proj_qkv." in name or ".conv1d" in name:
            w = w.reshape(w.shape[0], -1) if ".conv1d" in name else w
            w = np.concatenate([w[:qk], _tile_v_heads(w[qk:], 0, cfg, dv)])
        elif ".in_proj_z." in name:
            w = _tile_v_heads(w, 0, cfg, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name or "A_log" in name or "dt_bias" in name:
            w = _tile_v_heads(w, 0, cfg, 1)
        elif ".out_proj." in name:
            w = _tile_v_heads(w, 1, cfg, dv)
    if name.endswith(".A_log"):
        return [(name, (-torch.exp(torch.from_numpy(w))).numpy())]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix(".dt_bias") + ".dt_proj.bias", w)]
    if "conv1d" in name:
        return [(name, w.reshape(w.shape[0], -1))]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, w + np.float32(1))]
    if name.endswith("in_proj_qkvz.weight"):
        r = nv // nk
        per = w.T.reshape(h, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = np.split(per, np.cumsum([dk, dk, r * dv])[:3], axis=-1)
        qkv = np.concatenate([x.reshape(h, -1) for x in (q, k, v)], axis=-1).T
        return [(name.replace("in_proj_qkvz", "in_proj_qkv"), np.ascontiguousarray(qkv)),
                (name.replace("in_proj_qkvz", "in_proj_z"), np.ascontiguousarray(z.reshape(h, -1).T))]
    return [(name, w)]


def _mxfp4_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GptOssModel.repack_mxfp4: HF blocks (..., K/32, 16) (element 2i low nibble, 2i+1 high) + E8M0 scales
    (..., K/32) -> ggml MXFP4 bytes (..., K/32 * 17): the scale, then elements j / j+16 in the low / high nibble of
    byte j (transform_nibble_layout, written here on its bytes)."""
    lo, hi = blocks & 0x0F, blocks >> 4
    elems = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = (elems[..., :16] | (elems[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([scales[..., None], qs], axis=-1)
    return np.ascontiguousarray(out.reshape(*blocks.shape[:-2], -1))


def _tokenizer(wr: gguf.GGUFWriter, src_dir: Path, vocab_size: int, cfg: dict) -> None:
    tj = json.loads((src_dir / "tokenizer.json").read_text())
    tc = json.loads((src_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(src_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    special = {a["content"] for a in tj.get("added_tokens", []) if a.get("special")}
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED if t is None else
                     gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL)
    merges = tj["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre(cfg.get("tokenizer_pre") or PRE_TOKENIZER.get(cfg["model_type"], "default"))
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    for key, add in (("bos_token", wr.add_bos_token_id), ("eos_token", wr.add_eos_token_id)):
        if tc.get(key):
            add(vocab[tc[key]])
    wr.add_add_bos_token(bool(tc.get("add_bos_token")))
    if tc.get("chat_template"):
        wr.add_chat_template(tc["chat_template"])


def _encode(a: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    if a.ndim < 2 or qtype == Q.F32 or a.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return a.astype(np.float32), Q.F32
    return gguf.quants.quantize(a.astype(np.float32), qtype), qtype


def _gpt_oss_experts(src_dir: Path, nmap) -> list[tuple[str, np.ndarray, object]]:
    """GptOssModel's expert tensors, straight from the safetensors files: (GGUF name, data, ggml type or None for
    floats to encode). Fused gate_up rows alternate gate / up (even / odd); MXFP4 blocks are repacked, not decoded."""
    from safetensors import safe_open
    fused = {}
    for shard in sorted(src_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in sorted(f.keys()):
                if re.search(r"\.mlp\.experts\.(gate_up|down)_proj", k):
                    t = f.get_tensor(k)
                    fused[k] = t.numpy() if t.dtype == torch.uint8 else t.float().numpy()
    out = []
    for k, t in fused.items():
        base = k.removesuffix("_blocks").removesuffix("_scales").removesuffix("_bias")
        gu = base.endswith("gate_up_proj")
        halves = {"gate": (slice(None), slice(0, None, 2)), "up": (slice(None), slice(1, None, 2))} if gu else \
            {"down": (slice(None),)}
        stem = base.rsplit(".", 1)[0]
        for proj, sl in halves.items():
            hf = f"{stem}.{proj}_proj"
            if k.endswith("_bias"):                       # (E, 2I): the halves along the last axis
                b = t[..., sl[-1]] if gu else t
                out.append((nmap.get_name(hf + ".bias", try_suffixes=(".bias",)), b.astype(np.float32), Q.F32))
            elif k.endswith("_blocks"):
                blocks, scales = t[sl], fused[base + "_scales"][sl]
                out.append((nmap.get_name(hf + ".weight", try_suffixes=(".weight",)),
                            _mxfp4_ggml(blocks, scales), Q.MXFP4))
            elif not k.endswith("_scales"):                # floats (E, K, N): written (E, N, K) as Linear rows
                w = np.ascontiguousarray(t.transpose(0, 2, 1)[sl])
                out.append((nmap.get_name(hf + ".weight", try_suffixes=(".weight",)), w, None))
    return out


def export_gguf(src_dir, out_path, qtype=Q.BF16, expert_qtype=None, split_max_tensors: int = 0,
                raw_experts: dict | None = None, no_mtp: bool = False, tokenizer_pre: str | None = None) -> Path:
    """src_dir: hub-layout checkpoint -> GGUF at out_path. raw_experts: {gguf name: (bytes array, qtype)} written
    as given (hand-built K-quant blocks). no_mtp: convert_hf_to_gguf's --no-mtp (NextN blocks dropped);
    tokenizer_pre: another tool's tokenizer.ggml.pre."""
    src_dir, out_path = Path(src_dir), Path(out_path)
    src = open_source(src_dir)
    top = json.loads((src_dir / "config.json").read_text())
    cfg = {**top, **top.get("text_config", {}), "model_type": top["model_type"]}   # as llama.cpp merges them
    if no_mtp:
        cfg["num_nextn_predict_layers"] = 0
    if tokenizer_pre is not None:
        cfg["tokenizer_pre"] = tokenizer_pre
    mt = cfg["model_type"]
    arch = GGUF_ARCH[mt]
    nmap = gguf.get_tensor_name_map(arch, _blocks(cfg))
    wr = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    _metadata(wr, cfg)
    _tokenizer(wr, src_dir, cfg["vocab_size"], cfg)
    stacks: dict[str, dict[int, np.ndarray]] = {}

    def add(gname: str, w: np.ndarray, quantize: bool) -> None:
        data, t = _encode(w, qtype if quantize else Q.F32)
        wr.add_tensor(gname, data, raw_dtype=t)

    for name in src.tensor_names():
        role = src.arch.classify(name)
        mtp_block = mt in KEEPS_MTP and role.kind == "skip" and role.layer is not None and not no_mtp
        if role.kind == "skip" and not mtp_block or name.endswith("_scale_inv"):
            continue
        if mt == "gpt_oss" and role.kind in ("expert", "expert_bias"):
            continue                                      # from the files as stored (_gpt_oss_experts)
        w = src.read(name).numpy()
        name = name.replace("model.language_model.", "model.", 1)     # Qwen3.5's text model
        if role.kind == "expert" or mtp_block and ".mlp.experts." in name:
            stacked = re.sub(r"\.experts\.\d+\.", ".experts.", name)
            stacks.setdefault(stacked, {})[int(re.search(r"\.experts\.(\d+)\.", name).group(1))] = w
            continue
        if name.endswith("e_score_correction_bias"):
            layer = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
            wr.add_tensor(f"blk.{layer}.exp_probs_b.bias", w.astype(np.float32))
            continue
        if name.endswith("self_attn.sinks"):             # GptOssModel.filter_tensors appends .weight
            name += ".weight"
        parts = _linear_attention(name, w, cfg) if mt in ("qwen3_next", "qwen3_5_moe") else [(name, w)]
        for hf, w in parts:
            gname = (nmap.get_name(hf, try_suffixes=(".weight", ".bias"))
                     or NEXTN_MAP.get_name(hf, try_suffixes=(".weight", ".bias")))
            if mt == "mixtral" and re.search(r"self_attn\.[qk]_proj", hf):
                heads = cfg["num_attention_heads" if ".q_proj" in hf else "num_key_value_heads"]
                w = _permute(w, heads)
            if gname.endswith("attn_kv_b.weight"):
                h, nope, v, r = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                                 cfg["kv_lora_rank"])
                kv = w.reshape(h, nope + v, r)
                add(gname.replace("kv_b", "k_b"), np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1)), True)
                add(gname.replace("kv_b", "v_b"), np.ascontiguousarray(kv[:, nope:]), True)
                continue
            add(gname, w, w.ndim == 2 and not re.search(r"norm|ffn_gate_inp|ssm_conv1d", gname))
    for stacked, experts in stacks.items():
        gname = nmap.get_name(stacked, try_suffixes=(".weight",))
        if raw_experts and gname in raw_experts:
            data, t = raw_experts[gname]
        else:
            data, t = _encode(np.stack([experts[e] for e in sorted(experts)]), expert_qtype or qtype)
        wr.add_tensor(gname, data, raw_dtype=t)
    if mt == "gpt_oss":
        for gname, data, t in _gpt_oss_experts(src_dir, nmap):
            if t is None:
                data, t = _encode(data, expert_qtype or qtype)
            wr.add_tensor(gname, data, raw_dtype=t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    src.close()
    return out_path
