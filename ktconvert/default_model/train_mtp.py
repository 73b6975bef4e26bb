"""Train a multi-token-prediction (MTP) layer for the embedded default model, the main model frozen, and add it to the
checkpoint in DeepSeek-V3's hub layout (layer L = num_hidden_layers, `num_nextn_predict_layers: 1`).

DeepSeek-V3's MTP module, as vLLM and SGLang run it (and ktrun's `--speculative mtp`): at position i, from the main
model's final hidden state h_i (after the final norm) and the next token t_{i+1},

    u_i = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(h_i)))        (2H,) -> (H,)
    x   = the MTP decoder layer over u_0 .. u_i (causal attention; a MoE layer like the main ones)
    logits_i = shared_head.head(shared_head.norm(x_i))               predicts t_{i+2}

embed_tokens and shared_head.head are the main model's (frozen, and not stored again: DeepSeek-V3's release repeats
them in the MTP layer, readers fall back to the main ones when the layer has none); the decoder layer starts from the
main model's last layer, shared_head.norm from its final norm. Loss: next-next-token cross-entropy on the same training
stream as train.py (the Python standard library's source), the router balanced by the same bias rule. Reproducible
(fixed seed, one thread by default); stops at --steps or --max-minutes.

Examples:
    python -m ktconvert.default_model.train_mtp --out /tmp/dm-mtp                  # a copy of the shipped model + MTP
    python -m ktconvert.default_model.train_mtp --out ktconvert/data/default_model # in place (what is shipped)
    python -m ktconvert.default_model.train_mtp --out /tmp/m --steps 2 --limit-files 20 --eval-tokens 2048  # smoke
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
from safetensors.torch import save_file
from torch import nn

from ktconvert.default_model import data as io
from ktconvert.default_model import export
from ktconvert.default_model.train import SEED, SEQ_LEN, RouterLoadTracker, add_run_args, batch_windows, lr_at

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "data" / "default_model"
MTP_SHARD = "model-mtp.safetensors"
BIAS_UPDATE_SPEED = 1e-3


class MtpLayer(nn.Module):
    """enorm, hnorm, eh_proj, the decoder layer and shared_head.norm; embed and head are the main model's."""

    def __init__(self, main):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        cfg = main.config
        self.index = cfg.num_hidden_layers
        H = cfg.hidden_size
        self.enorm, self.hnorm = DeepseekV3RMSNorm(H, cfg.rms_norm_eps), DeepseekV3RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layer = DeepseekV3DecoderLayer(cfg, layer_idx=cfg.num_hidden_layers - 1)   # MoE, like the last layer
        self.layer.load_state_dict(main.model.layers[-1].state_dict())
        self.norm = DeepseekV3RMSNorm(H, cfg.rms_norm_eps)
        with torch.no_grad():
            self.norm.weight.copy_(main.model.norm.weight)
            # start as "the main model's next step from h": the h half passes through, the token half adds a little
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, H:].copy_(torch.eye(H))
            self.eh_proj.weight[:, :H].normal_(0.0, cfg.initializer_range)
        self.embed, self.head, self.rotary = main.model.embed_tokens, main.lm_head, main.model.rotary_emb

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_tokens (B, T) = t_{i+1}, hidden (B, T, H) = h_i -> logits (B, T, V) for t_{i+2}."""
        u = self.eh_proj(torch.cat([self.enorm(self.embed(next_tokens)), self.hnorm(hidden)], dim=-1))
        pos = torch.arange(u.shape[1]).unsqueeze(0).expand(u.shape[0], -1)
        x = self.layer(u, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(u, pos))
        x = x[0] if isinstance(x, tuple) else x
        return self.head(self.norm(x))

    def hub_tensors(self) -> dict[str, torch.Tensor]:
        """The layer in DeepSeek-V3's hub names (model.layers.L.*), per-expert Linears, bf16 but the routing bias;
        without embed_tokens and shared_head.head (the main model's)."""
        p = f"model.layers.{self.index}."
        named = {p + k: v for k, v in self.layer.state_dict().items()}
        named.update({p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
                      p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.norm.weight})
        return export.hub_tensors(named)


def main_hidden(main, x: torch.Tensor) -> torch.Tensor:
    """x (B, S) -> the main model's final hidden states (B, S, H), after its final norm."""
    with torch.no_grad():
        return main.model(input_ids=x).last_hidden_state


def mtp_loss(main, mtp: MtpLayer, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (B, S+1) token windows -> (mean cross-entropy of t_{i+2}, top-1 hits) over positions i = 0 .. S-2."""
    h = main_hidden(main, w[:, :-1])                                  # h_0 .. h_{S-1}
    logits = mtp(w[:, 1:-1], h[:, :-1])                               # (B, S-1, V): t_{i+1}, h_i -> t_{i+2}
    target = w[:, 2:]
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return loss, (logits.argmax(-1) == target).float().mean()


@torch.no_grad()
def evaluate(main, mtp: MtpLayer, stream: np.ndarray, max_tokens: int) -> dict:
    """Held-out next-next-token loss and top-1 accuracy of the MTP layer, and the main model's own next-token top-1
    accuracy on the same windows (how often a draft could be accepted is about the MTP accuracy)."""
    mtp.eval()
    windows = torch.from_numpy(io.eval_windows(stream, SEQ_LEN, max_tokens).astype(np.int64))
    losses, hits, main_hits = [], [], []
    for i in range(0, len(windows), 8):
        w = windows[i:i + 8]
        loss, hit = mtp_loss(main, mtp, w)
        losses.append(float(loss))
        hits.append(float(hit))
        main_hits.append(float((main(input_ids=w[:, :-1]).logits.argmax(-1) == w[:, 1:]).float().mean()))
    mtp.train()
    return {"mtp_heldout_loss": round(float(np.mean(losses)), 4), "mtp_heldout_top1": round(float(np.mean(hits)), 4),
            "main_heldout_top1": round(float(np.mean(main_hits)), 4), "mtp_eval_tokens": int(windows[:, 2:].numel())}


def write_mtp(model_dir: Path, out: Path, tensors: dict[str, torch.Tensor], stats: dict, config) -> None:
    """A copy of model_dir (or model_dir itself) with the MTP shard, its index entries, the config's
    num_nextn_predict_layers, the training numbers and the model card; files replaced atomically. model_dir has
    no MTP layer yet (main() checks)."""
    from ktconvert.default_model.card import model_card
    from ktconvert.writer import atomic_write_bytes
    if out.resolve() != model_dir.resolve():
        out.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.is_file() and f.name != MTP_SHARD:
                shutil.copy2(f, out / f.name)
    tmp = out / (MTP_SHARD + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / MTP_SHARD)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": index["metadata"]["total_size"] + total},
             "weight_map": {**index["weight_map"], **dict.fromkeys(tensors, MTP_SHARD)}}
    cfg = json.loads((out / "config.json").read_text())
    ts = json.loads((out / "training_stats.json").read_text())
    ts["mtp"] = stats
    for name, text in (("model.safetensors.index.json", json.dumps(index, indent=2) + "\n"),
                       ("config.json", json.dumps({**cfg, "num_nextn_predict_layers": 1}, indent=2, sort_keys=True)
                        + "\n"),
                       ("training_stats.json", json.dumps(ts) + "\n"),
                       ("README.md", model_card(config, ts))):
        atomic_write_bytes(out / name, text.encode("utf-8"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the trained main model (hub layout)")
    ap.add_argument("--out", required=True, type=Path, help="where the model with its MTP layer goes (may be --model)")
    add_run_args(ap, steps=600, lr=2e-3, max_minutes=10.0)
    ap.add_argument("--eval-tokens", type=int, default=1 << 30, help="held-out tokens scored after training")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    torch.set_num_threads(args.threads)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    cfg = json.loads((args.model / "config.json").read_text())
    if cfg.get("num_nextn_predict_layers", 0):
        sys.exit(f"{args.model}/config.json: the model already has {cfg['num_nextn_predict_layers']} MTP layer(s)")
    train_files, heldout_files = io.split_files(args.stdlib, args.limit_files)
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    train_stream = io.encode_stream(tok, [p.read_text(encoding="utf-8") for p in train_files],
                                    io.chat_samples(train_files))
    heldout_stream = io.encode_stream(tok, [p.read_text(encoding="utf-8") for p in heldout_files], [])
    print(f"tokens: train {len(train_stream)}, held-out {len(heldout_stream)}", flush=True)

    main_model = DeepseekV3ForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    main_model.config._attn_implementation = "sdpa"       # attention_mask=None is causal under sdpa
    main_model.eval().requires_grad_(False)
    mtp = MtpLayer(main_model)
    mtp.train()
    params = [p for n, p in mtp.named_parameters() if not n.startswith(("embed", "head"))]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    tracker = RouterLoadTracker(mtp)
    before = evaluate(main_model, mtp, heldout_stream, min(16384, args.eval_tokens))
    print(f"before: {before}", flush=True)
    rng = np.random.default_rng(SEED)
    t0, step, ema = time.time(), 0, None
    while step < args.steps:
        progress = max(step / args.steps, (time.time() - t0) / (args.max_minutes * 60))
        if progress >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, args.lr)
        loss, _ = mtp_loss(main_model, mtp, batch_windows(train_stream, args.batch, rng))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tracker.update_biases(BIAS_UPDATE_SPEED)
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.3f} ema {ema:.3f} elapsed {(time.time() - t0) / 60:.1f} min",
                  flush=True)
    minutes = (time.time() - t0) / 60
    export.round_to_shipped_precision(mtp)
    after = evaluate(main_model, mtp, heldout_stream, args.eval_tokens)
    stats = {"steps": step, "planned_steps": args.steps, "max_minutes": args.max_minutes,
             "train_minutes": round(minutes, 1), "threads": args.threads, "batch": args.batch,
             "peak_lr": args.lr, "seed": SEED, "init": "main layer {} copied; eh_proj passes h".format(
                 cfg["num_hidden_layers"] - 1), "before": before, **after,
             "heldout_ppl_next_next": round(math.exp(after["mtp_heldout_loss"]), 2)}
    print("final: " + json.dumps(stats), flush=True)
    write_mtp(args.model, args.out, mtp.hub_tensors(), stats, main_model.config)
    print(f"wrote {args.out} ({MTP_SHARD}, config num_nextn_predict_layers 1)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
