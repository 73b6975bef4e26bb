"""The progress bar's time shares (ktconvert.time_shares): where a conversion's time went, on the bar itself."""
from __future__ import annotations

import re
import subprocess
import sys

from ktconvert.time_shares import TimeShares


def test_shares_sum_to_the_whole():
    s = TimeShares()
    assert s.postfix() == ""
    s.add("read", 1.0)
    s.add("quantize", 3.0)
    assert s.postfix() == "read 25% quantize 75%"
    with s.timing("write"):
        pass
    assert s.seconds["write"] >= 0.0 and s.postfix().startswith("read ")


def test_the_bar_shows_where_the_time_goes(ckpt_dir, tmp_path):
    """A real `ktconvert quantize` with its progress bar (stderr, not a terminal): the bar's last line carries the
    shares of reading, quantizing and writing, and they add up to about 100%."""
    done = subprocess.run([sys.executable, "-m", "ktconvert", "quantize", str(ckpt_dir("qwen3_moe")), "-o",
                           str(tmp_path / "out"), "--gpu-method", "rtn-int4", "--expert-quantizer", "rtn"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    bars = [line for line in re.split(r"[\r\n]", done.stderr) if line.startswith("converting")]
    assert bars, done.stderr[-2000:]
    shares = {k: int(v) for k, v in re.findall(r"(read|calibrate|quantize|write) (\d+)%", bars[-1])}
    assert {"read", "quantize", "write"} <= set(shares), bars[-1]
    assert 97 <= sum(shares.values()) <= 103, bars[-1]
