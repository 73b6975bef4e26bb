"""Reading into reused buffers (Source.read's out, bf16 widening into a given array, the pipeline's per-thread
buffer), the row-chunked reference quantize, and the converter's malloc policy: the same values as the plain paths,
checked against safetensors' own reader and whole-matrix arithmetic."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from ktlayouts import cpu_expert
from ktlayouts.bf16 import bf16_bits_to_f32, f32_to_bf16_bits
from ktlayouts.converted_dir import ExpertGeometry
from safetensors import safe_open

from ktconvert import pipeline
from ktconvert.sources import open_source
from ktconvert.sources.roles import SourceError


def _shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_read_into_a_buffer_equals_safetensors(ckpt_dir):
    d = ckpt_dir("deepseek_v3")
    with open_source(d) as src:
        for name in src.tensor_names()[:40]:
            info = src.info(name)
            if info.dtype not in ("BF16", "F16", "F32"):
                continue
            with safe_open(_shard_of(d, name), framework="pt") as f:
                want = f.get_tensor(name).float()
            out = np.full(info.shape, np.nan, np.float32)             # every value must be written
            got = src.read(name, out=out)
            assert got.data_ptr() == out.ctypes.data, name            # decoded into the caller's memory
            assert torch.equal(got, want), name


def test_read_into_a_buffer_checks_its_shape(ckpt_dir):
    with open_source(ckpt_dir("deepseek_v3")) as src:
        name = next(n for n in src.tensor_names() if len(src.info(n).shape) == 2)
        with pytest.raises(ValueError, match="out is"):
            src.read(name, out=np.empty((1, 1), np.float32))


def test_nan_reported_by_the_buffer_read_too(ckpt_copy):
    d = ckpt_copy("deepseek_v3")
    with open_source(d) as src:
        name = next(n for n in src.tensor_names() if src.info(n).dtype == "BF16" and len(src.info(n).shape) == 2)
        info = src.info(name)
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 2 * 5)
        f.write(struct.pack("<H", 0x7FC0))               # a bf16 quiet NaN at element 5
    with open_source(d) as src:
        for out in (None, np.empty(info.shape, np.float32)):
            with pytest.raises(SourceError, match=r"NaN at element"):
                src.read(name, out=out)


def test_nan_in_a_large_tensor_beyond_the_first_chunk(tmp_path):
    """A tensor of several chunks (the fixtures' are smaller than one): NaN near its end is found."""
    from ktconvert.sources.checkpoint import FINITE_CHUNK, Source

    values = np.ones(3 * FINITE_CHUNK + 11, np.float32)
    values[-3] = np.inf
    assert not all(np.isfinite(values[i:i + FINITE_CHUNK]).all() for i in range(0, values.size, FINITE_CHUNK))
    info = type("Info", (), {"shape": values.shape, "dtype": "F32", "offset": 0, "file": tmp_path / "x",
                             "name": "x"})()
    with pytest.raises(SourceError, match=r"Inf at element \(3145736,\)"):
        Source._check_finite(info, values)


def test_bf16_widening_into_a_given_array():
    rng = np.random.default_rng(0)
    bits = f32_to_bf16_bits(rng.standard_normal((37, 19)).astype(np.float32))
    out = np.full((37, 19), 7.0, np.float32)
    got = bf16_bits_to_f32(bits, out=out)
    assert got is out
    want = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16).float().numpy()   # torch's widening
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(bf16_bits_to_f32(bits), want)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        bf16_bits_to_f32(bits, out=np.empty((19, 37), np.float32))


@pytest.mark.parametrize("method,group", [("int4-amx", 128), ("int8-amx", 32), ("int4-amx", -1)])
def test_quantize_in_row_chunks_equals_one_pass(monkeypatch, method, group):
    """The reference quantize works QUANTIZE_CHUNK weights at a time: the same codes and scales as all rows at once."""
    geom = ExpertGeometry(method=method, group_size=group, n_experts=1, hidden=512, intermediate=160, numa_nodes=1,
                          moe_layers=(0,)).matrix_geometry("gate", 0)
    w = np.random.default_rng(1).standard_normal((geom.n, geom.k)).astype(np.float32)
    monkeypatch.setattr(cpu_expert, "QUANTIZE_CHUNK", 1)             # one row per step
    codes_rows, scales_rows = cpu_expert.quantize(w, geom)
    monkeypatch.setattr(cpu_expert, "QUANTIZE_CHUNK", 1 << 40)       # every row in one step
    codes_all, scales_all = cpu_expert.quantize(w, geom)
    np.testing.assert_array_equal(codes_rows, codes_all)
    np.testing.assert_array_equal(scales_rows, scales_all)


