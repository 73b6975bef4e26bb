"""Shared helpers of the ktrun tests: peaked fixture checkpoints, their conversions, transformers references."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
from run_shared import built_once, run_dir

from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.testing import make_checkpoint

INIT_SCALE = 8.0          # lm_head x8: peaked next-token distributions, so greedy choices have clear margins
PROMPT = "The quick brown fox jumps over the lazy dog"


def _make_peaked(arch: str, out: Path, **kw) -> None:
    make_checkpoint(arch, out, init_scale=INIT_SCALE, **kw)


def _convert(src: Path, out: Path, method: str, **kw) -> None:
    convert(src, out, ConvertOptions(method=method, **kw), show_progress=False)


def build_checkpoint(root: Path, arch: str, **kw) -> Path:
    out = root / f"src_{arch}{'_fp8' if kw.get('fp8') else ''}"
    if not (out / "config.json").exists():
        _make_peaked(arch, out, **kw)
    return out


def build_conversion(src: Path, out: Path, method: str = "bf16", **kw) -> Path:
    if not (out / "manifest.json").exists():
        _convert(src, out, method, **kw)
    return out


def transformers_model(src: Path):
    """The checkpoint loaded by its transformers class (AutoModelForCausalLM, or the fixture family's own class:
    Kimi-K2.5's Kimi_K25ForConditionalGeneration)."""
    import json

    from ktconvert.testing import FIXTURES
    from ktconvert.testing.checkpoints import model_class
    mt = json.loads((Path(src) / "config.json").read_text())["model_type"]
    arch = mt if mt in FIXTURES else "deepseek_v3"          # kimi_k2 checkpoints are DeepSeek-V3's class
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return model_class(arch).from_pretrained(src, dtype=torch.float32).eval()


def transformers_tokenizer(src: Path):
    """transformers' tokenizer of the checkpoint; for Kimi's tiktoken tokenizer (remote code on the hub, never run)
    the reference is KimiReferenceTokenizer: the tiktoken package with the release tokenizer's spec."""
    if (Path(src) / "tiktoken.model").is_file() and not (Path(src) / "tokenizer.json").is_file():
        return KimiReferenceTokenizer(src)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(src)


# Kimi-K2's tokenizer as its tokenization_kimi.py (read as a spec, re-implemented here) defines it: tiktoken over
# tiktoken.model with this split regex, 256 reserved special tokens after the base vocabulary (contents from
# tokenizer_config.json's added_tokens_decoder, else <|reserved_token_ID|>), every special token allowed in the
# text, no BOS/EOS added; chat templates rendered by transformers' own jinja renderer.
_KIMI_PAT_PARTS = (
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
)
KIMI_PAT_STR = "|".join(_KIMI_PAT_PARTS)


class KimiReferenceTokenizer:
    """The parts of a transformers tokenizer the tests use, for Kimi's tiktoken.model."""

    def __init__(self, src: Path):
        import base64
        import json

        import tiktoken
        src = Path(src)
        ranks = {}
        for line in (src / "tiktoken.model").read_text().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        named = {int(i): t["content"] for i, t in cfg.get("added_tokens_decoder", {}).items()}
        n = len(ranks)
        self.special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
        self.enc = tiktoken.Encoding(name="kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                     special_tokens=self.special)
        self.chat_template = cfg["chat_template"]
        self.special_tokens_map = {k: cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        # as the tests read a tokenizer's bos_token_id: the BOS its encode() prepends; Kimi's prepends none (its
        # tokenizer_config.json's bos_token [BOS] is self.special["[BOS]"])
        self.bos_token_id = None
        self.eos_token_id = self.special[cfg["eos_token"]]
        self.all_special_ids = set(self.special.values())

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all")

    def __call__(self, text: str):
        from types import SimpleNamespace
        return SimpleNamespace(input_ids=self.encode(text))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [i for i in ids if not (skip_special_tokens and i in self.all_special_ids)]
        return self.enc.decode(ids)

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = False, **kw):
        from transformers.utils.chat_template_utils import render_jinja_template
        rendered, _ = render_jinja_template([messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            **self.special_tokens_map, **kw)
        return self.encode(rendered[0]) if tokenize else rendered[0]


@torch.no_grad()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """(T, V) float32 logits of the transformers model for every position of ids."""
    return model(torch.tensor([ids])).logits[0].float()


def greedy_gaps(ref_logits: torch.Tensor, n_prompt: int, generated: list[int]) -> list[float]:
    """Per generated token: transformers' max logit minus the logit of our token, at the same prefix (0 = argmax)."""
    rows = ref_logits[n_prompt - 1: n_prompt - 1 + len(generated)]
    return [float(r.max() - r[t]) for r, t in zip(rows, generated)]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row, nats."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def shared_root(tmp_path_factory) -> Path:
    """One directory per test session for checkpoints and conversions shared by the ktrun test files."""
    root = tmp_path_factory.getbasetemp() / "ktrun_shared"
    root.mkdir(exist_ok=True)
    return root


def converted(tmp_path_factory, arch: str, method: str = "bf16", fp8: bool = False, **kw) -> Path:
    """Run-wide conversion of the peaked fixture checkpoint of arch: built once by whichever xdist worker asks
    first (run_shared.built_once), then reused by every worker. Read-only."""
    root = run_dir(tmp_path_factory)
    src = built_once(root / f"src_{arch}{'_fp8' if fp8 else ''}",
                     lambda out: _make_peaked(arch, out, **({"fp8": True} if fp8 else {})))
    tag = "_".join([arch, "fp8" if fp8 else "bf16src", method] + [f"{k}{v}" for k, v in sorted(kw.items())])
    return built_once(root / f"conv_{tag}", lambda out: _convert(src, out, method, **kw))


# `ktrun` as a real subprocess (the console script's entry point, with this interpreter)
KTRUN = [__import__("sys").executable, "-c", "from ktrun.cli import main; main()"]
