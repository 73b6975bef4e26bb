"""Adding a model family that reuses known layer kinds is one file in layouts/families/ (README.md, "Adding a model
family"): proven by doing it, on a copy of ktlayouts, for a hypothetical family.

"hypo_moe" has hub names of its own (its MoE block is `moe`, its experts `gate_proj/up_proj/down_proj`, its model_type
and architecture new) and the math of a known family (Mixtral's attention, router and experts). The test writes its
family file into a copy of layouts/ (put first on PYTHONPATH, so ktconvert and ktrun are the repository's own),
renames a Mixtral fixture checkpoint's tensors and config to the new family's names, converts it with `ktconvert
quantize` and runs it with ktrun in subprocesses, and checks:
- the copy differs from layouts/ by exactly FILES_A_FAMILY_TOUCHES file (the new family file), nothing else edited;
- ktconvert recognises the family (`inspect` names it) and converts it, ktrun runs it, and its next-token logits are
  bit-identical to the same weights converted and run as Mixtral.
In the repository a family also gets its fixture entry (ktconvert/testing/families.py, checked by test_families.py);
a hypothetical family has no transformers class to build a fixture with, so the test stands in for that entry.
"""
from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from product_tree import package_dirs
from safetensors.torch import load_file, save_file

FILES_A_FAMILY_TOUCHES = 1      # docs/model-families.md "Adding a model family" states this number (checked below)

FAMILY_FILE = '''"""Hypo-MoE (hypothetical, tests/test_adding_a_family.py): Mixtral's math under names of its own."""
from __future__ import annotations

from .family import Family
from .hub_names import COMMON_ROWS, LAYER, HubNames
from .mixtral import parse

PROJS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
ROWS = COMMON_ROWS + [
    (LAYER + r"moe\\.experts\\.(?P<expert>\\d+)\\.(?P<proj>gate_proj|up_proj|down_proj)\\.weight$", "expert", PROJS),
    (LAYER + r"moe\\.gate\\.weight$", "router", None),
    (LAYER + r"self_attn\\.(q_proj|k_proj|v_proj|o_proj)\\.weight$", "attention", None),
]

FAMILY = Family(
    name="hypo_moe", title="Hypo-MoE", architectures=("HypoMoeForCausalLM",), parse=parse,
    names=HubNames(ROWS, "model.layers.{layer}.moe.experts.{expert}.{proj}.weight",
                   {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}, moe_prefix="moe."))
'''

RENAMES = [("block_sparse_moe.experts.", "moe.experts."), ("block_sparse_moe.gate.", "moe.gate."),
           (".w1.weight", ".gate_proj.weight"), (".w3.weight", ".up_proj.weight"), (".w2.weight", ".down_proj.weight")]

# ktrun on a converted directory: the prompt's next-token logits (float32 bytes, hex) and 8 greedy tokens
RUN_KTRUN = """
import sys, torch
from ktrun.generate import generate, prefill
from ktrun.loaded_model import load_model
from ktrun.sampling_params import SamplingParams
with load_model(sys.argv[1], device="cpu", dtype=torch.float32) as lm:
    ids = lm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    cache = lm.model.new_cache(128)
    print(prefill(lm.model, cache, ids).float().numpy().tobytes().hex())
    cache.release()
    print(generate(lm.model, ids, SamplingParams(max_tokens=8), 128, set()).tokens)
"""


