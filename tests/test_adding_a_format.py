"""Adding a CPU expert format is one record + its reference pack/unpack + its kernel body (layouts/README.md
"Adding an expert format").

1. A hypothetical weight format (int2, 4 codes per byte) and scale encoding (signed powers of two in one byte, with
   its own reference pack/unpack, a ScaleCodec defined here) are registered at run time, in a fresh interpreter
   before anything reads the registry (the records as if they were written in ktlayouts/expert_formats.py), and
   every derived table picks them up with no other edit: ktlayouts.constants' tables, the --method / --scale-dtype
   choices of `ktconvert quantize` and `inspect`, inspect's byte arithmetic, verify's limits, the manifest geometry,
   the golden-file versions, ConvertOptions' rules, ktrun.ops' ABI code map, and pack/unpack through the module
   functions. What is left is its kernel body: tests/test_kernel_abi_codes.py reports the missing C enumerators.
2. The source tree is scanned for product files that name a format outside the records (ktlayouts/expert_formats.py):
   a string literal equal to a record's name (scale dtype, layout, --method, format name) or an import of a record
   object. Their number is FORMAT_SPECIFIC_FILES, the same number layouts/README.md states.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys

import pytest
from ktlayouts import expert_formats as ef
from ktlayouts.expert_formats import (
    F16_SCALES,
    ExpertFormat,
    LayoutError,
    ScaleEncoding,
    expert_formats,
    registered,
    scale_encoding,
    scale_encodings,
)
from product_tree import REPO, product_modules
from test_kernel_abi_codes import abi_problems, public_enums, scale_type_enum

# product files outside the records that name a CPU expert format (measured; layouts/README.md says the same)
FORMAT_SPECIFIC_FILES = 9

# Record names that are also names in other vocabularies of the product, so a literal of them names no expert
# format: "bf16" is also the dense GPU method (ktconvert.gpu.dense), a hot-expert format (ktlayouts.expert_gpu) and
# an export mode of the experts (ktconvert.export.hf). Checked below.
SHARED_NAMES = {"bf16"}

INT2 = ExpertFormat(name="int2", layout="cpu-expert-int2", methods=("int2-amx",), bits=2, packing="int-tiles",
                    vnni=4, zero_point=2, max_rel_error=0.6, gptq_max_rel_error=0.7)
POW2 = ScaleEncoding(name="pow2", what="power-of-two scales", safetensors_dtype="I8", nbytes=1, layout_version=4,
                     packing="pow2-test", array_dtype="int8", runtime_name="pow2", abi_name="Pow2", abi_code=4)

# Runs in a fresh interpreter: the records registered before ktlayouts.constants derives its tables (its reload stands
# for the records being in expert_formats.py), the codec of the new packing defined as a format module would.
SCRIPT = r'''
import importlib, sys
import numpy as np
import ktlayouts.constants
from ktlayouts import expert_formats as ef
INT2 = ef.register(ef.ExpertFormat(**{INT2}))
POW2 = ef.register(ef.ScaleEncoding(**{POW2}))
importlib.reload(ktlayouts.constants)

from ktlayouts import constants as C
from ktlayouts.cpu_expert import (FloatScales, MatrixGeometry, pack_codes, pack_expert_matrix, pack_scales,
                                  unpack_codes, unpack_expert_matrix, unpack_scales)


class Pow2Scales(FloatScales, packing="pow2-test"):
    """sign x 2^e, e in [-63, 63], stored as the int8 sign x (e + 64); 0 as 0."""

    def _store(self, s):
        e = np.clip(np.rint(np.log2(np.abs(s), out=np.zeros_like(s), where=s != 0)), -63, 63)
        return np.where(s == 0, 0, np.sign(s) * (e + 64)).astype(np.int8)

    def _load(self, a):
        a = a.astype(np.float32)
        return np.where(a == 0, 0, np.sign(a) * np.exp2(np.abs(a) - 64)).astype(np.float32)


# ktlayouts.constants
assert C.CPU_EXPERT_LAYOUTS["cpu-expert-int2"] == (2, 2), C.CPU_EXPERT_LAYOUTS
assert C.METHOD_TO_LAYOUT["int2-amx"] == "cpu-expert-int2" and C.ZERO_POINT[2] == 2
assert C.SCALE_DTYPES["pow2"] == "I8" and C.SCALE_DTYPE_BYTES["pow2"] == 1
assert C.SCALE_DTYPES_OF_VERSION[4] == ("pow2",) and 4 in C.CPU_EXPERT_LAYOUT_VERSIONS
assert C.scale_layout_version("pow2") == 4 and C.scale_dtype_bits("pow2") == (2, 4, 8)
assert C.scale_dtype_bits("f16") == (2, 4, 8) and C.scale_dtype_bits("sub6") == (4,)

# the command line's choices and verify's limits
from ktconvert.cmd_inspect import expert_bytes_per_method, inspect
from ktconvert.cmd_quantize import quantize
from ktconvert.cmd_verify import DEFAULT_MAX_REL_ERROR, GPTQ_EXPERT_MAX_REL_ERROR, _limits_help


def choices(cmd, name):
    return next(p for p in cmd.params if p.name == name).type.choices


assert "int2-amx" in choices(quantize, "method") and "pow2" in choices(quantize, "scale_dtype")
assert "pow2" in choices(inspect, "scale_dtype")
assert DEFAULT_MAX_REL_ERROR["int2-amx"] == 0.6 and GPTQ_EXPERT_MAX_REL_ERROR["int2-amx"] == 0.7
assert "int2 0.6" in _limits_help()

# inspect's bytes: per expert 3 H I weights of 2 bits, and one 1-byte scale per group of 64
E, H, I, G = 4, 128, 64, 64
got = expert_bytes_per_method({"n_experts": E, "hidden": H, "intermediate": I, "moe_layers": (1,)}, G, "pow2")
assert got["int2-amx"] == E * (3 * H * I * 2 // 8 + 3 * H * I // G * 1), got
assert got["int4-amx"] == E * (3 * H * I * 4 // 8 + 3 * H * I // G * 1), got

# the manifest's geometry, the golden files' versions, the converter's options
from ktlayouts.converted_dir import ExpertGeometry
from ktlayouts.write_golden import written_versions
from ktconvert.convert_plan import ConvertError
from ktconvert.pipeline import ConvertOptions

geo = ExpertGeometry(method="int2-amx", group_size=32, n_experts=E, hidden=H, intermediate=I, numa_nodes=1,
                     moe_layers=(1,), scale_dtype="pow2")
j = geo.to_json()
assert (j["layout"], j["layout_version"], j["bits"]) == ("cpu-expert-int2", 4, 2), j
assert ExpertGeometry.from_json(j) == geo
assert {d for _, d in geo.expert_tensor_shapes(0).values()} == {"U8", "I8"}
assert written_versions("cpu-expert-int2") == [(1, ("f32",)), (2, ("f16", "bf16")), (4, ("pow2",))]
assert (4, ("pow2",)) in written_versions("cpu-expert-int4")
ConvertOptions(method="int2-amx", scale_dtype="pow2")
try:
    ConvertOptions(method="int2-amx", scale_dtype="sub6")
    raise AssertionError("two-level scales taken for int2")
except ConvertError as e:
    assert "--method int4-amx" in str(e), e

# ktrun's ABI code map
from ktrun.ops.library import SCALE_DTYPE_CODES
assert SCALE_DTYPE_CODES["pow2"] == 4

# the reference pack/unpack through the module functions
rng = np.random.default_rng(0)
geom = MatrixGeometry(20, 136, 2, 32, "pow2")
w = rng.standard_normal((20, 136)).astype(np.float32)
qweight, scales = pack_expert_matrix(w, geom)
assert qweight.shape == geom.qweight_shape == (2, 3, 256) and scales.shape == geom.scales_shape
assert scales.dtype == np.int8 and qweight.nbytes + scales.nbytes == geom.qweight_nbytes + geom.scales_nbytes
codes = unpack_codes(qweight, geom)
assert codes.max() <= 3 and np.array_equal(pack_codes(codes, geom), qweight)
s = unpack_scales(scales, geom)
assert np.array_equal(pack_scales(s, geom), scales)
assert np.all((s == 0) | (np.exp2(np.rint(np.log2(np.abs(s) + (s == 0)))) == np.abs(s)))
w_hat = unpack_expert_matrix(qweight, scales, geom)
want = (codes.astype(np.float32) - 2) * np.repeat(s, 32, axis=1)
assert np.array_equal(w_hat, want[:20, :136])
assert np.linalg.norm(w_hat - w) / np.linalg.norm(w) < 1
print("ok")
'''


def _kwargs(record) -> str:
    return repr(dataclasses.asdict(record))


def test_a_registered_format_reaches_every_derived_table():
    script = SCRIPT.replace("{INT2}", _kwargs(INT2)).replace("{POW2}", _kwargs(POW2))
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


def test_what_is_left_is_the_kernel_body():
    """The kernel ABI check names the new scale encoding's missing C enumerators (kScalePow2, KT_POW2)."""
    problems = abi_problems([POW2], scale_type_enum(), public_enums())
    assert len(problems) == 2 and all("kScalePow2" in p or "KT_POW2" in p for p in problems), problems


