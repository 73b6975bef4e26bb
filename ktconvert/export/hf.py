"""Export a converted directory (made with --gpu-format compressed-tensors or gptq) as a standard hub-layout
checkpoint in the layout vLLM / transformers read: sharded `model-XXXXX-of-YYYYY.safetensors` + `model.safetensors.index.json`,
config.json with the conversion's quantization_config, tokenizer files.

  non-expert tensors: under their hub names exactly as the conversion stored them (quantized Linears in their GPU
                      format, e.g. X.weight_packed / X.weight_scale / X.weight_shape; the rest BF16, or F32 where
                      the conversion kept F32 such as e_score_correction_bias)
  routed experts:     experts="quantized" (default): per-expert Linears in the same GPU format, from the CPU tiles'
                      codes and scales without re-quantizing (export.hf_experts), under the source's per-expert
                      names (ArchAdapter.expert_tensor_name); the quantization_config gets a second scheme for them
                      (compressed-tensors config group with a regex target, gptq `dynamic` override).
                      transformers `from_pretrained` loads the result directly (tests/test_export_hf.py).
                      experts="bf16": dequantized (ConvertedDir.read_expert) to BF16 and listed as not quantized
                      (compressed-tensors `ignore`, gptq `dynamic` negative match), for engines that want dense
                      experts. transformers 5.24 cannot load this variant of a compressed-tensors checkpoint: its
                      fused-MoE converter runs CompressedTensorsDequantize, which keeps only `weight_packed` keys.
                      Families whose hub checkpoints hold the experts fused, with no per-expert names their engines
                      read (gpt-oss: mlp.experts.gate_up_proj (E, H, 2I), gate/up interleaved, and down_proj
                      (E, I, H), their biases beside them): experts="bf16" writes that layout (the biases are dense
                      tensors of the conversion already); "quantized" is refused (no GPU Linear format quantizes
                      them: transformers' GptOssExperts holds parameters, not Linears).
  text models of a multimodal release (Qwen3.5-MoE, under model.language_model.; the vision tower is never
                      converted): text_only=True (what `--for transformers|vllm` write) makes the export the text
                      model's own checkpoint: its text_config as config.json with the family's text-only class
                      (Qwen3_5MoeForCausalLM), tensors under model.* (lm_head as it is). Otherwise the release's
                      layout is kept, and the Linears left unquantized are listed under both names (transformers'
                      AutoModelForCausalLM builds the text-only class from it, with model.* module names).
The output is written into a temporary sibling directory and renamed into place when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from ktlayouts.converted_dir import safe_relpath
from ktlayouts.families.hub_names import FusedExperts
from ktlayouts.gpu_formats import GpuLinearFormat, families_where, gpu_format, gpu_format_for, is_gpu_layout
from safetensors import safe_open
from safetensors.torch import save_file

from ktconvert.converted_reader import ConvertedDir
from ktconvert.export.hf_experts import ExpertExportError, add_expert_scheme, export_step, quantized_expert_tensors
from ktconvert.sources.roles import PROJS, adapter_for

DEFAULT_SHARD_BYTES = 4 << 30                       # 4 GiB per shard, as the hub's big checkpoints use
EXPERT_MODES = ("quantized", "bf16")
# Routed experts stay BF16. The pattern matches both the per-expert Linears (model.layers.N.mlp.experts.E.gate_proj,
# Mixtral's block_sparse_moe.experts.E.w1) and the fused MoE module engines name ...mlp.experts; not shared_experts.
EXPERT_MODULES = r".*\.experts($|\..*)"
# as each format's quantization_config spells it: compressed-tensors `ignore` entry (re.match), gptq `dynamic`
# negative match (vLLM / GPTQModel)
EXPERT_IGNORE_REGEX = gpu_format_for("compressed-tensors", 4).module_pattern(EXPERT_MODULES, quantized=False)
EXPERT_SKIP_DYNAMIC = gpu_format_for("gptq", 4).module_pattern(EXPERT_MODULES, quantized=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


class ExportError(ValueError):
    """A converted directory that cannot be exported, or an output path that is in the way."""


def gpu_format_of(conv: ConvertedDir) -> GpuLinearFormat | None:
    """The registered format of the GPU-quantized Linears (ktlayouts.gpu_formats), None when there is none."""
    layouts = {lay for lay in (conv.dense_layout(n) for n in conv.dense_names()) if is_gpu_layout(lay)}
    fmts = {gpu_format(lay).family for lay in layouts}
    if len(fmts) > 1:
        raise ExportError(f"{conv.root}: GPU layers in several formats {sorted(fmts)}; cannot export")
    return gpu_format(min(layouts)) if layouts else None


def export_quantization_config(qc: dict | None, fmt: GpuLinearFormat | None, unquantized_linears: list[str],
                               ignore_experts: bool = True) -> dict | None:
    """The conversion's quantization_config with unquantized Linears (such as router gates), and the routed experts
    when `ignore_experts` (BF16 experts), marked as not quantized."""
    if qc is None:
        return None
    if fmt is None or fmt.quant_method is None:
        return json.loads(json.dumps(qc))               # deep copy
    return fmt.with_unquantized(qc, unquantized_linears, [EXPERT_MODULES] * ignore_experts)


class ShardWriter:
    """Collects tensors into shards of about `shard_bytes`; `finish` names them -of-N and writes the index."""

    def __init__(self, root: Path, shard_bytes: int):
        self.root, self.shard_bytes = root, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []              # tensor names per written shard
        self.total_bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.pending or any(name in s for s in self.shards):
            raise ExportError(f"tensor {name} written twice")
        nbytes = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if not self.pending:
            return
        save_file(self.pending, str(self.root / f"shard-{len(self.shards):05d}.tmp"), metadata={"format": "pt"})
        self.shards.append(sorted(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        self.flush()
        n = len(self.shards)
        names, weight_map = [], {}
        for i, tensors in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.root / f"shard-{i:05d}.tmp", self.root / fname)
            names.append(fname)
            weight_map.update(dict.fromkeys(tensors, fname))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return names


def dense_tensors(conv: ConvertedDir) -> Iterator[tuple[str, torch.Tensor]]:
    """Every non-expert tensor as stored: (hub name, tensor)."""
    for rel, f in conv.manifest["files"].items():
        if f["kind"] not in ("dense", "globals"):
            continue
        with safe_open(str(safe_relpath(conv.root, rel)), framework="pt") as h:
            for name in f.get("tensors", {}):
                yield name, h.get_tensor(name)


def expert_tensors(conv: ConvertedDir, adapter) -> Iterator[tuple[str, torch.Tensor]]:
    """Routed experts dequantized to BF16 under their hub names: gate/up (I, H), down (H, I)."""
    geo = conv.geometry
    for layer in geo.moe_layers:
        for e in range(geo.n_experts):
            mats = conv.read_expert(layer, e)
            for p in PROJS:
                yield adapter.expert_tensor_name(layer, e, p), torch.from_numpy(mats[p]).to(torch.bfloat16)


def fused_layout(adapter) -> FusedExperts | None:
    """The family's fused expert layout when its hub checkpoints have no per-expert names (gpt-oss), else None."""
    fused = adapter.family.names.fused_experts
    return fused if fused is not None and not fused.optional else None


