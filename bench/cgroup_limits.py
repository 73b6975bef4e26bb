"""The limits bench_expert_tier.py runs its processes under (root only): a memory cgroup (RAM cap; page cache counts)
and a cgroup-v1 blkio read throttle (a slower disk: `blkio.throttle.read_bps_device` on the disk that holds the expert
files). Every cgroup made here is removed, its throttle rule cleared first, when the `Limits` holding it closes, when
the interpreter exits and on SIGTERM / SIGHUP / SIGINT; cgroups a killed earlier run left behind (no process in them)
are removed at start.

What the blkio throttle covers was checked on this machine's kernel (Linux 6.18, cgroup v1) by
bench_expert_tier.py's `throttle_check_*` lines: O_DIRECT preads, buffered reads, page faults on a file mmap and
posix_fadvise(WILLNEED) readahead are all held to the rate. All four are reads issued from the process's own context
(the faulting or reading task, or the fadvise caller), which v1 charges to its blkio cgroup; what v1 cannot charge is
writeback (dirty pages written later by a kernel thread), which this benchmark does not do.
"""
from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path
from typing import ClassVar

V1_MEMORY = Path("/sys/fs/cgroup/memory")
V1_BLKIO = Path("/sys/fs/cgroup/blkio")
UNIFIED = Path("/sys/fs/cgroup")
PREFIX = "ktrun-bench-tier-"


def _rmdir(path: Path, tries: int = 50) -> None:
    """rmdir a cgroup; its last process may still be exiting (the kernel refuses with EBUSY until then)."""
    for _ in range(tries):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"cgroup {path} could not be removed (processes still in it: "
                       f"{(path / 'cgroup.procs').read_text().split()})")


class MemoryCgroup:
    """A memory cgroup with a hard limit (v1 memory.limit_in_bytes, else v2 memory.max)."""

    def __init__(self, name: str, limit: int):
        if (V1_MEMORY / "memory.limit_in_bytes").exists():
            self.path, self.v1 = V1_MEMORY / name, True
        elif "memory" in (UNIFIED / "cgroup.controllers").read_text().split():
            self.path, self.v1 = UNIFIED / name, False
        else:
            raise RuntimeError("no memory cgroup controller found (v1 /sys/fs/cgroup/memory or v2 memory.max)")
        self.path.mkdir(exist_ok=True)
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            (self.path / "memory.max_usage_in_bytes").write_text("0")
        else:
            (self.path / "memory.max").write_text(str(limit))
        self.limit = limit

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        p = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(p.read_text()) if p.exists() else -1

    def oom_kills(self) -> int:
        for line in (self.path / ("memory.oom_control" if self.v1 else "memory.events")).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def close(self) -> None:
        _rmdir(self.path)


def whole_disk(path: Path) -> str:
    """'MAJ:MIN' of the disk holding `path` (its partition's parent disk: blk-throttle rules name whole disks)."""
    dev = os.stat(path).st_dev
    sysdev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysdev.exists():
        raise RuntimeError(f"{path} is not on a block device (device {os.major(dev)}:{os.minor(dev)}): "
                           f"nothing to throttle")
    if (sysdev / "partition").exists():
        sysdev = sysdev.resolve().parent
    return (sysdev / "dev").read_text().strip()


class BlkioThrottle:
    """A cgroup-v1 blkio cgroup whose reads from `device` ('MAJ:MIN') are held to `bps` bytes/s."""

    def __init__(self, name: str, device: str, bps: int):
        if not (V1_BLKIO / "blkio.throttle.read_bps_device").exists():
            raise RuntimeError("--throttle-mbps needs the cgroup-v1 blkio controller "
                               f"({V1_BLKIO}/blkio.throttle.read_bps_device not found)")
        self.path, self.device, self.bps = V1_BLKIO / name, device, int(bps)
        self.path.mkdir(exist_ok=True)
        (self.path / "blkio.throttle.read_bps_device").write_text(f"{device} {self.bps}")

    def enter(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def bytes_read(self) -> int:
        """Bytes this cgroup's processes read from the device (blkio.throttle.io_service_bytes)."""
        for line in (self.path / "blkio.throttle.io_service_bytes").read_text().splitlines():
            f = line.split()
            if len(f) == 3 and f[0] == self.device and f[1] == "Read":
                return int(f[2])
        return 0

    def close(self) -> None:
        if self.path.exists():
            try:
                (self.path / "blkio.throttle.read_bps_device").write_text(f"{self.device} 0")   # 0: rule removed
            except OSError:
                pass
        _rmdir(self.path)


class Limits:
    """The cgroups one child process runs in; closes them all (also on exit and on a terminating signal)."""
    _open: ClassVar[list[Limits]] = []

    def __init__(self):
        self.groups: list = []
        Limits._open.append(self)

    def add(self, group):
        self.groups.append(group)
        return group

    def enter(self) -> None:
        """Move the calling process into every group (a Popen preexec_fn: the child, before it execs)."""
        for g in self.groups:
            g.enter()

    def close(self) -> None:
        err = None
        for g in reversed(self.groups):
            try:
                g.close()
            except Exception as e:   # noqa: BLE001 (close the others, then report the first failure)
                err = err or e
        self.groups = []
        if self in Limits._open:
            Limits._open.remove(self)
        if err is not None:
            raise err

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _close_all() -> None:
    for lim in list(Limits._open):
        try:
            lim.close()
        except Exception as e:   # noqa: BLE001 (at exit: report and go on)
            print(f"cgroup clean-up: {e}", flush=True)


def install_cleanup() -> None:
    """Close every open Limits at interpreter exit and on SIGTERM / SIGHUP (turned into SystemExit, so `finally`
    blocks and atexit run; SIGINT already raises KeyboardInterrupt), and remove what a killed earlier run left."""
    atexit.register(_close_all)

    def stop(signum, _frame):
        raise SystemExit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, stop)
    remove_stale()


def group_name(kind: str) -> str:
    """A cgroup name carrying this process's id, so remove_stale() can tell whose it is."""
    return f"{PREFIX}{os.getpid()}-{kind}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_stale() -> list[Path]:
    """Remove this benchmark's cgroups whose benchmark process is gone and with no process left in them (from a
    run killed with SIGKILL)."""
    gone = []
    for root in (V1_MEMORY, V1_BLKIO, UNIFIED):
        if not root.is_dir():
            continue
        for p in root.glob(PREFIX + "*"):
            procs = p / "cgroup.procs"
            owner = p.name[len(PREFIX):].split("-")[0]
            if owner.isdigit() and _alive(int(owner)):
                continue
            if p.is_dir() and procs.exists() and not procs.read_text().split():
                rule = p / "blkio.throttle.read_bps_device"
                for line in (rule.read_text().splitlines() if rule.exists() else []):
                    rule.write_text(f"{line.split()[0]} 0")
                _rmdir(p, tries=5)
                gone.append(p)
    return gone
