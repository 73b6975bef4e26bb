"""Files from outside a source never get into a conversion (issue 34), through the real `ktconvert` and `ktrun`
commands on the embedded default model.

Every file the converter reads or copies resolves (links followed) inside the source folder or its hub cache repo
folder (hub snapshots are links into blobs/); JSON side files are parsed at conversion; ktrun applies the same rule to
a converted folder. A refusal names the file, exits non-zero and writes nothing that looks complete. A disk that
fills while manifest.json is written leaves no manifest.json.partial, and the message names the file.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ktlayouts.converted_dir import MANIFEST_NAME
from serve_helpers import ServerProcess

import ktconvert

BIN = Path(sys.executable).parent
SRC = Path(ktconvert.__file__).resolve().parent / "data" / "default_model"
FAST = ["--expert-quantizer", "rtn", "--gpu-method", "bf16", "--quiet"]   # no calibration: ~5 s on 2 cores
OUTSIDE = Path("/etc/passwd")


def quantize(src: Path, out: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ktconvert"), "quantize", str(src), "-o", str(out), *FAST, *extra],
                          check=False, capture_output=True, text=True, timeout=timeout)


def source_copy(tmp_path: Path) -> Path:
    """A private copy of the default model (hard links where the file system allows: the shards are 20 MB)."""
    dst = tmp_path / "src"
    try:
        shutil.copytree(SRC, dst, copy_function=os.link)
    except OSError:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(SRC, dst)
    return dst


def assert_nothing_written(out: Path):
    """Nothing that looks complete (no manifest.json, no copied file from outside) is left in the output."""
    if out.exists():
        assert not (out / MANIFEST_NAME).exists()
        for p in out.rglob("*"):
            assert not (p.is_file() and p.read_bytes() == OUTSIDE.read_bytes()), p


@pytest.mark.parametrize("name", ["special_tokens_map.json", "tokenizer_config.json", "vocab.txt"])
def test_side_file_linked_outside_is_refused(name, tmp_path):
    src = source_copy(tmp_path)
    (src / name).unlink(missing_ok=True)
    (src / name).symlink_to(OUTSIDE)
    out = tmp_path / "out"
    r = quantize(src, out)
    assert r.returncode != 0
    assert f"{src / name} is a link to {OUTSIDE}" in r.stderr and "outside" in r.stderr, r.stderr
    assert_nothing_written(out)


def test_shard_linked_outside_is_refused(tmp_path):
    src = source_copy(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shard = src / "model-00002-of-00003.safetensors"
    shutil.move(shard, elsewhere / shard.name)
    shard.symlink_to(elsewhere / shard.name)
    r = quantize(src, tmp_path / "out")
    assert r.returncode != 0 and f"{shard} is a link to {elsewhere / shard.name}" in r.stderr, r.stderr
    assert_nothing_written(tmp_path / "out")


def test_invalid_json_side_file_is_refused_at_conversion(tmp_path):
    src = source_copy(tmp_path)
    (src / "tokenizer_config.json").unlink()
    (src / "tokenizer_config.json").write_text("this is not JSON\n")
    r = quantize(src, tmp_path / "out")
    assert r.returncode != 0 and f"{src / 'tokenizer_config.json'}: not valid JSON" in r.stderr, r.stderr
    assert_nothing_written(tmp_path / "out")


def hub_snapshot(tmp_path: Path) -> Path:
    """The default model laid out as the hub cache does: models--ORG--NAME/blobs/<hash> files and
    snapshots/<revision>/<name> relative links into them."""
    repo = tmp_path / "hub" / "models--kt--default-model"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123456789abcdef"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    for i, p in enumerate(sorted(SRC.iterdir())):
        blob = blobs / f"{i:04d}{'0' * 60}"
        try:
            os.link(p, blob)
        except OSError:
            shutil.copyfile(p, blob)
        (snap / p.name).symlink_to(Path("../..") / "blobs" / blob.name)
    return snap


@pytest.fixture(scope="module")
def from_hub_cache(tmp_path_factory):
    """(snapshot folder, its conversion): links that stay inside the hub cache repo folder are followed."""
    tmp = tmp_path_factory.mktemp("hub_cache")
    snap = hub_snapshot(tmp)
    out = tmp / "converted"
    r = quantize(snap, out)
    assert r.returncode == 0, r.stderr
    return snap, out


def test_hub_cache_snapshot_links_are_accepted(from_hub_cache):
    snap, out = from_hub_cache
    assert (snap / "tokenizer_config.json").is_symlink()
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    for name in ("tokenizer_config.json", "tokenizer.json", "config.json"):
        assert name in manifest["files"]
        assert not (out / name).is_symlink()
    assert (out / "tokenizer_config.json").read_bytes() == (SRC / "tokenizer_config.json").read_bytes()


def test_hub_cache_link_leaving_the_repo_folder_is_refused(tmp_path):
    snap = hub_snapshot(tmp_path)
    (snap / "special_tokens_map.json").symlink_to(OUTSIDE)
    r = quantize(snap, tmp_path / "out")
    assert r.returncode != 0 and f"{snap / 'special_tokens_map.json'} is a link to {OUTSIDE}" in r.stderr, r.stderr
    assert_nothing_written(tmp_path / "out")


def serve_fails(model: Path) -> str:
    """`ktrun serve` on a folder it must refuse: exits 1 once loading fails; returns its stderr."""
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(model), "--port", "0"], wait_ready=False)
    try:
        assert s.proc.wait(120) == 1, s.stderr
    finally:
        s.stop()
    s._drain.join(5)
    return s.stderr


def test_ktrun_refuses_a_converted_file_linked_outside(from_hub_cache, tmp_path):
    _, out = from_hub_cache
    model = Path(shutil.copytree(out, tmp_path / "model"))
    # same size as the manifest lists, so only the link rule can refuse it
    size = (model / "tokenizer_config.json").stat().st_size
    target = tmp_path / "outside.json"
    target.write_bytes(b"{}" + b" " * (size - 2))
    (model / "tokenizer_config.json").unlink()
    (model / "tokenizer_config.json").symlink_to(target)
    err = serve_fails(model)
    assert f"{model / 'tokenizer_config.json'} is a link to {target}" in err, err
    # a link to the whole converted folder is fine (the folder is resolved first)
    (tmp_path / "alias").symlink_to(out)
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(tmp_path / "alias"), "--port", "0"], timeout=120)
    assert s.stop() == 0, s.stderr


def test_ktrun_names_a_tokenizer_config_that_is_not_json(from_hub_cache, tmp_path):
    _, out = from_hub_cache
    model = Path(shutil.copytree(out, tmp_path / "model"))
    cfg = model / "tokenizer_config.json"
    cfg.write_bytes(b"x" * cfg.stat().st_size)        # same size: passes the manifest's size check
    err = serve_fails(model)
    assert f"{cfg}: not valid JSON" in err, err


# -- a disk that fills while manifest.json is written -------------------------------------------------------------
FULL_AT_MANIFEST = """
import errno, os, sys
real_fsync = os.fsync
def fsync(fd):   # the disk fills as manifest.json is written: its fsync fails as a full disk's would
    if os.readlink(f"/proc/self/fd/{fd}").endswith("manifest.json.partial"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_fsync(fd)
os.fsync = fsync
from ktconvert.cli import main
sys.exit(main())
"""


def test_disk_full_at_the_manifest_leaves_no_partial_and_names_the_file(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", FULL_AT_MANIFEST, "quantize", str(SRC), "-o", str(out), *FAST],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "disk full" in r.stderr and str(out / MANIFEST_NAME) in r.stderr, r.stderr
    assert not (out / MANIFEST_NAME).exists()
    assert not list(out.rglob("*.partial")), list(out.rglob("*"))
