"""Model card (README.md) of the embedded default model, filled from the training run's numbers."""

from __future__ import annotations

import math


def model_card(config, s: dict) -> str:
    c = config
    planned = s.get("planned_steps", s["steps"])
    stop_note = (f"this run was stopped by the time budget at step {s['steps']} of {planned}" if s["steps"] < planned
                 else f"this run completed all {planned} steps")
    return f"""---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [deepseek_v3, moe, tiny, ktconvert-default]
---

# ktconvert default model: a tiny DeepSeek-V3-architecture MoE trained on Python source

The embedded default model of `ktconvert`/`ktrun`: real `deepseek_v3` architecture (loads with
`transformers.DeepseekV3ForCausalLM`), small enough to ship in the repository ({s['parameters'] / 1e6:.2f} M parameters,
BF16), trained so that quantization and routing measurements see trained structure (outliers, skewed expert use).
It writes Python-looking code; it is a test and demo model, not a useful assistant.

## Architecture

| | |
|---|---|
| layers | {c.num_hidden_layers} ({c.first_k_dense_replace} dense, {c.num_hidden_layers - c.first_k_dense_replace} MoE) |
| hidden / dense intermediate | {c.hidden_size} / {c.intermediate_size} |
| attention | MLA, {c.num_attention_heads} heads, q_lora_rank {c.q_lora_rank}, kv_lora_rank {c.kv_lora_rank}, \
qk_nope {c.qk_nope_head_dim}, qk_rope {c.qk_rope_head_dim} (interleaved), v {c.v_head_dim} |
| MoE | {c.n_routed_experts} routed experts (intermediate {c.moe_intermediate_size}) + {c.n_shared_experts} shared, \
top-{c.num_experts_per_tok}, sigmoid scores + `e_score_correction_bias`, {c.n_group} groups / topk_group \
{c.topk_group}, routed_scaling_factor {c.routed_scaling_factor}, norm_topk_prob (`scoring_func` sigmoid, \
`topk_method` noaux_tc) |
| rope | theta {(getattr(c, 'rope_parameters', None) or {}).get('rope_theta', 10000.0):g}, interleaved pairs, no scaling \
(`config.json` writes it in DeepSeek-V3's form: `rope_scaling` YaRN with factor 1, which is plain rope) |
| vocab | {c.vocab_size} (byte-level BPE), untied embeddings |
| weights | BF16 (`e_score_correction_bias` FP32), hub per-expert names, sharded safetensors with index |

## Data

The Python {s['python']} standard library's own source (the top-level `Lib/*.py` files; PSF License Version 2, which
permits redistribution). Files sorted by name; every 20th (index % 20 == 10) held out: {s['train_files']} training
files ({s['train_tokens']} tokens incl. chat samples), {s['heldout_files']} held-out files ({s['heldout_tokens']} tokens).
Chat samples: for each documented public function of the training files, one document
``<｜User｜>Write a Python function `name(args)`: <first docstring line><｜Assistant｜><function source>``.
`heldout_eval.txt` is the fixed held-out slice (the first 40,000 characters of the held-out files, in sorted order)
that the test checks.

## Training

`python -m ktconvert.default_model.train --out DIR --steps {s.get('planned_steps', s['steps'])} --max-minutes \
{s.get('max_minutes', s['train_minutes'])}` (seed {s['seed']}, {s['threads']} CPU thread, float32, AdamW
betas (0.9, 0.95), weight decay 0.1, peak lr {s['peak_lr']}, warmup + cosine to 10%, batch {s['batch']} x
{s['seq_len']} tokens). The routing bias is not trained by gradient: after every step it moves by 0.001 x
sign(mean load - expert load) (DeepSeek-V3's auxiliary-loss-free balancing); no auxiliary loss.
The run stops at `--steps` or `--max-minutes`, whichever comes first, and the learning-rate schedule follows whichever
is further along, so the step count of a rerun depends on the machine's speed; {stop_note}.

| | |
|---|---|
| run time | {s['train_minutes']} min on one thread of an AMD Zen 4 (shared machine) |
| steps / tokens seen | {s['steps']} / {s['tokens_seen']} |
| final train loss (first 32,768 training-stream tokens) | {s['train_loss']:.4f} nats/token (ppl {math.exp(s['train_loss']):.2f}) |
| held-out loss | {s['heldout_loss']:.4f} nats/token (ppl {s['heldout_ppl']:.2f}, {s['heldout_loss_tokens']} tokens) |
| max/mean expert load, final training batches | {s.get('final_max_over_mean_load', 'n/a')} |
| unigram baseline, held-out | ppl {s['unigram_ppl_heldout']:.2f} (add-one unigram fitted on training counts) |
| fixed eval slice (`heldout_eval.txt`, first {s['eval_slice_tokens']} predicted tokens) | ppl \
{s['eval_slice_ppl']:.3f} (unigram {s['unigram_ppl_eval_slice']:.2f}) |

All losses are measured on the shipped BF16 weights evaluated in float32, windows of {s['seq_len']} tokens.
`training_stats.json` has these numbers and the training-split token counts.

## Sample

Greedy continuation of `{s.get('sample_prompt', '')}` (transformers, float32):

```python
{s.get('sample_greedy', '')}
```

## Use

```python
from transformers import AutoTokenizer, DeepseekV3ForCausalLM
tok = AutoTokenizer.from_pretrained(DIR)
model = DeepseekV3ForCausalLM.from_pretrained(DIR)
ids = tok("def read_config(path):", return_tensors="pt").input_ids  # no trailing newline: BPE boundary
print(tok.decode(model.generate(ids, max_new_tokens=60, do_sample=False)[0]))
```
""" + (mtp_section(c, s["mtp"]) if "mtp" in s else "")


