"""`ktconvert inspect` (counts checked against the transformers model) and `ktconvert verify` (catches damage)."""
import json
import shutil

import pytest
from click.testing import CliRunner
from ktlayouts.converted_dir import MANIFEST_NAME

from ktconvert.cli import main
from ktconvert.cmd_inspect import inspect_converted, inspect_source, parse_bytes
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
