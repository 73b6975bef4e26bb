"""Files written for S NUMA shards serve on M nodes: each node cuts its unit pieces straight from the packed bytes
(expert_shards.nodes_for_shards), and the per-node partial expert outputs sum to the expert of the source."""
import numpy as np
import pytest
from ktlayouts.converted_dir import PROJECTIONS, expert_file, expert_tensor, node_unit_ranges
from ktlayouts.cpu_expert import unpack_expert_matrix
from safetensors import safe_open

from ktconvert.converted_reader import ConvertedDir, unit_piece
from ktconvert.pipeline import ConvertOptions, convert
from ktconvert.sources import open_source
from ktconvert.testing import make_checkpoint


@pytest.fixture(scope="module")
def wide_src(tmp_path_factory):
    """deepseek_v2 fixture with an expert intermediate of 320 = 5 units of 64."""
    return make_checkpoint("deepseek_v2", tmp_path_factory.mktemp("wide"), num_layers=2, moe_intermediate_size=320)


def silu(x):
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("shards,method,group", [(2, "int8-amx", 64), (3, "int4-amx", -1), (2, "bf16", 128)])
def test_n_shard_files_on_m_nodes(shards, method, group, wide_src, tmp_path):
    out = tmp_path / "out"
    convert(wide_src, out, ConvertOptions(method=method, group_size=group, numa_nodes=shards), show_progress=False)
    conv = ConvertedDir(out)
    geo = conv.geometry
    plan, unit = geo.shard_plan, geo.shard_plan.unit
    layer = geo.moe_layers[0]
    x = np.random.default_rng(0).standard_normal((4, geo.hidden)).astype(np.float64)
    limit = {"int8-amx": 0.01, "int4-amx": 0.15, "bf16": 0.005}[method]
    with open_source(wide_src) as src:
        ref_w = {e: {p: src.read(src.arch.expert_tensor_name(layer, e, p)).numpy().astype(np.float64)
                     for p in PROJECTIONS} for e in (0, 5)}
    handles = [safe_open(str(out / expert_file(layer, s, shards)), framework="pt") for s in range(shards)]
    for n_nodes in range(1, 6):
        nodes = node_unit_ranges(plan, n_nodes)
        # every padded intermediate row is served by exactly one node
        rows = sorted(r for node in nodes for s, u0, u1 in node
                      for r in range(plan.shard_range(s)[0] + u0 * unit, plan.shard_range(s)[0] + u1 * unit))
        assert rows == list(range(plan.intermediate_pad)), n_nodes
        for e, w in ref_w.items():
            y = np.zeros((x.shape[0], geo.hidden))
            gate_rows = {}
            for node in nodes:
                for s, u0, u1 in node:
                    mats = {}
                    for p in PROJECTIONS:
                        packed = {part: handles[s].get_slice(expert_tensor(p, part))[e: e + 1][0].numpy()
                                  for part in (("qweight",) if geo.bits == 16 else ("qweight", "scales"))}
                        q, sc, geom = unit_piece(packed, p, geo, s, u0, u1)
                        mats[p] = unpack_expert_matrix(q, sc, geom).astype(np.float64)
                    gate_rows[plan.shard_range(s)[0] + u0 * unit] = mats["gate"]
                    y += (silu(x @ mats["gate"].T) * (x @ mats["up"].T)) @ mats["down"].T   # this node's part
            # pieces cut from the bytes reassemble exactly to the whole-shard dequantization
            gate = np.concatenate([gate_rows[k] for k in sorted(gate_rows)])[: geo.intermediate]
            np.testing.assert_array_equal(gate, conv.read_expert(layer, e)["gate"])
            # and the summed node outputs are the source expert, within the method's error
            ref = (silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2 * limit, (n_nodes, e)
            assert np.linalg.norm(gate - w["gate"]) / np.linalg.norm(w["gate"]) < limit
