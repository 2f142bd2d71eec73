"""GGUF block quantizations to fp32 in a few whole-tensor torch operations.

The ``gguf`` package dequantizes with numpy, a group of rows at a time; for SmolLM2's Q4_1
weights that is about 2 s of every ``LLM()``. The formats the default model uses are simple
enough to unpack at once, with the same fp32 arithmetic, so the weights come out bitwise equal
(``tests/engine/test_engine_dequant.py``). F32 and F16 are copied; any other type goes to
``gguf.quants.dequantize`` (the package is imported only then).

Blocks of 32 weights (ggml's ``QK4_0 = QK4_1 = QK8_0 = 32``)::

    Q4_0  d fp16 | 16 bytes of nibbles        w = (nibble - 8) * d
    Q4_1  d fp16 | m fp16 | 16 bytes          w = nibble * d + m
    Q8_0  d fp16 | 32 int8                    w = q * d

A nibble byte ``j`` holds weight ``j`` in its low half and weight ``j + 16`` in its high half.
"""

from __future__ import annotations

import numpy as np
import torch

from growpage.engine.gguf_file import QUANT_SIZES

BLOCK = 32
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8  # gguf.GGMLQuantizationType values
_BLOCK_BYTES = {q: QUANT_SIZES[q][1] for q in (Q4_0, Q4_1, Q8_0)}  # 18, 20, 34


def dequantize(raw: np.ndarray, qtype: int) -> torch.Tensor:
    """A GGUF tensor's data as ``GGUFFile.raw`` gives it (``[..., bytes per row]`` uint8 for a
    quantized type, the items for a plain one) as a new fp32 tensor ``[..., row length]``."""
    if qtype in (F32, F16):  # plain items already
        return torch.from_numpy(np.array(raw, dtype=np.float32, copy=True))
    if qtype not in _BLOCK_BYTES:
        import gguf

        data = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
        return torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
    size = _BLOCK_BYTES[qtype]
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    if row_bytes % size:
        raise ValueError(f"a row of {row_bytes} bytes is not a whole number of {size}-byte blocks")
    # A writable copy of the packed bytes (the file's memory map is read-only): small next to
    # the fp32 weights.
    blocks = torch.from_numpy(np.array(raw, copy=True).reshape(-1, size))
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    w = torch.empty(blocks.shape[0], BLOCK)
    if qtype == Q8_0:
        w.copy_(blocks[:, 2:].view(torch.int8))
        w.mul_(d)
    else:
        packed = blocks[:, size - 16 :]
        w[:, :16] = packed & 0x0F  # weights 0-15: the low nibbles
        w[:, 16:] = packed >> 4  # weights 16-31: the high nibbles
        if qtype == Q4_0:
            w.sub_(8).mul_(d)
        else:
            m = blocks[:, 2:4].contiguous().view(torch.float16).float()
            w.mul_(d).add_(m)
    return w.reshape(*lead, row_bytes // size * BLOCK)