def fused_expert_tensors(conv: ConvertedDir, adapter) -> Iterator[tuple[str, torch.Tensor]]:
    """Routed experts dequantized to BF16 in the family's fused hub layout, one layer at a time: gate_up
    ((E, H, 2I) input first, else (E, 2I, H)) and down ((E, I, H) or (E, H, I)); filled in place, in the stored order."""
    geo, names = conv.geometry, adapter.family.names
    fused = names.fused_experts
    n_e, h, i = geo.n_experts, geo.hidden, geo.intermediate
    g_rows, u_rows = fused.gate_up_rows(i)
    for layer in geo.moe_layers:
        gate_up = torch.empty((n_e, h, 2 * i) if fused.input_first else (n_e, 2 * i, h), dtype=torch.bfloat16)
        down = torch.empty((n_e, i, h) if fused.input_first else (n_e, h, i), dtype=torch.bfloat16)
        gu_lin = gate_up.transpose(1, 2) if fused.input_first else gate_up        # (E, 2I, H) views
        d_lin = down.transpose(1, 2) if fused.input_first else down               # (E, H, I)
        for e in range(n_e):
            mats = conv.read_expert(layer, e)
            gu_lin[e, g_rows] = torch.from_numpy(mats["gate"]).to(torch.bfloat16)
            gu_lin[e, u_rows] = torch.from_numpy(mats["up"]).to(torch.bfloat16)
            d_lin[e] = torch.from_numpy(mats["down"]).to(torch.bfloat16)
        yield names.layer(layer) + fused.gate_up, gate_up
        yield names.layer(layer) + fused.down, down


