"""Trace files: one request recorded with full KV (docs/trace-format.md).

The engine's recorder writes traces and the simulator replays them; both import this module
and never each other. One trace is one safetensors file::

    metadata["growpage.trace"]   JSON header (TraceHeader fields + format, version, dtype)
    layer.{i}.q   [T, Hq, d]     pre-RoPE query (post q-norm) of model layer i
    layer.{i}.k   [T, Hkv, d]    post-RoPE key
    layer.{i}.v   [T, Hkv, d]    value (only when has_values)

A trace set is a directory of trace files plus ``index.json`` (``growpage.core.trace_set``).
Every problem found in a file raises ``TraceError`` naming the file and the problem.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from growpage._convert import int_tuple
from growpage.core.rope import RopeConfig
from growpage.errors import TraceError

FORMAT_NAME = "growpage-trace"
FORMAT_VERSION = 1
HEADER_KEY = "growpage.trace"
STORAGE_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def checked_int(name: str, value: Any, low: int = 0, what: str = "header field") -> int:
    """``value`` when it is an int (not a bool) ``>= low``; else ``TraceError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TraceError(f"{what} '{name}' must be an int >= {low}, got {value!r}")
    return value


def _check_header(h: TraceHeader) -> None:
    for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
        checked_int(name, getattr(h, name), low=1)
    checked_int("prompt_len", h.prompt_len, low=1)
    if not isinstance(h.request_id, str) or not isinstance(h.model, str):
        raise TraceError("header fields 'request_id' and 'model' must be strings")
    if not isinstance(h.has_values, bool):
        raise TraceError(f"header field 'has_values' must be a bool, got {h.has_values!r}")
    if not isinstance(h.meta, dict):
        raise TraceError(f"header field 'meta' must be a dict, got {type(h.meta).__name__}")
    ids = [checked_int("layer_ids", i) for i in h.layer_ids]
    if not ids or ids != sorted(set(ids)) or ids[-1] >= h.num_layers:
        raise TraceError(
            f"header field 'layer_ids' must be non-empty, strictly increasing and "
            f"< num_layers={h.num_layers}, got {list(h.layer_ids)}"
        )
    if h.num_q_heads % h.num_kv_heads:
        raise TraceError(
            f"num_q_heads={h.num_q_heads} is not a multiple of num_kv_heads={h.num_kv_heads}"
        )
    if not isinstance(h.rope, RopeConfig):
        raise TraceError(f"header field 'rope' must be a RopeConfig, got {h.rope!r}")
    if h.head_dim % 2 or h.rope.head_dim != h.head_dim:
        raise TraceError(
            f"head_dim={h.head_dim} must be even and equal rope.head_dim={h.rope.head_dim}"
        )
    scale = h.softmax_scale
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not 0 < scale < float("inf")
    ):
        raise TraceError(f"header field 'softmax_scale' must be a finite float > 0, got {scale!r}")
    for t in h.token_ids:
        checked_int("token_ids", t)
    if not h.token_ids:
        raise TraceError("header field 'token_ids' is empty")
    if h.prompt_len > len(h.token_ids):
        raise TraceError(
            f"prompt_len={h.prompt_len} exceeds the number of tokens {len(h.token_ids)}"
        )


