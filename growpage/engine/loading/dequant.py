"""GGUF block quantizations to fp32 in a few whole-tensor torch operations.

The ``gguf`` package dequantizes with numpy, a group of 16 rows at a time: for SmolLM2's Q4_1
weights that was about 2 s of every ``LLM()``, for Qwen2.5-Coder-1.5B's Q4_K / Q6_K weights it
is 11 s against 3.4 s here (one thread, ``benchmarks/gguf_read.py``). The formats below are
simple enough to unpack at once, with the same fp32 arithmetic in the same order, so the
weights come out bitwise equal (``tests/engine/test_engine_dequant.py``, and
``benchmarks/gguf_read.py`` on a real file). F32 and F16 are copied; any other type goes to
``gguf.quants.dequantize`` (the package is imported only then). A tensor is unpacked in chunks
of about 16 million weights, so the temporaries stay small next to the fp32 result;
``one_thread()`` is the context a whole model's tensors are unpacked in (the loader's).

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

import contextlib
from collections.abc import Callable, Iterator

import numpy as np
import torch

from growpage.engine.loading.gguf_file import QUANT_SIZES

BLOCK = 32
# gguf.GGMLQuantizationType values
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K = 12, 13, 14
CHUNK_WEIGHTS = 1 << 24  # weights unpacked per step

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


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread inside, its setting put back after.

    NOTE: unpacking is bound by memory, not arithmetic: a second thread gains nothing on an
    idle machine, and on a busy one every operation waits at its barrier for a thread that lost
    its core (Qwen2.5-Coder-1.5B's weights took 16 s on one thread against 70 s on two at a load
    average of 9, 2 cores). Changing the setting costs milliseconds: wrap a whole model's
    tensors, not each one."""
    num_threads = torch.get_num_threads()
    if num_threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at (even) byte ``at`` of each block as fp32 ``[n, 1]``."""
    return blocks.view(torch.float16)[:, at // 2 : at // 2 + 1].float()


def _nibbles(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """Blocks' bytes from ``at`` on, ``[n, k]`` -> ``[n, 2k]``: their low nibbles, then their
    high ones. NOTE: whole-block bit operations, then one copy: an operation on a slice of
    short rows costs several times one over the contiguous blocks."""
    return torch.cat(((blocks & 0x0F)[:, at:], (blocks >> 4)[:, at:]), dim=1)


# byte -> 8 int8, little-endian in an int64: 0 where bit i of the byte is set, -16 where it is
# clear; added to a 5-bit quant's low nibble it gives ``(nibble | bit << 4) - 16`` (Q5_0).
_MINUS_16_UNLESS_BIT = torch.tensor(
    [sum((0 if (b >> i) & 1 else 0xF0) << (8 * i) for i in range(8)) for b in range(256)],
    dtype=torch.uint64,
).view(torch.int64)
_BIT = torch.arange(8, dtype=torch.uint8)
_PAIR = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)


def _high_bits_minus_16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The 32 high bits in bytes ``at..at+3`` (a little-endian u32, bit ``j`` for weight
    ``j``) as int8 ``[n, 32]``: 0 for a set bit, -16 for a clear one."""
    index = blocks[:, at : at + 4].reshape(-1).int()
    return _MINUS_16_UNLESS_BIT.index_select(0, index).view(torch.int8).view(-1, BLOCK)


def _unpack_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(blocks, 2))
    out.sub_(8).mul_(_f16(blocks, 0))


def _unpack_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_nibbles(blocks, 4))
    out.mul_(_f16(blocks, 0)).add_(_f16(blocks, 2))


def _unpack_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    quants = _nibbles(blocks, 6).view(torch.int8).add_(_high_bits_minus_16(blocks, 2))
    out.copy_(quants)  # q - 16, exactly
    out.mul_(_f16(blocks, 0))


def _unpack_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    quants = _nibbles(blocks, 8).view(torch.int8).add_(_high_bits_minus_16(blocks, 4))
    out.copy_(quants).add_(16)  # q, exactly
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


def _k_nibbles(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """128 bytes of nibbles from ``at`` -> ``[n, 8, 32]``: chunk ``c`` of 32 bytes gives
    sub-blocks ``2c`` (low nibbles) and ``2c + 1`` (high nibbles)."""
    n = blocks.shape[0]
    low = (blocks & 0x0F)[:, at : at + 128].reshape(n, 4, 1, 32)
    high = (blocks >> 4)[:, at : at + 128].reshape(n, 4, 1, 32)
    return torch.cat((low, high), dim=2).view(n, 8, 32)


def _unpack_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scale, minimum = _k_scales(blocks)
    w = out.view(-1, 8, 32)
    w.copy_(_k_nibbles(blocks, 16))
    w.mul_(scale).sub_(minimum)


def _unpack_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scale, minimum = _k_scales(blocks)
    high = (blocks[:, 16:48].unsqueeze(1) >> _BIT.view(8, 1)) & 1  # [n, 8, 32]
    w = out.view(-1, 8, 32)
    w.copy_(_k_nibbles(blocks, 48).bitwise_or_(high << 4))
    w.mul_(scale).sub_(minimum)


def _unpack_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    low = torch.cat(
        (
            (blocks & 0x0F)[:, :128].reshape(n, 2, 1, 64),
            (blocks >> 4)[:, :128].reshape(n, 2, 1, 64),
        ),
        dim=2,
    ).view(n, 8, 32)
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> _PAIR.view(4, 1)) & 3
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()  # [n, 16]
    quants = low.bitwise_or_((high << 4).view(n, 8, 32)).view(torch.int8).sub_(32)
    w = out.view(n, 16, 16)
    w.copy_(quants.view(n, 16, 16))
    w.mul_(scale.unsqueeze(-1))


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
