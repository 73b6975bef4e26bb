"""KernelExperts: the routed-expert executor on libktkernels (runtime/ops/moe.py), reading the mapped expert tiles of
a converted directory in place. Same interface as experts.TorchExperts (submit / sync / stats / close).

Shards written for S NUMA nodes are handed to the kernels' sub-pools with ktlayouts.nodes_for_shards (inside
ktrun.ops.moe.MoEKernels.add_layer). Activations on a GPU are staged through CPU buffers; the result is copied back at
sync.

A dense layer's MLP (DeepSeek-V3's and GLM-4.5's first layers) on the same terms is a one-expert layer too (fuse_dense):
its rows run as a job of that one expert at weight 1 (run_dense; in a decode step kt_moe_decode's dense router), the
MLP's output exactly, with the job's SiLU (the last bit of torch's may differ, as for a fused shared expert).

A layer's shared expert whose Linears run on the same pool (ktrun.ops.kernel_linear.KernelLinear, the CPU default for a
quantized conversion) can join the routed job (fuse_shared): its gate/up/down tiles are registered as a one-expert
layer (cpu-linear tiles are cpu-expert matrices: no copy) and every submit of the layer computes it too, added after
the routed experts (kt_submit_shared), so a decode step spends no job, no Python and no torch op on it.
"""
from __future__ import annotations

import time

import numpy as np
import torch
from ktlayouts.cpu_expert import MatrixGeometry, group_unit

from ..ops.kernel_linear import KernelLinear
from ..ops.moe import ExpertShard, MoEKernels
from .activation import expert_biases

SHARED_LAYER_ID0 = 1 << 20   # kernel layer id of layer i's shared expert: SHARED_LAYER_ID0 + i (beside the MoE ids)
DENSE_LAYER_ID0 = 2 << 20    # kernel layer id of dense layer i's MLP: DENSE_LAYER_ID0 + i


