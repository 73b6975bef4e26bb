"""Builds shared by every pytest-xdist worker of one run: a checkpoint or conversion that several workers need is
built by the first to ask, the others wait for it (a file lock), and all read the same directory.

Each worker's basetemp is a sibling (`.../pytest-N/popen-gw0`, `popen-gw1`) under the run's own directory: the
shared builds go there. A build that stopped half-way (its `.done` marker missing) is removed and redone. What is
built here is read-only for the tests, as the session fixtures that use it say.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def run_dir(tmp_path_factory) -> Path:
    """The directory all workers of this run share (the basetemp itself without xdist)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "run_shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


def built_once(out: Path, build: Callable[[Path], object]) -> Path:
    """out after build(out) ran once in this run, whichever worker ran it."""
    done = out.with_name(out.name + ".done")
    if done.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.with_name(out.name + ".lock"))):
        if not done.exists():
            if out.exists():
                shutil.rmtree(out)
            build(out)
            done.touch()
    return out
