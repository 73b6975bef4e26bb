"""The shared expert inside the routed-expert job on the CPU kernels (ktrun.experts.kernel.KernelExperts.fuse_shared,
kt_submit_shared): with quantized GPU layers on the kernels' Linear op (the CPU default), a MoE layer's shared
expert is registered as a one-expert layer on its own KernelLinear tiles (no copy) and computed in the same job. A
shared intermediate that is not a whole number of the layout's K units (the embedded default model's 160) is padded to
one: gate / up get rows of zero scales (copied tiles), down's K padding already covers it.

The forward with it equals the forward that runs the shared expert as three Linears (the path it replaces) to float
rounding (only silu's last bit may differ before h is quantized), and the shared expert alone equals swiglu_mlp on
the same Linears; for DeepSeek-V3 (weight 1) and Qwen3-Next (a per-token sigmoid gate as the shared weight)."""
from __future__ import annotations

import pytest
import torch
from ktrun.loaded_model import load_model
from ktrun.models.kv_cache import Batch
from ktrun.models.layers import swiglu_mlp
from ktrun.ops.library import kernels_available
from runtime_helpers import PROMPT, build_conversion, shared_root

from ktconvert.testing.checkpoints import make_checkpoint

pytestmark = pytest.mark.skipif(not kernels_available(), reason="libktkernels not built (make kernels)")

# shared intermediate sizes that are whole K units of the layout (64), as real models' are (V3 2048, Qwen3-Next 512),
# and one that is not (80: padded to 128)
CASES = {"deepseek_v3": ("deepseek_v3", {"moe_intermediate_size": 128}),
         "qwen3_next": ("qwen3_next", {"shared_expert_intermediate_size": 128}),
         "deepseek_v3_padded": ("deepseek_v3", {"moe_intermediate_size": 80})}


def _conversion(tmp_path_factory, case):
    arch, kw = CASES[case]
    root = shared_root(tmp_path_factory)
    src = root / f"src_{case}_shared"
    if not (src / "config.json").exists():
        make_checkpoint(arch, src, init_scale=2.0, **kw)
    return build_conversion(src, root / f"conv_{case}_shared_int4", "int4-amx", gpu_method="rtn-int4",
                            gpu_format="marlin", gpu_group_size=64, quantize_head=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_expert_in_the_routed_job_equals_the_linear_path(tmp_path_factory, case):
    lm = load_model(_conversion(tmp_path_factory, case), device="cpu")
    try:
        m = lm.model
        assert m.shared_fused == m.moe_layers                         # every MoE layer's shared expert joined
        ids = lm.tokenizer.encode(PROMPT)

        def logits():
            return m.forward(Batch.build([(m.new_cache(128), ids)], "cpu"), all_logits=True).float()

        fused = logits()
        m.shared_fused, kept = set(), m.shared_fused                  # the three-Linear path on the same weights
        plain = logits()
        m.shared_fused = kept
        assert torch.equal(fused.argmax(-1), plain.argmax(-1))
        assert (fused - plain).abs().max() <= 1e-4 * plain.abs().max()
        # the shared expert alone (routed weights 0) is swiglu_mlp on its Linears
        i = min(m.moe_layers)
        sp = m.names.layer(i) + m.names.shared_prefix
        lins = [m.w[sp + n + ".weight"] for n in ("gate_proj", "up_proj", "down_proj")]
        for T in (1, 11):
            h = torch.randn(T, m.cfg.hidden_size, generator=torch.Generator().manual_seed(T))
            out, sw = torch.empty_like(h), torch.rand(T) + 0.5
            m.experts.submit(i, h, torch.zeros(T, 1, dtype=torch.long), torch.zeros(T, 1), out, shared=True,
                             shared_weights=sw)
            m.experts.sync()
            ref = sw[:, None] * swiglu_mlp(h, *lins)
            assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), f"T={T}"
        with pytest.raises(KeyError, match="no shared expert"):
            m.experts.submit(-1, h, torch.zeros(T, 1, dtype=torch.long), torch.zeros(T, 1), out, shared=True)
    finally:
        lm.close()