def text_only_config(config: dict, family) -> dict:
    """The text model's config.json of a multimodal release: its text_config, declaring the family's text-only
    class, with what the release keeps at the top (tied embeddings, quantization_config, token ids)."""
    text = dict(family.text_config(config))
    text["architectures"] = [family.text_architecture]
    for key in ("tie_word_embeddings", "quantization_config", "bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            text[key] = config[key]
    return text


def export_hf(converted: str | Path, out: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES,
              progress=None, experts: str = "quantized", expert_step: int | None = None,
              expert_scale_dtype: torch.dtype = torch.float32, before_rename=None, text_only: bool = False) -> list[str]:
    """Write the hub-layout checkpoint of `converted` to `out` (must not exist). Returns the shard file names.
    experts: "quantized" (the CPU codes and scales in the GPU format, lossless) or "bf16" (dequantized).
    `progress(nbytes)` is called after each tensor is queued (for a progress bar).
    For export targets (export.targets): expert_step forces the experts' group length (one of
    hf_experts.exact_steps), expert_scale_dtype stores their scales in another dtype (the caller checks that the
    values are exact in it), before_rename(tmp_dir, conv) writes more files into the export before it is renamed
    into place. text_only: a multimodal release's text model as its own checkpoint (see the module docstring)."""
    src, out = Path(converted), Path(out)
    if experts not in EXPERT_MODES:
        raise ExportError(f"experts must be one of {EXPERT_MODES}, got {experts!r}")
    if out.exists():
        raise ExportError(f"output {out} already exists; choose a new path or remove it")
    if not (src / "config.json").is_file():
        raise ExportError(f"{src}: no config.json (not a converted directory?)")
    conv = ConvertedDir(src)
    fmt = gpu_format_of(conv)
    if fmt is not None and fmt.quant_method is None:
        # formats with a quantization_config, compressed-tensors (registered last) first: transformers loads it
        readable = [f"--gpu-format {f}" for f in families_where("quant_method")][::-1]
        raise ExportError(f"{src} holds GPU layers in the {fmt.title} layout (--gpu-format {fmt.family}), which only "
                          f"ktrun reads; reconvert with `ktconvert quantize ... {readable[0]}` "
                          f"(or {' or '.join(readable[1:])}) to export for transformers / vLLM")
    config = json.loads((src / "config.json").read_text())
    adapter = adapter_for(config)
    names = adapter.family.names
    layouts = {n: conv.dense_layout(n) for n in conv.dense_names()}
    unquantized = sorted(n[: -len(".weight")] for n, lay in layouts.items()
                         if lay.startswith("dense-") and n.endswith(".weight") and conv_ndim(conv, n) == 2
                         and "embed" not in n)
    root = names.prefix + names.model_root

    def rename(n: str) -> str:          # the text-only class's names (model.layers.N...)
        return "model." + n[len(root):] if n.startswith(root) else n

    if text_only:
        if adapter.family.text_architecture is None:
            raise ExportError(f"{src}: {adapter.model_type} has no text-only class to export its text model as")
        config = text_only_config(config, adapter.family)
        unquantized = sorted(map(rename, unquantized))
    elif root != "model.":
        unquantized = sorted(set(unquantized) | set(map(rename, unquantized)))
    qc = config.get("quantization_config")
    fused = fused_layout(adapter)
    if experts == "quantized" and fused is not None:
        conv.close()
        raise ExportError(f"{src}: {adapter.model_type}'s checkpoints hold the routed experts fused per layer "
                          f"({names.layer(0)}{fused.gate_up} / {fused.down}, with biases), which no GPU Linear format "
                          "quantizes (transformers and vLLM read them as dense parameters); export with "
                          "--experts bf16 (that layout, dequantized)")
    if experts == "quantized":
        if qc is None or fmt is None:
            raise ExportError(f"{src} has no GPU-quantized layers (--gpu-method bf16), so no quantization_config "
                              "to put the routed experts in; export with --experts bf16")
        try:
            step = export_step(conv) if expert_step is None else expert_step
        except ExpertExportError as e:
            raise ExportError(str(e)) from None
        config["quantization_config"] = export_quantization_config(
            add_expert_scheme(qc, fmt, conv.geometry.bits, step), fmt, unquantized, ignore_experts=False)
        expert_iter = ((n, _scale_as(n, torch.from_numpy(a), fmt, expert_scale_dtype))
                       for n, a in quantized_expert_tensors(conv, adapter, fmt, step))
    else:
        if qc is not None:
            config["quantization_config"] = export_quantization_config(qc, fmt, unquantized)
        expert_iter = expert_tensors(conv, adapter) if fused is None else fused_expert_tensors(conv, adapter)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        writer = ShardWriter(tmp, shard_bytes)
        for name, t in _chain(dense_tensors(conv), expert_iter):
            writer.add(rename(name) if text_only else name, t)
            if progress is not None:
                progress(t.numel() * t.element_size())
        shards = writer.finish()
        config.pop("torch_dtype", None)
        config["dtype"] = "bfloat16"
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for fname in TOKENIZER_FILES:
            if (src / fname).is_file():
                shutil.copyfile(src / fname, tmp / fname)
        if before_rename is not None:
            before_rename(tmp, conv)
        if out.exists():
            raise ExportError(f"output {out} appeared while exporting; not overwriting it")
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        conv.close()
    return shards


def _scale_as(name: str, t: torch.Tensor, fmt: GpuLinearFormat, dtype: torch.dtype) -> torch.Tensor:
    """The format's scale part in `dtype` (numpy has no bfloat16, so the cast happens here); other parts as they are."""
    return t.to(dtype) if name.endswith("." + fmt.scale_part) and t.dtype != dtype else t


def conv_ndim(conv: ConvertedDir, name: str) -> int:
    return len(conv.manifest["files"][conv._dense_index[name]]["tensors"][name]["shape"])


def _chain(*its):
    for it in its:
        yield from it


def export_total_bytes(converted: str | Path, experts: str = "quantized") -> int:
    """Bytes the export will write (for a progress bar): dense tensors as stored + experts (BF16, or codes at the
    experts' bits with float32 scales, counted at one scale per 32 weights)."""
    conv = ConvertedDir(converted)
    dense = sum(t["nbytes"] for f in conv.manifest["files"].values()
                if f["kind"] in ("dense", "globals") for t in f.get("tensors", {}).values())
    geo = conv.geometry
    weights = len(geo.moe_layers) * geo.n_experts * 3 * geo.hidden * geo.intermediate
    per_weight = 2 if experts == "bf16" or not geo.format.quantized else geo.bits / 8 + 4 / 32
    return dense + int(weights * per_weight)
