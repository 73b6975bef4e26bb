"""The kernel ABI's codes, Python against C, read as text (no compiler, no library needed).

ktrun.ops.library.SCALE_DTYPE_CODES is derived from ktlayouts' scale encoding records (ScaleEncoding.abi_name,
abi_code); the kernels define the same codes twice: `enum ScaleType` in kernels/src/scale_types.h
(kScale<abi_name>) and the public `KT_<ABI_NAME>` enum of kernels/include/ktkernels.h. Every record must have both,
with its code, and every C scale type must have a record; a record without a C counterpart (a format registered
without its kernel body) fails here. The expert activation codes (ACTIVATION_CODES, KT_ACT_*), the codes layouts
(CODES_U8 / CODES_PACKED_K, KT_CODES_*) and the ABI version are checked the same way.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ktlayouts.expert_formats import F16_SCALES, ScaleEncoding, scale_encodings
from ktlayouts.families import ExpertActivation
from ktrun.ops import library
from ktrun.ops.linear import CODES_PACKED_K, CODES_U8

REPO = Path(__file__).resolve().parents[1]
SCALE_TYPES_H = REPO / "kernels" / "src" / "scale_types.h"
KTKERNELS_H = REPO / "kernels" / "include" / "ktkernels.h"


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL))


def c_enums(text: str) -> list[tuple[str, dict[str, int]]]:
    """Every `enum [Name] [: type] { A = 0, B = 1, ... };` of a C / C++ header: [(name or "", {enumerator: value})].
    Enumerators without an explicit value count on from the previous one, as in C."""
    out = []
    for m in re.finditer(r"\benum\s+(\w*)\s*(?::\s*\w+\s*)?\{([^}]*)\}", _strip_comments(text)):
        values, nxt = {}, 0
        for item in (x.strip() for x in m.group(2).split(",")):
            if not item:
                continue
            name, _, value = (p.strip() for p in item.partition("="))
            nxt = int(value, 0) if value else nxt
            values[name] = nxt
            nxt += 1
        out.append((m.group(1), values))
    return out


def scale_type_enum(text: str | None = None) -> dict[str, int]:
    """kernels/src/scale_types.h's `enum ScaleType`."""
    found = [v for name, v in c_enums(SCALE_TYPES_H.read_text() if text is None else text) if name == "ScaleType"]
    assert len(found) == 1, f"{SCALE_TYPES_H}: expected one `enum ScaleType {{...}}`, found {len(found)}"
    return found[0]


def public_enums(text: str | None = None) -> dict[str, int]:
    """Every enumerator of kernels/include/ktkernels.h."""
    out: dict[str, int] = {}
    for _, values in c_enums(KTKERNELS_H.read_text() if text is None else text):
        out.update(values)
    return out


def c_names(record: ScaleEncoding) -> tuple[str, str]:
    """The record's two C names: kScale<abi_name> (scale_types.h), KT_<ABI_NAME> (ktkernels.h)."""
    return f"kScale{record.abi_name}", f"KT_{record.abi_name.upper()}"


def abi_problems(records, scale_types: dict[str, int], public: dict[str, int]) -> list[str]:
    """What does not match between scale encoding records and the C enums: a record whose C names are missing (no
    kernel body for it) or hold another code. Empty when all agree."""
    problems = []
    for r in records:
        for name, table, where in zip(c_names(r), (scale_types, public), (SCALE_TYPES_H, KTKERNELS_H)):
            if name not in table:
                problems.append(f"scale dtype {r.name}: no {name} in {where.relative_to(REPO)} (its kernel body)")
            elif table[name] != r.abi_code:
                problems.append(f"scale dtype {r.name}: {name} = {table[name]} in {where.relative_to(REPO)}, the "
                                f"record says {r.abi_code}")
    return problems


def test_scale_dtype_codes_come_from_the_records():
    assert library.SCALE_DTYPE_CODES == {r.runtime_name: r.abi_code for r in scale_encodings()}
    assert len(set(library.SCALE_DTYPE_CODES.values())) == len(library.SCALE_DTYPE_CODES)


def test_every_record_has_its_c_enumerators_with_its_code():
    assert abi_problems(scale_encodings(), scale_type_enum(), public_enums()) == []


def test_every_c_scale_type_has_a_record():
    by_enum = {c_names(r)[0]: r for r in scale_encodings()}
    assert set(scale_type_enum()) == set(by_enum), "a kScale* of scale_types.h without a ScaleEncoding record"
    public_scale_enum = next(v for _, v in c_enums(KTKERNELS_H.read_text()) if "KT_F32" in v)
    assert set(public_scale_enum) == {c_names(r)[1] for r in scale_encodings()}, \
        "ktkernels.h's dtype enum (KT_F32 ...) and the scale encoding records differ"


def test_a_record_without_kernel_body_or_with_another_code_fails():
    orphan = dataclasses.replace(F16_SCALES, name="f8", abi_name="F8", abi_code=7, runtime_name="float8")
    problems = abi_problems([orphan], scale_type_enum(), public_enums())
    assert len(problems) == 2 and all("no kScaleF8" in p or "no KT_F8" in p for p in problems), problems
    moved = dataclasses.replace(F16_SCALES, abi_code=5)
    problems = abi_problems([moved], scale_type_enum(), public_enums())
    assert len(problems) == 2 and all("the record says 5" in p for p in problems), problems


def test_the_parser_reads_what_c_reads():
    text = "/* x */ enum Foo : int { kA = 0, kB, // c\n kC = 0x10, kD };\nenum { X_1 = 3 };"
    assert c_enums(text) == [("Foo", {"kA": 0, "kB": 1, "kC": 16, "kD": 17}), ("", {"X_1": 3})]


def test_activation_codes_match_kt_act():
    public = public_enums()
    c_act = {k: v for k, v in public.items() if k.startswith("KT_ACT_")}
    assert {f"KT_ACT_{kind.upper()}": code for kind, code in library.ACTIVATION_CODES.items()} == c_act
    assert set(library.ACTIVATION_CODES) == set(ExpertActivation.KINDS)


def test_codes_layouts_and_abi_version_match():
    public = public_enums()
    assert (CODES_U8, CODES_PACKED_K) == (public["KT_CODES_U8"], public["KT_CODES_PACKED_K"])
    m = re.search(r"#define\s+KT_ABI_VERSION\s+(\d+)", KTKERNELS_H.read_text())
    assert m and int(m.group(1)) == library.ABI_VERSION