def test_registration_is_temporary_and_refuses_clashes():
    with registered(INT2, POW2):
        assert scale_encoding("pow2") is POW2 and INT2 in expert_formats()
        assert ef.expert_format_of_method("int2-amx") is INT2
        assert ef.layout_records("cpu-expert-int2", 4) == (INT2, (POW2,))
    assert POW2 not in scale_encodings() and INT2 not in expert_formats()
    with pytest.raises(LayoutError):
        scale_encoding("pow2")
    for clash in (dataclasses.replace(POW2, abi_code=F16_SCALES.abi_code), dataclasses.replace(POW2, name="f16"),
                  dataclasses.replace(INT2, bits=4), dataclasses.replace(INT2, methods=("int4-amx",))):
        with pytest.raises(ValueError, match="already registered"):
            ef.register(clash)
    assert len(scale_encodings()) == 4 and len(expert_formats()) == 3


# --- the count ------------------------------------------------------------------------------------------------------

def record_objects() -> set[str]:
    """Names of the record objects in ktlayouts.expert_formats (INT4, F16_SCALES, ...)."""
    return {n for n, v in vars(ef).items() if isinstance(v, ScaleEncoding | ExpertFormat)}


def format_literals() -> set[str]:
    """Every name a record gives a format, but those shared with other vocabularies."""
    names = {r.name for r in scale_encodings()}
    for f in expert_formats():
        names |= {f.name, f.layout, *f.methods}
    return names - SHARED_NAMES


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def format_specific_files() -> dict[str, list[str]]:
    """Product file (relative path) -> what in it names a format: a string literal equal to a format name (docstrings
    aside; text in messages is not a literal of the name) or a record object imported from expert_formats."""
    literals, records = format_literals(), record_objects()
    found = {}
    for module, path in product_modules().items():
        if module == "ktlayouts.expert_formats":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        what = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in literals \
                    and id(node) not in docs:
                what.add(repr(node.value))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith("expert_formats"):
                what |= {a.name for a in node.names if a.name in records}
            elif isinstance(node, ast.Attribute) and node.attr in records:
                what.add(node.attr)
        if what:
            found[str(path.relative_to(REPO))] = sorted(what)
    return found


