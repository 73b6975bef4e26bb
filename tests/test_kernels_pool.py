"""libktkernels thread pool, NUMA sub-pools, shards, async API, binding and errors."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from ktrun.ops.library import KernelError, backend_supported
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, assert_close, routing


@pytest.fixture(scope="module")
def layer():
    return PackedLayer(np.random.default_rng(11), n_experts=6, hidden=96, inter=256, bits=4, group_size=64,
                       n_shards=2)


@pytest.mark.parametrize("threads,pools", [(1, 1), (2, 1), (2, 2)])
def test_pool_sizes_and_simulated_numa(layer, threads, pools):
    """1 and 2 threads; 2 sub-pools on this one-node machine: each computes its shard, results are summed."""
    rng = np.random.default_rng(threads * 10 + pools)
    with MoEKernels(n_threads=threads, numa_pools=pools, backend="scalar" if threads == 1 else None) as moe:
        assert (moe.n_threads, moe.numa_pools) == (threads, pools)
        assert sorted({p for p, _ in moe.thread_cpus()}) == list(range(pools))
        cpus = [cpu for _, cpu in moe.thread_cpus()]
        assert cpus[0] == -1 and all(cpu >= 0 for cpu in cpus[1:]), "worker 0 is the caller, the threads are pinned"
        layer.add_to(moe)
        for T, k in [(1, 4), (12, 6)]:
            x = rng.standard_normal((T, layer.H)).astype(np.float32)
            ids, w = routing(rng, T, k, layer.E)
            assert_close(moe.forward(0, x, ids, w), layer.reference(x, ids, w), 2e-3, f"{threads}t/{pools}p T={T}")


def test_more_pools_than_shards_split_units():
    """M > S: two sub-pools share one shard, each computing part of its units (converted_dir.node_unit_ranges)."""
    rng = np.random.default_rng(5)
    one = PackedLayer(rng, n_experts=4, hidden=64, inter=192, bits=8, group_size=64, n_shards=1)   # 3 units
    x = rng.standard_normal((7, 64)).astype(np.float32)
    ids, w = routing(rng, 7, 3, one.E)
    with MoEKernels(n_threads=2, numa_pools=2) as moe:
        one.add_to(moe)
        assert_close(moe.forward(0, x, ids, w), one.reference(x, ids, w), 2e-3, "1 shard on 2 pools")


def test_many_shards_on_one_pool(layer):
    """M < S: one pool computes both shards of the layer and sums them."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, layer.H)).astype(np.float32)
    ids, w = routing(rng, 5, 4, layer.E)
    with MoEKernels(n_threads=2, numa_pools=1) as moe:
        layer.add_to(moe)
        ref = layer.reference(x, ids, w)
        assert_close(moe.forward(0, x, ids, w), ref, 2e-3, "2 shards on 1 pool")
        # a layer needs all its shards: registering only one is refused
        with pytest.raises(ValueError, match="not the 1-shard split"):
            layer.add_to(moe, layer_id=1, shards=layer.shards[:1])


def test_async_submit_accumulate_and_torch(layer):
    rng = np.random.default_rng(8)
    x = torch.randn(6, layer.H)
    ids, w = routing(rng, 6, 2, layer.E)
    ref = layer.reference(x.numpy(), ids, w)
    with MoEKernels(n_threads=2) as moe:
        layer.add_to(moe)
        layer.add_to(moe, layer_id=7)
        out = torch.full((6, layer.H), 1.0)
        moe.submit(0, x, torch.from_numpy(ids), torch.from_numpy(w), out, accumulate=True)
        moe.sync()
        assert_close(out.numpy() - 1.0, ref, 2e-3, "accumulate into torch out")
        # two layers back to back: the second submit waits for the first
        a = moe.submit(0, x.numpy(), ids, w)
        b = moe.submit(7, x.numpy(), ids, w)
        moe.sync()
        assert_close(a, ref, 2e-3, "layer 0")
        assert_close(b, ref, 2e-3, "layer 7")
        # bf16 activations (torch bfloat16, or numpy uint16 bit patterns) are converted exactly
        xb = x.to(torch.bfloat16)
        got = moe.forward(0, xb, ids, w)
        np.testing.assert_array_equal(got, moe.forward(0, xb.float().numpy(), ids, w))
        np.testing.assert_array_equal(got, moe.forward(0, xb.view(torch.int16).numpy().view(np.uint16), ids, w))
        # strided rows of x (a view into a wider buffer)
        wide = np.zeros((6, layer.H + 32), np.float32)
        wide[:, : layer.H] = x.numpy()
        np.testing.assert_array_equal(moe.forward(0, wide[:, : layer.H], ids, w), moe.forward(0, x.numpy(), ids, w))


