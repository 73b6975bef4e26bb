"""Train the embedded default model: a small DeepSeek-V3-architecture MoE on the Python standard library's source.

Reproducible (sorted file list, fixed seed, one thread); stops at --steps or --max-minutes, whichever comes first
(the learning-rate schedule follows whichever is further along). Writes the checkpoint in the hub layout.

Examples:
    python -m ktconvert.default_model.train --out /tmp/default_model
    python -m ktconvert.default_model.train --out /tmp/m --steps 2 --limit-files 40     # smoke run (~1 min)
    python -m ktconvert.default_model.train --out /tmp/default_model --resume          # continue after a crash
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ktconvert.default_model import data as io
from ktconvert.default_model import export

SEED = 1234
SEQ_LEN = 256
BIAS_UPDATE_SPEED = 1e-3  # aux-loss-free balancing step (DeepSeek-V3 uses gamma = 0.001)


def model_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=io.VOCAB_SIZE, hidden_size=256, intermediate_size=768, moe_intermediate_size=160,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=1024, rope_interleave=True,
        bos_token_id=io.BOS_ID, eos_token_id=io.EOS_ID, pad_token_id=io.PAD_ID, tie_word_embeddings=False,
        initializer_range=0.02, rms_norm_eps=1e-6, num_nextn_predict_layers=0, dtype="bfloat16",
    )


class RouterLoadTracker:
    """Counts routed tokens per expert (forward hooks on each router) and nudges e_score_correction_bias
    by sign(mean load - load): DeepSeek-V3's auxiliary-loss-free balancing (the bias gets no gradient)."""

    def __init__(self, model):
        self.routers = [m for name, m in model.named_modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, outputs):
            topk_indices = outputs[2]  # (T, top_k)
            self.loads[i] += torch.bincount(topk_indices.flatten(), minlength=module.num_experts).float()
        return hook

    def update_biases(self, speed: float) -> float:
        """Apply one bias step; returns max-load / mean-load over layers (1.0 = perfectly balanced)."""
        worst = 1.0
        with torch.no_grad():
            for r, load in zip(self.routers, self.loads):
                if load.sum() == 0:
                    continue
                r.e_score_correction_bias += speed * torch.sign(load.mean() - load)
                worst = max(worst, float(load.max() / load.mean()))
                load.zero_()
        return worst


