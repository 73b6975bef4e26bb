"""The README's three commands as written, against the fake hub on loopback (tests/fake_hub.py) serving a real
fixture checkpoint: `ktconvert pull ORG/NAME`, `ktconvert quantize --method int4-amx` (no SRC: the most recent pull,
into ./converted/), `ktrun serve converted/` up to a healthy /health; and `ktconvert quantize ORG/NAME` pulling first.
All real subprocesses (the installed console scripts) in a scratch working directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_hub import FakeHub, FakeRepo
from serve_helpers import ServerProcess, request

BIN = Path(sys.executable).parent
REPO_ID = "tiny-org/qwen3-moe-tiny"
COMMIT = "c0ffee" + "0" * 34


@pytest.fixture(scope="module")
def hub(ckpt_dir):
    src = ckpt_dir("qwen3_moe")
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in sorted(src.rglob("*")) if p.is_file()}
    server = FakeHub(repos={REPO_ID: FakeRepo(REPO_ID, {COMMIT: files}, {"main": COMMIT})}).start()
    yield server, files
    server.stop()


def env_for(hub_url: str, home: Path) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "KTCONVERT"))}
    e.update(HF_ENDPOINT=hub_url, HF_HOME=str(home / "hf"), KTCONVERT_HOME=str(home / "kt"),
             HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    return e


def ktconvert(cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([str(BIN / "ktconvert"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, (args, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    return r


def test_pull_then_quantize_then_serve_as_written(hub, tmp_path):
    server, _files = hub
    env = env_for(server.url, tmp_path)
    r = ktconvert(tmp_path, env, "pull", REPO_ID)
    pulled = Path(r.stdout.strip().splitlines()[-1])
    assert pulled == tmp_path / "kt" / "models" / REPO_ID and (pulled / "config.json").is_file()
    r = ktconvert(tmp_path, env, "quantize", "--method", "int4-amx")           # no SRC, no -o
    out = tmp_path / "converted"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"] == "int4-amx" and manifest["model_type"] == "qwen3_moe"
    assert manifest["source"]["repo_id"] == REPO_ID and manifest["source"]["commit"] == COMMIT
    assert manifest["source"]["revision"] == "main"
    assert "B/s" in r.stderr                      # the progress bar shows bytes and a rate
    assert f"--against {pulled}" in r.stdout      # the suggested verify command names the pulled directory
    assert ktconvert(tmp_path, env, "verify", "converted/", "--against", str(pulled)).returncode == 0
    # `ktrun serve converted/`, with --port 0 only so that parallel test runs cannot collide on port 8000
    srv = ServerProcess([str(BIN / "ktrun"), "serve", "converted/", "--port", "0"], timeout=180, cwd=tmp_path)
    try:
        status, body, _ = request(srv, "GET", "/health")
        assert status == 200, body
        status, models, _ = request(srv, "GET", "/v1/models")
        assert status == 200 and models["data"], models
    finally:
        assert srv.stop() == 0, srv.stderr
    assert "Traceback" not in srv.stderr


def test_quantize_a_repo_id_pulls_first(hub, tmp_path):
    server, files = hub
    env = env_for(server.url, tmp_path)
    server.log.clear()
    r = ktconvert(tmp_path, env, "quantize", REPO_ID, "-o", "by-id", "--quiet")
    pulled = tmp_path / "kt" / "models" / REPO_ID
    assert {p: (pulled / p).read_bytes() for p in files} == files     # the whole default set, byte for byte
    assert {d["file"] for d in server.downloads()} >= {p for p in files if p.endswith(".safetensors")}
    manifest = json.loads((tmp_path / "by-id" / "manifest.json").read_text())
    assert manifest["source"]["repo_id"] == REPO_ID and manifest["source"]["commit"] == COMMIT
    assert f"--against {pulled}" in r.stdout
