"""The benchmark scripts still import and run (`make bench-check`, part of `make test`): nothing else imports bench/,
so a module they name can move or vanish without any test noticing.

    python tests/bench_check.py [--no-smoke] [FOLDER]   # default: bench/ of this checkout; exit 1 on any failure

1. Import check, for every FOLDER/*.py, with FOLDER first on sys.path (as `python bench/x.py` has it):
   - the script is imported as a module under its own name, so `if __name__ == "__main__":` does not run;
   - every import statement in it, at any depth (inside functions too: most benchmarks import ktrun lazily), is
     resolved: `import a.b` imports a.b; `from a.b import x` imports a.b and finds x in it, as an attribute or a
     submodule. Relative imports fail (bench/ is no package);
   - imports of the product packages (ktconvert, ktlayouts, ktrun) inside string constants that are Python code
     (the child scripts some benchmarks run with `python -c`) are resolved the same way.
   An import inside `try:` whose handler catches ImportError (or ModuleNotFoundError, Exception) is optional and may
   fail. Each failure is printed as `path:line: what failed`.
2. Smoke runs (FOLDER = bench/ only, unless --no-smoke): the scripts in SMOKE that have a seconds-sized mode run as
   `python bench/x.py ARGS` subprocesses and must exit 0 (their output is shown only when they fail). The heavier
   ones are run by their own tests (tests/test_bench_*.py) or by `make bench`.
"""
from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import time
import traceback
from pathlib import Path

PRODUCT = ("ktconvert", "ktlayouts", "ktrun")
BENCH = Path(__file__).resolve().parents[1] / "bench"
# script -> arguments of a run of a few seconds (2 shared cores: about 25 s for all of them)
SMOKE = {
    "bench_kv_blocks.py": ["--parts", "layer", "--layer-ctx", "64", "--layer-steps", "1", "--rounds", "1"],
    "bench_moe_kernels.py": ["--budget-gb", "0.02", "--tokens", "1", "--threads", "1", "--bits", "4", "--scales", "f32",
                             "--reps", "1"],
    "bench_mla_absorbed.py": ["--bits", "4", "--copies", "1", "--reps", "1", "--rounds", "1"],
    "bench_decode.py": ["--layers", "1", "--experts", "8", "--heads", "4", "--tg", "2", "--pp", "4", "--reps", "1"],
    "bench_scale_search.py": ["--rows", "64", "--rounds", "1", "--torch-rows", "16"],
    "bench_decode_glue.py": ["--head-rows", "256", "--head-tokens", "1", "--positions", "16", "--rounds", "1"],
}
SMOKE_TIMEOUT_S = 300
OPTIONAL_HANDLERS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in OPTIONAL_HANDLERS for t in types)


def import_nodes(tree: ast.AST) -> list[tuple[ast.stmt, bool]]:
    """Every Import / ImportFrom in tree, with whether it is optional (in a try that catches ImportError)."""
    found: list[tuple[ast.stmt, bool]] = []

    def walk(node: ast.AST, optional: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, optional))
        if isinstance(node, ast.Try):
            guarded = optional or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                walk(child, guarded)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                walk(child, optional)
            return
        for child in ast.iter_child_nodes(node):
            walk(child, optional)

    walk(tree, False)
    return found


def embedded_code(tree: ast.AST) -> list[tuple[int, ast.AST]]:
    """(line, parsed tree) of every string constant that is Python code importing a product package."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                sub = ast.parse(node.value)
            except SyntaxError:
                continue
            out.append((node.lineno, sub))
    return out


def resolve(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Imports what the statement imports; returns a message per name that does not resolve."""
    bad = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            try:
                importlib.import_module(alias.name)
            except Exception as e:  # noqa: BLE001 - any failure to import is what this check reports
                bad.append(f"import {alias.name}: {type(e).__name__}: {e}")
        return bad
    if node.level:
        return [f"from {'.' * node.level}{node.module or ''} import ...: relative import in a folder of scripts"]
    try:
        mod = importlib.import_module(node.module)
    except Exception as e:  # noqa: BLE001
        return [f"from {node.module} import ...: {type(e).__name__}: {e}"]
    for alias in node.names:
        if alias.name == "*" or hasattr(mod, alias.name):
            continue
        try:
            importlib.import_module(f"{node.module}.{alias.name}")
        except ModuleNotFoundError:
            bad.append(f"from {node.module} import {alias.name}: {node.module} has no attribute or submodule "
                       f"{alias.name!r}")
        except Exception as e:  # noqa: BLE001
            bad.append(f"from {node.module} import {alias.name}: {type(e).__name__}: {e}")
    return bad


def _top(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    return {(node.module or "").split(".")[0]} if not node.level else {""}


def check_script(path: Path) -> list[str]:
    """Failures of one script (empty: it imports, and every import in it resolves)."""
    bad = []
    try:
        importlib.import_module(path.stem)
    except BaseException as e:  # noqa: BLE001 - SystemExit at import time is a failure too
        mine = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        bad.append(f"{path}:{mine[-1] if mine else 1}: importing it as a module: {type(e).__name__}: {e}")
    tree = ast.parse(path.read_text(), str(path))
    for node, optional in import_nodes(tree):
        if not optional:
            bad += [f"{path}:{node.lineno}: {msg}" for msg in resolve(node)]
    for line, sub in embedded_code(tree):
        for node, optional in import_nodes(sub):
            if not optional and _top(node) & set(PRODUCT):
                bad += [f"{path}:{line + node.lineno - 1}: (in a code string) {msg}" for msg in resolve(node)]
    return bad


def check_folder(folder: Path) -> list[str]:
    folder = folder.resolve()
    sys.path.insert(0, str(folder))
    bad = []
    for path in sorted(folder.glob("*.py")):
        bad += check_script(path)
    return bad


def smoke_runs(folder: Path) -> list[str]:
    """Runs each SMOKE script of folder; a failure message (with the end of its output) per run that fails."""
    bad = []
    for script, args in SMOKE.items():
        cmd = [sys.executable, str(folder / script), *args]
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, check=False)
            rc, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            rc, out = f"timeout after {SMOKE_TIMEOUT_S} s", str(e.stdout or "") + str(e.stderr or "")
        line = f"{folder / script} {' '.join(args)} ({time.monotonic() - t0:.1f} s)"
        if rc == 0:
            print(f"smoke ok: {line}")
        else:
            tail = "\n".join(out.splitlines()[-30:])
            bad.append(f"{folder / script}:1: smoke run failed (exit {rc}): {line}\n{tail}")
    return bad


def main(argv: list[str]) -> int:
    smoke = "--no-smoke" not in argv
    args = [a for a in argv if a != "--no-smoke"]
    folder = Path(args[0]).resolve() if args else BENCH
    scripts = sorted(folder.glob("*.py"))
    if not scripts:
        print(f"bench check: no *.py in {folder}")
        return 1
    t0 = time.monotonic()
    bad = check_folder(folder)
    for line in bad:
        print(line)
    print(f"bench import check: {len(scripts)} scripts in {folder}, "
          + (f"{len(bad)} failures" if bad else "every import resolves") + f" ({time.monotonic() - t0:.1f} s)")
    if smoke and folder == BENCH:
        failed = smoke_runs(folder)
        for line in failed:
            print(line)
        bad += failed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.pop(0)   # this script's folder (tests/): bench scripts must not resolve imports through it
    sys.exit(main(sys.argv[1:]))
