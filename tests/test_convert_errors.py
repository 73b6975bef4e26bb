"""Bad input: each case fails with a clear message naming the file/tensor/flag, exits non-zero, and leaves nothing
that looks complete (no manifest.json, no stray *.partial files)."""
import json
import resource
import subprocess
import sys

import pytest
from click.testing import CliRunner
from ktlayouts.converted_dir import MANIFEST_NAME, PROGRESS_NAME

from ktconvert.cli import main
from ktconvert.sources import open_source


def quantize(src, out, *extra):
    res = CliRunner().invoke(main, ["quantize", str(src), "-o", str(out), "--quiet", *map(str, extra)])
    return res.exit_code, res.output


def assert_nothing_complete(out):
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.rglob("*.partial")) if out.exists() else True


def _poke(src, name, bits: int):
    """Overwrite the first element of BF16 tensor `name` in its shard with the bf16 bit pattern `bits`."""
    with open_source(src) as s:
        info = s.info(name)
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        f.write(bits.to_bytes(2, "little"))
    return info.file.name


@pytest.mark.parametrize("where,bits,what", [
    ("model.layers.1.mlp.experts.3.down_proj.weight", 0x7FC0, "NaN"),
    ("model.layers.0.self_attn.o_proj.weight", 0x7F80, "Inf"),
])
def test_nan_inf_names_the_tensor(where, bits, what, ckpt_copy, tmp_path):
    src = ckpt_copy("qwen3_moe")
    shard = _poke(src, where, bits)
    out = tmp_path / "out"
    code, text = quantize(src, out)
    assert code != 0 and where in text and what in text and shard in text, text
    assert_nothing_complete(out)


def test_truncated_shard(ckpt_copy, tmp_path):
    src = ckpt_copy("mixtral")
    shard = max(src.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    code, text = quantize(src, tmp_path / "out")
    assert code != 0 and shard.name in text and "truncated" in text, text
    assert_nothing_complete(tmp_path / "out")


def test_corrupt_shard_header(ckpt_copy, tmp_path):
    src = ckpt_copy("mixtral")
    shard = min(src.glob("model-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[8:24] = b"#" * 16
    shard.write_bytes(bytes(raw))
    code, text = quantize(src, tmp_path / "out")
    assert code != 0 and shard.name in text and "header" in text, text
    assert_nothing_complete(tmp_path / "out")


def test_shard_missing_and_tensor_missing_from_index(ckpt_copy, tmp_path):
    src = ckpt_copy("qwen3_moe")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    code, text = quantize(src, tmp_path / "out")
    assert code != 0 and name in text and "index" in text, text
    shard = min(src.glob("model-*.safetensors"))
    shard.unlink()
    code, text = quantize(src, tmp_path / "out")
    assert code != 0 and shard.name in text and "missing" in text, text
    assert_nothing_complete(tmp_path / "out")


def test_unsupported_model_type(ckpt_copy, tmp_path):
    src = ckpt_copy("mixtral")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama4"
    (src / "config.json").write_text(json.dumps(cfg))
    code, text = quantize(src, tmp_path / "out")
    assert code != 0 and "llama4" in text and "deepseek_v3" in text and "qwen3_moe" in text, text
    assert_nothing_complete(tmp_path / "out")


def test_dimensions_that_cannot_be_tiled(ckpt_dir, ckpt_copy, tmp_path):
    src = ckpt_dir("qwen3_moe")        # moe_intermediate_size 80: one unit of 128 at group 128
    code, text = quantize(src, tmp_path / "a", "--numa-nodes", "2", "--group-size", "128")   # not the default 64
    assert code != 0 and "--numa-nodes" in text and "80" in text, text
    code, text = quantize(src, tmp_path / "b", "--group-size", "48")
    assert code != 0 and "--group-size" in text and "48" in text, text
    bad = ckpt_copy("qwen3_moe")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] = 96        # the tensors are (80, 128): the config lies
    (bad / "config.json").write_text(json.dumps(cfg))
    code, text = quantize(bad, tmp_path / "c")
    assert code != 0 and "experts.0.gate_proj.weight" in text and "(80, 128)" in text and "96" in text, text
    for d in "abc":
        assert_nothing_complete(tmp_path / d)


def test_output_dir_holding_another_conversion(ckpt_dir, tmp_path):
    out = tmp_path / "out"
    assert quantize(ckpt_dir("qwen3_moe"), out)[0] == 0
    before = (out / MANIFEST_NAME).read_bytes()
    code, text = quantize(ckpt_dir("mixtral"), out)
    assert code != 0 and "--force" in text and str(out) in text, text
    code, text = quantize(ckpt_dir("qwen3_moe"), out, "--method", "int8-amx")
    assert code != 0 and "--force" in text, text
    assert (out / MANIFEST_NAME).read_bytes() == before            # untouched
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    assert quantize(ckpt_dir("mixtral"), out, "--force")[0] == 0
    assert json.loads((out / MANIFEST_NAME).read_text())["model_type"] == "mixtral"


def _limit_file_size(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_disk_full_then_resume(ckpt_dir, tmp_path):
    """Writes fail with EFBIG past RLIMIT_FSIZE (Python ignores SIGXFSZ): a clean error, no partial files, no
    manifest; after 'freeing space' --resume completes and verifies."""
    src, out = ckpt_dir("deepseek_v3"), tmp_path / "out"
    cmd = [sys.executable, "-c", "from ktconvert.cli import main; main()", "quantize", str(src), "-o", str(out),
           "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, preexec_fn=_limit_file_size(40_000))
    assert r.returncode == 1, r.stderr
    assert "disk full" in r.stderr and "--resume" in r.stderr and ".safetensors" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert_nothing_complete(out)
    assert (out / PROGRESS_NAME).exists()
    r = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    res = CliRunner().invoke(main, ["verify", str(out), "--against", str(src)])
    assert res.exit_code == 0, res.output
