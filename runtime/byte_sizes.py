"""Byte sizes on the command line ('24GB', '80GiB', '512G') and in messages, for ktrun and ktconvert alike."""
from __future__ import annotations

import re

import click

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, flag: str) -> int:
    """'24GB' -> 24e9, '24GiB' -> 24 * 2^30, '512G' -> 512e9, '1000000' -> bytes; click.BadParameter naming flag."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text or "")
    if not m or m.group(2).upper() not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size like 24GB, 24GiB or 512G", param_hint=flag)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def human(n: float) -> str:
    """Bytes for messages, in decimal units like the flags take them (24e9 -> '24.00 GB'); the one formatter of ktrun
    and ktconvert."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n}"
