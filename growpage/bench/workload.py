"""The requests a benchmark sends: read from a dataset file, or synthetic.

A dataset file (``--dataset-path``) is one of:

- JSON Lines of prompts, ``{"prompt": "text", "output_tokens": 128}`` per line
  (``output_tokens`` may be left out: ``--output-len``);
- a workload of the simulator (CSV or JSON Lines of ``arrival_s, prompt_tokens, output_tokens``
  and optionally ``prefix, prefix_tokens``: ``growpage.sim.workload_csv``), whose prompts are
  random token ids of those lengths (the requests naming one prefix share its first ids), so a
  server runs the workload the simulator simulates, token for token.

Synthetic requests are ``--num-prompts`` prompts of ``--input-len`` random token ids. Every
request generates exactly its output tokens (``ignore_eos``, which growpage and vLLM accept).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from growpage.errors import ConfigError, WorkloadError
from growpage.sim.workload_csv import WorkloadRequest, load_workload_csv, load_workload_jsonl

DEFAULT_NUM_PROMPTS = 16  # synthetic requests
DEFAULT_INPUT_LEN = 128  # tokens of a synthetic prompt
DEFAULT_OUTPUT_LEN = 128  # tokens a synthetic request, or a prompt line without its own, generates


@attrs.frozen
class BenchRequest:
    """One request: its prompt (text, or token ids), the tokens it generates and when it is
    sent (seconds after the first; a simulator workload's ``arrival_s``, else 0)."""

    request_id: str
    prompt: str | list[int]
    output_tokens: int
    arrival_s: float = 0.0

    @property
    def prompt_tokens(self) -> int | None:
        """Prompt length in tokens (None for a text prompt: the server's tokenizer decides)."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


def bench_requests(args: argparse.Namespace, vocab_size: Callable[[], int]) -> list[BenchRequest]:
    """The requests of ``--dataset-path`` (its first ``--num-prompts``) or the synthetic ones
    (``--num-prompts``, ``--input-len``, ``--output-len``, ``--seed``); ``vocab_size()``, the
    vocabulary random token ids are drawn from, is asked only when there are some."""
    if args.dataset_path is None:
        return synthetic_requests(
            args.num_prompts or DEFAULT_NUM_PROMPTS,
            args.input_len or DEFAULT_INPUT_LEN,
            args.output_len or DEFAULT_OUTPUT_LEN,
            vocab_size(),
            args.seed,
        )
    if args.input_len is not None:
        raise ConfigError("--input-len: for synthetic prompts, not with --dataset-path")
    requests = read_dataset(args.dataset_path, args.output_len, vocab_size, args.seed)
    return requests[: args.num_prompts] if args.num_prompts else requests


def read_dataset(
    path: Path, output_len: int | None, vocab_size: Callable[[], int], seed: int = 0
) -> list[BenchRequest]:
    """The requests of a dataset file (see the module docstring); ``output_len`` is the output
    length of prompt lines without ``output_tokens``, and must not be given for a workload,
    which has its own."""
    if not path.exists():
        raise ConfigError(f"--dataset-path {path}: no such file")
    if path.is_dir():
        raise ConfigError(f"--dataset-path {path}: is a directory; give a file in it")
    if path.suffix not in (".csv", ".jsonl", ".ndjson"):
        raise ConfigError(
            f"--dataset-path {path}: expected a .jsonl file of prompts, or a simulator workload "
            f"(.csv or .jsonl), got a {path.suffix or 'file without a suffix'}"
        )
    if path.suffix != ".csv" and _holds_prompts(path):
        return _prompt_lines(path, output_len)
    if output_len is not None:
        raise ConfigError(
            f"--output-len: {path} is a workload, whose output_tokens column sets every "
            "request's output length; leave --output-len out"
        )
    workload = load_workload_csv(path) if path.suffix == ".csv" else load_workload_jsonl(path)
    first = min(r.arrival_s for r in workload)
    return [
        BenchRequest(r.request_id, ids, r.output_tokens, r.arrival_s - first)
        for r, ids in zip(workload, token_prompts(workload, vocab_size(), seed), strict=True)
    ]


def synthetic_requests(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """``num_prompts`` prompts of ``input_len`` random token ids, each generating
    ``output_len`` tokens."""
    workload = [
        WorkloadRequest(f"random-{i}", 0.0, input_len, output_len) for i in range(num_prompts)
    ]
    ids = token_prompts(workload, vocab_size, seed)
    return [BenchRequest(r.request_id, p, output_len) for r, p in zip(workload, ids, strict=True)]


def token_prompts(
    requests: Sequence[WorkloadRequest], vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Seeded random token ids, ``prompt_tokens`` per request, from the upper three quarters
    of the vocabulary (clear of the special tokens most tokenizers put first); the requests
    naming one prefix begin with the same ``prefix_tokens`` ids."""
    rng = random.Random(seed)
    low = vocab_size // 4
    prefixes: dict[str, list[int]] = {}
    out = []
    for r in requests:
        head: list[int] = []
        if r.prefix is not None:
            known = prefixes.setdefault(r.prefix, [])
            while len(known) < r.prefix_tokens:
                known.append(rng.randrange(low, vocab_size))
            head = known[: r.prefix_tokens]
        out.append(
            head + [rng.randrange(low, vocab_size) for _ in range(r.prompt_tokens - len(head))]
        )
    return out


def send_times(
    requests: Sequence[BenchRequest], rate_per_s: float | None, seed: int = 0
) -> list[float]:
    """Each request's send time (seconds from the first): Poisson arrivals at ``rate_per_s``
    drawn as the simulator and ``LLM.generate`` draw them, the first at 0 (``inf``: all at
    once); None: the requests' own ``arrival_s``."""
    if rate_per_s is None:
        return [r.arrival_s for r in requests]
    if math.isinf(rate_per_s):
        return [0.0] * len(requests)
    from growpage.engine.inputs import poisson_arrivals

    times = poisson_arrivals(len(requests), rate_per_s, seed)
    return [t - times[0] for t in times]


def _holds_prompts(path: Path) -> bool:
    """Whether a JSON Lines file holds prompts (its first object has a ``prompt`` key)."""
    for line in _lines(path):
        if line.strip():
            try:
                first = json.loads(line)
            except ValueError:
                return False  # the workload reader names the line and the problem
            return isinstance(first, dict) and "prompt" in first
    return False


def _prompt_lines(path: Path, output_len: int | None) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    for number, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise WorkloadError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or set(obj) - {"prompt", "output_tokens"}:
            raise WorkloadError(
                f"{where}: expected an object with 'prompt' and optionally 'output_tokens', "
                f"got {line.strip()[:80]!r}"
            )
        prompt, tokens = (
            obj.get("prompt"),
            obj.get("output_tokens", output_len or DEFAULT_OUTPUT_LEN),
        )
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r:.60}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise WorkloadError(f"{where}: 'output_tokens' must be an integer >= 1, got {tokens!r}")
        out.append(BenchRequest(f"prompt-{len(out)}", prompt, tokens))
    if not out:
        raise WorkloadError(f"{path}: holds no prompts")
    return out


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--dataset-path {path}: cannot read it ({e})") from None
