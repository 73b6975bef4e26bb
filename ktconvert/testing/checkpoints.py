"""Tiny checkpoint factory: random-init Hugging Face models written exactly as the hub ships them.

Weights come from the `transformers` model class (fixed seed), rounded to bf16 so the saved files hold the
model's exact values; `from_pretrained(dir)` reproduces the in-memory model's logits bit for bit. In-memory
transformers (v5) MoE experts are fused (`experts.gate_up_proj (E, 2I, H)`, `experts.down_proj (E, H, I)`); the
files carry the hub's per-expert names. DeepSeek-V3 can also be written in DeepSeek's FP8 release format, with
the multi-token-prediction (MTP) layer at index num_hidden_layers.

transformers is imported lazily: it is a test/benchmark dependency, not a converter one.
"""
from __future__ import annotations

import importlib
import json
import math
import re
from pathlib import Path

import torch

from ktconvert.testing.families import ARCHS, FIXTURES
from ktconvert.testing.files import (
    F32_TENSORS,
    FP8_QUANTIZATION_CONFIG,
    hub_config,
    to_hub_dtype,
    write_shards,
)
from ktconvert.testing.tokenizer import TOKEN_IDS, write_tokenizer

DEFAULT_MAX_SHARD_BYTES = 512 * 1024
VOCAB_SIZE = 320  # tokenizer has 300 entries; the model's vocab is padded past it, as on the hub
TINY_CONFIGS = {arch: f.config for arch, f in FIXTURES.items()}   # tiny dimensions (ktconvert.testing.families)


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown fixture arch {arch!r}; choose from {', '.join(ARCHS)}")


def make_config(arch: str, num_layers: int | None = None, **config_overrides):
    """The transformers config object of a tiny `arch` model. Families whose text model's config is nested
    (Kimi-K2.5's text_config) take num_layers and config_overrides for the text model."""
    from transformers import AutoConfig

    _check_arch(arch)
    fixture = FIXTURES[arch]
    kw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in TINY_CONFIGS[arch].items()}
    text = kw[fixture.text_config_key] if fixture.text_config_key else kw
    text.update(vocab_size=fixture.vocab_size, tie_word_embeddings=False)
    if fixture.text_config_key:
        kw["tie_word_embeddings"] = False
    if fixture.tokenizer in TOKEN_IDS:       # bos/eos ids of a tokenizer whose special tokens follow its vocabulary
        text.update(TOKEN_IDS[fixture.tokenizer])
    if num_layers is not None:
        text[fixture.layers_key] = num_layers
    text.update(config_overrides)
    return AutoConfig.for_model(arch, **kw)


def text_config(config):
    """The text model's transformers config (config itself, or its text_config)."""
    return getattr(config, "text_config", None) or config


def model_class(arch: str):
    """The transformers class that builds `arch` (an auto class or the model class itself)."""
    import transformers

    return getattr(transformers, FIXTURES[arch].model_class)


