"""``WorkloadRequest`` and the workload file formats: CSV and JSON Lines.

::

    arrival_s,prompt_tokens,output_tokens,trace,prefix,prefix_tokens
    0.0,120,2048,req-0,system-a,64
    0.5,96,800,,system-a,64
    0.9,300,500,,,

``arrival_s``: seconds (finite, in ``[0, MAX_ARRIVAL_S]``); ``prompt_tokens`` /
``output_tokens``: integers in ``[1, MAX_TOKENS]``; ``trace`` (optional column, may be empty):
the request id of a trace in the trace set given to the simulator; ``prefix`` and
``prefix_tokens`` (optional columns, both given or both empty in a row): the requests naming
one prefix begin with the same ``prefix_tokens`` prompt tokens (``1 <= prefix_tokens <=
prompt_tokens``), which the simulator's prefix cache shares (``sim.prefix``). Rows are returned
in arrival order (stable). Every problem raises ``WorkloadError`` naming the file, the line and
the field.

JSON Lines (``.jsonl``): one object per line with the same fields, e.g.
``{"arrival_s": 0.5, "prompt_tokens": 96, "output_tokens": 800}``; ``trace`` may be omitted or
null, as may ``prefix`` and ``prefix_tokens`` (both or neither); token counts must be JSON
integers; blank lines are skipped; any other key, or a key given twice, is an error.
"""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
import os
from pathlib import Path
from typing import NoReturn, TypeGuard

import attrs

from growpage.errors import WorkloadError
from growpage.validators import is_finite, is_int, non_empty_str, non_negative_number

REQUIRED = ("arrival_s", "prompt_tokens", "output_tokens")
OPTIONAL = ("trace", "prefix", "prefix_tokens")
MAX_TOKENS = 1 << 20  # longest prompt or output accepted, tokens
# NOTE: simulated time is float seconds from 0, so an arrival far from 0 leaves the clock too
# coarse for a decode step (at 1.7e18 s, an epoch in nanoseconds, a 10 ms step does not move
# it, and every latency came out 0); at 2^32 s (136 years) it still keeps a microsecond.
MAX_ARRIVAL_S = 1 << 32
MAX_FILE_BYTES = 1 << 28


def _refuse(inst: WorkloadRequest, field: str, what: str, value: object) -> NoReturn:
    raise WorkloadError(
        f"WorkloadRequest {inst.request_id!r}: {field} must be {what}, got {value!r}"
    )


def _is_integral(value: object) -> TypeGuard[int]:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> TypeGuard[float]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and is_finite(value)


def _check_arrival(inst: WorkloadRequest, attribute: attrs.Attribute, value: object) -> None:
    if not _is_real(value) or value < 0:
        _refuse(inst, "arrival_s", "a finite number >= 0", value)
    if float(value) > MAX_ARRIVAL_S:
        raise WorkloadError(f"WorkloadRequest {inst.request_id!r}: {_too_late(value)}")


def _too_late(value: object) -> str:
    return (
        f"arrival_s must be at most {MAX_ARRIVAL_S} (seconds from the workload's start; "
        f"the simulated clock is too coarse beyond), got {value}"
    )


def _check_tokens(inst: WorkloadRequest, attribute: attrs.Attribute, value: object) -> None:
    if not _is_integral(value) or not 1 <= int(value) <= MAX_TOKENS:
        _refuse(inst, attribute.name, f"an integer in [1, {MAX_TOKENS}]", value)


def _check_optional_str(inst: WorkloadRequest, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, str):
        _refuse(inst, attribute.name, "a string or None", value)


def _check_kind(inst: WorkloadRequest, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str):
        _refuse(inst, "kind", "a string", value)


def _check_prefix(inst: WorkloadRequest, attribute: attrs.Attribute, value: object) -> None:
    if not _is_integral(value) or not 0 <= int(value) <= inst.prompt_tokens:
        _refuse(
            inst, "prefix_tokens", f"an integer in [0, prompt_tokens = {inst.prompt_tokens}]", value
        )
    if (inst.prefix is None) != (value == 0):
        raise WorkloadError(
            f"WorkloadRequest {inst.request_id!r}: prefix and prefix_tokens go "
            f"together (a shared prefix of >= 1 token, or none), got prefix="
            f"{inst.prefix!r}, prefix_tokens={value!r}"
        )
    if inst.prefix == "":
        _refuse(inst, "prefix", "a non-empty string or None", "")


