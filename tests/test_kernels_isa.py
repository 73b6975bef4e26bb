"""One libktkernels for every x86-64 CPU: code compiled with AVX/AVX2/AVX-512/AMX flags lives only in the per-ISA
files' anonymous namespaces (called through the dispatch table when cpuid says so). If a compiler merged an
ISA-flagged copy of a shared inline function into the library, an older CPU would hit an illegal instruction:
this test disassembles the built library and finds every function using VEX/EVEX/AMX instructions."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from ktrun.ops.library import _library_path

FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")
# VEX/EVEX-encoded mnemonics start with "v" (vmovdqu, vpdpbusd, vzeroupper, ...); AMX ones with "tile"/"tdp"/"ldtilecfg".
ISA_INSN = re.compile(r"^\s*[0-9a-f]+:\s+(v[a-z0-9]+|tile[a-z]+|tdp[a-z0-9]+|ldtilecfg|sttilecfg)\b")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_isa_code_only_in_backend_files():
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", _library_path()], capture_output=True,
                         text=True, check=True).stdout
    fn, offenders, isa_functions = "", set(), set()
    for line in asm.splitlines():
        m = FUNC.match(line)
        if m:
            fn = m.group(1)
            continue
        if ISA_INSN.match(line):
            isa_functions.add(fn)
            if "(anonymous namespace)" not in fn:
                offenders.add(fn)
    assert any("qgemm" in f for f in isa_functions), "expected the SIMD kernels in the disassembly"
    assert not offenders, f"functions outside the backend files use AVX/AMX instructions: {sorted(offenders)[:5]}"