def test_thread_buffer_is_reused_and_sized_for_the_plan(ckpt_dir):
    with open_source(ckpt_dir("deepseek_v3")) as src:
        names = {p: src.arch.expert_tensor_name(src.arch.moe_layers()[0], 0, p) for p in ("gate", "up", "down")}
        reserve = 10 * sum(int(np.prod(src.info(n).shape)) for n in names.values())
        a = pipeline._read_reused(src, names, reserve)
        first = pipeline._SCRATCH.reader.buf
        assert first.size == reserve
        b = pipeline._read_reused(src, names, reserve)
        assert pipeline._SCRATCH.reader.buf is first                   # no new memory for the next expert
        for p, n in names.items():
            assert np.shares_memory(b[p], first)
            np.testing.assert_array_equal(b[p], src.read(n).numpy())
        assert a["gate"].ctypes.data == b["gate"].ctypes.data


def test_dense_output_aliasing_the_buffer_is_copied(ckpt_dir, tmp_path):
    """An encoded array that is the read tensor's memory (a float32 tensor written as read) must not stay in the
    thread's buffer, which the next read overwrites."""
    class Passthrough:
        calibrated = False

        def encode(self, name, tensor, role):
            return {name: tensor}

    with open_source(ckpt_dir("deepseek_v3")) as src:
        names = [n for n in src.tensor_names() if src.info(n).dtype in ("BF16", "F32")][:2]
        conv = pipeline.Converter(src, tmp_path, pipeline.ConvertOptions(), None, None, Passthrough(), None, None,
                                  scratch_floats=1 << 20)
        _, first = conv._encode_dense(names[0], None)
        kept = first[names[0]].copy()
        conv._encode_dense(names[1], None)                       # overwrites the thread's buffer
        assert not np.shares_memory(first[names[0]], pipeline._SCRATCH.reader.buf)
        np.testing.assert_array_equal(first[names[0]], kept)
        np.testing.assert_array_equal(kept, src.read(names[0]).numpy())


def test_read_bf16_is_the_stored_bits(ckpt_dir, ckpt_copy):
    """The calibration forward's bf16 expert reads: a BF16 tensor's stored bits exactly (safetensors' reader), a
    NaN still reported by name."""
    d = ckpt_dir("deepseek_v3")
    with open_source(d) as src:
        name = src.arch.expert_tensor_name(src.arch.moe_layers()[0], 1, "down")
        with safe_open(_shard_of(d, name), framework="pt") as f:
            want = f.get_tensor(name)
        got = src.read_bf16(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))
    c = ckpt_copy("deepseek_v3")
    with open_source(c) as src:
        info = src.info(name)
    with open(info.file, "r+b") as f:
        f.seek(info.offset + 6)
        f.write(struct.pack("<H", 0xFF80))               # -inf
    with open_source(c) as src, pytest.raises(SourceError, match="Inf at element"):
        src.read_bf16(name)


def test_calibration_reads_experts_and_layers_into_reused_buffers(ckpt_dir):
    """The calibration forward's float32 reads (an expert's three matrices, a layer's tensors): the values
    safetensors stores, decoded into one buffer that the next read reuses (no fresh pages per expert)."""
    from ktconvert.read_buffer import ReadBuffer

    d = ckpt_dir("deepseek_v3")
    buf = ReadBuffer()
    with open_source(d) as src:
        layer = src.arch.moe_layers()[0]
        ptrs = []
        for e in (0, 1):
            names = [src.arch.expert_tensor_name(layer, e, p) for p in ("gate", "up", "down")]
            got = buf.read(src, names)
            for n, t in zip(names, got):
                with safe_open(_shard_of(d, n), framework="pt") as f:
                    torch.testing.assert_close(t, f.get_tensor(n).float(), rtol=0, atol=0)
                assert np.shares_memory(t.numpy(), buf.buf)
            ptrs.append(buf.buf.ctypes.data)
        assert ptrs[0] == ptrs[1]
