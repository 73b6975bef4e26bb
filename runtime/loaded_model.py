"""load_model(dir): a converted directory ready to run, for everything that runs it (`ktrun generate`, `ktrun bench`,
the Engine behind `ktrun serve`): the model forward, its tokenizer, its EOS token ids and the converted directory.

    lm = load_model("converted/")                  # device=None: cuda if available; verify=True: sha256 first
    out = generate(lm.model, lm.tokenizer.encode("Hello"), SamplingParams(max_tokens=32), 4096, lm.eos_ids,
                   decode_text=lm.tokenizer.decode)
    lm.close()                                     # stops the expert executor's threads
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # effective only if torch is not loaded yet (see cli.py)

import torch

from .defaults import KV_BUDGET_TOKENS
from .experts.executors import make_executor
from .experts.hot import HotExpertOptions, build_hot_executor
from .loader import ConvertedModel, load_converted
from .models.model import MoEModel
from .text.tokenizer import Tokenizer


@dataclass
class LoadedModel(contextlib.AbstractContextManager):
    """`with load_model(...) as lm:` closes it at the end."""

    model: MoEModel                 # forward over a Batch; model.experts is the routed-expert executor
    tokenizer: Tokenizer
    eos_ids: set[int]               # any of these ends a generation (unless ignore_eos)
    converted: ConvertedModel       # the mapped directory: manifest, geometry, device, dtype, GPU-layer placement
    mtp: object = None              # ktrun.mtp.MtpHead when loaded with mtp=True (--speculative mtp)

    @property
    def name(self) -> str:
        """The model's name as served: the converted directory's name."""
        return self.converted.root.resolve().name

    def close(self) -> None:
        for experts in (self.model.experts, self.mtp.block.experts if self.mtp is not None else None):
            close = getattr(experts, "close", None)
            if close:
                close()
        self.converted.close()       # the kernel pool of the quantized Linears, if any (closing twice is a no-op)

    def __exit__(self, *exc) -> None:
        self.close()


def eos_ids_of(model_dir: Path, cfg, tokenizer: Tokenizer) -> set[int]:
    """config.json's eos_token_id(s), generation_config.json's, and the tokenizer's eos_token."""
    ids = set(cfg.eos_token_ids)
    gc = model_dir / "generation_config.json"
    if gc.is_file():
        try:
            v = json.loads(gc.read_bytes()).get("eos_token_id")
        except (ValueError, AttributeError) as e:    # not JSON, or not an object
            raise ValueError(f"{gc}: not a valid JSON object ({e})") from None
        ids |= set(v if isinstance(v, list) else [] if v is None else [v])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _tiered_executor(converted, opts, use_kernels, hot_experts):
    """The RAM tier's executor (kernels on the tier's mirrors); its eviction counts start from --profile if given."""
    from ktlayouts.expert_profile import ExpertProfile

    from .experts.tiered import build_tiered_executor
    from .ops.library import kernels_available
    if use_kernels is False or not kernels_available():
        raise ValueError("--expert-ram needs the CPU kernels (libktkernels: run `make kernels`); the torch reference "
                         "experts keep dequantized copies outside any budget")
    counts = None
    if hot_experts is not None and hot_experts.profile:
        prof = ExpertProfile.load(hot_experts.profile)
        prof.check_model(converted.config.model_type, converted.geometry.n_experts, converted.geometry.moe_layers)
        counts = prof.counts()
    return build_tiered_executor(converted, opts.budget_bytes, predict=opts.predict, io=opts.io,
                                 io_threads=opts.io_threads, extra=opts.extra, profile_counts=counts,
                                 predictor=opts.predictor)


def load_model(model_dir: str | Path, device=None, dtype: torch.dtype | None = None, verify: bool = False,
               quiet: bool = True, numa_prefault: bool = False, gpu_weights: str = "auto",
               use_kernels: bool | None = None, hot_experts: HotExpertOptions | None = None,
               kv_tokens: int = KV_BUDGET_TOKENS, expert_ram=None, kv_states: int = 1, mtp: bool = False
               ) -> LoadedModel:
    """Open MODEL_DIR (ktrun.loader.load_converted: validated, experts mapped, dense layers placed), build the
    routed-expert executor (kernels when available; use_kernels=False: the torch reference) and the model forward.
    hot_experts: which experts run on the GPU (ktrun.experts.hot; None: the conversion's own placement, if any);
    kv_tokens: the KV budget a --gpu-mem plan leaves room for, unless it states one; kv_states: the recurrent
    states (linear-attention layers, a fixed size per request) it leaves room for.
    expert_ram: ktrun.cli.expert_ram_option.ExpertRamOptions: routed experts in a RAM tier of that budget, the rest read
    from the expert files on demand (ktrun.experts.ram_tier; needs the kernels).
    mtp: also load the conversion's multi-token-prediction layer and build its drafter (LoadedModel.mtp, for
    --speculative mtp; LoadError naming the directory and the flag when it has none).
    dtype of the dense part: None = bfloat16 on CUDA, float32 on the CPU. Raises LoadError / ConfigError /
    TokenizerError (all ValueErrors) naming the file at fault."""
    root = Path(model_dir)
    converted = load_converted(root, device=device, dtype=dtype, verify=verify, quiet=quiet,
                               numa_prefault=numa_prefault, gpu_weights=gpu_weights, mtp=mtp)
    if expert_ram is None:
        cpu = make_executor(converted, use_kernels=use_kernels)
    else:
        cpu = _tiered_executor(converted, expert_ram, use_kernels, hot_experts)
        if hot_experts is not None and not (hot_experts.budget.given or hot_experts.dynamic):
            hot_experts = None            # --profile alone with --expert-ram: it seeds the tier, places nothing
    experts = build_hot_executor(converted, cpu, hot_experts, kv_tokens, kv_states)
    model = MoEModel(converted.config, converted.dense, experts, converted.device, converted.dtype)
    # the routers' pool: the dense Linears' kernel context, else the routed experts' (None: not on the kernels)
    model.kernels = converted.kernels if converted.kernels is not None else getattr(cpu, "moe", None)
    model.dense_on_kernels = converted.kernels is not None and converted.device.type == "cpu"
    head = None
    if mtp:
        from .mtp import MtpHead, mtp_executor
        head = MtpHead(model, converted, mtp_executor(converted, cpu, use_kernels))
    tokenizer = Tokenizer(root)
    return LoadedModel(model, tokenizer, eos_ids_of(root, converted.config, tokenizer), converted, head)
