"""GGUF (llama.cpp) tensor names -> hub tensor names, as data tables per GGUF architecture.

A row maps a GGUF name pattern to a hub name template. `{L}` is the block index. Rows whose template holds `{E}` are
llama.cpp's stacked expert tensors (E, rows, cols): one GGUF tensor stands for n_experts hub tensors, read one expert
slice at a time. The special template KV_B_SPLIT marks DeepSeek's attn_k_b / attn_v_b, which newer llama.cpp
converters write instead of attn_kv_b; the reader reassembles kv_b_proj from them.
"""
from __future__ import annotations

import re

KV_B_SPLIT = "<kv_b split>"

_ATTN_NORMS = [
    (r"blk\.(?P<L>\d+)\.attn_norm\.weight", "model.layers.{L}.input_layernorm.weight"),
    (r"blk\.(?P<L>\d+)\.ffn_norm\.weight", "model.layers.{L}.post_attention_layernorm.weight"),
]
_GLOBALS = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]
_DENSE_MLP = [(rf"blk\.(?P<L>\d+)\.ffn_{p}\.weight", f"model.layers.{{L}}.mlp.{p}_proj.weight") for p in ("gate", "up", "down")]


def _experts(prefix: str, names: dict[str, str]) -> list:
    return [(rf"blk\.(?P<L>\d+)\.ffn_{p}_exps\.weight", f"model.layers.{{L}}.{prefix}.experts.{{E}}.{h}.weight")
            for p, h in names.items()]


_GUD = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

TABLES = {
    "deepseek2": _GLOBALS + _ATTN_NORMS + _DENSE_MLP + _experts("mlp", _GUD) + [
        (r"blk\.(?P<L>\d+)\.attn_q\.weight", "model.layers.{L}.self_attn.q_proj.weight"),
        (r"blk\.(?P<L>\d+)\.attn_q_a\.weight", "model.layers.{L}.self_attn.q_a_proj.weight"),
        (r"blk\.(?P<L>\d+)\.attn_q_a_norm\.weight", "model.layers.{L}.self_attn.q_a_layernorm.weight"),
        (r"blk\.(?P<L>\d+)\.attn_q_b\.weight", "model.layers.{L}.self_attn.q_b_proj.weight"),
        (r"blk\.(?P<L>\d+)\.attn_kv_a_mqa\.weight", "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight"),
        (r"blk\.(?P<L>\d+)\.attn_kv_a_norm\.weight", "model.layers.{L}.self_attn.kv_a_layernorm.weight"),
        (r"blk\.(?P<L>\d+)\.attn_kv_b\.weight", "model.layers.{L}.self_attn.kv_b_proj.weight"),
        (r"blk\.(?P<L>\d+)\.attn_[kv]_b\.weight", KV_B_SPLIT),
        (r"blk\.(?P<L>\d+)\.attn_output\.weight", "model.layers.{L}.self_attn.o_proj.weight"),
        (r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.mlp.gate.weight"),
        (r"blk\.(?P<L>\d+)\.exp_probs_b\.bias", "model.layers.{L}.mlp.gate.e_score_correction_bias"),
    ] + [(rf"blk\.(?P<L>\d+)\.ffn_{p}_shexp\.weight", f"model.layers.{{L}}.mlp.shared_experts.{p}_proj.weight")
         for p in ("gate", "up", "down")],
    "qwen3moe": _GLOBALS + _ATTN_NORMS + _DENSE_MLP + _experts("mlp", _GUD) + [
        (rf"blk\.(?P<L>\d+)\.attn_{g}\.weight", f"model.layers.{{L}}.self_attn.{h}.weight")
        for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj"),
                     ("q_norm", "q_norm"), ("k_norm", "k_norm"))
    ] + [(r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.mlp.gate.weight")],
    # Mixtral ships as GGUF architecture "llama" with stacked experts.
    "llama": _GLOBALS + _ATTN_NORMS + _experts("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}) + [
        (rf"blk\.(?P<L>\d+)\.attn_{g}\.weight", f"model.layers.{{L}}.self_attn.{h}.weight")
        for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj"))
    ] + [(r"blk\.(?P<L>\d+)\.ffn_gate_inp\.weight", "model.layers.{L}.block_sparse_moe.gate.weight")],
}
SUPPORTED_GGUF_ARCHS = tuple(sorted(TABLES))
# Tensors llama.cpp writes that carry no weights of the model (recomputed from metadata).
IGNORED = re.compile(r"(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
_COMPILED = {arch: [(re.compile(p + "$"), t) for p, t in rows] for arch, rows in TABLES.items()}


def hub_name(arch: str, gguf_name: str) -> tuple[str, int | None] | None:
    """(hub template with {L} filled, layer) for a GGUF tensor name, or None when no row matches."""
    for rx, template in _COMPILED[arch]:
        m = rx.match(gguf_name)
        if m:
            layer = int(m.group("L")) if "L" in m.groupdict() else None
            return (template if template == KV_B_SPLIT else template.replace("{L}", str(layer))), layer
    return None


def llama_unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation for the llama architecture (its rope is interleaved; HF's is half-split).

    w: (n_head * head_dim, hidden). llama.cpp wrote w.reshape(n_head, 2, hd/2, H).swapaxes(1, 2); invert it.
    """
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_permute(w, n_head: int):
    """llama.cpp's q/k permutation (used by tests to write GGUF files as llama.cpp does)."""
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)
