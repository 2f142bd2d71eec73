"""``growpage.engine.dequant``: GGUF blocks to fp32 with torch, bitwise what ``gguf`` gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from growpage.engine import dequant

gguf = pytest.importorskip("gguf")


def random_blocks(qtype: int, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """``[rows, bytes per row]`` uint8 of random blocks: finite fp16 scales (and minimums),
    every bit pattern for the quants."""
    rng = np.random.default_rng(seed)
    size = dequant._BLOCK_BYTES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, size), dtype=np.uint8)
    halves = 2 if qtype == dequant.Q4_1 else 1  # d, and m for Q4_1
    scales = (rng.standard_normal((rows * blocks_per_row, halves)) * 0.05).astype(np.float16)
    raw[:, : 2 * halves] = scales.view(np.uint8).reshape(-1, 2 * halves)
    return raw.reshape(rows, blocks_per_row * size)


@pytest.mark.parametrize(
    "qtype", [dequant.Q4_0, dequant.Q4_1, dequant.Q8_0], ids=["Q4_0", "Q4_1", "Q8_0"]
)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (64, 18)])
def test_the_same_bits_as_the_gguf_package(qtype, rows, blocks):
    raw = random_blocks(qtype, rows, blocks, seed=rows * 100 + blocks)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    got = dequant.dequantize(raw, qtype)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, blocks * 32)
    assert torch.equal(got, torch.from_numpy(np.asarray(want, dtype=np.float32)))


def test_leading_dimensions_are_kept_and_the_input_is_not_written():
    raw = random_blocks(dequant.Q4_1, 6, 2, seed=5)
    before = raw.copy()
    got = dequant.dequantize(raw.reshape(2, 3, -1), dequant.Q4_1)
    assert tuple(got.shape) == (2, 3, 64)
    assert torch.equal(got.reshape(6, 64), dequant.dequantize(raw, dequant.Q4_1))
    assert np.array_equal(raw, before)


def test_nibble_order_low_half_first():
    """One Q4_0 block by hand: byte j holds weight j (low nibble) and weight j + 16 (high)."""
    block = np.zeros(18, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[2:] = np.arange(16, dtype=np.uint8) | (np.uint8(15) << 4)  # low j, high 15
    got = dequant.dequantize(block[None], dequant.Q4_0)[0]
    assert got[:16].tolist() == [float(j - 8) for j in range(16)]
    assert got[16:].tolist() == [7.0] * 16


def test_a_partial_block_is_refused():
    with pytest.raises(ValueError, match="not a whole number of 20-byte blocks"):
        dequant.dequantize(np.zeros((2, 30), dtype=np.uint8), dequant.Q4_1)


@pytest.mark.parametrize("dtype,qtype", [(np.float32, dequant.F32), (np.float16, dequant.F16)])
def test_plain_types_are_copied_as_fp32(dtype, qtype):
    values = np.random.default_rng(0).standard_normal((3, 8)).astype(dtype)
    got = dequant.dequantize(values, qtype)
    assert got.dtype == torch.float32 and torch.equal(
        got, torch.from_numpy(values.astype(np.float32))
    )
    got[0, 0] = 123.0  # a copy, writable
    assert values[0, 0] != 123.0


def test_other_types_go_to_the_gguf_package():
    q5 = gguf.GGMLQuantizationType.Q5_0
    data = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(data, q5)
    got = dequant.dequantize(raw, int(q5))
    assert got.dtype == torch.float32 and tuple(got.shape) == (4, 64)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, q5)))


def test_the_default_models_quantized_weights():
    from growpage.engine.loader import default_model_path, open_gguf

    f = open_gguf(default_model_path())
    quantized = [t for t in f.tensors if t.type in dequant._BLOCK_BYTES]
    assert {t.type for t in quantized} == {dequant.Q4_1, dequant.Q8_0}
    for t in quantized[:3] + [t for t in quantized if t.type == dequant.Q8_0]:
        want = gguf.quants.dequantize(f.raw(t), gguf.GGMLQuantizationType(t.type))
        assert torch.equal(dequant.dequantize(f.raw(t), t.type), torch.from_numpy(want))
