"""The aligned safetensors writer: standard readers open its files, every tensor is 64-byte aligned."""
import json
import struct

import numpy as np
import pytest
import torch
from ktlayouts.converted_dir import is_pad_tensor
from safetensors import safe_open
from safetensors.torch import load_file

from ktconvert.writer import AlignedWriter, TensorSpec, atomic_write_bytes


def _tensor_offsets(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8: 8 + n])
    return 8 + n, {k: v for k, v in header.items() if k != "__metadata__"}, header.get("__metadata__")


def test_odd_sizes_are_aligned_and_readable(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "a.u8": rng.integers(0, 255, (3, 7, 5), dtype=np.uint8),          # 105 bytes: needs padding
        "b.f32": rng.standard_normal((2, 3, 11)).astype(np.float32),       # 264 bytes
        "c.bf16": rng.integers(0, 2**15, (13,), dtype=np.uint16),        # 26 bytes as BF16 bits
        "d.u8": rng.integers(0, 255, (64,), dtype=np.uint8),               # exactly 64
    }
    dtypes = {"a.u8": "U8", "b.f32": "F32", "c.bf16": "BF16", "d.u8": "U8"}
    specs = [TensorSpec(k, dtypes[k], v.shape) for k, v in arrays.items()]
    out = tmp_path / "x.safetensors"
    w = AlignedWriter(out, specs, {"kt.layout": "test"})
    # stacked tensors can be written slice by slice, in any order
    for e in (2, 0, 1):
        w.write("a.u8", arrays["a.u8"][e], index=e)
    for k in ("b.f32", "c.bf16", "d.u8"):
        w.write(k, arrays[k])
    assert not out.exists() and (tmp_path / "x.safetensors.partial").exists()
    size, sha = w.commit()
    assert out.stat().st_size == size and len(sha) == 64
    assert not (tmp_path / "x.safetensors.partial").exists()

    base, entries, meta = _tensor_offsets(out)
    assert base % 64 == 0 and meta == {"kt.layout": "test"}
    for name, e in entries.items():
        assert is_pad_tensor(name) or (base + e["data_offsets"][0]) % 64 == 0, name
    with safe_open(str(out), framework="np") as f:
        assert f.metadata() == {"kt.layout": "test"}
        for k in ("a.u8", "b.f32", "d.u8"):
            np.testing.assert_array_equal(f.get_tensor(k), arrays[k])
    t = load_file(str(out))
    assert t["c.bf16"].dtype == torch.bfloat16
    np.testing.assert_array_equal(t["c.bf16"].view(torch.int16).numpy().view(np.uint16), arrays["c.bf16"])
    assert {k for k in t if not is_pad_tensor(k)} == set(arrays)


def test_incomplete_write_is_refused_and_leaves_nothing(tmp_path):
    out = tmp_path / "y.safetensors"
    w = AlignedWriter(out, [TensorSpec("a", "F32", (4, 4))])
    w.write("a", np.zeros(4, np.float32), index=0)
    with pytest.raises(RuntimeError, match="not fully written"):
        w.commit()
    assert list(tmp_path.iterdir()) == []


def test_wrong_size_and_context_abort(tmp_path):
    out = tmp_path / "z.safetensors"
    with pytest.raises(ValueError, match="expected 64"), AlignedWriter(out, [TensorSpec("a", "F32", (16,))]) as w:
        w.write("a", np.zeros(15, np.float32))
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_bytes(tmp_path):
    atomic_write_bytes(tmp_path / "m.json", b"{}")
    assert (tmp_path / "m.json").read_bytes() == b"{}" and len(list(tmp_path.iterdir())) == 1
