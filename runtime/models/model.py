"""MoEModel: the decoder forward shared by every architecture, over a flattened varlen batch of requests.

Per layer: x += attention(norm(x)); then x += mlp(norm(x)) where the MoE mlp submits the routed experts to the
expert executor (CPU kernels or the torch reference, asynchronously), computes the shared experts meanwhile, then
waits and adds the two. On the CPU kernels the shared experts join the routed job instead (the executor's
fuse_shared: one job per MoE layer, the shared expert added after the routed ones). Dense weights are hub-named tensors in `weights` (already on the compute device/dtype), under
the family's names (ktlayouts.families HubNames: Kimi-K2.5's text model sits under `language_model.`).
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from ktlayouts.families import ModelConfig, get_family

from ..ops import float_linear, glue
from . import arch_module, cache_layers, moe_one_call, step_one_call
from .attention import prepare_absorbed
from .kv_cache import KV_BLOCK_SIZE, Batch, BlockLayout, BlockPool, SeqCache, StateLayout
from .layers import SERIAL_MAX_ELEMENTS, SERIAL_MAX_ROWS, Rope, add_rms_norm, rms_norm, serial_torch, swiglu_mlp


class MoEModel:
    def __init__(self, cfg: ModelConfig, weights: dict, experts, device="cpu", dtype=torch.float32,
                 layers: tuple[int, ...] | None = None):
        """layers: the decoder layers this forward runs, by hub index, in order (default: all cfg.num_layers; a
        multi-token-prediction block runs its one layer L = num_hidden_layers, in KV slot 0: ktrun.mtp)."""
        self.cfg, self.w, self.experts = cfg, weights, experts
        # the kernel context (ktrun.ops.moe.MoEKernels) whose pool computes a large router's logits (glue.routers_on);
        # None: the calling thread. Set by whoever loads the model onto the kernels (ktrun.loaded_model).
        self.kernels = None
        # whether the quantized dense Linears run on the kernels' op (set by ktrun.loaded_model): torch then computes
        # glue only, and a small forward keeps it on the calling thread (decoder, layers.SERIAL_MAX_ELEMENTS)
        self.dense_on_kernels = False
        self.layers = tuple(range(cfg.num_layers)) if layers is None else tuple(layers)
        self.device, self.dtype = torch.device(device), dtype
        self.arch = arch_module(cfg.model_type)
        self.names = get_family(cfg.model_type).names    # hub names: where the MoE block and shared experts live
        self.rope = Rope(cfg.rope, self.device)
        self.norm = getattr(self.arch, "rms_norm", rms_norm)     # the family's decoder RMSNorm (Qwen3-Next: 1 + w)
        # recurrent layers keep a per-request state (SeqCache.recurrent); None for families without one
        state = getattr(self.arch, "recurrent_state", None)
        self.state_layout: StateLayout | None = state(cfg, dtype) if state is not None else None
        self.has_recurrent_state = self.state_layout is not None
        self.moe_layers = set(cfg.moe_layers)
        self.moe_prefix = {i: self._moe_prefix(i) for i in self.layers}
        if cfg.is_mla:                                     # MLA's absorbed kv_b on the kernels' op: built now
            prepare_absorbed(cfg, weights, [self.names.layer(i) + "self_attn." for i in self.layers])
        self.shared_fused = self._fuse_shared()           # MoE layers whose executor computes the shared expert
        self.dense_fused = self._fuse_dense()             # dense layers whose MLP the executor runs as one expert
        self.moe_plans: dict = {}      # layer -> moe_one_call.MoePlan or None (made on first use); "experts": for whom
        self.step_plan = None          # step_one_call.StepPlan: every decoder layer of a decode step in one call
        self.lm_head = weights.get(self.names.head)
        if self.lm_head is None:
            if not cfg.tie_word_embeddings:
                raise KeyError(f"{self.names.head} is missing and tie_word_embeddings is false")
            self.lm_head = weights[self.names.embed]
        self.final_norm = weights.get(self.names.final_norm)   # after the last layer (an MTP block: its own)
        # speculative decoding with MTP drafts: each forward leaves every request's final hidden rows on its cache
        # (SeqCache.hidden: (start position, (n, H))) for the MTP drafter to read
        self.keep_hidden = False
        # wall seconds by part (CPU clock; on CUDA these are launch times unless synchronized)
        self.timing = {"expert_wait_s": 0.0, "attention_s": 0.0, "mlp_s": 0.0, "forward_s": 0.0, "forwards": 0}
        self.kv_pool = BlockPool(self.cache_layout(), dtype, self.device)   # every request's KV blocks

    def _moe_prefix(self, i: int) -> str:
        p = self.names.layer(i)
        for cand in (self.names.moe_prefix, "mlp.", "block_sparse_moe."):
            if p + cand + self.names.router + ".weight" in self.w:
                return p + cand
        return p + self.names.moe_prefix

    def _fuse_shared(self) -> set[int]:
        """The MoE layers whose shared expert the routed job computes (KernelExperts.fuse_shared). KTRUN_FUSE_SHARED=0
        keeps every shared expert outside the job, as the executors without fuse_shared (the RAM tier, hot experts)
        compute it: the fused job's silu rounds its last bit differently, so their logits are compared to such a run."""
        fuse = getattr(self.experts, "fuse_shared", None)
        if fuse is None or not (self.names.shared_prefix and self.cfg.n_shared_experts) or \
                os.environ.get("KTRUN_FUSE_SHARED", "1") == "0":
            return set()
        fused = set()
        for i in sorted(self.moe_layers):
            sp = self.names.layer(i) + self.names.shared_prefix
            lins = [self.w.get(sp + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj")]
            if all(li is not None for li in lins) and fuse(i, *lins):
                fused.add(i)
        return fused

    def _fuse_dense(self) -> set[int]:
        """The dense layers whose MLP the experts' executor runs as a one-expert layer (KernelExperts.fuse_dense), at
        every row count, so a decode step's plan takes them in too (step_one_call) and a row's bits never depend on
        its batch. KTRUN_FUSE_SHARED=0 keeps them on swiglu_mlp, as it keeps the shared experts outside the job."""
        fuse = getattr(self.experts, "fuse_dense", None)
        if fuse is None or os.environ.get("KTRUN_FUSE_SHARED", "1") == "0" or self.dtype != torch.float32 or \
                self.device.type != "cpu":
            return set()
        fused = set()
        for i in self.layers:
            if i in self.moe_layers:
                continue
            p = self.names.layer(i) + "mlp."
            lins = [self.w.get(p + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj")]
            if all(li is not None for li in lins) and fuse(i, *lins):
                fused.add(i)
        return fused

    def _dense(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Dense layer i's MLP of its normed rows h (T, H)."""
        if i in self.dense_fused:
            return self.experts.run_dense(i, h.contiguous())
        p = self.names.layer(i) + "mlp."
        return swiglu_mlp(h, self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"], self.w[p + "down_proj.weight"])

    def cache_layout(self, block_size: int = KV_BLOCK_SIZE) -> BlockLayout:
        return BlockLayout(cache_layers(self.arch, self.cfg), tuple(tuple(w) for w in self.arch.cache_widths(self.cfg)),
                           block_size)

    def set_kv_block_size(self, block_size: int) -> None:
        """Positions per KV block; only while no block is held."""
        if block_size != self.kv_pool.block_size:
            if self.kv_pool.used:
                raise RuntimeError("the KV block size cannot change while requests hold blocks")
            self.kv_pool = BlockPool(self.cache_layout(int(block_size)), self.dtype, self.device)

    def new_cache(self, ctx: int) -> SeqCache:
        return SeqCache(self.kv_pool, ctx)

    def _moe(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = self.moe_prefix[i]
        with serial_torch(h.shape[0] <= SERIAL_MAX_ROWS), glue.routers_on(self.kernels):   # no OpenMP wake-up
            ids, wts = self.arch.route(self.cfg, self.w, p, h)               # (T, k), (T, k)
        out = torch.empty_like(h)
        scale = getattr(self.arch, "shared_expert_scale", None)               # Qwen3-Next: a sigmoid gate
        if i in self.shared_fused:                                           # the shared expert in the same job
            self.experts.submit(i, h, ids, wts, out, shared=True, shared_weights=None if scale is None else
                                scale(self.cfg, self.w, p, h).float())
            t0 = time.perf_counter()
            self.experts.sync()
            self.timing["expert_wait_s"] += time.perf_counter() - t0
            return out
        self.experts.submit(i, h, ids, wts, out)                             # CPU works on routed experts...
        shared = None
        if self.names.shared_prefix and self.cfg.n_shared_experts:           # ...while we do the shared ones
            sp = self.names.layer(i) + self.names.shared_prefix
            shared = swiglu_mlp(h, self.w[sp + "gate_proj.weight"], self.w[sp + "up_proj.weight"],
                                self.w[sp + "down_proj.weight"])
            if scale is not None:
                shared = scale(self.cfg, self.w, p, h) * shared
        t0 = time.perf_counter()
        self.experts.sync()
        self.timing["expert_wait_s"] += time.perf_counter() - t0
        return out if shared is None else out + shared

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x + delta, norm(x + delta)) with the family's norm; the default RMSNorm fuses the add (layers)."""
        if self.norm is rms_norm:
            return add_rms_norm(x, delta, weight, self.cfg.rms_norm_eps)
        x = x + delta
        return x, self.norm(x, weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: Batch, all_logits: bool = False) -> torch.Tensor:
        """-> float32 logits: (T, V) for every token if all_logits, else (B, V) for each request's last token."""
        t0 = time.perf_counter()
        every_row = all_logits or all(s.n == 1 for s in batch.seqs)   # decode: the rows are the last tokens
        # a decode step the plan takes whole: tokens to logits in one library call (step_one_call.whole_step)
        got = step_one_call.whole_step(self, batch) if every_row and self.step_plan is not None else None
        if got is not None:
            h, logits = got
        else:
            # (T, H); a bf16 table widens
            x = F.embedding(batch.tokens.to(self.device), self.w[self.names.embed]).to(self.dtype)
            batch.carried[step_one_call.HEAD_ROWS] = every_row     # a decode step's one call may run the head too
            _, h = self.decoder(batch, x)
            logits = batch.carried.pop(step_one_call.HEAD_LOGITS, None)   # (T, V) from the step's one call
        if self.keep_hidden:
            for s in batch.seqs:
                s.cache.hidden.append((s.start, h[s.offset:s.offset + s.n]))
        if logits is None:
            if not every_row:
                h = h[batch.last_token_rows().to(self.device)]
            logits = float_linear.head(h, self.lm_head, self.kernels)   # (B or T, V); bf16 as stored on the CPU
        self.timing["forward_s"] += time.perf_counter() - t0
        self.timing["forwards"] += 1
        return logits

    def decoder(self, batch: Batch, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the batch's input rows x (T, H), committing the batch to its caches -> (the
        residual stream after the last layer (T, H), its final norm (T, H))."""
        cfg, w = self.cfg, self.w
        cos, sin = self.rope.cos_sin(batch.positions.to(self.device), self.dtype)
        L = len(self.layers)
        # a family whose decoder layer is not attention -> MLP (LongCat-Flash's two sublayers + shortcut MoE) runs
        # its module's decoder_layer(model, i, x, h, batch, cos, sin) -> (x, h): h is layer i's normed input as the
        # previous call left it (None for layer 0: the hook norms x itself); after the last layer, the final norm
        layer_hook = getattr(self.arch, "decoder_layer", None)
        small = self.dense_on_kernels and x.shape[0] * x.shape[1] <= SERIAL_MAX_ELEMENTS   # layers.serial_torch
        with serial_torch(small):
            h = None if layer_hook is not None else (
                self.norm(x, w[self.names.layer(self.layers[0]) + "input_layernorm.weight"], cfg.rms_norm_eps)
                if L else x)
            x, h = self._layers(batch, x, h, cos, sin, layer_hook)
        batch.commit()
        if not L:
            h = self.norm(x, self.final_norm, cfg.rms_norm_eps)
        return x, h

    def _layers(self, batch: Batch, x: torch.Tensor, h, cos, sin, layer_hook) -> tuple[torch.Tensor, torch.Tensor]:
        """decoder()'s layer loop: x (T, H) and layer 0's normed input h -> (x, h) after the last layer."""
        # decode rows: from the plan's first layer on, every layer in one kernel call (step_one_call)
        planned = step_one_call.start(self, batch, x.shape[0], cos, sin) \
            if layer_hook is None and x.dtype == self.dtype and x.device == self.device else None
        cfg, w = self.cfg, self.w
        tm, clock = self.timing, time.perf_counter
        L = len(self.layers)
        for slot, i in enumerate(self.layers):         # slot: the layer's KV blocks (i itself, but in an MTP block)
            if slot == planned:
                got = step_one_call.run(self, batch, x, h, cos, sin)
                if got is not None:
                    return got
            if layer_hook is not None:
                x, h = layer_hook(self, i, x, h, batch, cos, sin)
                continue
            p = self.names.layer(i)
            t1 = clock()
            a = self.arch.attention(cfg, w, p + "self_attn.", h, batch, slot, self.rope, cos, sin)
            t2 = clock()
            # the next layer's input norm, or after the last layer the final norm (of every row: row-wise, the
            # same bits for the rows kept below)
            next_w = w[self.names.layer(self.layers[slot + 1]) + "input_layernorm.weight"] if slot + 1 < L else \
                self.final_norm
            got = moe_one_call.run(self, i, x, a, w[p + "post_attention_layernorm.weight"], next_w, batch) \
                if i in self.moe_layers or i in self.dense_fused else None
            if got is not None:                         # decode rows: the MoE half in one kernel call
                x, h = got
            else:
                # each residual add runs with the norm after it (one kt_rms_norm call for float32 CPU rows)
                x, h = self._add_norm(x, a, w[p + "post_attention_layernorm.weight"])
                m = self._moe(i, h) if i in self.moe_layers else self._dense(i, h)
                x, h = self._add_norm(x, m, next_w)
            t3 = clock()
            tm["attention_s"] += t2 - t1
            tm["mlp_s"] += t3 - t2                      # router + shared/dense MLP + waiting for routed experts
        if layer_hook is None and (self.step_plan is None or self.step_plan.experts is not self.experts):
            step_one_call.learn(self, batch)
        return x, h
