"""A fast reader for GGUF files: metadata, tensor table and raw tensor data.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every part of every metadata
field: SmolLM2's 49k tokens and 49k merges take it several seconds, on every ``LLM()``. This
reads the same file with ``struct`` over one memory map (a fraction of a second). The common
block formats are dequantized by ``growpage.engine.loading.dequant``; the ``gguf`` package is
imported only for a tensor type this module does not know.

Layout (GGUF v2/v3, little-endian)::

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata:  key string | value type u32 | value    (string = u64 length + UTF-8 bytes;
               array = item type u32 + count u64 + items)
    tensors:   name string | n_dims u32 | dims u64 x n_dims (ne0 first) | type u32 | offset u64
    padding to ``general.alignment`` (default 32), then the tensor data (offsets from there)

Any inconsistency raises ``EngineError("cannot read GGUF file <path>: <what is wrong>")``.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from growpage.errors import EngineError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Metadata value types: id -> (struct format, size) for the scalars; 7 bool, 8 string, 9 array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    10: "<u8",
    11: "<i8",
    12: "<f8",
    7: "<u1",
}
BOOL, STRING, ARRAY = 7, 8, 9
_U64 = struct.Struct("<Q")
# Tensor type -> (items per block, bytes per block), as ggml defines them (the gguf package's
# GGML_QUANT_SIZES, which a test compares); other types are looked up there.
QUANT_SIZES = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 40),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    30: (1, 2),
}
# Tensor types stored as plain numpy items; every other type is handed over as raw bytes.
_PLAIN = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


def _quant_size(kind: int, name: str, path: Path) -> tuple[int, int]:
    """``(items per block, bytes per block)`` of tensor type ``kind``."""
    if kind in QUANT_SIZES:
        return QUANT_SIZES[kind]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (KeyError, ValueError):
        raise _bad(path, f"tensor {name!r} has unknown type {kind}") from None


def _bad(path: Path, problem: str) -> EngineError:
    return EngineError(f"cannot read GGUF file {path}: {problem}")


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous dimension) first
    type: int  # a ``gguf.GGMLQuantizationType`` value
    offset: int  # absolute byte offset of the data in the file
    num_bytes: int


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _bad(
                self.path, f"truncated at byte {self.pos} (needs {n} more of {len(self.buf)})"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise _bad(self.path, f"invalid UTF-8 string at byte {self.pos}") from exc

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == BOOL:
            return bool(self.scalar("<B"))
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:  # numbers in one block
                size = np.dtype(_NUMPY[item]).itemsize
                items = np.frombuffer(self.take(count * size), dtype=_NUMPY[item]).tolist()
                return [bool(x) for x in items] if item == BOOL else items
            if item == STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise _bad(self.path, f"unknown GGUF value type {kind} at byte {self.pos}")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a tokenizer's vocabulary and merges: about 100k of them
        in SmolLM2), in one tight loop; the same errors as ``string``."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = _U64.unpack_from
        out = []
        try:
            for _ in range(count):
                if pos + 8 > end:
                    break
                n = length(buf, pos)[0]
                pos += 8
                if pos + n > end:
                    pos -= 8
                    break
                out.append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except UnicodeDecodeError as exc:  # at the string's end, as ``string`` says it
            raise _bad(self.path, f"invalid UTF-8 string at byte {pos + n}") from exc
        self.pos = pos
        while len(out) < count:  # truncated: the reader's own error, at the same byte
            out.append(self.string())
        return out


class GGUFFile:
    """The metadata (``metadata``, ``value``) and tensor table (``tensors``) of a GGUF file;
    ``raw(tensor)`` maps a tensor's data without copying it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise _bad(self.path, str(exc)) from exc
        cur = _Cursor(self._map.data, self.path)  # a memoryview of the mapping
        if bytes(cur.take(4)) != MAGIC:
            raise _bad(self.path, "not a GGUF file (bad magic)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise _bad(self.path, f"unsupported GGUF version {self.version} (2 or 3)")
        num_tensors, num_fields = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            shape = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
            infos.append((name, shape, cur.scalar("<I"), cur.scalar("<Q")))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0:
            raise _bad(self.path, f"bad general.alignment {align!r}")
        start = -(-cur.pos // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, shape, kind, offset in infos:
            block, size = _quant_size(kind, name, self.path)
            count = math.prod(shape)
            if shape and shape[0] % block:
                raise _bad(
                    self.path, f"tensor {name!r} rows of {shape[0]} are not whole blocks of {block}"
                )
            tensor = GGUFTensor(name, shape, kind, start + offset, count // block * size)
            if tensor.offset + tensor.num_bytes > len(self._map):
                raise _bad(self.path, f"tensor {name!r} runs past the end of the file")
            self.tensors.append(tensor)
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise _bad(self.path, "duplicate tensor names")

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value (arrays as lists), or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's stored data, read-only: ``[..., ne1, ne0]`` items for plain types,
        ``[..., ne1, bytes per row]`` uint8 for quantized ones (``gguf.quants.dequantize``'s
        input)."""
        data = np.asarray(self._map[tensor.offset : tensor.offset + tensor.num_bytes])
        dims = tuple(reversed(tensor.shape))
        if tensor.type in _PLAIN:
            return data.view(_PLAIN[tensor.type]).reshape(dims)
        rows = math.prod(dims[:-1])
        return data.reshape(*dims[:-1], tensor.num_bytes // rows if rows else 0)
