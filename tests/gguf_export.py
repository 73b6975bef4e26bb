"""Write a hub-layout fixture checkpoint as a GGUF file the way llama.cpp's convert_hf_to_gguf does (test helper).

Names come from gguf-py's own TensorNameMap (llama.cpp's naming, independent of ktconvert's reader); experts are
stacked into `blk.N.ffn_*_exps` (E, rows, cols); metadata through GGUFWriter's add_* methods; Mixtral's q/k rows are
permuted as llama.cpp does for the llama architecture; DeepSeek's kv_b_proj is written split into attn_k_b/attn_v_b
as newer llama.cpp converters do. GLM-4.5 (`glm4moe`) keeps its NextN (MTP) layer as an extra block with its
`nextn.*` tensors and counts it in block_count, as llama.cpp's Glm4MoeModel does; MiniMax-M2 (`minimax-m2`) writes
rotary_dim as the rope dimension and the expert size as expert_feed_forward_length. `qtype` applies to 2-D weight
matrices whose rows fit its block size; norms, router and biases stay F32 (as llama.cpp keeps them).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer

from ktconvert.sources import open_source

GGUF_ARCH = {"deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2, "deepseek_v2": gguf.MODEL_ARCH.DEEPSEEK2,
             "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "mixtral": gguf.MODEL_ARCH.LLAMA,
             "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE, "minimax_m2": gguf.MODEL_ARCH.MINIMAXM2}


def _blocks(cfg: dict) -> int:
    """block_count as llama.cpp writes it (GLM-4.5: the NextN layers too)."""
    return cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) if cfg["model_type"] == "glm4_moe" else 0)
Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp LlamaModel.permute: (n_head, 2, hd/2, cols) -> swap -> rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(wr: gguf.GGUFWriter, cfg: dict) -> None:
    mt = cfg["model_type"]
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
    wr.add_tokenizer_pre("default")
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


def export_gguf(src_dir, out_path, qtype=Q.BF16, expert_qtype=None, split_max_tensors: int = 0,
                raw_experts: dict | None = None) -> Path:
    """src_dir: hub-layout checkpoint -> GGUF at out_path. raw_experts: {gguf name: (bytes array, qtype)} written
    as given (hand-built K-quant blocks)."""
    src_dir, out_path = Path(src_dir), Path(out_path)
    src = open_source(src_dir)
    cfg = json.loads((src_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    nmap = gguf.get_tensor_name_map(arch, _blocks(cfg))
    wr = gguf.GGUFWriter(out_path, gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    _metadata(wr, cfg)
    _tokenizer(wr, src_dir, cfg["vocab_size"], cfg)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name in src.tensor_names():
        role = src.arch.classify(name)
        mtp_block = cfg["model_type"] == "glm4_moe" and role.kind == "skip" and role.layer is not None
        if role.kind == "skip" and not mtp_block or name.endswith("_scale_inv"):
            continue
        w = src.read(name).numpy()
        if role.kind == "expert" or mtp_block and ".mlp.experts." in name:
            stacked = re.sub(r"\.experts\.\d+\.", ".experts.", name)
            stacks.setdefault(stacked, {})[int(re.search(r"\.experts\.(\d+)\.", name).group(1))] = w
            continue
        if name.endswith("e_score_correction_bias"):
            layer = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
            wr.add_tensor(f"blk.{layer}.exp_probs_b.bias", w.astype(np.float32))
            continue
        gname = nmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if cfg["model_type"] == "mixtral" and re.search(r"self_attn\.[qk]_proj", name):
            heads = cfg["num_attention_heads" if ".q_proj" in name else "num_key_value_heads"]
            w = _permute(w, heads)
        if gname.endswith("attn_kv_b.weight"):
            h, nope, v, r = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"],
                             cfg["kv_lora_rank"])
            kv = w.reshape(h, nope + v, r)
            for part, arr in ((gname.replace("kv_b", "k_b"), kv[:, :nope].transpose(0, 2, 1)),
                              (gname.replace("kv_b", "v_b"), kv[:, nope:])):
                data, t = _encode(np.ascontiguousarray(arr), qtype)
                wr.add_tensor(part, data, raw_dtype=t)
            continue
        is_matrix = w.ndim == 2 and "norm" not in gname and "ffn_gate_inp" not in gname
        data, t = _encode(w, qtype if is_matrix else Q.F32)
        wr.add_tensor(gname, data, raw_dtype=t)
    for stacked, experts in stacks.items():
        gname = nmap.get_name(stacked, try_suffixes=(".weight",))
        if raw_experts and gname in raw_experts:
            data, t = raw_experts[gname]
        else:
            data, t = _encode(np.stack([experts[e] for e in sorted(experts)]), expert_qtype or qtype)
        wr.add_tensor(gname, data, raw_dtype=t)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    src.close()
    return out_path
