"""The finished rows of a grid on disk, for ``--resume``: one JSON file per point.

    DIR/<key>.json   {"key": ..., "row": {...}, "point_s": ...}   written atomically
                                                              (temp file + rename)

A row is written the moment its point finishes, so a run that is interrupted (Ctrl-C, a killed
driver, a lost cluster) leaves every finished row on disk, whole; a file is never half written.
``key`` names the point *and* everything it ran with (``point_key``): a resumed run takes a row
only when both are the same, so rows of other settings in the same folder are never mixed in.
Failed rows are not kept: a resumed run tries those points again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from growpage.core.traces import atomic_write
from growpage.errors import ConfigError

Row = dict[str, Any]
KEY_CHARS = 40  # hex digits of a key (160 bits of sha256)
KEY_NAME = re.compile(rf"[0-9a-f]{{{KEY_CHARS}}}\.json")


def _canonical(obj: Any) -> Any:
    """``obj`` as plain JSON values that are the same in every process and run: attrs
    instances by class and fields, mappings sorted by key, sets sorted, floats by ``repr`` (so
    NaN, infinities and -0.0 are kept apart)."""
    if attrs.has(type(obj)):
        fields = {a.name: _canonical(getattr(obj, a.name)) for a in attrs.fields(type(obj))}
        return {"__class__": f"{type(obj).__module__}.{type(obj).__qualname__}", **fields}
    if isinstance(obj, dict):
        return {"__dict__": sorted([_text(_canonical(k)), _canonical(v)] for k, v in obj.items())}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return {"__set__": sorted(_text(_canonical(v)) for v in obj)}
    if isinstance(obj, float):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (torch.Tensor, np.ndarray)):  # by content: a repr elides the middle
        if isinstance(obj, torch.Tensor):  # as bytes: numpy has no bfloat16
            data = obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            data = np.ascontiguousarray(obj).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        return {"__array__": [str(obj.dtype), list(obj.shape), digest]}
    if callable(obj) and hasattr(obj, "__qualname__"):
        return {"__callable__": f"{obj.__module__}.{obj.__qualname__}"}
    return {"__repr__": repr(obj)}


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def fingerprint(obj: Any) -> str:
    """A digest of ``obj``'s canonical form (``_canonical``)."""
    return hashlib.sha256(_text(_canonical(obj)).encode()).hexdigest()


def point_key(fn: Callable[..., Any], item: Any, shared_digest: str) -> str:
    """What a point's row is stored under: its function, its item and the digest of what all
    points share (``fingerprint(shared)``, computed once per grid)."""
    return fingerprint([fn, item, shared_digest])[:KEY_CHARS]


def _json_ready(obj: Any) -> Any:
    """Tuples as lists, non-finite floats as strings JSON can hold (``_restore`` reads them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if isinstance(obj, dict):
        return {str(k): _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj


def _restore(obj: Any) -> Any:
    if isinstance(obj, dict):
        if obj.keys() == {"__float__"}:
            return float(obj["__float__"])
        return {k: _restore(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v) for v in obj]
    return obj


class RowStore:
    """Finished rows under ``directory``: ``get(key)`` / ``put(key, row)``.

    ``resume=False`` starts afresh: the rows a previous run left there are removed first.
    """

    def __init__(self, directory: str | os.PathLike, resume: bool = False) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"{self.directory}: cannot create the folder of finished rows ({e.strerror or e})"
            ) from None
        self._rows: dict[str, Row] = {}
        for path in sorted(self.directory.glob("*.json")):
            if not KEY_NAME.fullmatch(path.name):
                continue  # not a row this store wrote
            if not resume:
                path.unlink()
                continue
            try:
                saved = json.loads(path.read_text())
                self._rows[saved["key"]] = _restore(saved["row"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(
                    f"{path}: not a finished row ({e}); remove the file, or run without --resume"
                ) from None

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def get(self, key: str) -> Row | None:
        return self._rows.get(key)

    def put(self, key: str, row: Row, point_s: float | None = None) -> None:
        """Keep ``row`` under ``key``, with the seconds its point took (None: not known)."""
        saved = {"key": key, "row": _json_ready(row), "point_s": point_s}
        text = json.dumps(saved, allow_nan=False)
        atomic_write(self.directory / f"{key}.json", lambda tmp: Path(tmp).write_text(text))
        self._rows[key] = row
