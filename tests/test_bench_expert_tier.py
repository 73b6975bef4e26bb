"""bench/bench_expert_tier.py in its tiny configuration, as a real subprocess (root and cgroup-v1 blkio needed; skipped
visibly elsewhere): the default model's conversion read through a blkio read throttle, the throttle's effect on each
way of reading measured, the tier's logits identical to the all-in-RAM run, the target lines printed, and every cgroup
it made removed afterwards, also when it is stopped by SIGTERM in the middle of a run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "bench_expert_tier.py"
BLKIO = Path("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not BLKIO.exists(),
                                reason="needs root and the cgroup-v1 blkio controller (a blkio read throttle)")


def leftovers(pid: int) -> list[Path]:
    return [p for root in ("memory", "blkio", "") for p in Path("/sys/fs/cgroup", root).glob(f"ktrun-bench-tier-{pid}-*")]


def bench_cmd(conv: Path, work: Path, mbps: str, *extra: str) -> list[str]:
    return [sys.executable, str(BENCH), "--model", "default", "--conv", str(conv), "--work", str(work), "--ratios", "2",
            "--reps", "1", "--tokens", "3", "--throttle-mbps", mbps, "--max-run-s", "20", *extra]


def pid_of(stdout: str) -> int:
    return int(next(ln.split()[1] for ln in stdout.splitlines() if ln.startswith("bench_pid: ")))


def test_throttled_tiny_run(default_converted, tmp_path):
    p = subprocess.run(bench_cmd(default_converted, tmp_path, "8", "--modes", "ram,tier"), capture_output=True,
                       text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(ln.split(": ", 1) for ln in p.stdout.splitlines() if ": " in ln and not ln.startswith(" "))
    for kind in ("direct", "buffered", "mmap", "willneed"):       # every way of reading is held near 8 MB/s
        throttled = float(lines[f"throttle_check_{kind}"].split()[0])
        assert throttled < 8 * 2, (kind, lines[f"throttle_check_{kind}"])
    assert float(lines["disk_read_limit_8MBps"].split()[0]) < 0.016
    assert lines["logits_identical_across_modes"] == "1"
    assert lines["runs_failed_8MBps_2x_tier"] == "0"
    assert "limit: " in lines["bound_ratio_8MBps_2x_tier"]
    assert float(lines["tier_disk_busy_share_8MBps_2x_tier"].split()[0]) > 0
    assert not leftovers(pid_of(p.stdout))


def test_sigterm_removes_cgroups_and_throttle(default_converted, tmp_path):
    """Stopped while a child reads under the throttle: the child is ended, the throttle rule cleared, the cgroups
    removed, and the exit status says it was stopped."""
    proc = subprocess.Popen(bench_cmd(default_converted, tmp_path, "0.5"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not leftovers(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        made = leftovers(proc.pid)
        assert made, "the bench made no cgroup"
        time.sleep(0.5)                                    # a child is in it, reading at 0.5 MB/s
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not leftovers(proc.pid), err
