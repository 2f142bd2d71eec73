"""Trace sets: a directory of trace files plus ``index.json`` (docs/trace-format.md).

``TraceSet`` reads its traces lazily, one at a time, and checks each against its index line;
``write`` appends a trace, the file first and then the index, both atomically.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from tqdm import tqdm

from growpage._convert import str_tuple
from growpage.core.traces import (
    FORMAT_VERSION,
    Trace,
    TraceHeader,
    atomic_write,
    checked_int,
    read_trace,
    read_trace_header,
    reject_json_constant,
    write_trace,
)
from growpage.errors import ConfigError, TraceError

SET_FORMAT_NAME = "growpage-trace-set"
#: The names ``write`` gives trace files (what a set that lost its index leaves behind).
TRACE_FILE = re.compile(r"\d{6}-.*\.safetensors")
INDEX_NAME = "index.json"


@attrs.frozen(kw_only=True)
class TraceEntry:
    """One line of a trace set's index: where a trace is and what it holds."""

    file: str  # file name inside the set's directory
    request_id: str
    prompt_len: int
    num_tokens: int
    tags: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    @classmethod
    def from_json(cls, d: Any) -> TraceEntry:
        if not isinstance(d, dict) or set(d) - {"tags"} != {
            "file",
            "request_id",
            "prompt_len",
            "num_tokens",
        }:
            raise TraceError(
                f"index entry {d!r} must have exactly file, request_id, "
                "prompt_len, num_tokens and optional tags"
            )
        ok = (
            isinstance(d["file"], str)
            and isinstance(d["request_id"], str)
            and isinstance(d.get("tags", []), list)
            and all(isinstance(t, str) for t in d.get("tags", []))
            and Path(d["file"]).name == d["file"]
            and d["file"] not in ("", ".", "..")
        )
        if not ok:
            raise TraceError(f"index entry {d!r} has a bad file name, request_id or tags")
        checked_int("prompt_len", d["prompt_len"], low=1, what="index entry field")
        if (
            checked_int("num_tokens", d["num_tokens"], low=1, what="index entry field")
            < d["prompt_len"]
        ):
            raise TraceError(f"index entry {d['request_id']!r}: prompt_len > num_tokens")
        return cls(**d)


