"""Already-quantized fixture checkpoints written by the compressed-tensors library itself (llm-compressor's format).

`compressed_tensors_checkpoint(src, out, preset)` takes a tiny BF16 fixture (make_checkpoint) and writes it the way
llm-compressor saves a quantized model: every Linear matched by the config group's `targets` and not by `ignore` is
quantized with the library's own scale computation (`calculate_qparams` on per-group min/max, in the weights' bf16)
and compressed by the library's registered compressor for the preset's format (pack-quantized, float-quantized,
mxfp4-pack-quantized, mxfp8-quantized, ...); config.json gets the library's `QuantizationConfig` as
`quantization_config`. Nothing here uses ktconvert's readers or packers, so the fixtures check them.

compressed-tensors is a test dependency (the `test` extra), imported when used.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

EXPERTS_ONLY = r"re:.*\.experts\.\d+\..*"         # a regex target: routed experts only (Kimi-K2-Thinking style)
ROUTER_IGNORE = r"re:.*(mlp|block_sparse_moe)\.gate$"


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name


def _matches(module: str, target: str) -> bool:
    from compressed_tensors.utils.match import match_name
    return target == "Linear" or match_name(module, target)


def _qparams(w: torch.Tensor, args):
    """The library's scale (and zero point) of weight w (N, K) for args' strategy."""
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w.shape
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    elif strategy in ("group", "tensor_group"):
        pad = -k % args.group_size          # a partial last group: zeros change no min/max (0 is always in range)
        g = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, args.group_size)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
    elif strategy == "block":
        bn, bk = args.block_structure
        b = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))           # partial edge blocks, as the library
        b = b.reshape(b.shape[0] // bn, bn, b.shape[1] // bk, bk)
        lo, hi = b.amin(dim=(1, 3)), b.amax(dim=(1, 3))
    else:
        raise ValueError(f"strategy {strategy} not handled by the fixture writer")
    if strategy == "tensor_group":                  # NVFP4: FP8 group scales under one float32 global scale
        from compressed_tensors.quantization.utils import generate_gparam
        gs = generate_gparam(w.amin().reshape(1).float(), w.amax().reshape(1).float())
        return (*calculate_qparams(lo, hi, args, global_scale=gs), gs)
    return (*calculate_qparams(lo, hi, args), None)


def compressed_tensors_checkpoint(src: Path, out: Path, preset: str = "W4A16", group_size: int | None = None,
                                  targets: tuple[str, ...] = ("Linear",),
                                  ignore: tuple[str, ...] = ("lm_head", ROUTER_IGNORE), block=None,
                                  symmetric: bool | None = None) -> Path:
    """Write `src` (a BF16 hub-layout checkpoint) quantized with compressed-tensors preset `preset` (W4A16,
    W8A16, W4A16_ASYM, FP8, FP8_DYNAMIC, FP8_BLOCK, MXFP4A16, MXFP8A16, NVFP4A16, ...) into `out`; group_size /
    block / symmetric override the preset's. Returns out."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from safetensors.torch import load_file

    from ktconvert.testing.files import write_shards

    src, out = Path(src), Path(out)
    scheme = preset_name_to_scheme(preset, list(targets))
    if group_size is not None:
        scheme.weights.group_size = group_size
        scheme.weights.strategy = "group" if group_size > 0 else "channel"
        if group_size <= 0:
            scheme.weights.group_size = None
    if block is not None:
        scheme.weights.block_structure = list(block)
    if symmetric is not None:
        scheme.weights.symmetric = symmetric
    scheme.input_activations = None               # weight-only checkpoints (what a CPU converter reads)
    fmt = infer_module_format(torch.nn.Linear, scheme).value
    scheme.format = fmt
    compressor = BaseCompressor.get_value_from_registry(fmt)

    index = json.loads((src / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(src / shard)))
    written: dict[str, torch.Tensor] = {}
    for name in index["weight_map"]:
        t = tensors[name]
        module = name.removesuffix(".weight")
        if not (_is_linear(name, t) and any(_matches(module, x) for x in targets)
                and not any(_matches(module, x) and x != "Linear" for x in ignore)):
            written[name] = t
            continue
        w = t.to(torch.bfloat16)
        scale, zp, global_scale = _qparams(w, scheme.weights)
        state = {"weight": w, "weight_scale": scale}
        if global_scale is not None:
            state["weight_global_scale"] = global_scale
        if not scheme.weights.symmetric:
            state["weight_zero_point"] = zp
        for suffix, v in compressor.compress(state, scheme).items():
            written[f"{module}.{suffix}"] = v.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    write_shards(written, out, max_shard_bytes=512 * 1024)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=list(ignore),
                            quantization_status=QuantizationStatus.COMPRESSED)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc.model_dump(mode="json")
    for p in src.iterdir():
        if p.is_file() and p.name != "config.json" and not re.match(r"model.*\.safetensors", p.name) \
                and p.name != "model.safetensors.index.json":
            shutil.copy(p, out / p.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