def _id_tuple(values: Iterable[int]) -> tuple[int, ...]:
    """``layer_ids`` / ``token_ids`` as a tuple (each id is checked with the header)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TraceError(
            f"header ids (layer_ids, token_ids) must be lists of integers, got {values!r:.80}"
        )
    return int_tuple(values)


@attrs.frozen(kw_only=True)
class TraceHeader:
    """What a trace records besides tensors. ``num_tokens`` (T) is ``len(token_ids)``."""

    request_id: str
    model: str
    num_layers: int  # layers of the model
    layer_ids: tuple[int, ...] = attrs.field(converter=_id_tuple)  # recorded model layers
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeConfig
    softmax_scale: float
    prompt_len: int
    token_ids: tuple[int, ...] = attrs.field(converter=_id_tuple)  # prompt + generated, length T
    has_values: bool = True
    meta: dict = attrs.field(factory=dict, hash=False)  # free-form, JSON-serializable

    def __attrs_post_init__(self) -> None:
        _check_header(self)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_recorded_layers(self) -> int:
        return len(self.layer_ids)

    def to_json(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        d.update(
            layer_ids=list(self.layer_ids), token_ids=list(self.token_ids), rope=self.rope.to_dict()
        )
        return d

    @classmethod
    def from_json(cls, d: dict) -> TraceHeader:
        """Build from ``to_json()`` output; raises ``TraceError`` on any bad field."""
        names = {f.name for f in attrs.fields(cls)}
        missing, unknown = names - d.keys(), d.keys() - names
        if missing or unknown:
            raise TraceError(f"header fields missing {sorted(missing)} / unknown {sorted(unknown)}")
        for name in ("layer_ids", "token_ids"):
            if not isinstance(d[name], list):
                raise TraceError(f"header field '{name}' must be a list")
        if not isinstance(d["rope"], dict):
            raise TraceError("header field 'rope' must be an object")
        try:
            rope = RopeConfig.from_dict(d["rope"])
            rope_ok = all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in attrs.astuple(rope)
                if v is not None
            )
        except (TypeError, ValueError) as e:
            raise TraceError(f"header field 'rope' is invalid: {e}") from None
        if not rope_ok or not isinstance(rope.head_dim, int):
            raise TraceError(
                f"header field 'rope' has non-numeric or non-finite values: {d['rope']!r}"
            )
        return cls(**{**d, "rope": rope})


@attrs.define(eq=False)
class Trace:
    """One recorded request; tensors stacked over recorded layers (in ``header.layer_ids`` order).

    queries: ``[L_rec, T, Hq, d]`` pre-RoPE (post q-norm) queries.
    keys:    ``[L_rec, T, Hkv, d]`` post-RoPE keys.
    values:  ``[L_rec, T, Hkv, d]`` or None (exactly when ``header.has_values`` is false).
    """

    header: TraceHeader
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        check_trace_tensors(self, "trace")

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def prompt_len(self) -> int:
        return self.header.prompt_len

    @property
    def num_generated(self) -> int:
        return self.header.num_tokens - self.header.prompt_len

    @property
    def request_id(self) -> str:
        return self.header.request_id


def check_trace_tensors(trace: Trace, where: str) -> None:
    """Raise ``TraceError`` (prefixed with ``where``) unless the tensors fit the header."""
    h = trace.header
    L, T, d = h.num_recorded_layers, h.num_tokens, h.head_dim
    expected = {
        "queries": (L, T, h.num_q_heads, d),
        "keys": (L, T, h.num_kv_heads, d),
        "values": (L, T, h.num_kv_heads, d),
    }
    if (trace.values is not None) != h.has_values:
        raise TraceError(
            f"{where}: has_values={h.has_values} but values are "
            f"{'present' if trace.values is not None else 'missing'}"
        )
    for name, shape in expected.items():
        x = getattr(trace, name)
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TraceError(f"{where}: {name} must be a floating-point tensor")
        if tuple(x.shape) != shape:
            raise TraceError(
                f"{where}: {name} have shape {tuple(x.shape)}, header expects "
                f"{shape} [recorded layers, tokens, heads, head_dim]"
            )
        if not bool(torch.isfinite(x).all()):
            raise TraceError(f"{where}: {name} have non-finite values (NaN or inf)")
    # |q . k| * softmax_scale <= |q| |k| * softmax_scale: past this bound a replay's attention
    # logits could overflow float32 and every attention signal turn into NaN.
    bound = h.softmax_scale * _largest_norm(trace.queries) * _largest_norm(trace.keys)
    if not bound <= LOGIT_BOUND:
        raise TraceError(
            f"{where}: queries and keys this large (|q| |k| softmax_scale up to "
            f"{bound:.3g}) would overflow attention in float32; check "
            "softmax_scale and the recorded tensors"
        )


#: Largest attention logit bound a trace may reach (float32 overflows at 3.4e38).
LOGIT_BOUND = 1e30


def _largest_norm(x: torch.Tensor) -> float:
    """Largest vector norm over the last dimension, a layer at a time (float64 scalars)."""
    return max(float(layer.double().norm(dim=-1).max()) for layer in x) if x.numel() else 0.0


def _tensor_names(h: TraceHeader) -> list[tuple[str, str, int]]:
    """``(tensor name, Trace attribute, layer index)`` for every tensor a file must hold."""
    kinds = [("q", "queries"), ("k", "keys")] + ([("v", "values")] if h.has_values else [])
    return [(f"layer.{lid}.{s}", attr, i) for i, lid in enumerate(h.layer_ids) for s, attr in kinds]


def write_trace(path: str | os.PathLike, trace: Trace, dtype: torch.dtype = torch.float16) -> Path:
    """Validate ``trace`` and write it atomically (temp file + rename) as fp16 or bf16."""
    path = Path(path)
    names = {v: k for k, v in STORAGE_DTYPES.items()}
    if dtype not in names:
        raise TraceError(f"{path}: storage dtype must be float16 or bfloat16, got {dtype}")
    check_trace_tensors(trace, str(path))
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "dtype": names[dtype],
        **trace.header.to_json(),
    }
    try:
        text = json.dumps(header, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{path}: header is not JSON-serializable ({e})") from None
    tensors = {}
    for name, attr, i in _tensor_names(trace.header):
        x = getattr(trace, attr)[i].to(device="cpu", dtype=dtype, copy=True)
        if not torch.isfinite(x).all():
            raise TraceError(f"{path}: tensor {name} has non-finite values in {names[dtype]}")
        tensors[name] = x.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={HEADER_KEY: text}))
    return path


def atomic_write(path: Path, write: Callable[[str], object]) -> None:
    """``write(tmp)`` a temporary file beside ``path``, then rename it over ``path``: readers
    see the old file or the new one, never half of one (the temporary is removed on failure).

    The file gets the permissions a plain ``open(path, "w")`` would give it: those of the file
    it replaces, else 0o666 less the umask (``mkstemp`` alone would leave 0o600, so a trace set
    could not be read by another account).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, _new_file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _new_file_mode(path: Path) -> int:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # reading the umask means setting it: put it back at once
        os.umask(umask)
        return 0o666 & ~umask


