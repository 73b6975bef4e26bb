"""GGUF (llama.cpp) architectures: tensor names -> hub tensor names, and metadata -> a hub-style config.json dict.

A name row maps a GGUF name pattern to a hub name template. `{L}` is the block index. Rows whose template holds `{E}`
are llama.cpp's stacked expert tensors (E, rows, cols): one GGUF tensor stands for n_experts hub tensors, read one
expert slice at a time. The special template KV_B_SPLIT marks DeepSeek's attn_k_b / attn_v_b, which newer llama.cpp
converters write instead of attn_kv_b; the reader reassembles kv_b_proj from them.

Metadata is read through a `meta` object with `.arch`, `.where`, `.get(key, default)` and `.a(key, default)`
(`a` prefixes the architecture: a('block_count') -> '<arch>.block_count'); a missing key without a default is the
reader's error. Only what the converter and ktrun need is mapped. gguf-py itself stays in ktconvert's reader.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

KV_B_SPLIT = "<kv_b split>"
# Tensors llama.cpp writes that carry no weights of the model (recomputed from metadata).
IGNORED = re.compile(r"(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")

ATTN_NORM_ROWS = [
    (r"blk\.(?P<L>\d+)\.attn_norm\.weight", "model.layers.{L}.input_layernorm.weight"),
    (r"blk\.(?P<L>\d+)\.ffn_norm\.weight", "model.layers.{L}.post_attention_layernorm.weight"),
]
GLOBAL_ROWS = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]
DENSE_MLP_ROWS = [(rf"blk\.(?P<L>\d+)\.ffn_{p}\.weight", f"model.layers.{{L}}.mlp.{p}_proj.weight")
                  for p in ("gate", "up", "down")]
HUB_GATE_UP_DOWN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def expert_rows(prefix: str, names: dict[str, str]) -> list:
    """llama.cpp's stacked `blk.N.ffn_{gate,up,down}_exps` -> per-expert hub names under `prefix`."""
    return [(rf"blk\.(?P<L>\d+)\.ffn_{p}_exps\.weight", f"model.layers.{{L}}.{prefix}.experts.{{E}}.{h}.weight")
            for p, h in names.items()]


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture` value: its tensor names and how its metadata becomes config.json."""
    name: str                                     # e.g. "deepseek2"
    rows: list                                    # (GGUF name regex, hub name template)
    build_config: Callable                        # (meta, common config dict, GGUF tensor names) -> config
                                                  # dict (tensor presence tells optional parts apart)
    permuted_qk: bool = False                     # llama.cpp permuted q/k rows (arch "llama"); undone at read
    compiled: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        self.compiled.extend((re.compile(p + "$"), t) for p, t in self.rows)

    def hub_name(self, gguf_name: str) -> tuple[str, int | None] | None:
        """(hub template with {L} filled, layer) for a GGUF tensor name, or None when no row matches."""
        for rx, template in self.compiled:
            m = rx.match(gguf_name)
            if m:
                layer = int(m.group("L")) if "L" in m.groupdict() else None
                return (template if template == KV_B_SPLIT else template.replace("{L}", str(layer))), layer
        return None


def common_config(m, vocab_size: int) -> dict:
    """The keys every architecture writes the same way."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": m.a("embedding_length"),
        "num_hidden_layers": m.a("block_count"),
        "num_attention_heads": m.a("attention.head_count"),
        "num_key_value_heads": m.a("attention.head_count_kv", m.a("attention.head_count")),
        "max_position_embeddings": m.a("context_length", 4096),
        "rms_norm_eps": m.a("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": m.a("rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": m.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": m.get("tokenizer.ggml.eos_token_id", None),
    }


def config_from_gguf(arch: GGUFArch, m, vocab_size: int, has_output: bool, names: frozenset) -> dict:
    """A hub-style config.json dict (model_type and architectures set) from a GGUF file's metadata; names: every
    tensor name in the file (optional parts such as q/k norms are known by their tensors)."""
    cfg = arch.build_config(m, common_config(m, vocab_size), names)
    cfg["tie_word_embeddings"] = not has_output
    return {k: v for k, v in cfg.items() if v is not None or k in ("q_lora_rank",)}


def llama_unpermute(w, n_head: int):
    """Undo llama.cpp's q/k row permutation for the llama architecture (its rope is interleaved; HF's is half-split).

    w: (n_head * head_dim, hidden). llama.cpp wrote w.reshape(n_head, 2, hd/2, H).swapaxes(1, 2); invert it.
    """
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_permute(w, n_head: int):
    """llama.cpp's q/k permutation (the inverse of llama_unpermute)."""
    rows, cols = w.shape
    hd = rows // n_head
    return w.reshape(n_head, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols)
