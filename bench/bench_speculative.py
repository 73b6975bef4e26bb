"""Speculative decoding with n-gram drafts (`--speculative ngram`) and, when the conversion has its MTP layer, MTP
drafts (`--speculative mtp`): acceptance rate and decode tokens/s with and without drafts, in one run, alternating
(each repetition runs plain, then each speculative method, so the machine's noise hits all alike), greedy (the run
checks that all give the same tokens).

Scenarios, on the default model's held-out Python source (heldout_eval.txt, not trained on):
- edit: a code-editing prompt: a ~1500-character stretch of the file, then the same stretch again with a few
  identifiers renamed, cut after its first lines; the model continues the edited copy, so most of what it writes
  is in its context already;
- plain: plain continuation of a ~1500-character stretch of the file.
Each method runs twice: with the adaptive draft length (the default: 0 .. k tokens a step, as the measured costs and
the request's acceptance pay for; ktrun.speculative) and with k tokens every step (`_fixed`). Also the cost of the
verify forward: one decode step with 1 + k rows vs 1 row (the same cache), so the break-even acceptance is visible.

    .venv/bin/python bench/bench_speculative.py                    # the embedded default model, converted int4
    .venv/bin/python bench/bench_speculative.py --model-dir converted/ --tg 128 --reps 3 --draft-tokens 4
    .venv/bin/python bench/bench_speculative.py --quick            # seconds: a smoke run
Output: `name: value unit` lines.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # before torch loads, as `ktrun` does (runtime/cli/__init__.py)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULT_MODEL = REPO / "ktconvert" / "data" / "default_model"
HELDOUT = DEFAULT_MODEL / "heldout_eval.txt"
RENAMES = (("context", "ctx"), ("other", "rhs"), ("self", "this"))


def convert_default(work: Path) -> Path:
    out = work / "default-model"
    subprocess.run([str(BIN / "ktconvert"), "quantize", str(DEFAULT_MODEL), "-o", str(out), "--method", "int4-amx",
                    "--gpu-method", "rtn-int4", "--quiet"], check=True, cwd=REPO)
    return out


def model_layers(model_dir: Path) -> set[str]:
    """What kinds of layers a conversion lists: {"mtp"} when its manifest has multi-token-prediction layers."""
    manifest = json.loads((Path(model_dir) / "manifest.json").read_text())
    return {"mtp"} if manifest.get("mtp_layers") else set()


def prompts(chars: int) -> dict[str, str]:
    text = HELDOUT.read_text()
    start = text.index("\nclass ", len(text) // 3)          # a stretch of real code, not the licence header
    block = text[start:start + chars]
    edited = block
    for a, b in RENAMES:
        edited = edited.replace(a, b)
    head = edited[:edited.index("\n", len(edited) // 5) + 1]
    plain_at = text.index("\n    def ", 2 * len(text) // 3)
    return {"edit": block + "\n\n# the same code after renaming:\n" + head, "plain": text[plain_at:plain_at + chars]}


WARM_STEPS = 3   # verify_cost: one-row forwards (rolled back) before each timed forward


def verify_cost(model, ids: list[int], k: int, reps: int) -> tuple[float, float]:
    """Milliseconds of one decode forward with 1 row and with 1 + k rows (medians), as a decode meets them: after the
    prompt, each timed forward follows WARM_STEPS one-row forwards, every forward rolled back (SeqCache.keep) to the
    prompt's end, the two row counts alternated round by round. Timed straight after the prompt instead (each on a
    fresh cache), the forward found its weights and the kernels' state cold from the prefill: on the default model the
    1-row forward took ~1.0 ms there against ~0.28 ms in a decode (Zen 4), which hid most of the extra rows' cost
    (ratios 1.06-1.29x then, ~2.1x in the decode's state). Attention-only models (a recurrent layer's state is
    recorded for drafted positions only, so a 1-row forward could not be rolled back)."""
    from ktrun.generate import prefill, verify

    cache = model.new_cache(len(ids) + k + 2)
    times: dict[int, list[float]] = {1: [], 1 + k: []}
    try:
        prefill(model, cache, ids)
        n = cache.length
        for _ in range(reps):
            for rows, got in times.items():
                for _ in range(WARM_STEPS):
                    verify(model, [(cache, ids[-1:])])
                    cache.keep(n)
                t0 = time.perf_counter()
                verify(model, [(cache, ids[-rows:])])
                got.append(time.perf_counter() - t0)
                cache.keep(n)
    finally:
        cache.release()
    return 1e3 * statistics.median(times[1]), 1e3 * statistics.median(times[1 + k])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="a converted model (default: convert the default)")
    ap.add_argument("--tg", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--chars", type=int, default=1500, help="characters of source per prompt")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the CPU kernels use every core)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: --tg 8 --reps 1 --chars 300")
    a = ap.parse_args(argv)
    if a.quick:
        a.tg, a.reps, a.chars = 8, 1, 300

    import torch
    from ktrun.generate import generate
    from ktrun.loaded_model import load_model
    from ktrun.sampling import SamplingParams
    from ktrun.speculative import SpeculativeConfig

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as work:
        model_dir = a.model_dir or convert_default(Path(work))
        has_mtp = "mtp" in model_layers(model_dir)
        with load_model(model_dir, device="cpu", mtp=has_mtp) as lm:
            # each method with the adaptive draft length (the default) and with draft_tokens every step ("_fixed")
            specs = {"ngram": SpeculativeConfig("ngram", a.draft_tokens),
                     "ngram_fixed": SpeculativeConfig("ngram", a.draft_tokens, policy="fixed")}
            if has_mtp:
                specs["mtp"] = SpeculativeConfig("mtp", a.draft_tokens).with_mtp(lm.mtp)
                specs["mtp_fixed"] = SpeculativeConfig("mtp", a.draft_tokens, policy="fixed").with_mtp(lm.mtp)
            params = SamplingParams(max_tokens=a.tg, ignore_eos=True)
            print(f"model: {model_dir.name}")
            print(f"threads: {a.threads} torch, {os.cpu_count()} cpus")
            print(f"draft_tokens: {a.draft_tokens}")
            print(f"methods: off {' '.join(specs)}" + ("" if has_mtp else " (the conversion has no MTP layer)"))
            for name, text in prompts(a.chars).items():
                ids = lm.tokenizer.encode(text)
                ctx = len(ids) + a.tg + 1
                generate(lm.model, ids, SamplingParams(max_tokens=2), ctx, set())         # warm-up
                rate = {"off": [], **{m: [] for m in specs}}
                counts = {m: dict.fromkeys(("drafted", "accepted", "steps", "tokens"), 0) for m in specs}
                same = True
                for _ in range(a.reps):
                    plain = generate(lm.model, ids, params, ctx, set())
                    rate["off"].append((len(plain.tokens) - 1) / plain.decode_s)
                    for m, spec in specs.items():
                        out = generate(lm.model, ids, params, ctx, set(), speculative=spec)
                        rate[m].append((len(out.tokens) - 1) / out.decode_s)
                        same &= plain.tokens == out.tokens
                        c = counts[m]
                        c["drafted"], c["accepted"] = c["drafted"] + out.drafted, c["accepted"] + out.accepted
                        c["steps"], c["tokens"] = c["steps"] + out.steps - 1, c["tokens"] + len(out.tokens) - 1
                off = statistics.median(rate["off"])
                print(f"{name}_prompt_tokens: {len(ids)} tokens")
                print(f"{name}_decode_off: {off:.2f} tok/s")
                for m, c in counts.items():
                    tag = name if m == "ngram" else f"{name}_{m}"     # the n-gram lines keep their names
                    med = statistics.median(rate[m])
                    print(f"{name}_decode_{m}: {med:.2f} tok/s")
                    print(f"{tag}_speedup: {med / off:.3f} x")
                    print(f"{tag}_acceptance_rate: {c['accepted'] / max(c['drafted'], 1):.4f} ratio")
                    print(f"{tag}_drafted: {c['drafted'] / a.reps:.1f} tokens/run")
                    print(f"{tag}_tokens_per_forward: {c['tokens'] / max(c['steps'], 1):.3f} tokens")
                print(f"{name}_greedy_identical: {int(same)} bool")
                if not same:
                    print(f"error: {name}: speculative greedy tokens differ from plain ones", file=sys.stderr)
                    return 1
            one, many = verify_cost(lm.model, ids, a.draft_tokens, max(3, a.reps))
            print(f"verify_forward_1_row: {one:.2f} ms")
            print(f"verify_forward_{1 + a.draft_tokens}_rows: {many:.2f} ms")
            print(f"verify_cost_ratio: {many / one:.3f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