def test_bad_input_is_reported(layer):
    with MoEKernels(n_threads=2) as moe:
        layer.add_to(moe)
        x = np.zeros((2, layer.H), np.float32)
        with pytest.raises(KernelError, match=r"expert id 6 at token 1, slot 0 is out of range"):
            moe.forward(0, x, np.array([[0], [6]]), np.ones((2, 1), np.float32))
        with pytest.raises(ValueError, match="expected"):
            moe.forward(0, np.zeros((2, 5), np.float32), np.zeros((2, 1)), np.ones((2, 1), np.float32))
        with pytest.raises(KeyError):
            moe.forward(3, x, np.zeros((2, 1)), np.ones((2, 1), np.float32))
        sh = layer.shards[0]
        with pytest.raises(ValueError, match="gate.qweight: shape"):
            moe.add_layer(2, shards=[type(sh)(sh.gate_q[:, :1], *[getattr(sh, f) for f in
                                     ("gate_s", "up_q", "up_s", "down_q", "down_s", "i0", "i1")]), layer.shards[1]],
                          n_experts=layer.E, hidden=layer.H, intermediate_pad=layer.plan.intermediate_pad, bits=4,
                          group_size=64)


def _run_with_backend_env(value: str) -> subprocess.CompletedProcess:
    code = "from ktrun.ops.moe import MoEKernels; print(MoEKernels(n_threads=1).backend)"
    return subprocess.run([sys.executable, "-c", code], check=False, env={**os.environ, "KT_KERNEL_BACKEND": value},
                          capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("backend", ["scalar", "avx2", "avx512", "amx"])
def test_forced_backend_env(backend):
    r = _run_with_backend_env(backend)
    if backend_supported(backend):
        assert r.returncode == 0 and r.stdout.strip() == backend, r.stderr
    else:
        assert r.returncode != 0 and f"kernel backend '{backend}' is not supported by this CPU" in r.stderr


def test_unknown_backend_env():
    r = _run_with_backend_env("sse9")
    assert r.returncode != 0 and "unknown kernel backend 'sse9'" in r.stderr


_POOL_MODE_RUN = """
import sys; import numpy as np
sys.path.insert(0, {tests!r})
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, routing
rng = np.random.default_rng(21)
layer = PackedLayer(rng, n_experts=6, hidden=96, inter=256, bits=4, group_size=64, n_shards=1)
x = rng.standard_normal(({T}, layer.H)).astype(np.float32)
ids, w = routing(rng, {T}, 4, layer.E)
with MoEKernels(n_threads=2) as moe:
    layer.add_to(moe)
    print([cpu for _, cpu in moe.thread_cpus()])
    np.save({out!r}, moe.forward(0, x, ids, w))
"""


@pytest.mark.parametrize("T", [1, 12])
def test_caller_worker_and_pinned_threads_agree(tmp_path, T):
    """Worker 0 computing inside sync() (the default) and every worker a pinned thread (KT_POOL_CALLER=0) split the
    same items: bit-identical outputs; the caller is reported unpinned (-1) only in the default mode."""
    tests = os.path.dirname(os.path.abspath(__file__))
    outs = {}
    for mode in ("1", "0"):
        out = str(tmp_path / f"out{mode}.npy")
        r = subprocess.run([sys.executable, "-c", _POOL_MODE_RUN.format(tests=tests, T=T, out=out)], check=False,
                           env={**os.environ, "KT_POOL_CALLER": mode}, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        cpus = ast.literal_eval(r.stdout.strip().splitlines()[-1])
        assert (cpus[0] == -1) == (mode == "1") and all(c >= 0 for c in cpus[1:]), cpus
        outs[mode] = np.load(out)
    np.testing.assert_array_equal(outs["1"], outs["0"])


@pytest.mark.parametrize("threads", [1, 2])
def test_wake_and_rest_leave_the_jobs_bits(layer, threads):
    """MoEKernels.wake (kt_pool_wake, what Engine.step calls first: the workers run an empty job) and rest
    (kt_pool_rest, what the server calls after each step: idle workers sleep at once): jobs after either, a wake while
    a job is in flight (nothing launched) and a wake with no job after it change no bits."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((3, layer.H)).astype(np.float32)
    ids, w = routing(rng, 3, 4, layer.E)
    with MoEKernels(n_threads=threads) as moe:
        layer.add_to(moe)
        plain = moe.forward(0, x, ids, w)
        moe.wake()
        moe.wake()                                     # the first empty job may still be pending: no second one
        assert np.array_equal(moe.forward(0, x, ids, w), plain)
        out = np.empty_like(plain)
        moe.submit(0, x, ids, w, out)
        moe.wake()                                     # a job in flight: nothing launched, the job ends as before
        moe.sync()
        assert np.array_equal(out, plain)
        moe.rest()                                     # idle workers sleep at once; the next job wakes them
        assert np.array_equal(moe.forward(0, x, ids, w), plain)
        moe.rest()
        moe.wake()                                     # a wake after a rest: the empty job runs, then the next one
        assert np.array_equal(moe.forward(0, x, ids, w), plain)
        moe.wake()                                     # left pending when the context closes


_PREFETCH_RUN = """
import sys; import numpy as np
sys.path.insert(0, {tests!r})
from ktrun.ops.moe import MoEKernels
from test_kernels_helpers import PackedLayer, routing
rng = np.random.default_rng(23)
layer = PackedLayer(rng, n_experts=6, hidden=96, inter=256, bits={bits}, group_size=64, n_shards=1)
x = rng.standard_normal((2, layer.H)).astype(np.float32)
ids, w = routing(rng, 2, 4, layer.E)
with MoEKernels(n_threads=2) as moe:
    layer.add_to(moe)
    print(moe.backend_detail)
    np.save({out!r}, np.stack([moe.forward(0, x[:1], ids[:1], w[:1])[0], moe.forward(0, x, ids, w)[1]]))
"""


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_prefetch_hint_by_vendor_and_env(tmp_path, bits):
    """Decode-shaped weight streams prefetch non-temporally on AMD and into L2 elsewhere (kt::decode_prefetch_nta:
    nta halved the decode rate on an Intel Xeon), KT_DECODE_PREFETCH=nta / t1 overrides, another value is ignored
    with a word in backend_detail; the hint changes no bits (decode rows at T = 1 and 2)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    with open("/proc/cpuinfo") as f:   # the vendor as the OS reads it, not through the library under test
        amd = any(line.split(":")[1].strip() in ("AuthenticAMD", "HygonGenuine")
                  for line in f if line.startswith("vendor_id"))
    default = "nta (AMD default)" if amd else "t1 (non-AMD default)"
    expect = {None: default, "nta": "nta (KT_DECODE_PREFETCH)", "t1": "t1 (KT_DECODE_PREFETCH)",
              "l3": default[:-1] + "; KT_DECODE_PREFETCH not nta / t1)"}
    outs = {}
    for value, name in expect.items():
        env = {k: v for k, v in os.environ.items() if k != "KT_DECODE_PREFETCH"}
        if value:
            env["KT_DECODE_PREFETCH"] = value
        out = str(tmp_path / f"out_{value}.npy")
        r = subprocess.run([sys.executable, "-c", _PREFETCH_RUN.format(tests=tests, bits=bits, out=out)], check=False,
                           env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1].endswith(f"; decode prefetch {name}"), r.stdout
        outs[value] = np.load(out)
    for value in expect:
        np.testing.assert_array_equal(outs[value], outs[None])
