"""Mixed precision of the GPU layers: which method each non-expert Linear gets.

`--gpu-method` sets the method of every quantized non-expert Linear; `--gpu-method-for GLOB=METHOD` (repeatable)
overrides it for the Linears whose hub tensor name matches GLOB (fnmatch, case-sensitive; the name is tried with and
without its `.weight` suffix, so `model.layers.0.mlp.down_proj` and `*.kv_b_proj.weight` both work). The first
matching rule wins. Rules are validated twice: the method when the options are built (an unknown one is refused
naming the flag, the pattern and the choices), the pattern against the checkpoint's quantized Linears when the
encoder sees the source (a pattern that matches none is refused, naming it and a few names it could match).

Light to import (no torch).
"""
from __future__ import annotations

from fnmatch import fnmatchcase

FLAG = "--gpu-method-for"


class MixError(ValueError):
    """A --gpu-method-for rule that cannot be applied; the message names the flag and the rule."""


def parse_rule(text: str, methods) -> tuple[str, str]:
    """'GLOB=METHOD' -> (glob, method), METHOD one of `methods` (MixError naming the flag and the rule)."""
    glob, sep, method = (s.strip() for s in text.rpartition("="))
    if not sep or not glob or not method:
        raise MixError(f"{FLAG} {text!r}: expected GLOB=METHOD, e.g. 'model.layers.0.mlp.down_proj=gptq-int8'")
    check_method(glob, method, methods)
    return glob, method


def check_method(glob: str, method: str, methods) -> None:
    if method not in methods:
        raise MixError(f"{FLAG} {glob}={method}: unknown method {method!r}; choose one of {', '.join(methods)}")


def parse_rules(texts, methods) -> tuple[tuple[str, str], ...]:
    return tuple(parse_rule(t, methods) for t in texts or ())


def matches(glob: str, name: str) -> bool:
    return fnmatchcase(name, glob) or fnmatchcase(name.removesuffix(".weight"), glob)


def method_for(rules, name: str, default: str) -> str:
    """The method of Linear `name`: the first rule whose glob matches it, else `default`."""
    for glob, method in rules:
        if matches(glob, name):
            return method
    return default


def check_rules_match(rules, names) -> None:
    """MixError for the first rule whose glob matches none of `names` (the quantizable Linears of the source)."""
    names = list(names)
    for glob, method in rules:
        if not any(matches(glob, n) for n in names):
            tail = glob.rsplit(".", 1)[-1].strip("*")
            near = [n for n in names if tail and tail in n][:3] or names[:3]
            raise MixError(f"{FLAG} {glob}={method}: the pattern matches none of the {len(names)} non-expert Linears "
                           f"this conversion quantizes (e.g. {', '.join(near)})")