def mtp_stop(m: dict) -> str:
    planned = m.get("planned_steps", m["steps"])
    return f", stopped by the time budget at step {m['steps']}" if m["steps"] < planned else ""


def mtp_section(c, m: dict) -> str:
    """The card's part on the multi-token-prediction layer (ktconvert.default_model.train_mtp)."""
    b = m["before"]
    return f"""
## Multi-token prediction (MTP) layer

`model.layers.{c.num_hidden_layers}.*` (`num_nextn_predict_layers: 1`, shard `model-mtp.safetensors`) is a
DeepSeek-V3 MTP module trained afterwards with the main model frozen: from the main model's final hidden state h_i
(after the final norm) and the next token t_(i+1), `eh_proj(concat(enorm(embed(t_(i+1))), hnorm(h_i)))` goes through one
more MoE decoder layer and `shared_head.norm` into the main head, predicting t_(i+2). It shares `embed_tokens` and
the head with the main model (DeepSeek-V3's release stores copies; readers fall back to the main ones). `ktrun
--speculative mtp` drafts with it; transformers ignores it.

`python -m ktconvert.default_model.train_mtp --out DIR --steps {m.get('planned_steps', m['steps'])} --max-minutes \
{m.get('max_minutes', m['train_minutes'])}` (seed {m['seed']}, {m['threads']} CPU thread, AdamW, peak lr {m['peak_lr']}, \
warmup + cosine, batch {m['batch']} x 256 tokens, the same training stream and routing-bias rule as the main model;
the decoder layer starts as a copy of the main model's last layer){mtp_stop(m)}.

| held-out (the main model's held-out files) | before training | after |
|---|---:|---:|
| next-next-token loss (nats) | {b['mtp_heldout_loss']:.4f} | {m['mtp_heldout_loss']:.4f} |
| top-1 accuracy of t_(i+2) | {b['mtp_heldout_top1']:.4f} | {m['mtp_heldout_top1']:.4f} |
| predictions scored | {b['mtp_eval_tokens']} | {m['mtp_eval_tokens']} |

On the same windows the main model's own top-1 accuracy of t_(i+1) is {m['main_heldout_top1']:.4f}. Training took
{m['train_minutes']} min on one thread of an AMD Zen 4 (shared machine).
"""
