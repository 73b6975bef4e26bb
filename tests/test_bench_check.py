"""tests/bench_check.py (`make bench-check`, run by `make test` before pytest) fails on a deliberate violation: run as
`make` runs it, on a folder of scripts each breaking one import in its own way, it exits 1 and names every broken
line; on the same folder without them it exits 0. (That bench/ itself passes is `make bench-check`'s job.)"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHECK = Path(__file__).resolve().parent / "bench_check.py"

GOOD = {
    "helper_mod.py": "VALUE = 1\n",
    "bench_good.py": '''
        import json
        from helper_mod import VALUE                       # a sibling script, as `python bench/x.py` finds it
        from ktlayouts.families import parse_config

        def run():
            from ktlayouts import families                 # a submodule named in a from-import
            try:
                import not_installed_anywhere              # optional: guarded by ImportError
            except ImportError:
                pass
            return json, VALUE, parse_config, families

        CHILD = "import sys\\nfrom ktlayouts.families import parse_config\\n"

        if __name__ == "__main__":
            raise SystemExit("main must not run")
    ''',
}
BROKEN = {   # file -> (source, the line numbers the check must name)
    "bench_lazy.py": ('''
        def run():
            from ktrun.models.config import parse_config   # the module was removed
            return parse_config
    ''', [2]),
    "bench_attr.py": ('''
        def run():
            from ktlayouts.families import no_such_name     # the name moved away
            import json
            return no_such_name, json
    ''', [2]),
    "bench_top.py": ('''
        import json
        import ktrun.no_such_wing                           # fails at import time
    ''', [2, 2]),   # once importing the script, once resolving the statement
    "bench_string.py": ('''
        CHILD = """
        import sys
        from ktconvert.no_such_module import convert
        """
    ''', [3]),
}


def write(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        (folder / name).write_text(textwrap.dedent(src).lstrip("\n"))


def run_check(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--no-smoke", str(folder)], capture_output=True, text=True,
                          timeout=300, check=False)


def test_bench_check_passes_good_scripts_and_names_every_broken_import(tmp_path):
    write(tmp_path / "good", GOOD)
    r = run_check(tmp_path / "good")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every import resolves" in r.stdout

    bad_dir = tmp_path / "bad"
    write(bad_dir, {**GOOD, **{name: src for name, (src, _) in BROKEN.items()}})
    r = run_check(bad_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    reported = [line for line in r.stdout.splitlines() if line.startswith(str(bad_dir))]
    for name, (_, lines) in BROKEN.items():
        mine = [int(line.split(":")[1]) for line in reported if line.startswith(f"{bad_dir / name}:")]
        assert sorted(mine) == lines, (name, r.stdout)
    assert not [line for line in reported if "bench_good.py" in line or "helper_mod.py" in line], r.stdout
    assert f"{sum(len(v[1]) for v in BROKEN.values())} failures" in r.stdout
    assert "no attribute or submodule 'no_such_name'" in r.stdout and "ktrun.models.config" in r.stdout
