"""Resume: a real `ktconvert quantize` subprocess SIGKILLed at several points, then `--resume`d, gives output
byte-identical to an uninterrupted run; the output-directory rules name the flags."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ktlayouts.converted_dir import MANIFEST_NAME, PROGRESS_NAME

from ktconvert.pipeline import TEST_KILL_ENV, ConvertOptions, convert
from ktconvert.progress import Journal, OutputDirError, prepare_output

KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]


def run_quantize(src, out, *extra, kill_at=None):
    env = dict(os.environ)
    env.pop(TEST_KILL_ENV, None)
    if kill_at:
        env[TEST_KILL_ENV] = kill_at
    return subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(out), "--quiet", *extra],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


ARGS = ("--numa-nodes", "2", "--group-size", "32", "--gpu-method", "bf16")   # the in-process reference is bf16


@pytest.fixture(scope="module")
def reference(ckpt_dir, tmp_path_factory):
    """An uninterrupted conversion (in-process) of the deepseek_v3 fixture: dense layer, 2 MoE layers, 2 shards."""
    src = ckpt_dir("deepseek_v3")
    out = tmp_path_factory.mktemp("ref") / "out"
    convert(src, out, ConvertOptions(numa_nodes=2, group_size=32), show_progress=False)
    return src, tree(out)


def test_kill_and_resume_is_byte_identical(reference, tmp_path):
    """Killed at several points: mid dense file and mid expert file (a .partial on disk), after a rename but before
    the journal recorded it; a plain rerun is refused naming the flags; --resume finishes byte-identical."""
    src, ref = reference
    out = tmp_path / "out"
    for kill, extra in (("dense:2", ()), ("expert:5", ("--resume",)), ("commit:2", ("--resume",))):
        r = run_quantize(src, out, *ARGS, *extra, kill_at=kill)
        assert r.returncode == -signal.SIGKILL, (kill, r.returncode, r.stderr[-2000:])
        assert not (out / MANIFEST_NAME).exists()      # an interrupted run never looks complete
        if kill.startswith(("dense", "expert")):
            assert list(out.rglob("*.partial")), kill
    r = run_quantize(src, out, *ARGS)
    assert r.returncode != 0 and "--resume" in r.stderr and "--force" in r.stderr
    r = run_quantize(src, out, *ARGS, "--resume")
    assert r.returncode == 0, r.stderr
    got = tree(out)
    assert sorted(got) == sorted(ref)
    for rel in ref:
        assert got[rel] == ref[rel], rel


def test_resume_after_k_files_redoes_a_damaged_file(reference, tmp_path):
    """Killed after the last file was recorded but before the side files and manifest.json; a completed file
    damaged meanwhile is redone on --resume."""
    src, ref = reference
    out = tmp_path / "out"
    n_files = len([rel for rel in ref if rel.startswith(("experts/", "dense/"))])
    assert run_quantize(src, out, *ARGS, kill_at=f"file:{n_files}").returncode == -signal.SIGKILL
    done = Journal.load(out).files
    assert len(done) == n_files and not (out / MANIFEST_NAME).exists() and not (out / "config.json").exists()
    victim = next(rel for rel in done if rel.startswith("experts/"))
    (out / victim).write_bytes(b"garbage")
    inodes = {rel: (out / rel).stat().st_ino for rel in done if rel != victim}
    r = run_quantize(src, out, *ARGS, "--resume", "--workers", "1")    # worker count does not change the bytes
    assert r.returncode == 0, r.stderr
    assert tree(out) == ref
    # only the damaged file was rewritten (files are renamed into place, so a rewrite is a new inode), not the
    # other NUMA shard of its layer
    assert {rel: (out / rel).stat().st_ino for rel in inodes} == inodes


def test_output_dir_rules(tmp_path):
    params = {"method": "int4-amx", "source": "/x"}
    out = tmp_path / "out"
    j = prepare_output(out, params, resume=False, force=False)        # fresh
    assert (out / PROGRESS_NAME).exists() and j.files == {}
    with pytest.raises(OutputDirError, match="--resume.*--force"):
        prepare_output(out, params, resume=False, force=False)
    with pytest.raises(OutputDirError, match="different parameters.*method.*--force"):
        prepare_output(out, {**params, "method": "int8-amx"}, resume=True, force=False)
    with pytest.raises(OutputDirError, match="exclude each other"):
        prepare_output(out, params, resume=True, force=True)
    (out / MANIFEST_NAME).write_text("{}")
    (out / PROGRESS_NAME).unlink()
    with pytest.raises(OutputDirError, match="complete conversion.*--force"):
        prepare_output(out, params, resume=False, force=False)
    prepare_output(out, params, resume=False, force=True)                # --force starts over
    assert not (out / MANIFEST_NAME).exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not empty"):
        prepare_output(foreign, params, resume=False, force=False)
    prepare_output(foreign, params, resume=False, force=True)
    assert (foreign / "notes.txt").read_text() == "mine"                # --force never deletes unknown files
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / PROGRESS_NAME).write_text("{not json")
    with pytest.raises(OutputDirError, match="unreadable.*--force"):
        prepare_output(bad, params, resume=True, force=False)
    assert json.loads((foreign / PROGRESS_NAME).read_text())["params"] == params
