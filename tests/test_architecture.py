"""The import rules of the house (README.md, section "Repository"), enforced on every `make test`.

1. The layer contracts in pyproject.toml ([tool.importlinter]) hold: `lint-imports`, the installed import-linter
   tool, is run on the tree and must keep every contract (ktlayouts imports neither ktconvert nor ktrun; ktrun never
   imports ktconvert; layers ktconvert > ktrun > ktlayouts; no import cycles between sibling modules).
2. Nothing in the product reaches into tests/ or bench/ (they are folders of scripts, not packages, so import-linter
   cannot see them): an AST scan of every product module finds no import of `tests`, `bench`, `conftest` or any
   module or folder found in tests/ or bench/, no import_module("...") or "pkg.mod:attr" string naming one, no
   sys.path edit and no relative import climbing out of its package.
3. Imports made by name at run time (importlib.import_module("..."), LazyGroup's "pkg.mod:attr" strings), which
   import-linter cannot see, follow the same layers.

How a violation was checked (each rule has a test that breaks it on purpose and must see it fail): the three
package folders are copied into tmp_path under their import names (ktconvert/, ktlayouts/ <- layouts/, ktrun/ <-
runtime/), one import that breaks a rule is appended to a module of the copy found by walking it (never named by
hand), and the same check is run on the copy: `lint-imports` with the repository's own pyproject.toml and the copy
on PYTHONPATH must exit non-zero and report the contracts that import breaks as BROKEN, naming the importing module; the AST scans must report the injected line. The untouched copy passes the same checks, so a failure is the
injected line and nothing else.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from product_tree import REPO, modules_under, package_dirs, product_modules, pyproject

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")  # import-linter's command, from the `test` extra


# ---------------------------------------------------------------- 1. import-linter contracts

def importlinter_config() -> dict:
    return pyproject()["tool"]["importlinter"]


def contract_names() -> dict[str, str]:
    """Contract id -> the name lint-imports prints."""
    return {c["id"]: c["name"] for c in importlinter_config()["contracts"]}


def lint_imports(cwd: Path, pythonpath: Path | None = None) -> tuple[int, str, dict[str, str]]:
    """Runs `lint-imports` in cwd (which holds the pyproject.toml it reads): (exit code, output, {name: KEPT|BROKEN})."""
    env = {**os.environ, "COLUMNS": "500"}  # one contract per line, however long its name
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    p = subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    out = p.stdout + p.stderr
    status = {}
    for line in out.splitlines():
        for word in ("KEPT", "BROKEN"):
            if line.rstrip().endswith(" " + word):
                status[line.rstrip()[: -len(word)].strip()] = word
    return p.returncode, out, status


def test_contracts_cover_every_product_package():
    """A new top-level package (found in setup.py) cannot escape the contracts: it must be a root and a layer."""
    cfg = importlinter_config()
    tops = set(package_dirs())
    assert set(cfg["root_packages"]) == tops
    layers = [c for c in cfg["contracts"] if c["type"] == "layers"]
    assert layers and set(layers[0]["layers"]) == tops, layers


def test_runtime_wing_contracts_name_every_module_of_ktrun():
    """The contracts that order ktrun's wings list its children by name: a new module or wing must be added to them
    (or it would escape them), and none may be listed that does not exist."""
    folder = package_dirs()["ktrun"]
    children = {f"ktrun.{p.stem}" for p in folder.glob("*.py") if p.stem not in ("__init__", "__main__")}
    children |= {f"ktrun.{p.name}" for p in folder.iterdir() if (p / "__init__.py").is_file()}
    contracts = {c["id"]: c for c in importlinter_config()["contracts"]}
    front_ends = {"ktrun.cli", "ktrun.serve"}
    assert set(contracts["runtime-front-ends"]["source_modules"]) == children - front_ends
    assert set(contracts["runtime-front-ends"]["forbidden_modules"]) == front_ends
    assert set(contracts["ops-at-the-bottom"]["forbidden_modules"]) == children - {"ktrun.ops"}


def test_lint_imports_keeps_every_contract():
    assert LINT_IMPORTS.is_file(), f"{LINT_IMPORTS} missing: install the test extra (pip install -e '.[test]')"
    rc, out, status = lint_imports(REPO)
    assert rc == 0, out
    assert status == {name: "KEPT" for name in contract_names().values()}, out
    # every product module was analysed, not a stale installed copy of part of it
    assert f"Analyzed {len(product_modules())} files" in out, out


def copy_product(dst: Path) -> dict[str, Path]:
    """Copies every product package's .py files to dst/<import name>/; returns the copy's modules (name -> file)."""
    def not_python(folder, names):
        return [n for n in names if n == "__pycache__" or (not n.endswith(".py") and not Path(folder, n).is_dir())]

    mods: dict[str, Path] = {}
    for top, folder in package_dirs().items():
        shutil.copytree(folder, dst / top, ignore=not_python)
        mods.update(modules_under(top, dst / top))
    return mods


def deepest_module(mods: dict[str, Path], top: str) -> str:
    """A plain module (not a package __init__ or __main__) of `top`, as deep in its subpackages as any."""
    plain = [m for m, f in mods.items() if m.split(".")[0] == top and f.stem not in ("__init__", "__main__")]
    return max(plain, key=lambda m: (m.count("."), m))


def sibling_pair(mods: dict[str, Path]) -> tuple[str, str]:
    """Two plain modules in one package, the deepest such package."""
    by_parent: dict[str, list[str]] = {}
    for m, f in mods.items():
        if f.stem not in ("__init__", "__main__"):
            by_parent.setdefault(m.rsplit(".", 1)[0], []).append(m)
    parent = max((p for p, ms in by_parent.items() if len(ms) >= 2), key=lambda p: (p.count("."), p))
    a, b = sorted(by_parent[parent])[:2]
    return a, b


def append_line(path: Path, line: str) -> int:
    """Appends `line` to a module; returns its line number."""
    text = path.read_text()
    if not text.endswith("\n"):
        text += "\n"
    path.write_text(text + line + "\n")
    return text.count("\n") + 1


def violations_for(case: str, mods: dict[str, Path]) -> tuple[list[tuple[str, str]], set[str], str]:
    """(importer, imported) pairs to inject for one deliberate violation, the contract ids it must break, and the
    module the report must name."""
    if case == "layouts imports converter":
        importer = deepest_module(mods, "ktlayouts")
        return [(importer, "ktconvert")], {"layouts-standalone", "layers"}, importer
    if case == "layouts imports runtime":
        importer = deepest_module(mods, "ktlayouts")
        return [(importer, "ktrun")], {"layouts-standalone", "layers"}, importer
    if case == "runtime imports converter":
        importer = deepest_module(mods, "ktrun")
        return [(importer, deepest_module(mods, "ktconvert"))], {"runtime-without-converter", "layers"}, importer
    if case == "runtime wing imports the command line":
        importer = deepest_module({m: f for m, f in mods.items() if m.startswith("ktrun.experts.")}, "ktrun")
        return [(importer, "ktrun.cli")], {"runtime-front-ends"}, importer
    if case == "ops imports a wing above it":
        importer = deepest_module({m: f for m, f in mods.items() if m.startswith("ktrun.ops.")}, "ktrun")
        return [(importer, "ktrun.experts.residency")], {"ops-at-the-bottom"}, importer
    if case == "import cycle":
        a, b = sibling_pair(mods)
        return [(a, b), (b, a)], {"no-cycles"}, a.rsplit(".", 1)[0]  # reported as a cycle in their package
    raise ValueError(case)


def test_lint_imports_passes_on_an_untouched_copy(tmp_path):
    """The control for the next test: the copy alone breaks nothing."""
    copy_product(tmp_path / "src")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    rc, out, status = lint_imports(tmp_path, pythonpath=tmp_path / "src")
    assert rc == 0 and set(status.values()) == {"KEPT"}, out


@pytest.mark.parametrize("case", ["layouts imports converter", "layouts imports runtime",
                                  "runtime imports converter", "runtime wing imports the command line",
                                  "ops imports a wing above it", "import cycle"])
def test_lint_imports_fails_on_a_deliberate_violation(tmp_path, case):
    mods = copy_product(tmp_path / "src")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    injected, broken_ids, named = violations_for(case, mods)
    for importer, imported in injected:
        append_line(mods[importer], f"import {imported}  # deliberate violation: {case}")
    rc, out, status = lint_imports(tmp_path, pythonpath=tmp_path / "src")
    assert rc != 0, out
    names = contract_names()
    # at least these (a lower-layer violation also breaks, indirectly, every rule of the layers above it)
    assert {names[i] for i in broken_ids} <= {n for n, s in status.items() if s == "BROKEN"}, out
    assert set(status) == set(names.values()), out
    assert named in out, out


# ---------------------------------------------------------------- 2./3. AST scans (what import-linter cannot see)

# "pkg.mod" or "pkg.mod:attr": a module named in a string (LazyGroup's table, entry points)
MODULE_STRING = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_][\w.]*)?")


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def module_refs(module: str, path: Path) -> list[tuple[int, str, str]]:
    """(line, kind, what) for every way `module` (the file `path`) names or reaches another module:
    kind "import" (import statements, relative ones resolved), "by-name" (import_module/__import__ with a literal,
    or the literal head of an f-string), "string" (a "pkg.mod[:attr]" string), "escape" (a relative import above
    the top package), "sys.path" (any edit of sys.path or site.addsitedir)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    package = module.split(".") if path.stem == "__init__" else module.split(".")[:-1]
    refs = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            refs += [(line, "import", a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                refs.append((line, "import", node.module))
            elif node.level > len(package):
                refs.append((line, "escape", "." * node.level + (node.module or "")))
            else:
                base = package[: len(package) - node.level + 1]
                refs.append((line, "import", ".".join([*base, *([node.module] if node.module else [])])))
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.JoinedStr) and arg.values:
                    arg = arg.values[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.strip("."):
                    refs.append((line, "by-name", arg.value.rstrip(".")))
            if (isinstance(fn, ast.Attribute) and _is_sys_path(fn.value)) or name == "addsitedir":
                refs.append((line, "sys.path", ast.unparse(node)))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                    refs.append((line, "sys.path", ast.unparse(node)))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
              and MODULE_STRING.fullmatch(node.value) and ("." in node.value or ":" in node.value)):
            refs.append((line, "string", node.value))
    return refs


def names_in_tests_and_bench(repo: Path = REPO) -> set[str]:
    """Top-level names that resolve into tests/ or bench/: the folders, conftest, and every module and folder in
    them (pytest and `python bench/x.py` put those folders on sys.path, so `import serve_helpers` would work there)."""
    names = {"tests", "bench", "conftest"}
    for folder in ("tests", "bench"):
        for p in (repo / folder).iterdir():
            if p.suffix == ".py":
                names.add(p.stem)
            elif p.is_dir() and p.name.isidentifier() and p.name != "__pycache__":
                names.add(p.name)
    return names


def _top(ref: str) -> str:
    return ref.split(":")[0].split(".")[0]


def reaches_into_tests_or_bench(mods: dict[str, Path], forbidden: set[str]) -> list[str]:
    bad = []
    for module, path in sorted(mods.items()):
        for line, kind, what in module_refs(module, path):
            # a plain dotted string counts only as "tests.x"/"bench.x" or "mod:attr": "config.json" must not
            # clash with a tests/config.py
            named = _top(what) in forbidden and (kind != "string" or ":" in what or _top(what) in ("tests", "bench"))
            if kind in ("sys.path", "escape") or named:
                bad.append(f"{path}:{line}: {module} {kind} {what}")
    return bad


def by_name_against_layers(mods: dict[str, Path]) -> list[str]:
    """Modules named in strings or import_module(...) must sit in the same or a lower layer than the importer."""
    order = next(c for c in importlinter_config()["contracts"] if c["type"] == "layers")["layers"]  # highest first
    bad = []
    for module, path in sorted(mods.items()):
        higher = order[: order.index(module.split(".")[0])]
        for line, kind, what in module_refs(module, path):
            if kind in ("by-name", "string") and _top(what) in higher:
                bad.append(f"{path}:{line}: {module} names {what} ({kind}), a layer above it")
    return bad


def test_product_never_reaches_into_tests_or_bench():
    forbidden = names_in_tests_and_bench()
    assert len(forbidden) > 3, forbidden  # the folders' modules were found
    assert reaches_into_tests_or_bench(product_modules(), forbidden) == []


def test_modules_named_at_run_time_follow_the_layers():
    assert by_name_against_layers(product_modules()) == []


def test_ast_scans_fail_on_deliberate_violations(tmp_path):
    mods = copy_product(tmp_path / "src")
    forbidden = names_in_tests_and_bench()
    assert reaches_into_tests_or_bench(mods, forbidden) == [] and by_name_against_layers(mods) == []  # control

    helper = min(forbidden - {"tests", "bench", "conftest"})   # some module found in tests/ or bench/
    target = mods[deepest_module(mods, "ktconvert")]
    tests_lines = [append_line(target, src) for src in (
        f"import {helper}",
        "from tests import conftest",
        "import bench.bench_x as b",
        f"importlib.import_module('{helper}')",
        "importlib.import_module(f'bench.{name}')",
        f"COMMANDS = {{'x': '{helper}:main'}}",
        "sys.path.insert(0, str(Path(__file__).parents[2] / 'tests'))",
        "sys.path += ['bench']",
        "from .... import tests_escape",
        "HUB_FIXTURE = 'tests.fake_hub'",
    )]
    append_line(target, f"NOT_A_MODULE = '{helper}.json'")  # a file name, allowed even if it shares a helper's stem
    found = reaches_into_tests_or_bench(mods, forbidden)
    assert sorted(int(v.split(":")[1]) for v in found) == tests_lines, found

    converter_module = deepest_module(mods, "ktconvert")
    runtime_file, layouts_file = mods[deepest_module(mods, "ktrun")], mods[deepest_module(mods, "ktlayouts")]
    layer_lines = {
        (runtime_file, append_line(runtime_file, f"LAZY = {{'quantize': '{converter_module}:main'}}")),
        (runtime_file, append_line(runtime_file, "importlib.import_module('ktconvert')")),
        (layouts_file, append_line(layouts_file, "importlib.import_module(f'ktrun.{sub}')")),
        (layouts_file, append_line(layouts_file, f"ENTRY = '{converter_module}'")),
    }
    found = by_name_against_layers(mods)
    assert {(Path(v.split(":")[0]), int(v.split(":")[1])) for v in found} == layer_lines, found
