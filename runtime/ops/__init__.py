"""ktrun.ops: our C++ kernel library (libktkernels, kernels/) and the layers that run on it, in place on the packed
layouts of ktlayouts. The lowest wing of ktrun: it imports ktlayouts and nothing else of ktrun.

    library.py        the library, loaded once: its path, ABI check, the whole C signature table, the ABI's codes,
                      KernelError, argument helpers, kernels_available(), the bandwidth probe's size
    moe.py            MoEKernels: the routed experts of MoE layers on the packed cpu-expert tiles (submit / sync)
    linear.py         LinearKernels: dense quantized Linears on the cpu-linear tiles, on the same thread pool
    kernel_linear.py  KernelLinear / AbsorbedKvB: GPU-format Linears repacked once for the CPU Linear op
    glue.py           the decode step's float32 glue in one call each (RMSNorm, RoPE, MLA attention, sigmoid router)
    prompt_attention.py  a prompt's causal attention (GQA / MLA, windows, sinks) on the kernel pool
    packed_linear.py  MarlinLinear: a GPU Linear kept in the Marlin layout on the device; linear() for every weight kind
    marlin.py         finding an installed Marlin GEMM (vLLM / SGLang) and calling it on our layout
    triton_linear.py  TritonLinear: our Triton W4A16 / W8A16 kernel on the GPTQ layout (CUDA with torch alone;
                      Triton's interpreter on the CPU for tests)

The way in: the names below; the modules for everything else.
"""
from .library import BACKENDS, KernelError, backend_supported, kernels_available, load_library
from .moe import ExpertShard, MoEKernels

__all__ = ["BACKENDS", "ExpertShard", "KernelError", "MoEKernels", "backend_supported", "kernels_available",
           "load_library"]