@attrs.frozen
class WorkloadRequest:
    """One request of a workload (lengths in tokens, arrival in seconds); checked as the CSV
    format's rows are (``WorkloadError`` naming the request and the field)."""

    request_id: str = attrs.field(validator=non_empty_str.raising(WorkloadError))
    arrival_s: float = attrs.field(validator=_check_arrival)
    prompt_tokens: int = attrs.field(validator=_check_tokens)
    output_tokens: int = attrs.field(validator=_check_tokens)
    trace: str | None = attrs.field(default=None, validator=_check_optional_str)
    kind: str = attrs.field(default="", validator=_check_kind)
    prefix: str | None = attrs.field(default=None, validator=_check_optional_str)
    prefix_tokens: int = attrs.field(default=0, validator=_check_prefix)


def _int_field(text: str, name: str, where: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise WorkloadError(f"{where}: {name} must be an integer, got {text!r}") from None
    return _token_count(value, name, where)


def _token_count(value: int, name: str, where: str) -> int:
    """``value`` when it is a token count the formats accept (CSV and JSON Lines alike)."""
    if not 1 <= value <= MAX_TOKENS:
        raise WorkloadError(f"{where}: {name} must lie in [1, {MAX_TOKENS}], got {value}")
    return value


def _arrival(text: str, where: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise WorkloadError(f"{where}: arrival_s must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise WorkloadError(f"{where}: arrival_s must be finite and >= 0, got {text!r}")
    if value > MAX_ARRIVAL_S:
        raise WorkloadError(f"{where}: {_too_late(text.strip())}")
    return value


def _read_text(path: Path) -> str:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise WorkloadError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
        return path.read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the workload file ({e})") from None


def _check_header(header: list[str], source: str) -> None:
    """``WorkloadError`` naming what is missing, unknown or repeated in a CSV header."""
    missing = [c for c in REQUIRED if c not in header]
    unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
    twice = sorted({c for c in header if header.count(c) > 1})
    if not (missing or unknown or twice):
        return
    problems = [
        f"{what} {', '.join(map(repr, names))}"
        for what, names in (("missing", missing), ("unknown column", unknown), ("repeated", twice))
        if names
    ]
    hint = "; the first line must be the header" if len(missing) == len(REQUIRED) else ""
    raise WorkloadError(
        f"{source}: bad header ({'; '.join(problems)}{hint}): it must hold "
        f"{', '.join(REQUIRED)} and optionally {', '.join(OPTIONAL)}, each once"
    )


def parse_workload_csv(text: str, source: str = "<workload>") -> list[WorkloadRequest]:
    """Parse CSV text (see the module docstring)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[int, list[str]]] = []  # (line number in the file, cells); blank lines out
    try:
        for row in reader:
            if any(cell.strip() for cell in row):
                rows.append((reader.line_num, row))
    except csv.Error as e:
        raise WorkloadError(f"{source}: not valid CSV ({e})") from None
    if not rows:
        raise WorkloadError(f"{source}: empty workload (no header)")
    header = [h.strip() for h in rows[0][1]]
    _check_header(header, source)
    if len(rows) == 1:
        raise WorkloadError(f"{source}: no requests after the header")
    col = {name: i for i, name in enumerate(header)}
    out = []
    for i, (line, row) in enumerate(rows[1:]):
        where = f"{source}, line {line}"
        if len(row) != len(header):
            raise WorkloadError(f"{where}: {len(row)} fields, header has {len(header)}")
        trace = row[col["trace"]].strip() if "trace" in col else ""
        prefix = row[col["prefix"]].strip() if "prefix" in col else ""
        count = row[col["prefix_tokens"]].strip() if "prefix_tokens" in col else ""
        if bool(prefix) != bool(count):
            raise WorkloadError(
                f"{where}: prefix and prefix_tokens are given together or not "
                f"at all, got prefix={prefix!r}, prefix_tokens={count!r}"
            )
        prompt = _int_field(row[col["prompt_tokens"]], "prompt_tokens", where)
        out.append(
            _checked(
                where,
                WorkloadRequest,
                request_id=f"req-{i}",
                arrival_s=_arrival(row[col["arrival_s"]], where),
                prompt_tokens=prompt,
                output_tokens=_int_field(row[col["output_tokens"]], "output_tokens", where),
                trace=trace or None,
                kind="csv",
                prefix=prefix or None,
                prefix_tokens=_int_field(count, "prefix_tokens", where) if count else 0,
            )
        )
    return sorted(out, key=lambda r: r.arrival_s)


def _json_tokens(value: object, name: str, where: str) -> int:
    if not is_int(value):
        raise WorkloadError(f"{where}: {name} must be an integer, got {value!r}")
    return _token_count(value, name, where)


def _json_request(obj: object, i: int, where: str) -> WorkloadRequest:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED if k not in obj]
    unknown = [k for k in obj if k not in REQUIRED + OPTIONAL]
    if missing or unknown:
        raise WorkloadError(
            f"{where}: "
            + "; ".join(
                ([f"missing {', '.join(missing)}"] if missing else [])
                + ([f"unknown key {', '.join(map(repr, unknown))}"] if unknown else [])
            )
            + f" (keys: {', '.join(REQUIRED)} and optionally {', '.join(OPTIONAL)})"
        )
    arrival = obj["arrival_s"]
    if not non_negative_number.accepts(arrival):
        raise WorkloadError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    trace = obj.get("trace")
    if trace is not None and not isinstance(trace, str):
        raise WorkloadError(f"{where}: trace must be a string or null, got {trace!r}")
    trace = (trace or "").strip() or None
    prefix, count = obj.get("prefix"), obj.get("prefix_tokens")
    if prefix is not None and not isinstance(prefix, str):
        raise WorkloadError(f"{where}: prefix must be a string or null, got {prefix!r}")
    prefix = (prefix or "").strip() or None
    if (prefix is None) != (count is None):
        raise WorkloadError(
            f"{where}: prefix and prefix_tokens are given together or not at "
            f"all, got prefix={prefix!r}, prefix_tokens={count!r}"
        )
    return _checked(
        where,
        WorkloadRequest,
        request_id=f"req-{i}",
        arrival_s=float(arrival),
        prompt_tokens=_json_tokens(obj["prompt_tokens"], "prompt_tokens", where),
        output_tokens=_json_tokens(obj["output_tokens"], "output_tokens", where),
        trace=trace,
        kind="jsonl",
        prefix=prefix,
        prefix_tokens=0 if count is None else _json_tokens(count, "prefix_tokens", where),
    )


def _checked(where: str, cls: type[WorkloadRequest], **fields: object) -> WorkloadRequest:
    """``cls(**fields)``, its ``WorkloadError`` naming the file and line instead of the
    request's made-up id."""
    try:
        return cls(**fields)  # type: ignore[arg-type]
    except WorkloadError as e:
        text = str(e)
        head = f"WorkloadRequest {fields['request_id']!r}: "
        raise WorkloadError(f"{where}: {text.removeprefix(head)}") from None


class _RepeatedKeys(Exception):
    """A JSON object names a key more than once (``args[0]``: those keys, sorted)."""


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads``'s ``object_pairs_hook``: the object, or ``_RepeatedKeys``.

    NOTE: plain ``json.loads`` keeps the last of a repeated key's values silently; a CSV
    header refuses a repeated column, and a JSON Lines object refuses a repeated key alike."""
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise _RepeatedKeys(twice)
    return dict(pairs)


def parse_workload_jsonl(text: str, source: str = "<workload>") -> list[WorkloadRequest]:
    """Parse JSON Lines text (see the module docstring); requests in arrival order."""
    out: list[WorkloadRequest] = []
    # Only "\n" ends a line: str.splitlines() also splits at U+2028, form feeds, ..., which
    # JSON allows inside a string (and which would shift the reported line numbers).
    for line, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"{source}, line {line}"
        try:
            obj = json.loads(raw, object_pairs_hook=_object)
        except ValueError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e})") from None
        except _RepeatedKeys as e:
            keys = e.args[0]
            raise WorkloadError(
                f"{where}: {'keys' if len(keys) > 1 else 'key'} "
                f"{', '.join(map(repr, keys))} given twice (each key once)"
            ) from None
        out.append(_json_request(obj, len(out), where))
    if not out:
        raise WorkloadError(f"{source}: empty workload (no requests)")
    return sorted(out, key=lambda r: r.arrival_s)


def load_workload_jsonl(path: str | os.PathLike) -> list[WorkloadRequest]:
    """Requests of a JSON Lines workload file, in arrival order; ``WorkloadError`` on any
    problem."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such workload file")
    return parse_workload_jsonl(_read_text(path), str(path))


def load_workload_csv(path: str | os.PathLike) -> list[WorkloadRequest]:
    """Requests of a CSV workload file, in arrival order; ``WorkloadError`` on any problem."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such workload file")
    return parse_workload_csv(_read_text(path), str(path))
