"""File selection, server path checks and `resolve_source` (the SRC of `ktconvert quantize`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_hub import FakeHub

from ktconvert.hub import PullError, resolve_source, safe_relpath, select_files

# Shaped like the DeepSeek-V3 / Kimi-K2 / Mixtral repos: weights, remote code, docs, pickles, nested configs.
LISTING = [
    ".gitattributes", "LICENSE", "README.md", "config.json", "configuration_deepseek.py", "figures/benchmark.png",
    "generation_config.json", "inference/configs/config_671B.json", "inference/model.py",
    "model-00001-of-000163.safetensors", "model-00002-of-000163.safetensors", "model.safetensors.index.json",
    "modeling_deepseek.py", "tokenizer.json", "tokenizer_config.json", "tiktoken.model", "chat_template.jinja",
    "pytorch_model-00001-of-00002.bin", "consolidated.00.pth", "original/consolidated.pt", "vocab.json", "merges.txt",
]


def test_default_selection_is_what_conversion_needs():
    chosen, skipped = select_files(LISTING, None, None)
    assert chosen == [
        "config.json", "generation_config.json", "model-00001-of-000163.safetensors",
        "model-00002-of-000163.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "tiktoken.model", "chat_template.jinja", "vocab.json", "merges.txt",
    ]
    assert skipped == []  # pickles are not in the default set at all


def test_include_replaces_default_and_pickles_need_their_suffix():
    chosen, skipped = select_files(LISTING, ["*"], ["*.py", "figures/*"])
    assert "README.md" in chosen and "inference/configs/config_671B.json" in chosen
    assert not any(p.endswith((".py", ".png", ".bin", ".pth", ".pt")) for p in chosen)
    assert skipped == ["pytorch_model-00001-of-00002.bin", "consolidated.00.pth", "original/consolidated.pt"]
    chosen, skipped = select_files(LISTING, ["*.bin", "config.json"], None)
    assert chosen == ["config.json", "pytorch_model-00001-of-00002.bin"] and skipped == []
    chosen, _ = select_files(LISTING, None, ["model-00002*"])
    assert "model-00002-of-000163.safetensors" not in chosen and "model-00001-of-000163.safetensors" in chosen


@pytest.mark.parametrize("name", ["../escape.safetensors", "/etc/passwd", "a/../../b", "a\\..\\b", "", "./a",
                                  "a//b", "a/", ".ktconvert-source.json", ".ktconvert-partial/x.part",
                                  ".cache/huggingface/x", "nul\0byte"])
def test_unsafe_server_file_names_are_refused(name):
    with pytest.raises(PullError, match="refusing file name"):
        safe_relpath(name)


def test_safe_names_pass():
    assert safe_relpath("original/tokenizer.model") == "original/tokenizer.model"
    assert safe_relpath("model-00001-of-000163.safetensors") == "model-00001-of-000163.safetensors"


def test_resolve_source_local_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("KTCONVERT_HOME", str(tmp_path / "kt"))
    with pytest.raises(PullError, match="nothing pulled yet"):
        resolve_source(None)
    own = tmp_path / "my-ckpt"
    own.mkdir()
    assert resolve_source(str(own)) == own  # a directory without a pull record is the user's own checkpoint
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(PullError, match="neither a directory nor a .gguf file"):
        resolve_source(str(tmp_path / "file.txt"))
    with pytest.raises(PullError, match="neither an existing directory nor a hub repo id"):
        resolve_source(str(tmp_path / "missing" / "dir"))


def test_resolve_source_pulls_a_repo_id_then_remembers_it(tmp_path):
    hub = FakeHub().start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "KTCONVERT"))}
        env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), KTCONVERT_HOME=str(tmp_path / "kt"))
        script = ("import sys; from ktconvert.hub import resolve_source; "
                  "print('SRC=' + str(resolve_source(sys.argv[1] or None)))")

        def resolve(arg):
            r = subprocess.run([sys.executable, "-c", script, arg], env=env, capture_output=True, text=True,
                               cwd=tmp_path, timeout=60, check=False)
            assert r.returncode == 0, r.stderr
            return Path(r.stdout.strip().splitlines()[-1].removeprefix("SRC="))

        pulled = resolve("tiny-org/tiny-moe")
        assert pulled == tmp_path / "kt" / "models" / "tiny-org" / "tiny-moe"
        rec = json.loads((pulled / ".ktconvert-source.json").read_text())
        assert rec["complete"] and rec["commit"] == hub.repos["tiny-org/tiny-moe"].refs["main"]
        assert (pulled / "model-00001-of-00002.safetensors").is_file()
        hub.log.clear()
        assert resolve("") == pulled and hub.downloads() == []  # no SRC: the most recent pull, no new download
    finally:
        hub.stop()
