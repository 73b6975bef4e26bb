"""GGUF (llama.cpp) architectures: tensor names -> hub tensor names, and metadata -> a hub-style config.json dict.

A name row maps a GGUF name pattern to a hub name template. `{L}` is the block index. Rows whose template holds `{E}`
are llama.cpp's stacked expert tensors (E, rows, cols): one GGUF tensor stands for n_experts hub tensors, read one
expert slice at a time.

Where llama.cpp's converter changed a tensor on the way in, the architecture says how to undo it, as data beside the
names (each checked against convert_hf_to_gguf.py):
- a `Join` row part: one hub tensor written as several GGUF tensors (DeepSeek's kv_b_proj as attn_k_b + attn_v_b,
  Qwen3-Next's in_proj_qkvz as attn_qkv + attn_gate, gpt-oss's interleaved gate_up bias as two bias stacks); the
  reader reads every part and the Join rebuilds the hub tensor.
- an `Undo` row: the inverse of a value transform on one tensor (the llama architecture's q/k row permutation,
  Qwen3-Next's A_log stored as -exp(A_log) and its 1 + weight norms stored with the 1 added, a squeezed conv kernel,
  Qwen3.5's value heads reordered).
A tensor with an Undo or a Join is read through the float path only (its integer grid, if any, is not taken over).

Metadata is read through a `meta` object with `.arch`, `.where`, `.get(key, default)` and `.a(key, default)`
(`a` prefixes the architecture: a('block_count') -> '<arch>.block_count'); a missing key without a default is the
reader's error. Only what the converter and ktrun need is mapped. gguf-py itself stays in ktconvert's reader.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

# Tensors llama.cpp writes that carry no weights of the model (recomputed from metadata).
IGNORED = re.compile(r"(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
# A multi-token-prediction (NextN) block's own tensors, kept by llama.cpp's GLM / Qwen3-Next converters after the main
# blocks (blk.N for N >= the model's layer count); mapped here only to be skipped.
NEXTN_ROW = (r"blk\.(?P<L>\d+)\.nextn\.(eh_proj|embed_tokens|enorm|hnorm|shared_head_head|shared_head_norm)\.weight",
             "model.layers.{L}.nextn.weight")

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


def _same_shape(shape: tuple, cfg: dict) -> tuple:
    return shape


@dataclass(frozen=True)
class Join:
    """One hub tensor the converter wrote as several GGUF tensors; each part's row names it (regex, template, join,
    part). Arrays and shapes are in hub orientation (GGUF dims reversed), float32."""
    parts: tuple[str, ...]
    shape: Callable            # ({part: shape}, config dict) -> the hub tensor's shape
    build: Callable            # ({part: array}, config dict) -> the hub tensor


@dataclass(frozen=True)
class Undo:
    """The inverse of a value transform the converter applied to one tensor."""
    fn: Callable                          # (array as stored, in hub orientation, config dict) -> the hub tensor
    shape: Callable = _same_shape         # (stored shape, config dict) -> the hub tensor's shape


@dataclass(frozen=True)
class Mapped:
    """Where one GGUF tensor goes: its hub name, block index, and the Join it is a part of (if any)."""
    hub: str
    layer: int | None
    join: Join | None = None
    part: str | None = None


@dataclass(frozen=True)
class GGUFArch:
    """One `general.architecture` value: its tensor names and how its metadata becomes config.json."""
    name: str                                     # e.g. "deepseek2"
    rows: list                                    # (GGUF name regex, hub name template) or
                                                  # (regex, template, Join, part name)
    build_config: Callable                        # (meta, common config dict, GGUF tensor names) -> config
                                                  # dict (tensor presence tells optional parts apart)
    undo: list = field(default_factory=list)      # (hub name regex, Undo): converter transforms undone at read
    compiled: list = field(default_factory=list, compare=False, repr=False)
    compiled_undo: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        for row in self.rows:
            if len(row) not in (2, 4) or (len(row) == 4 and not isinstance(row[2], Join)):
                raise ValueError(f"GGUF row {row[0]!r}: (regex, template) or (regex, template, Join, part)")
        self.compiled.extend((re.compile(r[0] + "$"), *r[1:], *(None, None)[: 4 - len(r)]) for r in self.rows)
        self.compiled_undo.extend((re.compile(p), u) for p, u in self.undo)

    def match(self, gguf_name: str) -> Mapped | None:
        """Where a GGUF tensor goes (hub template with {L} filled), or None when no row matches."""
        for rx, template, join, part in self.compiled:
            m = rx.match(gguf_name)
            if m:
                layer = int(m.group("L")) if "L" in m.groupdict() else None
                hub = template if layer is None else template.replace("{L}", str(layer))
                return Mapped(hub, layer, join, part)
        return None

    def undo_for(self, hub_name: str) -> Undo | None:
        """The Undo of a hub tensor, or None when the converter stored it as it is."""
        for rx, u in self.compiled_undo:
            if rx.search(hub_name):
                return u
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
