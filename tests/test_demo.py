"""The README's main job (`make demo` = `python -m ktconvert.default_model.demo`) converts the embedded default model with int4
experts and gptq-int4 GPU layers and generates Python-looking text, as a real subprocess."""
import json
import subprocess
import sys


def test_demo_converts_the_default_model_and_generates(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "ktconvert.default_model.demo", "-o", str(out), "--max-tokens", "24"],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert "$ ktconvert quantize" in r.stderr and "$ ktrun generate" in r.stderr   # the real commands, shown
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"] == "int4-amx"
    assert manifest["gpu_method"] == "gptq-int4"
    assert "generated" in r.stderr and r.stdout.strip(), (r.stdout, r.stderr)
