"""The wheel a user installs: every package found on disk is in it, it carries the kernel library and the package
data pyproject.toml promises, and every module imports from it alone.

The wheel is built once for this file by pip (`pip wheel . --no-deps --no-build-isolation`, which compiles kernels/
with CMake) from a copy of what a clone holds (git's tracked and not-ignored files, so no in-place .so or build/
leftovers can stand in for what the build must produce), then unpacked. The expected modules are found by walking
the source folders for `__init__.py`, independently of setup.py's find_packages, so a subpackage that setup.py
fails to discover is missing from the wheel and fails here.
"""
from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from product_tree import REPO, package_dirs, product_modules, pyproject


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """{"src": the copied checkout, "site": the unpacked wheel, "root": their parent}."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():  # a tracked file deleted in the work tree is not there to copy
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, src / rel)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
                        "--no-cache-dir", "-q", "-w", str(root / "dist")],
                       cwd=src, capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    (whl,) = (root / "dist").glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        z.extractall(root / "site")
    return {"src": src, "site": root / "site", "root": root}


def wheel_path(module: str, file: Path) -> str:
    return "/".join(module.split(".")) + ("/__init__.py" if file.stem == "__init__" else ".py")


def test_wheel_holds_exactly_the_source_modules(built):
    site = built["site"]
    expected = {wheel_path(m, f) for m, f in product_modules(built["src"]).items()}
    in_wheel = {p.relative_to(site).as_posix() for p in site.rglob("*.py")}
    assert expected - in_wheel == set(), "modules missing from the wheel"
    assert in_wheel - expected == set(), "modules in the wheel that the source tree does not have"


def test_wheel_holds_the_kernel_library_and_the_package_data(built):
    src, site = built["src"], built["site"]
    folders = package_dirs(src)
    promised = pyproject(src)["tool"]["setuptools"]["package-data"]
    assert set(promised) <= set(folders), promised
    for package, patterns in promised.items():
        for pattern in patterns:
            in_source = {p.relative_to(folders[package]) for p in folders[package].glob(pattern) if p.is_file()}
            in_wheel = {p.relative_to(site / package) for p in (site / package).glob(pattern) if p.is_file()}
            assert in_wheel, f"package-data {package}: {pattern!r} matches nothing in the wheel"
            assert in_source - in_wheel == set(), f"package-data {package}: {pattern!r} not all in the wheel"
    # and nothing a clone holds in a package folder is left behind (a data file nobody promised would be)
    for package, folder in folders.items():
        in_clone = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
        in_wheel = {p.relative_to(site / package) for p in (site / package).rglob("*") if p.is_file()}
        assert in_clone - in_wheel == set(), f"{folder.name}/ files missing from the wheel's {package}/"
    assert list((site / "ktrun" / "ops").glob("libktkernels*.so")), "the kernel library is not in the wheel"


# Runs with `python -I -S`: no PYTHONPATH, no user site, no current directory and no .pth files (so not the
# editable install's finder) - only the unpacked wheel, then the interpreter's site-packages for dependencies.
IMPORT_ALL = textwrap.dedent("""
    import ctypes, importlib, json, runpy, sys
    from pathlib import Path
    site, deps, modules, mains, entry_points = json.loads(sys.argv[1])
    sys.path[:0] = [site]
    sys.path += deps
    result = {"outside": [], "mains": {}, "entry_points": {}, "libraries": {}}
    for name in modules:
        mod = importlib.import_module(name)
        if not Path(mod.__file__).resolve().is_relative_to(Path(site).resolve()):
            result["outside"].append(f"{name}: {mod.__file__}")
    for name, target in entry_points.items():
        mod_name, attr = target.split(":")
        result["entry_points"][name] = callable(getattr(importlib.import_module(mod_name), attr))
    for so in sorted(Path(site).rglob("*.so")):
        lib = ctypes.CDLL(str(so))
        result["libraries"][str(so.relative_to(site))] = lib.kt_abi_version() if hasattr(lib, "kt_abi_version") else None
    for package in mains:  # `python -m package --help`
        sys.argv = [package, "--help"]
        try:
            runpy.run_module(package, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
        result["mains"][package] = code
    print("RESULT " + json.dumps(result))
""")


def test_every_module_imports_from_the_wheel_alone(built):
    site = built["site"]
    mods = product_modules(built["src"])
    plain = sorted(m for m, f in mods.items() if f.stem != "__main__")
    mains = sorted(m.rsplit(".", 1)[0] for m, f in mods.items() if f.stem == "__main__")
    (dist_info,) = site.glob("*.dist-info")
    eps = configparser.ConfigParser()
    eps.read(dist_info / "entry_points.txt")
    scripts = dict(eps["console_scripts"]) if eps.has_section("console_scripts") else {}
    # dependencies (torch, click, ...) from this interpreter's site-packages; their .pth files stay unread, so the
    # editable install of this checkout (a .pth-installed finder) is not there
    deps = [p for p in sys.path if Path(p).name == "site-packages"]
    arg = json.dumps([str(site), deps, plain, mains, scripts])
    p = subprocess.run([sys.executable, "-I", "-S", "-c", IMPORT_ALL, arg], cwd=built["root"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    result = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert result["outside"] == [], "modules imported from outside the wheel"
    assert scripts and all(result["entry_points"].values()), result["entry_points"]
    assert result["mains"] == {m: 0 for m in mains}, result["mains"]
    kernels = {so: abi for so, abi in result["libraries"].items() if so.startswith("ktrun/")}
    assert kernels and all(isinstance(abi, int) and abi > 0 for abi in kernels.values()), result["libraries"]