def batch_windows(stream: np.ndarray, n: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - SEQ_LEN - 1, size=n)
    return torch.from_numpy(np.stack([stream[s:s + SEQ_LEN + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def mean_loss(model, stream: np.ndarray, max_tokens: int, batch: int = 8) -> tuple[float, int]:
    """Mean next-token loss (nats) over consecutive non-overlapping windows of SEQ_LEN+1 tokens."""
    model.eval()
    windows = io.eval_windows(stream, SEQ_LEN, max_tokens)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = torch.from_numpy(windows[i:i + batch].astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total, count = total + float(loss), count + x[:, 1:].numel()
    model.train()
    return total / count, count


def save_training_state(path: Path, model, opt, step: int, tokens: int, elapsed: float) -> None:
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"opt.{gi}.{pi}.{key}"] = st[key].contiguous()
    meta = {"step": str(step), "tokens": str(tokens), "elapsed": f"{elapsed:.3f}"}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # atomic: a crash never leaves a half-written state that looks complete


def load_training_state(path: Path, model, opt) -> tuple[int, int, float]:
    from safetensors import safe_open

    tensors = load_file(str(path))
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            if f"opt.{gi}.{pi}.exp_avg" in tensors:
                opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": tensors[f"opt.{gi}.{pi}.exp_avg"],
                                "exp_avg_sq": tensors[f"opt.{gi}.{pi}.exp_avg_sq"]}
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    step = int(meta["step"])
    for st in opt.state.values():
        st["step"] = torch.tensor(float(step))
    return step, int(meta["tokens"]), float(meta["elapsed"])


SAMPLE_PROMPT = "def read_config(path):"


@torch.no_grad()
def greedy_sample(model, tok, n_tokens: int = 48) -> str:
    """Greedy continuation of SAMPLE_PROMPT (for the model card)."""
    model.eval()
    ids = torch.tensor([tok.encode(SAMPLE_PROMPT).ids])
    out = model.generate(ids, max_new_tokens=n_tokens, do_sample=False, eos_token_id=io.EOS_ID, pad_token_id=io.PAD_ID)
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def make_optimizer(model, lr: float) -> torch.optim.AdamW:
    """AdamW, weight decay 0.1 on the matrices except the routers' (norms, biases and router gates: none)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(progress: float, peak: float, warmup: float = 0.03) -> float:
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def add_run_args(ap: argparse.ArgumentParser, steps: int, lr: float, max_minutes: float) -> None:
    """The options a training run shares with train_mtp: data, length, batch, learning rate, time budget, threads."""
    ap.add_argument("--stdlib", type=Path, default=io.default_stdlib_dir(), help="folder of *.py training text")
    ap.add_argument("--limit-files", type=int, default=0, help="use only the first N files (smoke runs, tests)")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=12, help=f"sequences of {SEQ_LEN} tokens per step")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--max-minutes", type=float, default=max_minutes)
    ap.add_argument("--threads", type=int, default=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="output directory (hub layout)")
    add_run_args(ap, steps=1600, lr=3e-3, max_minutes=38.0)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/train_state.safetensors")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train_log.txt", "a")  # noqa: SIM115 (open for the whole run)

    def say(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    train_files, heldout_files = io.split_files(args.stdlib, args.limit_files)
    say(f"data: {len(train_files)} train files, {len(heldout_files)} held-out files from {args.stdlib}")
    tok = io.train_tokenizer(train_files)
    chats = io.chat_samples(train_files)
    train_stream = io.encode_stream(tok, [p.read_text(encoding="utf-8") for p in train_files], chats)
    heldout_stream = io.encode_stream(tok, [p.read_text(encoding="utf-8") for p in heldout_files], [])
    say(f"tokens: train {len(train_stream)} (incl. {len(chats)} chat samples), held-out {len(heldout_stream)}")

    from transformers import DeepseekV3ForCausalLM

    config = model_config()
    model = DeepseekV3ForCausalLM(config).float()
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params / 1e6:.2f} M parameters")
    opt = make_optimizer(model, args.lr)
    tracker = RouterLoadTracker(model)
    state_path = args.out / "train_state.safetensors"
    step, tokens, elapsed0 = 0, 0, 0.0
    if args.resume and state_path.exists():
        step, tokens, elapsed0 = load_training_state(state_path, model, opt)
        say(f"resumed at step {step}")
    rng = np.random.default_rng(SEED + step)
    t0 = time.time() - elapsed0
    budget = args.max_minutes * 60
    ema, imbalance = None, float("nan")
    while step < args.steps:
        progress = max(step / args.steps, (time.time() - t0) / budget)
        if progress >= 1.0:
            say(f"time budget reached at step {step}")
            break
        lr = lr_at(progress, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_windows(train_stream, args.batch, rng)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = tracker.update_biases(BIAS_UPDATE_SPEED)
        step, tokens = step + 1, tokens + x[:, 1:].numel()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 25 == 0:
            el = time.time() - t0
            say(f"step {step} loss {loss.item():.3f} ema {ema:.3f} lr {lr:.2e} max/mean load {imbalance:.2f} "
                f"tokens {tokens} {tokens / el:.0f} tok/s elapsed {el / 60:.1f} min")
        if step % 200 == 0:
            save_training_state(state_path, model, opt, step, tokens, time.time() - t0)
    train_minutes = (time.time() - t0) / 60
    save_training_state(state_path, model, opt, step, tokens, time.time() - t0)

    # Final numbers on the weights as shipped (rounded to BF16), evaluated in float32.
    export.round_to_shipped_precision(model)
    train_loss, _ = mean_loss(model, train_stream, 32768)
    heldout_loss, heldout_n = mean_loss(model, heldout_stream, 1 << 30)
    counts = np.bincount(train_stream, minlength=config.vocab_size)
    eval_text = io.heldout_eval_text(heldout_files)
    eval_ids = np.array(tok.encode(eval_text).ids, dtype=np.int32)
    eval_loss, eval_n = mean_loss(model, eval_ids, io.EVAL_TOKENS)
    stats = {
        "seed": SEED, "steps": step, "tokens_seen": tokens, "train_minutes": round(train_minutes, 1),
        "threads": args.threads, "seq_len": SEQ_LEN, "batch": args.batch, "peak_lr": args.lr,
        "parameters": n_params, "train_files": len(train_files), "heldout_files": len(heldout_files),
        "train_tokens": len(train_stream), "heldout_tokens": len(heldout_stream),
        "train_loss": round(train_loss, 4), "heldout_loss": round(heldout_loss, 4),
        "heldout_ppl": round(math.exp(heldout_loss), 3), "heldout_loss_tokens": heldout_n,
        "eval_slice_tokens": eval_n, "eval_slice_ppl": round(math.exp(eval_loss), 3),
        "unigram_ppl_heldout": round(io.unigram_ppl(counts, heldout_stream), 2),
        "unigram_ppl_eval_slice": round(io.unigram_ppl(counts, io.eval_windows(eval_ids, SEQ_LEN,
                                                                              io.EVAL_TOKENS)[:, 1:]), 2),
        "planned_steps": args.steps, "max_minutes": args.max_minutes, "final_max_over_mean_load": round(imbalance, 2),
        "sample_prompt": SAMPLE_PROMPT, "sample_greedy": greedy_sample(model, tok),
        "python": sys.version.split()[0], "torch": torch.__version__,
    }
    say("final: " + json.dumps(stats))
    export.export_hub_dir(args.out, model, tok, stats, counts, eval_text)
    export.verify_hub_dir(args.out, model)
    state_path.unlink()  # the optimizer state is only for --resume; the shipped folder stays small
    say(f"wrote {args.out} (verified: from_pretrained gives identical logits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
