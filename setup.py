"""Builds the C++ kernel library in kernels/ with CMake as part of `pip install` (no manual step).

The shared library is placed in `ktrun.ops` (runtime/ops/) and loaded with ctypes by ktrun.ops.library.
"""
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


# import name -> folder. Import names are specific: `layouts/` installs as `ktlayouts`, `runtime/` as `ktrun`.
PACKAGE_DIRS = {"ktconvert": "ktconvert", "ktlayouts": "layouts", "ktrun": "runtime"}


def discover_packages() -> list[str]:
    """Every package under each folder (found, not listed by hand), under its import name."""
    return [name for top, folder in PACKAGE_DIRS.items()
            for name in [top, *(f"{top}.{sub}" for sub in find_packages(str(ROOT / folder)))]]


class CMakeLibrary(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = source_dir


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeLibrary) -> None:
        build_dir = Path(self.build_temp).resolve() / "kernels"
        jobs = str(os.cpu_count() or 2)
        cfg = os.environ.get("KT_BUILD_TYPE", "Release")
        subprocess.check_call(["cmake", "-S", str(ext.source_dir), "-B", str(build_dir),
                               f"-DCMAKE_BUILD_TYPE={cfg}", "-DKT_BUILD_TESTS=OFF"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs, "--target", "ktkernels"])
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        # copy then rename: a process that has the old library mapped keeps its (unchanged) inode
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(build_dir / "libktkernels.so", tmp)
        os.replace(tmp, dest)


setup(packages=discover_packages(), package_dir=PACKAGE_DIRS,
      ext_modules=[CMakeLibrary("ktrun.ops.libktkernels", ROOT / "kernels")], cmdclass={"build_ext": CMakeBuild})
