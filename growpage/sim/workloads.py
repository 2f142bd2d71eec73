"""Workloads: request lengths and arrivals for the serving simulator.

A ``WorkloadSpec`` draws requests from classes (a count, a prompt-length and an output-length
distribution each). Named workloads (``WORKLOADS``) follow the paper's datasets (Table 5 and 6);
their output lengths are *modelled*, not measured: lognormal with the mean tokens per request
implied by the paper's FullKV runs on Qwen3-8B (Table 1 TPS x Table 7 time / requests):
GSM8K ~2.2k, AMC23 ~8.0k, AIME24 ~15.0k tokens, sigma 0.6 / 0.6 / 0.5, clipped to the
benchmark's max output length. Prompts are short (chat-templated questions, ~100-200 tokens).

Workload files: CSV (``load_workload_csv``) with a header holding ``arrival_s, prompt_tokens,
output_tokens`` and optionally ``trace`` (a request id in a trace set), or JSON Lines
(``load_workload_jsonl``, a ``.jsonl`` file) with the same fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import attrs
import numpy as np

from growpage.errors import WorkloadError
from growpage.sim.workload_csv import WorkloadRequest, load_workload_csv, load_workload_jsonl
from growpage.validators import (
    instance_of,
    non_empty_str,
    non_negative_int,
    non_negative_number,
    one_of,
    positive_number,
)

__all__ = [
    "LengthDist",
    "RequestClass",
    "WorkloadRequest",
    "WorkloadSpec",
    "WORKLOADS",
    "load_workload_csv",
    "load_workload_jsonl",
    "resolve_workload",
]
JSONL_SUFFIXES = (".jsonl", ".ndjson")

ARRIVALS = ("offline", "poisson")


_LENGTH = non_negative_number.raising(WorkloadError)


@attrs.frozen
class LengthDist:
    """Token-length distribution: lognormal with the given mean and sigma, clipped to [low, high].

    ``sigma = 0`` gives the constant ``mean`` (clipped).
    """

    mean: float = attrs.field(validator=_LENGTH)
    sigma: float = attrs.field(default=0.0, validator=_LENGTH)
    low: int = attrs.field(default=1, validator=_LENGTH)
    high: int = attrs.field(default=32768, validator=_LENGTH)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise WorkloadError(f"LengthDist needs 1 <= low <= high, got [{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``[n]`` int64 lengths."""
        if self.sigma == 0:
            x = np.full(n, float(self.mean))
        else:
            mu = math.log(max(self.mean, 1e-9)) - self.sigma**2 / 2  # E[x] = mean
            x = rng.lognormal(mu, self.sigma, n)
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)


@attrs.frozen
class RequestClass:
    """``count`` requests of one kind (a dataset, e.g. "aime24")."""

    name: str = attrs.field(validator=non_empty_str.raising(WorkloadError))
    count: int = attrs.field(validator=non_negative_int.raising(WorkloadError))
    prompt: LengthDist = attrs.field(validator=instance_of(LengthDist).raising(WorkloadError))
    output: LengthDist = attrs.field(validator=instance_of(LengthDist).raising(WorkloadError))


def _classes(values: Iterable[RequestClass]) -> tuple[RequestClass, ...]:
    return tuple(values)  # converter=tuple, typed (growpage._convert says why)


def _check_classes(inst: WorkloadSpec, attribute: attrs.Attribute, value: tuple) -> None:
    if not value or not all(isinstance(c, RequestClass) for c in value):
        raise WorkloadError(
            f"WorkloadSpec {inst.name!r}: classes must be one or more RequestClasses, got {value!r}"
        )
    if not sum(c.count for c in value):
        raise WorkloadError(f"WorkloadSpec {inst.name!r}: its classes hold no requests")


