"""ktrun.experts: where and how the routed experts of MoE layers run. Every executor has one asynchronous interface
(submit, then sync; executors.py), and the model forward sees nothing else.

    executors.py        the interface, TorchExperts (the reference), expert sources, make_executor()
    kernel.py           KernelExperts: our CPU kernels (ktrun.ops.moe) on the mapped expert tiles
    activation.py       the family's expert activation and biases, as every executor computes them
    residency.py        where each (layer, expert) runs: the one place that decides it
    placement.py        hot experts for the GPU: a byte budget spread over the MoE layers by a strategy
    hot.py              hot experts at load: which placement applies, its memory plan, the executor it builds
    hot_store.py        hot experts' weights on the GPU, in slots, and their computation
    hybrid.py           HybridExperts: hot experts on the GPU, the rest on the CPU executor, overlapped
    dynamic.py          hot placement that follows the traffic while serving (windowed counts, hysteresis)
    ram_tier.py         ExpertRamTier: experts held in RAM under a byte budget, the rest read from NVMe on demand
    tiered.py           TieredExperts: the CPU executor over a RAM tier
    prediction.py       which experts the next MoE layer will route to, so the tier reads them early
    routing_recorder.py counting routed calls per expert into an activation profile

The ways in: executors.make_executor(), hot.build_hot_executor() and tiered.build_tiered_executor() build an
executor; placement.py (torch-free, like residency.py) is what the command lines and ktconvert use. This file imports
nothing, so importing a torch-free module of the wing never loads torch.
"""
