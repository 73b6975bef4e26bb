"""`ktconvert pull` end to end: real CLI subprocesses against a real HTTP fake hub on 127.0.0.1 (tests/fake_hub.py)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_hub import FakeHub

from ktconvert.hub import resolve_source

KTCONVERT = str(Path(sys.executable).with_name("ktconvert"))
REPO = "tiny-org/tiny-moe"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
DEFAULT_SET = {SHARD1, SHARD2, "model.safetensors.index.json", "config.json", "generation_config.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


@pytest.fixture(scope="module")
def hub():
    server = FakeHub().start()
    yield server
    server.stop()


@pytest.fixture
def fake(hub):
    hub.reset()
    yield hub
    hub.release.set()


@pytest.fixture
def env(fake, tmp_path):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE", "KTCONVERT"))}
    e.update(HF_ENDPOINT=fake.url, HF_HOME=str(tmp_path / "hf"), KTCONVERT_HOME=str(tmp_path / "kt"),
             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DOWNLOAD_TIMEOUT="20", PYTHONUNBUFFERED="1")
    return e


def run(env, *args, extra=None, timeout=60):
    return subprocess.run([KTCONVERT, "pull", *args], env={**env, **(extra or {})}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def content(fake, path, rev="main", repo=REPO):
    r = fake.repos[repo]
    return r.commits[r.resolve(rev)][path]


def pulled_files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and ".ktconvert" not in p.as_posix()}


def local_dir(env, repo=REPO) -> Path:
    return Path(env["KTCONVERT_HOME"]) / "models" / repo


def test_full_pull_default_set_verified_and_recorded(fake, env):
    fake.page_size = 3  # the tree listing comes in pages (Link header)
    r = run(env, REPO)
    assert r.returncode == 0, r.stderr
    d = local_dir(env)
    assert r.stdout.strip() == str(d)
    assert pulled_files(d) == DEFAULT_SET  # no .bin, README, .gitattributes or remote code
    for p in DEFAULT_SET:
        assert (d / p).read_bytes() == content(fake, p)
    want = load_safetensors(content(fake, SHARD1))
    got = load_file(d / SHARD1)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    rec = json.loads((d / ".ktconvert-source.json").read_text())
    assert rec["repo_id"] == REPO and rec["revision"] == "main" and rec["complete"] is True
    assert rec["commit"] == fake.repos[REPO].refs["main"]
    assert set(rec["files"]) == DEFAULT_SET
    for p, e in rec["files"].items():
        assert e["size"] == len(content(fake, p)) and e["sha256"] == hashlib.sha256(content(fake, p)).hexdigest()
    assert not (d / ".ktconvert-partial").exists()
    last = json.loads((Path(env["KTCONVERT_HOME"]) / "last_pull.json").read_text())
    assert last["local_dir"] == str(d) and last["commit"] == rec["commit"]
    assert sum("/tree/" in e["path"] for e in fake.log) >= 3
    assert "B/s" in r.stderr  # byte progress with rates

    fake.log.clear()  # a second run downloads nothing
    r = run(env, REPO)
    assert r.returncode == 0, r.stderr
    assert fake.downloads() == [] and "0 bytes to download" in r.stderr


def test_include_exclude_and_pickles(fake, env, tmp_path):
    r = run(env, REPO, "--local-dir", str(tmp_path / "a"), "--include", "*.json", "--exclude", "tokenizer*")
    assert r.returncode == 0, r.stderr
    assert pulled_files(tmp_path / "a") == {"config.json", "generation_config.json", "model.safetensors.index.json",
                                            "special_tokens_map.json"}
    r = run(env, REPO, "--local-dir", str(tmp_path / "b"), "--include", "*", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "skipped    pytorch_model.bin (pickle format; pull it with --include '*.bin')" in r.stdout
    assert "README.md" in r.stdout and "inference/convert.py" in r.stdout
    r = run(env, REPO, "--local-dir", str(tmp_path / "c"), "--include", "*.bin")
    assert r.returncode == 0, r.stderr
    assert pulled_files(tmp_path / "c") == {"pytorch_model.bin"}
    r = run(env, REPO, "--local-dir", str(tmp_path / "d"), "--include", "nothing-matches-*")
    assert r.returncode != 0 and "no file of tiny-org/tiny-moe@main matches" in r.stderr


def test_dry_run_prints_plan_and_writes_nothing(fake, env):
    r = run(env, REPO, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"commit {fake.repos[REPO].refs['main']}" in r.stdout
    total = sum(len(content(fake, p)) for p in DEFAULT_SET)
    assert f"download   {total:,} bytes" in r.stdout
    assert all(p in r.stdout for p in DEFAULT_SET)
    assert not Path(env["KTCONVERT_HOME"]).exists() and fake.downloads() == []


def test_revision_pinning(fake, env, tmp_path):
    v1 = fake.repos[REPO].refs["v1.0"]
    for rev in ("v1.0", v1):
        d = tmp_path / rev
        r = run(env, REPO, "--revision", rev, "--local-dir", str(d))
        assert r.returncode == 0, r.stderr
        assert json.loads((d / "config.json").read_bytes())["fixture_version"] == 1
        assert (d / SHARD2).read_bytes() == content(fake, SHARD2, "v1.0")
        rec = json.loads((d / ".ktconvert-source.json").read_text())
        assert (rec["revision"], rec["commit"]) == (rev, v1)
    r = run(env, REPO, "--revision", "no-such-branch", "--local-dir", str(tmp_path / "x"))
    assert r.returncode == 1 and "revision 'no-such-branch' not found in tiny-org/tiny-moe" in r.stderr


def test_transfer_cut_mid_file_is_resumed_with_range(fake, env):
    repo, shard = "tiny-org/big-moe", "model.safetensors"
    size = len(content(fake, shard, repo=repo))
    fake.cut_once[shard] = size - 1_000_000  # the connection drops ~1 MB before the end of a ~12 MB file
    r = run(env, repo)
    assert r.returncode == 0, r.stderr
    assert "peer closed connection" in r.stderr and "resume" in r.stderr
    first, second = fake.downloads(shard)
    assert first["range"] is None and first["sent"] == size - 1_000_000
    start = int(second["range"].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= first["sent"] and second["status"] == 206 and second["sent"] == size - start
    assert (local_dir(env, repo) / shard).read_bytes() == content(fake, shard, repo=repo)


def test_killed_pull_resumes_only_the_missing_bytes(fake, env):
    repo, shard = "tiny-org/big-moe", "model.safetensors"
    size = len(content(fake, shard, repo=repo))
    fake.stall[shard] = size - 1_000_000  # the server sends most of the shard, then hangs until the client is killed
    proc = subprocess.Popen([KTCONVERT, "pull", repo], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    d = local_dir(env, repo)
    try:
        assert fake.stalled.wait(30)
        part_dir, deadline = d / ".ktconvert-partial", time.time() + 20
        # only the shard's partial: config.json's may be renamed into place between glob() and stat()
        shard_parts = lambda: [p for p in part_dir.glob(f"{shard}.*.part") if p.exists() and p.stat().st_size > 0]
        while time.time() < deadline and not shard_parts():
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        fake.release.set()
    (part,) = list((d / ".ktconvert-partial").glob("*.part"))
    have = part.stat().st_size
    assert 0 < have < size and not (d / shard).exists()  # nothing half-written at the final path
    assert json.loads((d / ".ktconvert-source.json").read_text())["complete"] is False
    with pytest.raises(Exception, match="unfinished pull of tiny-org/big-moe"):
        resolve_source(str(d))
    fake.log.clear()
    r = run(env, repo)
    assert r.returncode == 0, r.stderr
    (get,) = fake.downloads()  # config.json was complete before the kill: only the shard's tail is fetched
    assert get["file"] == shard and get["range"] == f"bytes={have}-" and get["sent"] == size - have
    assert (d / shard).read_bytes() == content(fake, shard, repo=repo)
    assert json.loads((d / ".ktconvert-source.json").read_text())["complete"] is True
    assert resolve_source(str(d)) == d


def test_corrupted_transfer_is_detected_and_repaired(fake, env):
    fake.corrupt_once.update({SHARD2, "config.json"})  # an LFS file (sha256) and a git file (blob id)
    r = run(env, REPO)
    assert r.returncode == 0, r.stderr
    assert f"{SHARD2}: sha256" in r.stderr and "does not match the hub's" in r.stderr
    assert "config.json: git blob id" in r.stderr and "downloading config.json again" in r.stderr
    assert len(fake.downloads(SHARD2)) == 2 and len(fake.downloads("config.json")) == 2
    for p in (SHARD2, "config.json"):
        assert (local_dir(env) / p).read_bytes() == content(fake, p)


def test_persistently_corrupted_file_fails_naming_it(fake, env):
    fake.corrupt_always.add(SHARD1)
    r = run(env, REPO)
    assert r.returncode == 1
    assert f"verification failed: {SHARD1}: sha256" in r.stderr and "second download, giving up" in r.stderr
    d = local_dir(env)
    assert not (d / SHARD1).exists() and len(fake.downloads(SHARD1)) == 2
    assert json.loads((d / ".ktconvert-source.json").read_text())["complete"] is False


def test_locally_damaged_file_is_found_on_rerun(fake, env):
    assert run(env, REPO).returncode == 0
    shard = local_dir(env) / SHARD1
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    fake.log.clear()
    r = run(env, REPO)
    assert r.returncode == 0, r.stderr
    assert f"local copy differs from the hub: {SHARD1}" in r.stderr
    assert {e["file"] for e in fake.downloads()} == {SHARD1} and shard.read_bytes() == content(fake, SHARD1)


def test_repo_not_found(fake, env):
    r = run(env, "tiny-org/no-such-model")
    assert r.returncode == 1
    assert f"repository tiny-org/no-such-model not found on {fake.url}" in r.stderr
    assert not local_dir(env, "tiny-org/no-such-model").exists()


def test_gated_repo_needs_token(fake, env):
    repo = "tiny-org/gated-moe"
    r = run(env, repo)
    assert r.returncode == 1 and "tiny-org/gated-moe is a gated repository" in r.stderr and "HF_TOKEN" in r.stderr
    assert any(e["status"] == 401 for e in fake.log) and fake.downloads() == []
    assert not local_dir(env, repo).exists()
    r = run(env, repo, extra={"HF_TOKEN": fake.token})
    assert r.returncode == 0, r.stderr
    assert (local_dir(env, repo) / SHARD1).read_bytes() == content(fake, SHARD1, repo=repo)


def test_not_enough_disk_refuses_before_downloading(fake, env):
    total = sum(len(content(fake, p)) for p in DEFAULT_SET)
    r = run(env, REPO, extra={"KTCONVERT_TEST_FREE_BYTES": "1000"})
    assert r.returncode == 1
    assert f"not enough free disk space in {local_dir(env)}: the pull needs {total:,} bytes" in r.stderr
    assert "only 1,000 bytes" in r.stderr
    assert fake.downloads() == [] and not local_dir(env).exists()


def test_offline_mode(fake, env):
    offline = {"HF_HUB_OFFLINE": "1"}
    r = run(env, REPO, extra=offline)
    assert r.returncode == 1 and "HF_HUB_OFFLINE=1" in r.stderr and "holds no pull of tiny-org/tiny-moe" in r.stderr
    assert run(env, REPO).returncode == 0
    fake.log.clear()
    r = run(env, REPO, extra=offline)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(local_dir(env)) and fake.log == []  # no request at all
    r = run(env, REPO, "--revision", "v1.0", extra=offline)
    assert r.returncode == 1 and "not revision 'v1.0'" in r.stderr
    (local_dir(env) / SHARD2).unlink()
    r = run(env, REPO, extra=offline)
    assert r.returncode == 1 and f"{SHARD2} (missing or incomplete)" in r.stderr and fake.log == []


def test_path_traversal_from_server_is_refused(fake, env, tmp_path):
    d = tmp_path / "deep" / "dir"
    r = run(env, "evil-org/traversal", "--local-dir", str(d), "--include", "*")
    assert r.returncode == 1 and "refusing file name '../escape.safetensors'" in r.stderr
    assert not (tmp_path / "deep" / "escape.safetensors").exists() and fake.downloads() == []
