"""GGUF block quantizations to fp32 in a few whole-tensor torch operations.

The ``gguf`` package dequantizes with numpy, a group of 16 rows at a time: for SmolLM2's Q4_1
weights that is about 2 s of every ``LLM()``, for Qwen2.5-Coder-1.5B's K-quants minutes. The
formats below are simple enough to unpack at once, with the same fp32 arithmetic in the same
order, so the weights come out bitwise equal (``tests/engine/test_engine_dequant.py``, and
``benchmarks/gguf_read.py`` on a real file). F32 and F16 are copied; any other type goes to
``gguf.quants.dequantize`` (the package is imported only then). A tensor is unpacked in chunks
of about a million weights, so the temporaries stay small next to the fp32 result.

Blocks of 32 weights (``d``, ``m``: fp16 scale and minimum; ``qh``: one high bit per weight,
bit ``j`` of the little-endian u32 for weight ``j``)::

    Q4_0  d | 16 B nibbles                     w = (nibble - 8) * d
    Q4_1  d | m | 16 B nibbles                 w = nibble * d + m
    Q5_0  d | qh u32 | 16 B nibbles            w = ((nibble | high << 4) - 16) * d
    Q5_1  d | m | qh u32 | 16 B nibbles        w = (nibble | high << 4) * d + m
    Q8_0  d | 32 int8                          w = q * d

A nibble byte ``j`` holds weight ``j`` in its low half and weight ``j + 16`` in its high half.

K-quants, super-blocks of 256 weights::

    Q4_K  d | dmin | 12 B scales | 128 B nibbles            (8 sub-blocks of 32)
    Q5_K  d | dmin | 12 B scales | 32 B qh | 128 B nibbles  (8 sub-blocks of 32)
    Q6_K  128 B ql | 64 B qh | 16 int8 scales | d           (16 sub-blocks of 16)

Q4_K / Q5_K: sub-block ``i`` has a 6-bit scale ``sc_i`` and minimum ``mn_i`` (bytes 0-3 hold
``sc_0..3`` in their low 6 bits, bytes 4-7 ``mn_0..3``, bytes 8-11 the low 4 bits of
``sc_4..7`` (low half) and ``mn_4..7`` (high half), whose top 2 bits sit in the top bits of
bytes 0-3 and 4-7); ``w = (d * sc_i) * q - (dmin * mn_i)``. The nibbles come in 4 chunks of
32 bytes: chunk ``c`` holds sub-block ``2c`` in its low halves and ``2c + 1`` in its high
halves; Q5_K's high bit of weight ``j`` of sub-block ``i`` is bit ``i`` of ``qh[j]``.
Q6_K: two halves of 128 weights; in half ``h``, ``ql[64h : 64h + 64]`` gives weights
``0-63`` (low nibbles) and ``64-127`` (high nibbles), and bits ``2k, 2k + 1`` of
``qh[32h + j]`` are the top 2 bits of weight ``32k + j``; ``w = (d * scale_s) * (q - 32)``
with ``s`` the weight's sub-block of 16.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from growpage.engine.gguf_file import QUANT_SIZES

BLOCK = 32
# gguf.GGMLQuantizationType values
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K = 12, 13, 14
CHUNK_WEIGHTS = 1 << 20  # weights unpacked per step

_Unpack = Callable[[torch.Tensor, torch.Tensor], None]  # (blocks [n, bytes] u8, out [n, items])


def dequantize(raw: np.ndarray, qtype: int) -> torch.Tensor:
    """A GGUF tensor's data as ``GGUFFile.raw`` gives it (``[..., bytes per row]`` uint8 for a
    quantized type, the items for a plain one) as a new fp32 tensor ``[..., row length]``."""
    if qtype in (F32, F16):  # plain items already
        return torch.from_numpy(np.array(raw, dtype=np.float32, copy=True))
    if qtype not in _UNPACK:
        import gguf

        data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
    items, size = QUANT_SIZES[qtype]
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    if row_bytes % size:
        raise ValueError(f"a row of {row_bytes} bytes is not a whole number of {size}-byte blocks")
    blocks = raw.reshape(-1, size)
    out = torch.empty(blocks.shape[0], items)
    step = max(1, CHUNK_WEIGHTS // items)
    for start in range(0, blocks.shape[0], step):
        # A writable copy of this chunk's packed bytes (the file's memory map is read-only).
        part = torch.from_numpy(np.array(blocks[start : start + step], copy=True))
        _UNPACK[qtype](part, out[start : start + step])
    return out.reshape(*lead, row_bytes // size * items)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block as fp32 ``[n, 1]``."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` bytes -> ``[..., 2, k]``: the low nibbles, then the high ones."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-2)


_BIT = torch.arange(8, dtype=torch.uint8)
_PAIR = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """``[n, 4]`` bytes of a little-endian u32 -> its 32 bits ``[n, 32]`` (bit 0 first)."""
    return ((qh.unsqueeze(-1) >> _BIT) & 1).reshape(qh.shape[0], 32)


def _unpack_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(blocks[:, 2:]).reshape(out.shape))
    out.sub_(8).mul_(_f16(blocks, 0))


def _unpack_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(blocks[:, 4:]).reshape(out.shape))
    out.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _five_bits(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    low = _nibbles(blocks[:, qh_at + 4 :]).reshape(-1, BLOCK)
    return low | (_high_bits_32(blocks[:, qh_at : qh_at + 4]) << 4)


def _unpack_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_five_bits(blocks, 2))
    out.sub_(16).mul_(_f16(blocks, 0))


def _unpack_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_five_bits(blocks, 4))
    out.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _unpack_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(_f16(blocks, 0))


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: ``d * sc`` and ``dmin * mn``, each fp32 ``[n, 8, 1]``."""
    s = blocks[:, 4:16].reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)), dim=1)
    scale = _f16(blocks, 0) * sc.float()
    minimum = _f16(blocks, 2) * mn.float()
    return scale.unsqueeze(-1), minimum.unsqueeze(-1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes of nibbles -> ``[n, 8, 32]``: chunk ``c`` gives sub-blocks ``2c``, ``2c+1``."""
    return _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 8, 32)


def _unpack_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scale, minimum = _k_scales(blocks)
    w = out.view(-1, 8, 32)
    w.copy_(_k_nibbles(blocks[:, 16:]))
    w.mul_(scale).sub_(minimum)


def _unpack_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scale, minimum = _k_scales(blocks)
    high = (blocks[:, 16:48].unsqueeze(1) >> _BIT.view(8, 1)) & 1  # [n, 8, 32]
    w = out.view(-1, 8, 32)
    w.copy_(_k_nibbles(blocks[:, 48:]) | (high << 4))
    w.mul_(scale).sub_(minimum)


def _unpack_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    low = _nibbles(blocks[:, :128].reshape(-1, 2, 64)).reshape(-1, 8, 32)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> _PAIR.view(4, 1)) & 3
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    w = out.view(-1, 16, 16)
    w.copy_((low | (high.reshape(-1, 8, 32) << 4)).reshape(-1, 16, 16))
    w.sub_(32).mul_(scale.unsqueeze(-1))


_UNPACK: dict[int, _Unpack] = {
    Q4_0: _unpack_q4_0,
    Q4_1: _unpack_q4_1,
    Q5_0: _unpack_q5_0,
    Q5_1: _unpack_q5_1,
    Q8_0: _unpack_q8_0,
    Q4_K: _unpack_q4_k,
    Q5_K: _unpack_q5_k,
    Q6_K: _unpack_q6_k,
}
_BLOCK_BYTES = {q: QUANT_SIZES[q][1] for q in _UNPACK}  # bytes per block of each native type
