"""Prompt files of ``growpage generate`` and ``record``: a text file holds one prompt per line,
a JSONL file (``.jsonl``, ``.ndjson``) one ``{"prompt": ..., "arrival_s": ...}`` object per
line. Every problem is an ``EngineError`` naming the file's line."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from growpage.errors import EngineError
from growpage.validators import lone_surrogate


def read_prompts(path: Path) -> list[str]:
    """Prompts of a text file (one per line) or a JSONL file (``{"prompt": ...}`` per line)."""
    return read_prompt_file(path)[0]


def read_prompt_file(path: Path) -> tuple[list[str], list[float] | None]:
    """Prompts of a text file (one per line) or a JSONL file (``{"prompt": ...}`` per line),
    and their arrival times: a JSONL file's ``arrival_s`` (seconds), on every line or on none
    (then None)."""
    if path.is_dir():
        raise EngineError(f"prompt file {path} is a directory")
    if not path.is_file():
        raise EngineError(f"prompt file {path} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EngineError(
            f"prompt file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    except OSError as exc:
        raise EngineError(f"prompt file {path}: cannot read it ({exc.strerror})") from None
    prompts: list[str] = []
    arrivals: list[float | None] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix in (".jsonl", ".ndjson"):
            prompt, arrival = _jsonl_prompt(line, f"{path}:{number}")
            if arrivals and (arrival is None) != (arrivals[0] is None):
                raise EngineError(
                    f"{path}:{number}: 'arrival_s' must be on every line or on "
                    f"none (line {number} "
                    + ("lacks it" if arrival is None else "has it")
                    + ", the first "
                    "prompt's line " + ("has it)" if arrival is None else "does not)")
                )
            prompts.append(prompt)
            arrivals.append(arrival)
        else:
            prompts.append(line)
    if not prompts:
        raise EngineError(f"{path} holds no prompts")
    if not arrivals or arrivals[0] is None:
        return prompts, None
    return prompts, [a for a in arrivals if a is not None]


#: The keys a JSONL prompt file's lines are read for.
JSONL_KEYS = ("prompt", "arrival_s")


def _jsonl_prompt(line: str, where: str) -> tuple[str, float | None]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise EngineError(f"{where}: bad JSONL line {line[:60]!r} (not JSON: {exc})") from None
    if not isinstance(record, dict) or "prompt" not in record:
        what = "no 'prompt' key" if isinstance(record, dict) else "not a JSON object"
        raise EngineError(
            f"{where}: bad JSONL line {line[:60]!r} ({what}; each line holds "
            f'an object such as {{"prompt": "..."}})'
        )
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise EngineError(
            f"{where}: 'prompt' must be a string, got {type(prompt).__name__} ({line[:60]!r})"
        )
    if not prompt:
        raise EngineError(f"{where}: empty prompt")
    problem = lone_surrogate(prompt)
    if problem is not None:
        raise EngineError(f"{where}: 'prompt' is not valid Unicode text ({problem})")
    # Other keys are allowed (a data set's answer, an id), but one spelled like a known key is
    # a typo whose value would be lost without a word (arrival times, say).
    for key in record:
        near = difflib.get_close_matches(key, JSONL_KEYS, n=1, cutoff=0.85)
        if key not in JSONL_KEYS and near:
            raise EngineError(f"{where}: unknown key {key!r}; did you mean {near[0]!r}?")
    from growpage.engine.inputs import seconds_of

    if "arrival_s" not in record:
        return prompt, None
    # NOTE: a null is refused as any other non-number, not read as no time: pandas writes a
    # missing (NaN) time as null, and a file of nulls would run all at once without a word.
    arrival = record["arrival_s"]
    seconds = seconds_of(arrival)
    if seconds is None:
        raise EngineError(
            f"{where}: 'arrival_s' must be a number of seconds >= 0, got {arrival!r:.40}"
        )
    return prompt, seconds