def rename_to_hypo(src: Path, dst: Path) -> None:
    """The Mixtral fixture checkpoint under the hypothetical family's tensor names and config."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            out = {}
            for name, t in tensors.items():
                for a, b in RENAMES:
                    name = name.replace(a, b)
                out[name] = t
            save_file(out, dst / f.name, metadata={"format": "pt"})
        elif f.name == "model.safetensors.index.json":
            index = json.loads(f.read_text())
            wm = {}
            for name, shard in index["weight_map"].items():
                for a, b in RENAMES:
                    name = name.replace(a, b)
                wm[name] = shard
            index["weight_map"] = wm
            (dst / f.name).write_text(json.dumps(index))
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            cfg["model_type"], cfg["architectures"] = "hypo_moe", ["HypoMoeForCausalLM"]
            (dst / f.name).write_text(json.dumps(cfg, indent=2))
        elif f.is_file():
            shutil.copy(f, dst / f.name)


def changed_files(original: Path, copy: Path) -> list[str]:
    """Files added, removed or edited in `copy` against `original` (recursively, __pycache__ left out)."""
    out = []

    def walk(cmp: filecmp.dircmp, rel: Path) -> None:
        out.extend(str(rel / n) for n in cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files
                   if n != "__pycache__")
        for name, sub in cmp.subdirs.items():
            if name != "__pycache__":
                walk(sub, rel / name)
    walk(filecmp.dircmp(original, copy, ignore=["__pycache__"]), Path("."))
    return sorted(out)


def run(args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    p = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, f"{args}\n{p.stdout}\n{p.stderr}"
    return p


@pytest.fixture(scope="module")
def overlay(tmp_path_factory):
    """A copy of ktlayouts with the new family file, and the environment that imports it ahead of layouts/."""
    root = tmp_path_factory.mktemp("overlay")
    layouts = package_dirs()["ktlayouts"]
    shutil.copytree(layouts, root / "ktlayouts", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "ktlayouts" / "families" / "hypo_moe.py").write_text(FAMILY_FILE)
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    return root, env


def test_a_new_family_is_one_file(overlay):
    root, env = overlay
    changed = changed_files(package_dirs()["ktlayouts"], root / "ktlayouts")
    assert changed == ["families/hypo_moe.py"]
    assert len(changed) == FILES_A_FAMILY_TOUCHES
    docs = (Path(__file__).resolve().parents[1] / "docs" / "model-families.md").read_text()
    section = docs.split("## Adding a model family", 1)
    assert len(section) == 2, "docs/model-families.md has no section 'Adding a model family'"
    words = {1: "one", 2: "two", 3: "three"}
    assert f"is **{words[FILES_A_FAMILY_TOUCHES]} product file" in section[1], "the docs state another count"
    # ... and it is registered: discovered by the registry, resolved from a config.json, its forward module found
    code = ("import ktlayouts, ktrun.models as m; from ktlayouts.families import SUPPORTED_MODEL_TYPES, family_for;"
            f"assert ktlayouts.__file__.startswith({str(root)!r}), ktlayouts.__file__;"
            "assert 'hypo_moe' in SUPPORTED_MODEL_TYPES;"
            "f = family_for({'model_type': 'hypo_moe', 'architectures': ['HypoMoeForCausalLM']});"
            "print(f.name, m.arch_module('hypo_moe').__name__)")
    out = run([sys.executable, "-c", code], env, root).stdout.split()
    assert out == ["hypo_moe", "ktrun.models.generic"]


def test_it_converts_and_runs_like_the_family_whose_math_it_reuses(overlay, tmp_path):
    root, env = overlay
    from ktconvert.testing.checkpoints import make_checkpoint

    mixtral = tmp_path / "mixtral"
    make_checkpoint("mixtral", mixtral, seed=3)
    hypo = tmp_path / "hypo"
    rename_to_hypo(mixtral, hypo)

    inspect = run([sys.executable, "-m", "ktconvert", "inspect", str(hypo)], env, root).stdout
    assert "hypo_moe" in inspect, inspect

    logits = {}
    for name, src in (("mixtral", mixtral), ("hypo", hypo)):
        out = tmp_path / f"{name}-int4"
        run([sys.executable, "-m", "ktconvert", "quantize", str(src), "-o", str(out), "--method", "int4-amx",
             "--expert-quantizer", "rtn", "--gpu-method", "rtn-int4", "--quiet"], env, root)
        logits[name] = run([sys.executable, "-c", RUN_KTRUN, str(out)], env, root).stdout
    hex_logits, tokens = logits["mixtral"].split("\n")[:2]
    assert len(hex_logits) == 2 * 4 * 320 and len(json.loads(tokens)) == 8, logits["mixtral"]   # vocab 320, float32
    assert logits["hypo"] == logits["mixtral"]