def test_shared_names_belong_to_other_vocabularies():
    from ktlayouts.expert_gpu import HOT_FORMATS

    from ktconvert.export.hf import EXPERT_MODES
    from ktconvert.gpu.dense import DENSE_ENCODERS

    for name in SHARED_NAMES:
        assert name in EXPERT_MODES and name in DENSE_ENCODERS and name in HOT_FORMATS, name


def test_the_scan_sees_a_literal_and_a_record():
    tree = ast.parse('"""doc: sub6"""\nfrom ktlayouts.expert_formats import SUB6_SCALES\nx = y == "sub6"\n')
    assert "sub6" in format_literals() and "SUB6_SCALES" in record_objects()
    assert sum(isinstance(n, ast.Constant) and n.value == "sub6" and id(n) not in _docstrings(tree)
               for n in ast.walk(tree)) == 1


def test_format_specific_files_are_counted_and_the_readme_says_how_many():
    found = format_specific_files()
    listing = "\n".join(f"  {f}: {', '.join(w)}" for f, w in sorted(found.items()))
    assert len(found) == FORMAT_SPECIFIC_FILES, (
        f"{len(found)} product files name an expert format outside ktlayouts/expert_formats.py (expected "
        f"{FORMAT_SPECIFIC_FILES}); read the format from its record instead, or update FORMAT_SPECIFIC_FILES and "
        f"layouts/README.md 'Adding an expert format':\n{listing}")
    readme = (REPO / "layouts" / "README.md").read_text()
    section = readme.split("## Adding an expert format", 1)
    assert len(section) == 2, "layouts/README.md has no section 'Adding an expert format'"
    m = re.search(r"\*\*(\d+)\*\* product files", section[1])
    assert m and int(m.group(1)) == FORMAT_SPECIFIC_FILES, "layouts/README.md states another count"
    for f in found:
        assert f"`{f}`" in section[1], f"layouts/README.md 'Adding an expert format' does not list {f}"
