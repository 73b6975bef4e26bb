"""A second trained model shape for the quality bench: a small Qwen3-MoE (GQA with q/k norms, softmax top-k router,
no shared expert, every layer MoE) trained on the same Python standard library split and with the same tokenizer
as the embedded default model (a DeepSeek-V3 shape: MLA, sigmoid router, shared expert, a dense first layer).

Why a trained model and not random weights: quantization error that matters is error on the weights and
activations a trained network has (outlier channels, skewed expert loads), which random N(0, 1/K) weights lack.
Why this shape: it is the GQA class (Qwen3-30B-A3B, Qwen3.5, GLM-4.5-Air, gpt-oss) and its expert rows are whole
256-wide super-blocks (moe_intermediate_size 256), so the k-quant and IQ4_K* peers run their own types on every
expert tensor (the default model's down_proj, K = 160, makes them fall back).

Reproducible: fixed seed, one thread by default, a fixed number of steps (--max-minutes is only a safety stop and
is reported when it cuts the run short). Writes a hub-layout checkpoint (safetensors, config.json as the hub ships
Qwen3-MoE, the default model's tokenizer files) and checks that transformers' from_pretrained reads back the very
logits the trained weights give.

Examples:
    .venv/bin/python bench/second_model.py --out /work/scratch/qwen3-small --threads 2   # 900 steps, ~15-26 min
    .venv/bin/python bench/second_model.py --out /tmp/q --steps 2 --limit-files 40    # smoke run (~1 min)
    .venv/bin/python bench/bench_quant_vs_llamacpp.py --model /work/scratch/qwen3-small ...
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "ktconvert" / "data" / "default_model"
SEED = 4321
AUX_LOSS_COEF = 0.01     # Qwen3-MoE's load-balancing loss weight would be 0.001; a small model needs more push
SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "moe_intermediate_size": 256, "intermediate_size": 768, "num_experts": 16,
         "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
         "max_position_embeddings": 1024, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def model_config():
    from ktconvert.default_model import data as io
    from ktconvert.testing.checkpoints import make_config

    return make_config("qwen3_moe", **SHAPE, vocab_size=io.VOCAB_SIZE, bos_token_id=io.BOS_ID,
                       eos_token_id=io.EOS_ID, pad_token_id=io.PAD_ID, router_aux_loss_coef=AUX_LOSS_COEF,
                       initializer_range=0.02, tie_word_embeddings=False)


def expert_loads(model, x: torch.Tensor) -> float:
    """max / mean tokens per expert over the routers of one batch (1.0: perfectly balanced)."""
    out = model(input_ids=x, output_router_logits=True)
    k = model.config.num_experts_per_tok
    worst = 1.0
    for logits in out.router_logits:               # (tokens, experts) per MoE layer
        counts = torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=logits.shape[-1]).float()
        worst = max(worst, float(counts.max() / counts.mean()))
    return worst


def write_checkpoint(out: Path, model) -> None:
    """Hub layout: one safetensors file (bf16, experts split per expert as the hub ships them), config.json,
    the default model's tokenizer files; config.json last (its presence marks a complete checkpoint)."""
    from safetensors.torch import save_file

    from ktconvert.testing.checkpoints import hub_state_dict
    from ktconvert.testing.files import hub_config

    tensors = {k: v.detach().to(torch.bfloat16).contiguous().clone() for k, v in
               hub_state_dict(model, "qwen3_moe").items() if "rotary_emb" not in k}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(DEFAULT_MODEL / name, out / name)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(hub_config(model.config, "qwen3_moe", False), indent=2) + "\n")
    tmp.replace(out / "config.json")


def main(argv=None) -> int:
    from ktconvert.default_model import data as io
    from ktconvert.default_model import train as default_train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (hub layout)")
    default_train.add_run_args(ap, steps=900, lr=3e-3, max_minutes=60.0)
    args = ap.parse_args(argv)
    if (args.out / "config.json").is_file():
        print(f"{args.out}: already written (delete it to train again)")
        return 0

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    train_files, heldout_files = io.split_files(args.stdlib, args.limit_files)
    train_stream = io.encode_stream(tok, [p.read_text(encoding="utf-8") for p in train_files],
                                    io.chat_samples(train_files))
    heldout_stream = io.encode_stream(tok, [p.read_text(encoding="utf-8") for p in heldout_files], [])
    config = model_config()
    model = AutoModelForCausalLM.from_config(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: qwen3_moe, {n_params / 1e6:.2f} M parameters; data: {len(train_stream)} training tokens "
          f"({len(train_files)} files), {len(heldout_stream)} held-out", flush=True)
    opt = default_train.make_optimizer(model, args.lr)
    rng = np.random.default_rng(SEED)
    t0 = time.time()
    step, tokens, ema = 0, 0, None
    while step < args.steps:
        if time.time() - t0 > args.max_minutes * 60:
            print(f"--max-minutes {args.max_minutes} reached at step {step} of {args.steps}", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = default_train.lr_at(step / args.steps, args.lr)
        x = default_train.batch_windows(train_stream, args.batch, rng)          # (B, SEQ_LEN + 1)
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = ce + AUX_LOSS_COEF * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, tokens = step + 1, tokens + x[:, 1:].numel()
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        if step % 25 == 0:
            el = time.time() - t0
            print(f"step {step} loss {ce.item():.3f} ema {ema:.3f} aux {out.aux_loss.item():.3f} "
                  f"tokens {tokens} {tokens / el:.0f} tok/s elapsed {el / 60:.1f} min", flush=True)

    from ktconvert.default_model.export import round_to_shipped_precision

    round_to_shipped_precision(model)                  # evaluate what is shipped (bf16 values)
    model.eval()
    heldout_loss, n = default_train.mean_loss(model, heldout_stream, 1 << 30)
    with torch.no_grad():
        load = expert_loads(model, default_train.batch_windows(heldout_stream, 8, rng))
    # Written beside OUT first: the checkpoint, read back by transformers, must give the trained model's logits
    # before it takes OUT's name (nothing half-written or wrong looks complete).
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, model)
    check = torch.from_numpy(heldout_stream[:257].astype(np.int64))[None]
    back = AutoModelForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
    with torch.no_grad():
        diff = float((back(input_ids=check).logits - model(input_ids=check).logits).abs().max())
    if diff > 1e-3:
        sys.exit(f"error: {tmp} read back by transformers differs from the trained model (max |dlogit| {diff})")
    stats = {"seed": SEED, "steps": step, "tokens_seen": tokens, "train_minutes": round((time.time() - t0) / 60, 1),
             "threads": args.threads, "parameters": n_params, "heldout_loss": round(heldout_loss, 4),
             "heldout_ppl": round(math.exp(heldout_loss), 2), "heldout_tokens": n,
             "heldout_max_over_mean_expert_load": round(load, 2), "readback_max_abs_dlogit": diff,
             "torch": torch.__version__}
    (tmp / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.replace(args.out)
    print("final: " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