def _seeded_model(arch: str, config, seed: int):
    cls = model_class(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        build = getattr(cls, "from_config", None) or cls._from_config
        model = build(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init; the hub's are not
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.05)
            elif name.endswith("tid2eid"):     # DeepSeek-V4's hash routing: k distinct experts per token id
                n_experts = config.num_local_experts
                buf.copy_(torch.stack([torch.randperm(n_experts, generator=gen)[:buf.shape[1]]
                                       for _ in range(buf.shape[0])]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and not p.any():   # zero-centred norms (Qwen3-Next): 1 + w
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
                elif ((FIXTURES[arch].random_biases and name.endswith(("bias", "sinks")) and not p.any())
                      or (FIXTURES[arch].random_extra and name.endswith(FIXTURES[arch].random_extra))):
                    p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.1))
    return model.eval()


def make_model(arch: str, *, num_layers: int | None = None, seed: int = 0, init_scale: float = 1.0,
               **config_overrides):
    """The in-memory reference model whose weights make_checkpoint writes (same arguments -> same weights).

    Weights are rounded to bf16 (kept as f32) so the bf16 files hold them exactly; the f32 router bias is not.
    init_scale multiplies lm_head, making logits more peaked (confident) for runtime tests.
    """
    model = _seeded_model(arch, make_config(arch, num_layers, **config_overrides), seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(init_scale)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and not F32_TENSORS.match(name) and "rotary_emb" not in name:
                t.copy_(t.to(torch.bfloat16).float())
    return model


def _expert_name(arch: str, prefix: str, expert: int, proj: str) -> str:
    f = FIXTURES[arch]
    return f"{prefix}.{f.moe_block}.experts.{expert}.{f.expert_projs[proj]}.weight"


def _hub_name(arch: str, name: str) -> str | None:
    """A transformers state_dict name under the hub's name (None: not a text-model tensor of a wrapped family)."""
    f = FIXTURES[arch]
    if f.text_prefix:       # Kimi-K2.5: model.language_model.X -> language_model.model.X, lm_head -> language_model.
        if name.startswith("model.language_model."):
            name = f"{f.text_prefix}model." + name[len("model.language_model."):]
        elif name.startswith("lm_head."):
            name = f.text_prefix + name
        else:
            return None
    if f.moe_block != "mlp":  # the MoE block's router and score bias (the experts are split below)
        name = re.sub(r"^(.*model\.layers\.\d+)\.mlp\.(gate\.weight|e_score_correction_bias)$",
                      rf"\1.{f.moe_block}.\2", name)
    return name


def _release_name(arch: str, name: str) -> str:
    """A hub-layout name under the release's own names where the fixture renames them (DeepSeek-V4)."""
    for pattern, repl in FIXTURES[arch].hub_renames:
        name = re.sub(pattern, repl, name)
    return name


def hub_name(arch: str, name: str) -> str | None:
    """The hub file's name of a transformers state_dict tensor other than a fused expert tensor (None: not in the
    text model's file set): what the factory writes it as."""
    name = _hub_name(arch, name)
    return None if name is None else _release_name(arch, name)


def hub_state_dict(model, arch: str) -> dict[str, torch.Tensor]:
    """The model's tensors under hub names, in module order: fused experts split per expert, the MoE block renamed
    where the hub names it otherwise (Mixtral's and MiniMax's block_sparse_moe), a wrapped text model's names
    under its prefix (Kimi-K2.5's language_model.; its vision tower: vision_state_dict)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        name = _hub_name(arch, name)
        if name is None:
            continue
        m = re.match(r"(.*model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m and not FIXTURES[arch].fused_experts:
            prefix = m.group(1)
            if m.group(2) == "gate_up_proj":  # (E, 2I, H): rows [0, I) gate, [I, 2I) up
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[_expert_name(arch, prefix, e, "gate")] = t[e, :inter]
                    out[_expert_name(arch, prefix, e, "up")] = t[e, inter:]
            else:  # (E, H, I)
                for e in range(t.shape[0]):
                    out[_expert_name(arch, prefix, e, "down")] = t[e]
            continue
        out[name] = t
    out = {_release_name(arch, k): v for k, v in out.items()}     # the release's own names (DeepSeek-V4)
    for pattern, repls in FIXTURES[arch].hub_splits:     # one tensor stored as parts (Kimi Linear's q/k/v convs)
        split: dict[str, torch.Tensor] = {}
        for k, v in out.items():
            if re.search(pattern, k):
                split.update(zip([re.sub(pattern, r, k) for r in repls], v.chunk(len(repls), dim=0)))
            else:
                split[k] = v
        out = split
    return out


def vision_state_dict(model, arch: str) -> dict[str, torch.Tensor]:
    """A multimodal family's non-text tensors (Kimi-K2.5's vision tower and projector) under the release's names:
    transformers' own save_pretrained writes them back in the checkpoint layout it loads."""
    if not FIXTURES[arch].text_prefix:
        return {}
    import tempfile

    from safetensors.torch import load_file
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        saved = {}
        for shard in sorted(Path(d).glob("*.safetensors")):
            saved.update(load_file(str(shard)))
    prefix = FIXTURES[arch].text_prefix
    return {re.sub(r"^model\.(mm_projector|vision_tower)\.", r"\1.", k): v for k, v in sorted(saved.items())
            if not k.startswith(prefix)}


def _mtp_state_dict(arch: str, num_layers: int | None, seed: int, overrides: dict) -> dict[str, torch.Tensor]:
    """DeepSeek's MTP layer at index L = num_hidden_layers: a normal MoE layer's tensors plus its own extras."""
    n = text_config(make_config(arch, num_layers, **overrides)).num_hidden_layers
    deeper = make_model(arch, num_layers=n + 1, seed=seed + 7919, **overrides)
    prefix = f"{FIXTURES[arch].text_prefix}model.layers.{n}."
    out = {k: v for k, v in hub_state_dict(deeper, arch).items() if k.startswith(prefix)}
    tc = text_config(deeper.config)
    h, v = tc.hidden_size, tc.vocab_size
    gen = torch.Generator().manual_seed(seed + 104729)
    std = tc.initializer_range
    extras = {"embed_tokens.weight": torch.randn(v, h, generator=gen) * std, "enorm.weight": torch.ones(h),
              "hnorm.weight": torch.ones(h), "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * std,
              "shared_head.norm.weight": torch.ones(h),
              "shared_head.head.weight": torch.randn(v, h, generator=gen) * std}
    out.update({prefix + k: t.to(torch.bfloat16).float() for k, t in extras.items()})
    return out


MXFP4_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def mxfp4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert weights (E, K, N) as gpt-oss's MXFP4 release stores them: <name>_blocks (E, N, K/32, 16) and
    <name>_scales (E, N, K/32), output dimension first (ktconvert.testing.mxfp4)."""
    import numpy as np

    from ktconvert.testing.mxfp4 import quantize_mxfp4

    out = {}
    for name, t in tensors.items():
        if re.search(r"\.mlp\.experts\.(gate_up_proj|down_proj)$", name):
            blocks, scales = quantize_mxfp4(t.float().transpose(1, 2).numpy())
            out[name + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            out[name + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        else:
            out[name] = t
    return out


def make_checkpoint(arch: str, out_dir, *, fp8: bool = False, mxfp4: bool = False, num_layers: int | None = None, seed: int = 0,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, init_scale: float = 1.0,
                    **config_overrides) -> Path:
    """Write a tiny random `arch` checkpoint to out_dir, laid out as the hub ships it; returns out_dir.

    fp8=True (families released in FP8: DeepSeek-V3 / V3.2, MiniMax-M2) writes the FP8 release format; mxfp4=True
    (gpt-oss) writes the experts in MXFP4 as its releases do (their weights: the MXFP4-rounded make_model experts).
    Families with MTP (deepseek_v3) always get
    their MTP layer.
    The weights equal make_model(arch, num_layers=..., seed=..., init_scale=..., **config_overrides)
    (FP8: their block-quantized version). num_layers counts main layers (without MTP); config_overrides go to
    the transformers config class (e.g. hidden_size=256, moe_intermediate_size=320, initializer_range=0.1);
    init_scale > 1 multiplies lm_head for peaked logits; max_shard_bytes bounds each shard (a tensor never splits).
    config.json is written last, so its presence means the checkpoint is complete.
    """
    _check_arch(arch)
    if fp8 and not FIXTURES[arch].fp8:
        ships = ", ".join(f"arch={a!r}" for a, f in FIXTURES.items() if f.fp8)
        raise ValueError(f"fp8=True is the FP8 block format of the releases of {ships} only")
    if mxfp4 and not FIXTURES[arch].mxfp4:
        raise ValueError(f"mxfp4=True is the MXFP4 expert format of the releases of "
                         f"{', '.join(a for a, f in FIXTURES.items() if f.mxfp4)} only")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = make_model(arch, num_layers=num_layers, seed=seed, init_scale=init_scale, **config_overrides)
    config = model.config
    tc = text_config(config)
    named = hub_state_dict(model, arch)
    if FIXTURES[arch].mtp:
        named.update(_mtp_state_dict(arch, num_layers, seed, config_overrides))
    named.update(vision_state_dict(model, arch))
    block = FP8_QUANTIZATION_CONFIG["weight_block_size"]
    pow2 = FIXTURES[arch].fp8_config.get("scale_fmt") == "ue8m0"
    tensors: dict[str, torch.Tensor] = {}
    fixture = FIXTURES[arch]
    writer = (importlib.import_module(f"ktconvert.testing.{fixture.release_quant}")
              if fp8 and fixture.release_quant else None)     # the release's own quantization (DeepSeek-V4)
    for name, t in named.items():
        quantized = writer.release_tensors(name, t) if writer else None
        if quantized:
            tensors.update(quantized)
        elif fixture.hub_int and re.match(fixture.hub_int, name):
            tensors[name] = t.to(torch.int32).contiguous()
        elif fixture.hub_f32 and re.match(fixture.hub_f32, name):
            tensors[name] = t.float().contiguous()
        else:
            tensors.update(to_hub_dtype(name, t, fp8, block, pow2))
    hub_cfg = hub_config(config, arch, fp8)
    if writer:
        hub_cfg = writer.release_config(hub_cfg)
    if mxfp4:
        tensors = mxfp4_experts(tensors)
        hub_cfg["quantization_config"] = MXFP4_QUANTIZATION_CONFIG
    _check_against_adapter(hub_cfg, tensors)
    (out_dir / "config.json").unlink(missing_ok=True)  # written last: its presence marks a complete checkpoint
    write_shards(tensors, out_dir, max_shard_bytes)
    gen_cfg = {"bos_token_id": tc.bos_token_id, "eos_token_id": tc.eos_token_id, "do_sample": True,
               "temperature": 0.6, "top_p": 0.95, "transformers_version": hub_cfg.get("transformers_version")}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    write_tokenizer(arch, out_dir, model_max_length=tc.max_position_embeddings)
    tmp = out_dir / "config.json.tmp"
    tmp.write_text(json.dumps(hub_cfg, indent=2) + "\n")
    tmp.replace(out_dir / "config.json")
    return out_dir


def _check_against_adapter(hub_cfg: dict, tensors: dict) -> None:
    """The factory and the converter's adapter tables must agree on every name (and there must be experts)."""
    from ktconvert.sources.roles import adapter_for

    adapter = adapter_for(hub_cfg)
    if not adapter.moe_layers():
        raise ValueError(f"{hub_cfg['model_type']} with num_hidden_layers={adapter.num_layers} has no MoE layer "
                         f"(first_k_dense_replace={adapter.cfg.first_k_dense}); use more layers")
    for name in tensors:
        adapter.classify(name)


def checkpoint_nbytes(out_dir) -> int:
    """Bytes of tensor data of a written checkpoint (the index's total_size)."""
    return int(json.loads((Path(out_dir) / "model.safetensors.index.json").read_text())["metadata"]["total_size"])


def param_count(model) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())


def main(argv=None) -> None:
    """python -m ktconvert.testing ARCH OUT_DIR [--fp8] [--layers N] [--seed S] [--set key=json ...]"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ktconvert.testing", description=main.__doc__)
    ap.add_argument("arch", choices=ARCHS)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--fp8", action="store_true", help="FP8 block release format (deepseek_v3, deepseek_v32, "
                                                       "minimax_m2)")
    ap.add_argument("--mxfp4", action="store_true", help="MXFP4 experts (gpt_oss's release format)")
    ap.add_argument("--layers", type=int, default=None, help="main layers (without the MTP layer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-scale", type=float, default=1.0, help="lm_head multiplier (peaked logits)")
    ap.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="config override, e.g. hidden_size=256")
    a = ap.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.set)}
    out = make_checkpoint(a.arch, a.out_dir, fp8=a.fp8, mxfp4=a.mxfp4, num_layers=a.layers, seed=a.seed, init_scale=a.init_scale,
                          max_shard_bytes=a.max_shard_bytes, **overrides)
    print(f"{out}: {checkpoint_nbytes(out)} bytes of tensors")

