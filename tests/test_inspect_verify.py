"""`ktconvert inspect` (counts checked against the transformers model) and `ktconvert verify` (catches damage)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from ktlayouts.converted_dir import MANIFEST_NAME, MTP_DENSE_KIND
from ktrun.byte_sizes import human

import ktconvert
from ktconvert.cli import main
from ktconvert.cmd_inspect import inspect_converted, inspect_source, parse_bytes
from ktconvert.gpu.options import DEFAULT_MIX_BUDGET
from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.testing import make_checkpoint, make_model


def cli(*args):
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def converted(ckpt_dir, tmp_path_factory):
    src = ckpt_dir("qwen3_moe")
    out = tmp_path_factory.mktemp("conv") / "out"
    convert(src, out, ConvertOptions(), show_progress=False)
    return src, out


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
def test_inspect_counts_match_the_transformers_model(arch, ckpt_dir):
    info = inspect_source(ckpt_dir(arch), 128)
    model = make_model(arch)
    params = dict(model.named_parameters())
    # e_score_correction_bias is a buffer in transformers but a stored tensor on the hub
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    total = sum(p.numel() for p in params.values()) + bias
    assert info["params"].get("router_bias", 0) == bias
    expert = sum(p.numel() for n, p in params.items() if ".experts." in n and "shared" not in n)
    assert sum(info["params"].values()) == total          # MTP and FP8 scales are not model parameters
    assert info["params"]["expert"] == expert
    assert info["params"]["embedding"] == model.config.vocab_size * model.config.hidden_size
    assert info["cpu"]["int8-amx"] > info["cpu"]["int4-amx"] and info["cpu"]["bf16"] > info["cpu"]["int8-amx"]


def test_inspect_fits_and_converted_sizes(converted):
    src, out = converted
    code, text = cli("inspect", src, "--gpu-mem", "1KB", "--cpu-mem", "1TB")
    assert code == 0 and "qwen3_moe" in text and "GPU does NOT fit" in text and "CPU fits" in text, text
    code, text = cli("inspect", out, "--gpu-mem", "24GB")
    assert code == 0 and "converted" in text and "int4-amx" in text and "GPU fits" in text, text
    code, text = cli("inspect", out, "--gpu-mem", "1KB", "--cpu-mem", "1KB")
    assert code == 0 and "GPU does NOT fit" in text and "CPU does NOT fit" in text, text
    code, text = cli("inspect", out, "--cpu-mem", "1TB")
    assert code == 0 and "CPU fits" in text and "GPU fits" not in text and "GPU does NOT" not in text, text
    predicted = inspect_source(src, 128)["cpu"]["int4-amx"]
    conv = inspect_converted(out)
    source_info = inspect_source(src, 128)
    assert conv["params"] == source_info["params"]      # the same counts by role as the source
    assert (conv["top_k"], conv["shared_experts"]) == (source_info["top_k"], source_info["shared_experts"])
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    expert_files = [f for f in manifest["files"].values() if f["kind"] == "expert"]
    assert conv["cpu"]["int4-amx"] == sum(f["size"] for f in expert_files)
    # the files hold exactly the predicted tile bytes plus one aligned header each
    assert predicted <= conv["cpu"]["int4-amx"] <= predicted + 4096 * len(expert_files)
    assert parse_bytes("24GiB", "--gpu-mem") == 24 * 2**30 and parse_bytes("1.5TB", "--cpu-mem") == 1.5e12
    code, text = cli("inspect", src, "--gpu-mem", "lots")
    assert code != 0 and "--gpu-mem" in text


DEFAULT_MODEL = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"


def ktconvert_cli(*args) -> str:
    """stdout of a real `ktconvert ARGS` subprocess (which must succeed)."""
    r = subprocess.run([sys.executable, "-m", "ktconvert", *map(str, args)], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_inspect_bounds_the_measured_upgrades_and_the_default_conversion_stays_within(tmp_path):
    """inspect SRC: the GPU bytes without the measured int8 upgrades (--gpu-mix-budget) and the most they can add,
    which the fit check counts; no bound where the pass does not run. The default conversion's GPU files then lie
    between the two; inspect of it reads their sizes and lists the Linears it upgraded."""
    info = inspect_source(DEFAULT_MODEL, 64, gpu={"gpu_method": "auto"})     # quantize's defaults, exact bytes
    base, mix = info["gpu"]["int4-amx"], info["gpu_layers"]["mix"]
    assert info["gpu_layers"]["method"] == "gptq-int4" and mix["budget"] == DEFAULT_MIX_BUDGET and mix["bound"] > 0
    between = base + mix["bound"] // 2                  # fits without the upgrades, not with all they may add
    text = ktconvert_cli("inspect", DEFAULT_MODEL, "--gpu-mem", between)
    assert (f"GPU: up to +{human(mix['bound'])} for the measured int8 upgrades, --gpu-mix-budget "
            f"{DEFAULT_MIX_BUDGET:g} ") in text, text
    assert re.search(rf"int4-amx\s+GPU\s+{re.escape(human(base))}\s+CPU .*GPU does NOT fit", text), text
    for no_pass in (["--gpu-mix-budget", "0"], ["--gpu-method", "rtn-int4"]):
        text = ktconvert_cli("inspect", DEFAULT_MODEL, "--gpu-mem", between, *no_pass)
        assert "measured int8 upgrades" not in text, (no_pass, text)
        assert re.search(rf"int4-amx\s+GPU\s+{re.escape(human(base))}\s+CPU .*GPU fits", text), (no_pass, text)

    out = tmp_path / "out"
    ktconvert_cli("quantize", DEFAULT_MODEL, "-o", out, "--quiet")
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    upgraded = manifest["gpu_mix"]["upgraded"]
    assert upgraded                                     # the pass upgraded something, so real > base below
    real = {kind: sum((out / rel).stat().st_size for rel, f in manifest["files"].items() if f["kind"] in kinds)
            for kind, kinds in (("gpu", ("dense", "globals")), ("mtp", (MTP_DENSE_KIND,)))}
    assert base < real["gpu"] <= base + mix["bound"], (base, mix["bound"], real)
    assert info["mtp"]["gpu"]["int4-amx"] == real["mtp"]            # MTP layers: not upgraded
    assert inspect_converted(out)["gpu"]["int4-amx"] == real["gpu"]
    text = ktconvert_cli("inspect", out)
    assert (f"GPU layers: gptq-int4; measured upgrades to gptq-int8 (--gpu-mix-budget {DEFAULT_MIX_BUDGET:g}): "
            + ", ".join(n.removesuffix(".weight") for n in upgraded)) in text, text
    assert "for the measured int8 upgrades" not in text               # real sizes: no bound


def test_the_bound_holds_whatever_the_measurement_ranks_first():
    """The measured rule picks by scores only a conversion knows: under any scores, what choose() picks adds no
    more stored bytes than the bound (Marlin pads some of the default model's Linears, so that is more than
    budget x weights / 8)."""
    import random

    from ktconvert.gpu import dense_encoder_for
    from ktconvert.gpu.sensitivity import Measured, added_bytes_bound, choose
    from ktconvert.sources import open_source

    with open_source(DEFAULT_MODEL) as src:
        enc = dense_encoder_for(src, gpu_method="auto")
        bound = added_bytes_bound(enc, 1.0, "gptq-int8")
        weights = {n: src.info(n).shape[0] * src.info(n).shape[1] for n in enc.upgrade_candidates(8)}
        added = {n: enc.stored_nbytes(n, 8) - enc.stored_nbytes(n, 4) for n in weights}
        rng = random.Random(0)
        most = 0
        for _ in range(300):
            measured = [Measured(n, w, 0.0, rng.random() * (added[n] / w) ** rng.choice((0, 8))) for n, w in
                        weights.items()]
            most = max(most, sum(added[n] for n in choose(measured, enc.bits_of, 8, 1.0, enc.decoder_weights())))
    assert enc.decoder_weights() / 8 < most <= bound, (most, bound)


def test_verify_passes_then_catches_damage(converted, tmp_path):
    _src, good = converted
    code, text = cli("verify", good)
    assert code == 0 and "verify: OK" in text, text
    out = shutil.copytree(good, tmp_path / "c")
    victim = min((out / "experts").iterdir())
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    code, text = cli("verify", out)
    assert code == 1 and "sha256" in text and victim.name in text, text
    victim.unlink()
    code, text = cli("verify", out)
    assert code == 1 and "missing" in text, text
    shutil.copy(good / "experts" / victim.name, victim)
    (out / "dense" / "x.safetensors.partial").write_bytes(b"")
    code, text = cli("verify", out)
    assert code == 1 and "leftovers" in text, text
    (out / "dense" / "x.safetensors.partial").unlink()
    assert cli("verify", out)[0] == 0
    m = json.loads((out / MANIFEST_NAME).read_text())
    m["format_version"] = 99
    (out / MANIFEST_NAME).write_text(json.dumps(m))
    code, text = cli("verify", out)
    assert code != 0 and "newer" in text, text


def test_verify_against_a_different_source_fails(converted, tmp_path):
    _, out = converted
    other = make_checkpoint("qwen3_moe", tmp_path / "other", seed=1)
    code, text = cli("verify", out, "--against", other)
    assert code == 1 and "FAIL" in text and "above the limit" in text, text


def test_verify_per_expert_lines_and_limit(converted):
    src, out = converted
    code, text = cli("verify", out, "--against", src, "--per-expert")
    assert code == 0, text
    assert "model.layers.1.mlp.experts.7.down_proj.weight: relative error" in text
    code, text = cli("verify", out, "--against", src, "--max-rel-error", "0.001", "--quiet")
    assert code == 1 and "FAIL layer 0 gate of 8 experts, worst model.layers.0.mlp.experts." in text, text
    assert "self_attn" not in text       # dense tensors keep their own (BF16) limit


def test_every_command_has_help_with_examples():
    """`ktconvert --help` and `ktconvert CMD --help` (a real subprocess each) list examples of that command."""
    import subprocess
    import sys

    exe = [sys.executable, "-m", "ktconvert"]
    r = subprocess.run([*exe, "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and "Examples:" in r.stdout, r.stdout + r.stderr
    commands = ("pull", "quantize", "inspect", "verify")
    for cmd in commands:
        assert cmd in r.stdout.split("Commands:")[1], cmd
        h = subprocess.run([*exe, cmd, "-h"], capture_output=True, text=True, timeout=60, check=False)
        assert h.returncode == 0 and "Examples:" in h.stdout, (cmd, h.stdout + h.stderr)
        examples = h.stdout.split("Examples:")[1].split("Options:")[0]
        assert f"ktconvert {cmd} " in examples, (cmd, examples)
