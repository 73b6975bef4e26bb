"""The command lines' glibc malloc settings (ktrun.malloc_policy), each checked in a child process: the settings are
process-wide, and this test process's other tests keep glibc's defaults."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError):
        return False


# a 64 MiB array made after the policy: whether the heap holds it (not a mapping of its own), from /proc/self/maps
_IN_HEAP = ("x = np.ones(1 << 24, np.float32)\n"
            "in_heap = False\n"
            "for line in open('/proc/self/maps'):\n"
            "    f = line.split()\n"
            "    lo, hi = (int(v, 16) for v in f[0].split('-'))\n"
            "    in_heap |= f[-1] == '[heap]' and lo <= x.ctypes.data < hi\n"
            "print(ok, in_heap, float(x.sum()))")


def _run(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.split()


def test_malloc_policy_applies_on_glibc():
    code = ("import numpy as np\nfrom ktrun.malloc_policy import keep_freed_memory\nok = keep_freed_memory()\n"
            "x = np.ones(1 << 22, np.float32)\nprint(ok, float(x.sum()))")
    assert _run(code) == [str(_glibc()), str(float(1 << 22))]


def test_calibrated_conversions_keep_large_arrays_in_the_heap():
    """keep_large_arrays (a calibrated conversion's malloc policy): a 64 MiB array comes from the heap, not from a
    mapping of its own (/proc/self/maps: [heap] grows, no anonymous mapping of that size appears)."""
    if not _glibc() or not os.path.exists("/proc/self/maps"):
        pytest.skip("glibc and /proc only")
    code = ("import numpy as np\nfrom ktrun.malloc_policy import keep_freed_memory, keep_large_arrays\n"
            "keep_freed_memory()\nok = keep_large_arrays()\n" + _IN_HEAP)
    out = _run(code)
    assert out == ["True", "True", str(float(1 << 24))], out


def test_every_ktrun_command_keeps_large_arrays_in_the_heap():
    """`ktrun`'s command line group sets keep_warm_heap before any subcommand runs (here `ktrun bench --help`): a
    prompt's large arrays then come from the heap, reused warm; without it the same array is a mapping of its own."""
    if not _glibc() or not os.path.exists("/proc/self/maps"):
        pytest.skip("glibc and /proc only")
    cli = ("import numpy as np\nfrom ktrun.cli import main\n"
           "try:\n    main(['bench', '--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\nok = True\n")
    out = _run(cli + _IN_HEAP)[-3:]               # after the help text
    assert out == ["True", "True", str(float(1 << 24))], out
    plain = _run("import numpy as np\nok = True\n" + _IN_HEAP)
    assert plain == ["True", "False", str(float(1 << 24))], plain      # glibc's default: a mapping of its own