@attrs.frozen(kw_only=True)
class WorkloadSpec:
    """A synthetic workload.

    Attributes:
        arrival: "offline" (every request at t = 0, the paper's setting) or "poisson".
        rate_per_s: mean arrivals per second for "poisson".
    """

    name: str
    classes: tuple[RequestClass, ...] = attrs.field(converter=_classes, validator=_check_classes)
    arrival: str = attrs.field(default="offline", validator=one_of(ARRIVALS).raising(WorkloadError))
    rate_per_s: float = attrs.field(default=1.0, validator=positive_number.raising(WorkloadError))

    @property
    def num_requests(self) -> int:
        return sum(c.count for c in self.classes)

    def requests(self, seed: int = 0) -> list[WorkloadRequest]:
        """Draw the requests (shuffled across classes), in arrival order."""
        if not non_negative_int.accepts(seed):
            raise WorkloadError(
                f"WorkloadSpec {self.name!r}: seed must be an int >= 0, got {seed!r}"
            )
        rng = np.random.default_rng(seed)
        kinds, prompts, outputs = [], [], []
        for c in self.classes:
            kinds += [c.name] * c.count
            prompts.append(c.prompt.sample(rng, c.count))
            outputs.append(c.output.sample(rng, c.count))
        order = rng.permutation(len(kinds))
        prompt = np.concatenate(prompts)[order]
        output = np.concatenate(outputs)[order]
        if self.arrival == "poisson":
            arrivals = np.cumsum(rng.exponential(1.0 / self.rate_per_s, len(kinds)))
        else:
            arrivals = np.zeros(len(kinds))
        return [
            WorkloadRequest(
                f"{kinds[j]}-{i}",
                float(arrivals[i]),
                int(prompt[i]),
                int(output[i]),
                None,
                kinds[j],
            )
            for i, j in enumerate(order.tolist())
        ]


def _cls(
    name: str, count: int, prompt: float, output: float, sigma: float, max_output: int
) -> RequestClass:
    return RequestClass(
        name, count, LengthDist(prompt, 0.25, 16, 2048), LengthDist(output, sigma, 16, max_output)
    )


GSM8K = _cls("gsm8k", 1319, 140, 2200, 0.6, 16384)
AMC23 = _cls("amc23", 1280, 160, 8000, 0.6, 16384)
AIME24 = _cls("aime24", 960, 190, 15000, 0.5, 32768)

WORKLOADS: dict[str, WorkloadSpec] = {
    # Table 6: 1280 AMC23-like + 960 AIME24-like + 1319 GSM8K-like, max output 32768.
    "mixed": WorkloadSpec(
        name="mixed",
        classes=[
            attrs.evolve(AMC23, output=attrs.evolve(AMC23.output, high=32768)),
            AIME24,
            attrs.evolve(GSM8K, output=attrs.evolve(GSM8K.output, high=32768)),
        ],
    ),
    "gsm8k": WorkloadSpec(name="gsm8k", classes=[attrs.evolve(GSM8K, count=1319 * 4)]),
    "amc23": WorkloadSpec(name="amc23", classes=[AMC23]),
    "aime24": WorkloadSpec(name="aime24", classes=[AIME24]),
    # Small and quick: demos, tests, CPU-sized experiments.
    "tiny": WorkloadSpec(
        name="tiny",
        classes=[_cls("short", 8, 96, 600, 0.5, 2048), _cls("long", 4, 128, 2400, 0.3, 4096)],
    ),
    "small": WorkloadSpec(
        name="small",
        classes=[_cls("short", 64, 128, 1500, 0.6, 8192), _cls("long", 32, 160, 6000, 0.5, 16384)],
    ),
}


def resolve_workload(
    name_or_file: str, seed: int = 0, rate_per_s: float | None = None
) -> list[WorkloadRequest]:
    """Requests of a named workload (``WORKLOADS``) or of a workload file (``.jsonl``: JSON
    Lines, else CSV).

    ``rate_per_s`` turns a named workload's arrivals into a Poisson process of that rate; the
    requests' lengths do not depend on it (drawn first from the same seed), and the arrival
    times scale as ``1 / rate_per_s``. A file gives its own arrival times, so a rate with a file
    is an error.
    """
    if name_or_file in WORKLOADS:
        spec = WORKLOADS[name_or_file]
        if rate_per_s is not None:
            spec = attrs.evolve(spec, arrival="poisson", rate_per_s=rate_per_s)
        return spec.requests(seed)
    path = Path(name_or_file)
    is_file = (
        path.suffix.lower() in JSONL_SUFFIXES + (".csv",) or "/" in name_or_file or path.is_file()
    )
    if is_file and rate_per_s is not None:
        raise WorkloadError(
            f"{name_or_file}: an arrival rate applies to the named workloads "
            "only; a workload file gives its own arrival times"
        )
    if path.suffix.lower() in JSONL_SUFFIXES:
        return load_workload_jsonl(name_or_file)
    if is_file:
        return load_workload_csv(name_or_file)
    raise WorkloadError(
        f"unknown workload {name_or_file!r}: give one of {', '.join(WORKLOADS)}, "
        "a CSV file (arrival_s, prompt_tokens, output_tokens[, trace, prefix, "
        "prefix_tokens]) or a .jsonl file with those keys"
    )
