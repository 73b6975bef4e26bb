"""`ktrun generate` / `ktrun bench` as real subprocesses, and bad input refused before any generation."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from ktrun.loader import LoadError, load_converted
from runtime_helpers import (
    KTRUN,
    PROMPT,
    build_checkpoint,
    converted,
    greedy_gaps,
    reference_logits,
    shared_root,
    transformers_model,
    transformers_tokenizer,
)

GAP = 3e-2   # default backend may be the bf16 kernels (activations rounded to bf16); see test_runtime_models


def ktrun(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*KTRUN, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    src = build_checkpoint(shared_root(tmp_path_factory), "deepseek_v3")
    return src, converted(tmp_path_factory, "deepseek_v3", "bf16")


@pytest.fixture(scope="module")
def plain_json(v3):
    """`ktrun generate --json` of PROMPT: 10 greedy tokens."""
    r = ktrun("generate", v3[1], "--prompt", PROMPT, "--max-tokens", 10, "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_json_matches_transformers(v3, plain_json):
    src, conv = v3
    out = plain_json
    assert set(out) >= {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    tok = transformers_tokenizer(src)
    assert out["prompt_token_ids"] == tok(PROMPT).input_ids          # BOS included, as transformers adds it
    gen = out["token_ids"]
    assert len(gen) == 10 and out["finish_reason"] == "length"
    gaps = greedy_gaps(reference_logits(transformers_model(src), out["prompt_token_ids"] + gen), len(
        out["prompt_token_ids"]), gen)
    assert max(gaps) <= GAP, gaps
    assert out["text"] == tok.decode(gen, skip_special_tokens=True)
    # streamed text mode prints the same continuation
    r2 = ktrun("generate", conv, "--prompt", PROMPT, "--max-tokens", 10, "--ignore-eos")
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout == out["text"] + "\n"
    assert "10 generated" in r2.stderr


def test_generate_stop_string(v3, plain_json):
    """--stop ends generation at the token that completes the stop string; the text ends before it, streamed or not."""
    full = plain_json["text"]
    i = next(i for i in range(2, len(full)) if full[i].isalnum() and full[i] not in full[:i])
    stop = full[i]
    r = ktrun("generate", v3[1], "--prompt", PROMPT, "--max-tokens", 10, "--ignore-eos", "--json", "--stop", stop)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["text"], out["finish_reason"]) == (full[:i], "stop")
    assert out["token_ids"] == plain_json["token_ids"][: len(out["token_ids"])] and len(out["token_ids"]) < 10
    r2 = ktrun("generate", v3[1], "--prompt", PROMPT, "--max-tokens", 10, "--ignore-eos", "--stop", stop)
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout == full[:i] + "\n" and "finish: stop" in r2.stderr


def test_generate_stops_at_ctx(v3, plain_json):
    """--ctx bounds prompt + generated tokens: generation ends with "length" when the context is full."""
    n = len(plain_json["prompt_token_ids"])
    r = ktrun("generate", v3[1], "--prompt", PROMPT, "--max-tokens", 10, "--ignore-eos", "--json", "--ctx", n + 3)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["token_ids"], out["finish_reason"]) == (plain_json["token_ids"][:3], "length")
    r = ktrun("generate", v3[1], "--prompt", PROMPT, "--ctx", n)      # no room for a generated token
    assert r.returncode != 0 and f"--prompt is {n} tokens, longer than --ctx {n}" in r.stderr and r.stdout == ""


def test_generate_chat_with_sampling(v3):
    src, conv = v3
    r = ktrun("generate", conv, "--chat", "--prompt", "hi there", "--max-tokens", 6, "--json",
              "--temperature", "0.9", "--top-p", "0.9", "--seed", 7, "--ignore-eos")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = transformers_tokenizer(src).apply_chat_template([{"role": "user", "content": "hi there"}],
                                                           add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert out["prompt_token_ids"] == list(want) and len(out["token_ids"]) == 6


def test_bench_prints_llama_bench_table(v3):
    _src, conv = v3
    r = ktrun("bench", conv, "--pp", 16, "--tg", 4, "--reps", 2)
    assert r.returncode == 0, r.stderr
    assert "pp16" in r.stdout and "tg4" in r.stdout and "±" in r.stdout
    assert "decode step" in r.stdout and "CPU experts" in r.stdout
    assert "quantized GPU layers: none quantized" in r.stdout        # a bf16 conversion


def test_cli_refuses_bad_input(v3, tmp_path):
    src, conv = v3
    r = ktrun("generate", src, "--prompt", "x")                       # a hub checkpoint, not a conversion
    assert r.returncode != 0 and "manifest.json is missing" in r.stderr and r.stdout == ""
    r = ktrun("generate", conv, "--prompt", PROMPT, "--ctx", 4)      # prompt longer than --ctx
    assert r.returncode != 0 and "longer than --ctx 4" in r.stderr and r.stdout == ""
    for cmd in ("generate", "bench"):
        h = ktrun(cmd, "--help")
        assert h.returncode == 0 and "Examples:" in h.stdout


def _cli_refuses(d, *words):
    """`ktrun generate` and `ktrun serve` stop at load with the reason and a non-zero exit; no text generated."""
    r = ktrun("generate", d, "--prompt", PROMPT, "--max-tokens", 2)
    assert r.returncode != 0 and r.stdout == "" and all(w in r.stderr for w in words), r.stderr
    r = ktrun("serve", d, "--port", 0, timeout=120)
    assert r.returncode == 1 and "could not load the model" in r.stderr and all(w in r.stderr for w in words), \
        r.stderr


def _copy(conv, tmp_path):
    return shutil.copytree(conv, tmp_path / "conv")


def _first_expert_file(d):
    return min((d / "experts").glob("*.safetensors"))


def test_newer_format_version_refused(v3, tmp_path):
    d = _copy(v3[1], tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    m["format_version"] = 99
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(LoadError, match="format_version 99 is newer"):
        load_converted(d)
    _cli_refuses(d, "format_version 99 is newer")


def test_missing_shard_refused(v3, tmp_path):
    d = _copy(v3[1], tmp_path)
    f = _first_expert_file(d)
    f.unlink()
    with pytest.raises(LoadError, match=f"{f.name}: listed in manifest.json but missing"):
        load_converted(d)


def test_truncated_shard_refused(v3, tmp_path):
    d = _copy(v3[1], tmp_path)
    f = _first_expert_file(d)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 4096)
    with pytest.raises(LoadError, match=f"{f.name}: .*truncated"):
        load_converted(d)
    _cli_refuses(d, f.name, "truncated")


def test_corrupt_shard_found_by_verify(v3, tmp_path):
    d = _copy(v3[1], tmp_path)
    f = _first_expert_file(d)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size - 10)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    load_converted(d)                                                # sizes fine: mapped without reading
    with pytest.raises(LoadError, match=f"{f.name}: sha256 mismatch"):
        load_converted(d, verify=True)


def test_header_offsets_must_match_manifest(v3, tmp_path):
    d = _copy(v3[1], tmp_path)
    m = json.loads((d / "manifest.json").read_text())
    rel = next(r for r in m["files"] if r.startswith("experts/"))
    m["files"][rel]["tensors"]["gate.qweight"]["offset"] += 64
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(LoadError, match="gate.qweight.*disagrees with manifest.json"):
        load_converted(d)