def reject_json_constant(name: str) -> float:
    """``json.loads(..., parse_constant=...)``: NaN and infinities are not valid JSON here."""
    raise ValueError(f"non-finite number {name} in JSON")


def _parse_header(metadata: dict[str, str] | None, path: Path) -> tuple[TraceHeader, torch.dtype]:
    if not metadata or HEADER_KEY not in metadata:
        raise TraceError(f"{path}: no '{HEADER_KEY}' header in the safetensors metadata")
    try:
        d = json.loads(metadata[HEADER_KEY], parse_constant=reject_json_constant)
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise TraceError(f"{path}: header is not a '{FORMAT_NAME}' object")
    version, dtype = d.pop("version", None), d.pop("dtype", None)
    d.pop("format")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise TraceError(
            f"{path}: unsupported format version {version!r} (this reader knows {FORMAT_VERSION})"
        )
    if not isinstance(dtype, str) or dtype not in STORAGE_DTYPES:
        raise TraceError(f"{path}: header dtype {dtype!r} is not one of {list(STORAGE_DTYPES)}")
    try:
        return TraceHeader.from_json(d), STORAGE_DTYPES[dtype]
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def _open(path: Path) -> Any:
    if path.exists() and not path.is_file():  # a FIFO or device would block or never end
        raise TraceError(f"{path}: not a regular file (a trace is a safetensors file)")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except Exception as e:  # safetensors raises its own error type or OSError on bad input
        raise TraceError(f"{path}: not a readable safetensors file ({e})") from None


def read_trace_header(path: str | os.PathLike) -> TraceHeader:
    """Only the header of a trace file (no tensor data is read)."""
    path = Path(path)
    with _open(path) as f:
        return _parse_header(f.metadata(), path)[0]


def read_trace(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Trace:
    """Read and fully validate one trace file; tensors land on ``device`` as ``dtype``."""
    path = Path(path)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TraceError(f"{path}: traces are read as a floating-point dtype, got {dtype!r}")
    with _open(path) as f:
        header, stored = _parse_header(f.metadata(), path)
        names = _tensor_names(header)
        present = set(f.keys())
        missing = [n for n, _, _ in names if n not in present]
        extra = sorted(present - {n for n, _, _ in names})
        if missing or extra:
            raise TraceError(
                f"{path}: tensors missing {missing[:4]} / unexpected {extra[:4]} "
                f"for layer_ids {list(header.layer_ids)}, has_values="
                f"{header.has_values}"
            )
        out: dict[str, torch.Tensor] = {}
        heads = {
            "queries": header.num_q_heads,
            "keys": header.num_kv_heads,
            "values": header.num_kv_heads,
        }
        for name, attr, i in names:
            x = _load_tensor(f, name, path)
            shape = (header.num_tokens, heads[attr], header.head_dim)
            if x.dim() and x.shape[0] != header.num_tokens:
                raise TraceError(
                    f"{path}: tensor {name} holds {x.shape[0]} tokens but "
                    f"token_ids has {header.num_tokens}"
                )
            if x.dtype != stored or tuple(x.shape) != shape:
                raise TraceError(
                    f"{path}: tensor {name} is {x.dtype} {tuple(x.shape)}, header "
                    f"says {stored} {shape} [tokens, heads, head_dim]"
                )
            if not torch.isfinite(x).all():
                raise TraceError(f"{path}: tensor {name} has non-finite values")
            if attr not in out:
                out[attr] = torch.empty(
                    (header.num_recorded_layers, *shape), dtype=dtype, device=device
                )
            out[attr][i].copy_(x)
    try:
        return Trace(header=header, **out)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def _load_tensor(f: Any, name: str, path: Path) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:  # corrupt offsets or dtypes surface here
        raise TraceError(f"{path}: cannot load tensor {name} ({e})") from None


_MOVED = {"TraceEntry", "TraceSet", "read_trace_set", "SET_FORMAT_NAME", "INDEX_NAME"}


def __getattr__(name: str) -> Any:
    # Trace sets live in growpage.core.trace_set; importing them from here still works.
    if name in _MOVED:
        from growpage.core import trace_set

        return getattr(trace_set, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