def _prepared(x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether submit may hand its tensors to the kernels as they are (MoEKernels.submit_prepared)."""
    return (x.is_cpu and out.is_cpu and ids.is_cpu and weights.is_cpu and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous() and out.dtype == torch.float32
            and out.is_contiguous() and out.shape == x.shape and ids.dim() == 2 and weights.shape == ids.shape
            and ids.shape[0] == x.shape[0] and not ids.dtype.is_floating_point)


class KernelExperts:
    def __init__(self, converted, n_threads: int | None = None, backend: str | None = None, layers=None):
        """layers: the expert arrays to read (default converted.experts, the file maps; the RAM tier passes its
        mirrors, ktrun.experts.ram_tier)."""
        geo = converted.geometry
        # the pool the loader made for the quantized Linears (--gpu-weights kernels), if any: one set of threads
        # runs both, so they never fight over the cores
        shared = getattr(converted, "kernels", None)
        if shared is not None and n_threads is None and backend is None:
            self.moe = shared
        else:
            self.moe = MoEKernels(n_threads=n_threads, backend=backend)
        plan = geo.shard_plan
        layers = converted.experts if layers is None else layers
        self._layers = set(layers)
        for layer, shards in layers.items():
            pieces = []
            for s, shard in enumerate(shards):
                i0, i1 = plan.shard_range(s)
                (gq, gs, _), (uq, us, _), (dq, ds, _) = shard["gate"], shard["up"], shard["down"]
                pieces.append(ExpertShard(gq, gs, uq, us, dq, ds, i0, i1))
            self.moe.add_layer(layer, pieces, geo.n_experts, geo.hidden, plan.intermediate_pad, geo.bits,
                               geo.group_size)
        act = converted.config.expert_activation
        if act.kind != "silu" or act.bias:        # gpt-oss: the clamped SwiGLU and biases, in the kernels
            biases = expert_biases(converted)
            for layer in layers:
                bg = bu = bd = None
                if layer in biases:
                    g, u, bd = biases[layer]
                    bg, bu = (np.pad(b, ((0, 0), (0, plan.intermediate_pad - b.shape[1]))) for b in (g, u))
                self.moe.set_activation(layer, act.kind, act.alpha, act.limit, bg, bu, bd)
        self._pending = self._staged = None
        self._shared: dict[int, int] = {}          # layer -> kernel layer id of its fused shared expert
        self._dense: dict[int, int] = {}           # dense layer -> kernel layer id of its MLP (fuse_dense)
        self._single_piece = all(len(shards) == 1 for shards in layers.values())
        self.stats = {"expert_compute_s": 0.0, "expert_calls": 0, "expert_token_slots": 0,
                      "expert_staged_calls": 0, "kernel_backend": self.moe.backend}

    @property
    def can_stage(self) -> bool:
        """Whether a layer may be computed in several calls (submit, then submit_more for the experts above) with
        the bits of one call: the kernels sum a token's experts into out in ascending expert order, so calls over
        ascending runs of experts that add into out (accumulate) repeat that order exactly, as long as one pool
        holds one piece per layer (more pools, or more shards in one, sum per piece or pool first)."""
        return self._single_piece and self.moe.numa_pools == 1

    def fuse_shared(self, layer: int, gate, up, down) -> bool:
        """Compute layer's shared expert (gate/up (I, H), down (H, I)) inside its routed job from now on; True when
        registered, False (nothing changed) when these Linears cannot join it: not KernelLinears on this pool,
        act-order or padded inputs, mixed bits / groups, tiles not those of a one-expert layer."""
        if not self._one_expert(SHARED_LAYER_ID0 + layer, gate, up, down):
            return False
        self._shared[layer] = SHARED_LAYER_ID0 + layer
        return True

    def fuse_dense(self, layer: int, gate, up, down) -> bool:
        """Run dense layer's MLP (gate/up (I, H), down (H, I)) as a one-expert layer of these kernels from now on
        (run_dense, one_call_dense); True when registered, False (nothing changed) on fuse_shared's terms."""
        if not self._one_expert(DENSE_LAYER_ID0 + layer, gate, up, down):
            return False
        self._dense[layer] = DENSE_LAYER_ID0 + layer
        return True

    def run_dense(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Dense layer's MLP (fuse_dense) of x (T, H) float32 CPU contiguous rows -> (T, H): its one expert at weight
        1 for every row, one job, waited for here. Not counted in the expert stats."""
        T = x.shape[0]
        out = torch.empty_like(x)
        ids, wts = torch.zeros((T, 1), dtype=torch.int32), torch.ones((T, 1), dtype=torch.float32)
        self.moe.submit_prepared(self._dense[layer], x, ids, wts, out)
        self.moe.sync()
        return out

    def one_call_dense(self, layer: int):
        """(the kernel context, the kernel layer id) of dense layer's MLP for kt_moe_decode's dense router, or None
        (not fused, a submit pending, a subclass overriding submit or sync: one_call_layer's terms)."""
        if self._pending is not None or layer not in self._dense:
            return None
        if type(self).submit is not KernelExperts.submit or type(self).sync is not KernelExperts.sync:
            return None
        return self.moe, self._dense[layer]

    def _one_expert(self, sid: int, gate, up, down) -> bool:
        """Register gate / up / down as kernel layer sid of one expert; False when they cannot be (fuse_shared)."""
        lins = (gate, up, down)
        if not all(isinstance(li, KernelLinear) and li.lin.kernels is self.moe and li.perm is None for li in lins):
            return False
        (I, H), bits, g = gate.shape, gate.bits, gate.group_size
        if up.shape != (I, H) or down.shape != (H, I) or any(li.bits != bits or li.group_size != g for li in lins):
            return False
        # the tiles must be those of the one-expert layer: the same padded K (a Linear's K padding holds zero-point
        # codes, and the layer zero-pads x past H as the Linear pads its input) and I a whole number of K units. An I
        # that is not (the default model's 160) is padded to one: gate / up get rows of zero scales (outputs 0.0, so
        # silu(0) * 0 = 0 in the padded intermediate), and down's K tiles already reach the padded I (its K pad)
        unit = group_unit(g)
        Ip = -(-I // unit) * unit
        gu, dn = MatrixGeometry(Ip, H, bits, g), MatrixGeometry(H, Ip, bits, g)
        if (gate.qweight.shape[1:] != gu.qweight_shape[1:] or gate.scales.shape[1:] != gu.scales_shape[1:]
                or any(a.shape != b.shape for a, b in ((up.qweight, gate.qweight), (up.scales, gate.scales)))
                or down.qweight.shape != dn.qweight_shape or down.scales.shape != dn.scales_shape):
            return False
        gate_q, gate_s, up_q, up_s = (_pad_rows(a, gu.n_blocks) for a in (gate.qweight, gate.scales, up.qweight,
                                                                           up.scales))
        self.moe.add_layer(sid, [ExpertShard(gate_q[None], gate_s[None], up_q[None], up_s[None], down.qweight[None],
                                             down.scales[None], 0, Ip)],
                           n_experts=1, hidden=H, intermediate_pad=Ip, bits=bits, group_size=g)
        return True

    def one_call_layer(self, layer: int, shared: bool) -> tuple[object, int | None] | None:
        """(the kernel context, the fused shared expert's layer id or None) for running layer's rows in one
        kt_moe_decode call (ktrun.models.moe_one_call), or None when it cannot: a layer these kernels do not hold, a
        shared expert not fused, a submit pending, a subclass overriding submit or sync."""
        if self._pending is not None or layer not in self._layers or (shared and layer not in self._shared):
            return None
        if type(self).submit is not KernelExperts.submit or type(self).sync is not KernelExperts.sync:
            return None            # a subclass that sees every submit (a recording bench) keeps the separate calls
        return self.moe, self._shared[layer] if shared else None

    def record_one_call(self, token_slots: int, seconds: float) -> None:
        """Count a kt_moe_decode call's experts in stats, as submit + sync count theirs."""
        self.stats["expert_compute_s"] += seconds
        self.stats["expert_calls"] += 1
        self.stats["expert_token_slots"] += token_slots

    def submit(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
               skip=None, shared: bool = False, shared_weights: torch.Tensor | None = None):
        """skip: (E,) uint8 mask of experts computed elsewhere (GPU-resident), handed to the kernels as is.
        shared: also compute the layer's shared expert (registered by fuse_shared) in the same job and add it to out,
        times shared_weights (T,) if given."""
        if shared and layer not in self._shared:
            raise KeyError(f"layer {layer}: no shared expert was fused (fuse_shared)")
        if self._pending is not None:
            raise RuntimeError("submit() called twice without sync()")
        t0 = time.perf_counter()
        sid = self._shared[layer] if shared else None
        if skip is None and _prepared(x, out, ids, weights):   # a decode step's layer: no conversions, no checks
            xc, buf, direct = x, out, True
            ids_c = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
            w_c = weights if weights.dtype == torch.float32 and weights.is_contiguous() else \
                weights.float().contiguous()
            sw = None if sid is None or shared_weights is None else shared_weights.reshape(-1).float().contiguous()
            self.moe.submit_prepared(layer, x, ids_c, w_c, out, shared=sid, shared_weights=sw)
        else:
            xc = x if (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous()) \
                else x.detach().float().cpu().contiguous()
            direct = out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
            buf = out if direct else torch.empty(out.shape, dtype=torch.float32)
            ids_c, w_c = ids.cpu(), weights.float().cpu()
            self.moe.submit(layer, xc, ids_c, w_c, buf, skip=skip, shared=sid, shared_weights=None
                            if sid is None or shared_weights is None else shared_weights.reshape(-1))
        self._pending = (t0, xc, buf, out, direct)
        self._staged = (layer, xc, ids_c, w_c, buf)
        self.stats["expert_token_slots"] += ids.numel()

    def submit_more(self, skip) -> None:
        """Another call on the pending layer (after submit, before sync): the experts `skip` leaves in, added into
        out. Bit-identical to one call only in ascending expert runs where can_stage (the caller's promise)."""
        if self._pending is None:
            raise RuntimeError("submit_more() without a pending submit()")
        layer, xc, ids_c, w_c, buf = self._staged
        self.moe.submit(layer, xc, ids_c, w_c, buf, accumulate=True, skip=skip)
        self.stats["expert_staged_calls"] += 1

    def sync(self) -> None:
        if self._pending is None:
            return
        t0, _xc, buf, out, direct = self._pending
        self._pending = self._staged = None
        self.moe.sync()
        if not direct:
            out.copy_(buf.to(device=out.device, dtype=out.dtype))
        # span from submit to the result being ready: kernel time, plus any wait for the caller to call sync
        self.stats["expert_compute_s"] += time.perf_counter() - t0
        self.stats["expert_calls"] += 1

    def close(self) -> None:
        self.moe.close()


def _pad_rows(a, blocks: int):
    """A Linear's tiles or scales (N_pad/16, ...) with zero blocks appended up to `blocks` (zero scales: those rows
    output 0.0 whatever their codes); the array itself when it has them already."""
    if a.shape[0] == blocks:
        return a
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(np.concatenate([a, np.zeros((blocks - a.shape[0], *a.shape[1:]), a.dtype)]))