class TraceSet:
    """A directory of trace files plus ``index.json``; traces are read lazily, one at a time.

    ``TraceSet(dir)`` opens an existing set; ``TraceSet(dir, create=True)`` also starts an
    empty one. ``write`` appends a trace (file first, then the index, both atomically).
    NOTE: one writer at a time; concurrent writers would lose index entries.
    """

    def __init__(self, directory: str | os.PathLike, *, create: bool = False) -> None:
        self.directory = Path(directory).absolute()  # later reads do not depend on the cwd
        self._index_path = self.directory / INDEX_NAME
        if self._index_path.is_file():
            self._entries = self._load_index()
        elif create and (not self.directory.exists() or self.directory.is_dir()):
            orphans = (
                sorted(
                    p.name
                    for p in self.directory.glob("*.safetensors")
                    if TRACE_FILE.fullmatch(p.name)
                )
                if self.directory.is_dir()
                else []
            )
            if orphans:  # a set that lost its index: starting a new one would overwrite them
                raise TraceError(
                    f"{directory}: holds trace files ({', '.join(orphans[:3])}"
                    f"{', ...' if len(orphans) > 3 else ''}) but no {INDEX_NAME}; "
                    "record into an empty directory, or restore the index"
                )
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._entries = []
                self._save_index()
            except OSError as e:
                raise TraceError(
                    f"{directory}: cannot create a trace set ({e.strerror or e})"
                ) from None
        elif not self.directory.exists():
            raise TraceError(f"{directory}: no such directory (not a trace set)")
        elif not self.directory.is_dir():
            raise TraceError(f"{directory}: not a directory (not a trace set)")
        else:
            raise TraceError(f"{self._index_path}: no trace-set index (not a trace set)")

    @property
    def index(self) -> tuple[TraceEntry, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Trace]:
        return (self.read(e) for e in self._entries)

    def read(
        self,
        entry: TraceEntry | int | str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Trace:
        """Read one trace by entry, position or request id; checks it against the index."""
        if isinstance(entry, int) and not isinstance(entry, bool):
            if not 0 <= entry < len(self._entries):
                raise TraceError(
                    f"{self._index_path}: no trace at position {entry} (the set "
                    f"holds {len(self._entries)})"
                )
            entry = self._entries[entry]
        elif isinstance(entry, str):
            found = [e for e in self._entries if e.request_id == entry]
            if not found:
                raise TraceError(f"{self._index_path}: no request {entry!r}")
            entry = found[0]
        elif not isinstance(entry, TraceEntry):
            raise TypeError(
                f"TraceSet.read takes a TraceEntry, a position or a request id, got {entry!r}"
            )
        path = self.directory / entry.file
        trace = read_trace(path, device=device, dtype=dtype)
        self._check_entry(entry, trace.header, path)
        return trace

    def read_all(
        self,
        limit: int | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> list[Trace]:
        """The first ``limit`` traces (all when None), in index order. A set holding none is a
        ``TraceError``: whoever asks for the traces of a set has nothing to do without one."""
        if not self._entries:
            raise TraceError(f"{self.directory}: the trace set is empty")
        if limit is not None and limit < 1:
            raise ConfigError(f"limit must be >= 1 or None, got {limit!r}")
        n = len(self._entries) if limit is None else min(limit, len(self._entries))
        return [self.read(i, device=device, dtype=dtype) for i in range(n)]

    def check(self, *, deep: bool = False, progress: bool = False) -> list[TraceHeader]:
        """Read every file's header (not its tensors) and check it against the index, so that
        a missing, foreign or broken file is found before any trace is used; ``TraceError``
        naming the first such file. Returns the headers, in index order.

        ``deep``: then also read every trace's tensors, one trace at a time, and validate them
        as ``read`` does when a replay takes the trace (names, dtypes and shapes against the
        header, finite values, the ``LOGIT_BOUND`` on queries and keys), so that bad tensor
        data is found before the work too; ``progress`` shows a progress bar over that pass.
        """
        headers = []
        for entry in self._entries:  # all headers first: a missing file is found at once
            path = self.directory / entry.file
            headers.append(read_trace_header(path))
            self._check_entry(entry, headers[-1], path)
        if deep:
            for entry in tqdm(
                self._entries, desc="check traces", unit="trace", disable=not progress
            ):
                self.read(entry)  # validates, and is dropped before the next one is read
        return headers

    def _check_entry(self, entry: TraceEntry, header: TraceHeader, path: Path) -> None:
        got = (header.request_id, header.prompt_len, header.num_tokens)
        if got != (entry.request_id, entry.prompt_len, entry.num_tokens):
            raise TraceError(
                f"{path}: (request_id, prompt_len, num_tokens) = {got} disagrees "
                f"with {self._index_path}"
            )

    def write(
        self, trace: Trace, *, tags: Iterable[str] = (), dtype: torch.dtype = torch.float16
    ) -> TraceEntry:
        """Append ``trace`` to the set; request ids must be unique, ``tags`` a list of
        strings. The file gets a name no file in the directory has."""
        rid = trace.request_id
        if any(e.request_id == rid for e in self._entries):
            raise TraceError(f"{self._index_path}: request id {rid!r} is already in the set")
        given = (
            None
            if isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Iterable)
            else tuple(tags)
        )  # once: a generator is read here only
        if given is None or not all(isinstance(t, str) for t in given):
            raise TraceError(f"tags must be a list of strings, got {tags!r:.80}")
        tags = given
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in rid)[:64]
        taken = {e.file for e in self._entries}
        number = len(self._entries)
        while (name := f"{number:06d}-{slug}.safetensors") in taken or (
            self.directory / name
        ).exists():
            number += 1  # an entry removed by hand, or a file the index does not list
        entry = TraceEntry(
            file=name,
            request_id=rid,
            prompt_len=trace.prompt_len,
            num_tokens=trace.num_tokens,
            tags=tuple(tags),
        )
        write_trace(self.directory / entry.file, trace, dtype=dtype)
        self._entries.append(entry)
        try:
            self._save_index()
        except BaseException:
            self._entries.pop()
            raise
        return entry

    def _load_index(self) -> list[TraceEntry]:
        try:
            d = json.loads(self._index_path.read_text(), parse_constant=reject_json_constant)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise TraceError(f"{self._index_path}: unreadable index ({e})") from None
        if not isinstance(d, dict) or d.get("format") != SET_FORMAT_NAME:
            raise TraceError(f"{self._index_path}: not a '{SET_FORMAT_NAME}' index")
        if d.get("version") != FORMAT_VERSION or not isinstance(d.get("traces"), list):
            raise TraceError(
                f"{self._index_path}: unsupported version {d.get('version')!r} or no 'traces' list"
            )
        try:
            entries = [TraceEntry.from_json(e) for e in d["traces"]]
        except TraceError as e:
            raise TraceError(f"{self._index_path}: {e}") from None
        for key in ("file", "request_id"):
            if len({getattr(e, key) for e in entries}) != len(entries):
                raise TraceError(f"{self._index_path}: duplicate {key} in the index")
        return entries

    def _save_index(self) -> None:
        d = {
            "format": SET_FORMAT_NAME,
            "version": FORMAT_VERSION,
            "traces": [{**attrs.asdict(e), "tags": list(e.tags)} for e in self._entries],
        }
        atomic_write(self._index_path, lambda tmp: Path(tmp).write_text(json.dumps(d, indent=1)))


def read_trace_set(directory: str | os.PathLike) -> TraceSet:
    """Open an existing trace set (``TraceError`` if ``directory`` has no valid index)."""
    return TraceSet(directory)
