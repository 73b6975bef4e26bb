"""The product's packages as the tests see them: found on disk, never listed by hand.

The folder of each top-level package comes from setup.py's PACKAGE_DIRS (read as text, not run), and the modules are
found by walking each folder the way Python finds packages (a directory is a package when it has `__init__.py`), so
modules and subpackages can move inside ktconvert/, layouts/ and runtime/ without any test naming them.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def package_dirs(repo: Path = REPO) -> dict[str, Path]:
    """Import name -> folder of each top-level product package, e.g. {"ktlayouts": repo/"layouts", ...}."""
    tree = ast.parse((repo / "setup.py").read_text(), "setup.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PACKAGE_DIRS"
                                                for t in node.targets):
            return {name: repo / folder for name, folder in ast.literal_eval(node.value).items()}
    raise AssertionError("setup.py has no PACKAGE_DIRS = {import name: folder} mapping")


def modules_under(top: str, folder: Path) -> dict[str, Path]:
    """Dotted module name -> .py file for every module of the package `top` rooted at `folder`.

    Only directories with `__init__.py` (below a package) are packages, as for setuptools' find_packages; data
    folders such as ktconvert/data are not. `pkg/__init__.py` is the module `pkg`."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if (here / d / "__init__.py").is_file())
        parts = [top, *here.relative_to(folder).parts]
        for f in sorted(filenames):
            if f.endswith(".py"):
                stem = f[:-3]
                found[".".join(parts if stem == "__init__" else [*parts, stem])] = here / f
    return found


def product_modules(repo: Path = REPO) -> dict[str, Path]:
    """Every module of every product package (ktconvert, ktlayouts, ktrun, ...), found on disk."""
    mods: dict[str, Path] = {}
    for top, folder in package_dirs(repo).items():
        assert (folder / "__init__.py").is_file(), f"{folder}: a product package without __init__.py"
        mods.update(modules_under(top, folder))
    return mods


def pyproject(repo: Path = REPO) -> dict:
    return tomllib.loads((repo / "pyproject.toml").read_text())
