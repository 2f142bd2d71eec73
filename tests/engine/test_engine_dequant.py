"""``growpage.engine.loading.dequant``: GGUF blocks to fp32 with torch, bitwise what ``gguf`` gives
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; random blocks, extreme scales, chunk seams)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from growpage.engine.loading import dequant

gguf = pytest.importorskip("gguf")


# Byte offsets of each type's fp16 fields (scales, minimums) in its block.
FP16_AT = {
    dequant.Q4_0: (0,),
    dequant.Q4_1: (0, 2),
    dequant.Q5_0: (0,),
    dequant.Q5_1: (0, 2),
    dequant.Q8_0: (0,),
    dequant.Q4_K: (0, 2),
    dequant.Q5_K: (0, 2),
    dequant.Q6_K: (208,),
}
NAMES = {q: gguf.GGMLQuantizationType(q).name for q in FP16_AT}
# fp16 extremes: the largest finite, the smallest normal and subnormal, signed zeros.
EXTREMES = np.array([65504.0, -65504.0, 6.1035e-5, -5.96e-8, 5.96e-8, 0.0, -0.0], np.float16)


def random_blocks(
    qtype: int, rows: int, blocks_per_row: int, seed: int, extreme: bool = False
) -> np.ndarray:
    """``[rows, bytes per row]`` uint8 of random blocks: finite fp16 scales (and minimums),
    half of them ``EXTREMES`` when ``extreme``, every bit pattern elsewhere (quants, packed
    sub-block scales)."""
    rng = np.random.default_rng(seed)
    size = dequant._BLOCK_BYTES[qtype]
    n = rows * blocks_per_row
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        scales = (rng.standard_normal(n) * 0.05).astype(np.float16)
        if extreme:  # every other block, each extreme in turn
            scales[::2] = np.resize(rng.permutation(EXTREMES), len(scales[::2]))
        raw[:, at : at + 2] = scales.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, blocks_per_row * size)


def reference(raw: np.ndarray, qtype: int) -> torch.Tensor:
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.asarray(want, dtype=np.float32))


@pytest.mark.parametrize("qtype", list(FP16_AT), ids=NAMES.get)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (64, 18)])
@pytest.mark.parametrize("extreme", [False, True], ids=["normal", "extreme"])
def test_the_same_bits_as_the_gguf_package(qtype, rows, blocks, extreme):
    raw = random_blocks(qtype, rows, blocks, seed=rows * 100 + blocks + qtype, extreme=extreme)
    items = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)][0]
    got = dequant.dequantize(raw, qtype)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, blocks * items)
    want = reference(raw, qtype)
    assert torch.equal(got, want)
    if extreme and rows * blocks > 2 * len(EXTREMES):  # the output has huge and zero weights
        assert want.abs().max() > 1e5 and (want == 0).any()


@pytest.mark.parametrize("qtype", [dequant.Q4_K, dequant.Q6_K, dequant.Q5_0], ids=NAMES.get)
def test_chunks_join_at_their_seams(monkeypatch, qtype):
    """A tensor unpacked in many small chunks (one not full) equals the reference."""
    monkeypatch.setattr(dequant, "CHUNK_WEIGHTS", 3 * 256)
    raw = random_blocks(qtype, 5, 7, seed=qtype)
    assert torch.equal(dequant.dequantize(raw, qtype), reference(raw, qtype))


def test_q4_k_sub_block_scales_by_hand():
    """One Q4_K super-block: the 6-bit scale and minimum of sub-block 5 are split between the
    low nibble / high nibble of byte 9 and the top bits of bytes 1 and 5."""
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([0.5], np.float16).view(np.uint8)  # d
    block[2:4] = np.array([0.25], np.float16).view(np.uint8)  # dmin
    scales = block[4:16]
    scales[9] = 0x3B  # sub-block 5: scale low 4 bits 0xB, minimum low 4 bits 0x3
    scales[1] = 0b10 << 6  # scale bits 4-5 = 0b10: scale 0x2B = 43
    scales[5] = 0b01 << 6  # minimum bits 4-5 = 0b01: minimum 0x13 = 19
    block[16 + 64 : 16 + 96] = 0x70  # chunk 2: sub-block 4 nibbles 0, sub-block 5 nibbles 7
    got = dequant.dequantize(block[None], dequant.Q4_K)[0].reshape(8, 32)
    assert got[5].tolist() == [0.5 * 43 * 7 - 0.25 * 19] * 32
    assert got[4].tolist() == [0.0] * 32  # scale and minimum 0 (their bits are all clear)
    assert torch.equal(got.reshape(1, 256), reference(block[None], dequant.Q4_K))


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
    q3 = gguf.GGMLQuantizationType.Q3_K
    assert int(q3) not in dequant._BLOCK_BYTES
    raw = np.random.default_rng(1).integers(0, 256, size=(4, 110), dtype=np.uint8)
    raw[:, 108:110] = np.array([0.01], np.float16).view(np.uint8)
    got = dequant.dequantize(raw, int(q3))
    assert got.dtype == torch.float32 and tuple(got.shape) == (4, 256)
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(raw, q3)))


def test_the_default_models_quantized_weights():
    from growpage.engine.loading.loader import default_model_path, open_gguf

    f = open_gguf(default_model_path())
    quantized = [t for t in f.tensors if t.type in dequant._BLOCK_BYTES]
    assert {t.type for t in quantized} == {dequant.Q4_1, dequant.Q8_0}
    for t in quantized[:3] + [t for t in quantized if t.type == dequant.Q8_0]:
        want = gguf.quants.dequantize(f.raw(t), gguf.GGMLQuantizationType(t.type))
        assert torch.equal(dequant.dequantize(f.raw(t), t.type), torch.from_numpy(want))


def test_one_thread_inside_and_the_setting_back_after():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with dequant.one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(KeyError), dequant.one_thread():
            raise KeyError("x")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
