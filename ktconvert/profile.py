"""Measuring an expert activation profile: run the model with ktrun over a text and count, per MoE layer and routed
expert, the routed calls and their routing weight mass (ktlayouts.expert_profile is the file format).

The model is a converted directory run by ktrun as served (CPU kernels, or the torch reference), or a source
checkpoint run by ktrun's forward straight from the source tensors (dense weights in float32, experts read from the
source on use, cached while they fit in a quarter of the free memory).

Text: a plain text file is one document; a .jsonl file holds one document per line (a JSON string, or an object
with "prompt" or "text"). Each document is tokenized (BOS as the model adds it) and run as one sequence in chunks
of `chunk_tokens` (each chunk sees the ones before it through the KV cache, as a prefill does), up to
`seq_tokens` tokens per sequence. Chunks are numbered across the whole text; every `heldout_every`-th one is
counted into the held-out split.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
from ktlayouts.converted_dir import MANIFEST_NAME
from ktlayouts.expert_profile import ExpertProfile
from tqdm import tqdm

from ktconvert.gpu.calib import DEFAULT_CALIB


class ProfileInputError(ValueError):
    """A prompts file or model that `ktconvert profile` cannot use; the message names it."""


def read_documents(path: str | Path | None) -> tuple[list[str], str, str]:
    """(documents, source name, sha256 of the file) of --prompts FILE (None: the shipped calibration text)."""
    p = Path(path) if path is not None else DEFAULT_CALIB
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ProfileInputError(f"--prompts {p}: cannot read ({e.strerror})") from None
    sha = hashlib.sha256(raw).hexdigest()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProfileInputError(f"--prompts {p}: not UTF-8 text (byte {e.start})") from None
    name = "calib" if path is None else p.name
    if p.suffix != ".jsonl":
        return ([text] if text.strip() else []), name, sha
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            v = json.loads(line)
        except json.JSONDecodeError as e:
            raise ProfileInputError(f"--prompts {p}: line {i} is not JSON ({e.msg})") from None
        doc = v if isinstance(v, str) else (v.get("prompt") or v.get("text")) if isinstance(v, dict) else None
        if not isinstance(doc, str):
            raise ProfileInputError(f"--prompts {p}: line {i} is neither a string nor an object with a "
                                    "\"prompt\" or \"text\" string")
        docs.append(doc)
    return docs, name, sha


class _SourceExperts:
    """ExpertSource over a checkpoint: gate (I, H), up (I, H), down (H, I) float32 of one expert, read on use."""

    def __init__(self, src):
        self.src, self.arch = src, src.arch

    def expert(self, layer: int, e: int):
        return tuple(self.src.read(self.arch.expert_tensor_name(layer, e, p)).float() for p in ("gate", "up", "down"))


@contextlib.contextmanager
def open_model(path: str | Path, use_kernels: bool | None = None):
    """-> (ktrun MoEModel, ktrun Tokenizer, model description) for a converted directory or a source checkpoint."""
    p = Path(path)
    if (p / MANIFEST_NAME).is_file():
        from ktrun.loaded_model import load_model

        with load_model(p, device="cpu", use_kernels=use_kernels) as lm:
            yield lm.model, lm.tokenizer, f"converted {p} ({lm.converted.geometry.method} experts)"
        return
    import psutil
    import torch
    from ktlayouts.families import parse_config
    from ktrun.experts.executors import TorchExperts
    from ktrun.models.model import MoEModel
    from ktrun.text.tokenizer import Tokenizer

    from ktconvert.sources import open_source

    with open_source(p) as src, tempfile.TemporaryDirectory(prefix="ktconvert-profile-") as tmp:
        cfg = parse_config(src.config, str(p))
        dense = {}
        for name in src.tensor_names():
            if src.arch.classify(name).kind not in ("skip", "expert"):
                dense[name] = src.read(name).to(torch.float32)
        expert_bytes = 4 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts * len(cfg.moe_layers)
        cache = expert_bytes < psutil.virtual_memory().available // 4
        experts = TorchExperts(_SourceExperts(src), device="cpu", cache=cache)
        tok_dir = p
        if hasattr(src, "side_files"):                  # GGUF: the tokenizer lives in the metadata
            tok_dir = Path(tmp)
            for name, raw in src.side_files().items():
                (tok_dir / name).write_bytes(raw)
        model = MoEModel(cfg, dense, experts, "cpu", torch.float32)
        try:
            yield model, Tokenizer(tok_dir), f"source {p} (float32, experts {'cached' if cache else 'read on use'})"
        finally:
            experts.close()


def run_profile(model, tokenizer, docs: list[str], chunk_tokens: int = 256, heldout_every: int = 5,
                max_tokens: int | None = None, seq_tokens: int = 2048, progress: bool = True,
                text_info: dict | None = None, model_path: str = "") -> ExpertProfile:
    """Run `docs` through `model` and count its routing (see the module docstring)."""
    from ktrun.experts.routing_recorder import RoutingRecorder
    from ktrun.models.kv_cache import Batch

    cfg = model.cfg
    prof = ExpertProfile.empty(cfg.model_type, cfg.num_experts, cfg.top_k, cfg.moe_layers,
                               text={**(text_info or {}), "chunk_tokens": chunk_tokens,
                                     "heldout_every": heldout_every}, model_path=model_path)
    encoded = [tokenizer.encode(d) for d in docs]
    total = sum(len(x) for x in encoded)
    if max_tokens:
        total = min(total, max_tokens)
    if total == 0:
        raise ProfileInputError("the prompts hold no tokens")
    recorder = RoutingRecorder(model.experts, prof)
    model.experts = recorder
    done, chunk_no = 0, 0
    try:
        with tqdm(total=total, unit="tok", desc="profiling", disable=not progress, dynamic_ncols=True) as bar:
            for ids in encoded:
                for s0 in range(0, len(ids), seq_tokens):
                    seq = ids[s0:s0 + seq_tokens]
                    cache = model.new_cache(len(seq))
                    for c0 in range(0, len(seq), chunk_tokens):
                        chunk = seq[c0:c0 + chunk_tokens][: total - done]
                        if not chunk:
                            break
                        held = heldout_every > 0 and chunk_no % heldout_every == heldout_every - 1
                        recorder.split = "heldout" if held else "fit"
                        model.forward(Batch.build([(cache, chunk)], model.device))
                        prof.splits[recorder.split].tokens += len(chunk)
                        chunk_no += 1
                        done += len(chunk)
                        bar.update(len(chunk))
                    if done >= total:
                        break
                if done >= total:
                    break
    finally:
        model.experts = recorder.inner
    prof.text["chunks"] = chunk_no
    for s, sp in prof.splits.items():           # every token is routed to top_k experts in every MoE layer
        for L, c in sp.counts.items():
            if int(np.sum(c)) != sp.tokens * cfg.top_k:
                raise RuntimeError(f"profile split {s} layer {L}: {int(np.sum(c))} routed calls for {sp.tokens} "
                                   f"tokens x top-{cfg.top_k}")
    return prof
