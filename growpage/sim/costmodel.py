"""Step-time cost models for the serving simulator.

A step is one engine iteration: a decode step for ``num_seqs`` running requests whose attention
reads ``kv_tokens`` resident KV tokens in total, and/or a prefill of ``prefill_tokens`` prompt
tokens. Three models:

* ``LinearCostModel``: ``t = base + per_seq * num_seqs + per_kv_token * kv_tokens
  + per_prefill_token * prefill_tokens``, fitted by least squares from engine measurements
  (``growpage calibrate``), saved and loaded as JSON.
* ``PiecewiseCostModel``: as the linear model, but what a step of ``num_seqs`` sequences costs
  beyond its KV and prompt tokens is a measured table, interpolated between the batch sizes
  measured (``growpage calibrate --kind piecewise``). Matrix kernels on a CPU are not linear in
  the batch size (on the project's machine SmolLM2 decodes 16 sequences faster than 15), and a
  line through a few batch sizes misprices the others.
* ``RooflineCostModel``: ``t = overhead + max(flops / (peak * mfu), bytes / (bandwidth * mbu))``
  from hardware and model specs (``sim.hardware`` has the paper's presets).

All may also price capacity control (``boundary_time``), as the engine runs it: one pass for
a step's decisions and one for its compactions, each a fixed cost per step plus a cost per
request (``boundary_step_s`` + ``boundary_s`` per decision, ``compaction_step_s`` +
``compaction_s`` per compaction); 0 by default (the paper's asynchronous pipeline).

All arguments may be numpy arrays (broadcast), so a run of decode steps is priced in one call.
"""

from __future__ import annotations

import abc
import functools
import itertools
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import numpy as np

from growpage.errors import ConfigError
from growpage.sim.hardware import PRESETS, HardwareSpec, ModelSpec
from growpage.validators import (
    check,
    flag,
    in_range,
    is_finite,
    is_number,
    non_negative_int,
    non_negative_number,
)

if TYPE_CHECKING:
    from typing_extensions import TypeIs

ArrayLike = float | int | np.ndarray


def _plain_number(value: Any) -> Any:
    """A numpy integer or float scalar as ``int`` or ``float`` (anything else, a numpy bool
    included, is left for the validator)."""
    if isinstance(value, np.integer):
        return int(value)
    return float(value) if isinstance(value, np.floating) else value


def _seconds(default: float = 0.0) -> Any:
    """A price in seconds: a plain non-negative number (numpy scalars converted)."""
    return attrs.field(default=default, converter=_plain_number, validator=non_negative_number)


def _plain_bool(value: Any) -> Any:
    return bool(value) if isinstance(value, np.bool_) else value


class CostModel(abc.ABC):
    """Seconds per engine step."""

    name: str = "cost"
    #: Price a decode step's KV as ``num_seqs * (longest context)`` instead of the sum of the
    #: contexts: an attention that pads every sequence to the longest in the batch reads that
    #: much (the engine's torch backend, ``AttentionBackend.pads_decode``). The simulator asks.
    padded_kv: bool = False

    @abc.abstractmethod
    def step_time(
        self, num_seqs: ArrayLike, kv_tokens: ArrayLike, prefill_tokens: ArrayLike = 0
    ) -> ArrayLike:
        """Seconds of one step (scalars or broadcastable numpy arrays)."""

    def decode_lines(self, num_seqs: int) -> tuple[float, list[tuple[float, float]]]:
        """Decode step time as ``overhead + max_i(a_i + b_i * kv_tokens)`` for a batch size.

        Returns ``(overhead_s, [(a_i, b_i), ...])``; every built-in model is of this form, which
        prices a run of steps in closed form (``decode_time``).
        """
        raise NotImplementedError

    def decode_times(self, num_seqs: int, kv_tokens: int, num_steps: int) -> np.ndarray:
        """``[num_steps]`` seconds of consecutive decode steps of a fixed batch.

        ``kv_tokens`` is what the first step reads (its new tokens included); every step adds
        one token per sequence.
        """
        kv = kv_tokens + num_seqs * np.arange(num_steps, dtype=np.float64)
        times = self.step_time(num_seqs, kv, 0)
        return np.broadcast_to(np.asarray(times, dtype=np.float64), (num_steps,))

    def decode_time(self, num_seqs: int, kv_tokens: int, num_steps: int) -> float:
        """Total seconds of ``decode_times(...)``, in closed form when ``decode_lines`` is there."""
        try:
            overhead, lines = self.decode_lines(num_seqs)
        except NotImplementedError:
            return float(self.decode_times(num_seqs, kv_tokens, num_steps).sum())
        return overhead * num_steps + _sum_of_max(lines, kv_tokens, num_seqs, num_steps)

    def prefill_time(self, prefill_tokens: int, context_tokens: int = 0) -> float:
        """Seconds of a prefill-only step computing ``prefill_tokens`` tokens, whose requests
        had ``context_tokens`` KV tokens computed in earlier steps (chunked prefill's later
        chunks attend to them), read as a decode step reads its resident KV."""
        return float(self.step_time(0, context_tokens, prefill_tokens))

    def boundary_time(self, decided: int, compactions: int) -> float:
        """Seconds of capacity control between two steps: ``decided`` policy decisions, of
        which ``compactions`` compacted KV (Compress & Hold, Shrink, a refused GROW).

        The engine handles a step's boundaries together (``core.compaction_batch``): one pass
        for the decisions' signals, one for the compactions' selections and KV moves. So a
        step that decides costs ``boundary_step_s`` plus ``boundary_s`` per decision, and one
        that compacts ``compaction_step_s`` plus ``compaction_s`` per compaction. All 0 unless
        set, which is the paper's asynchronous pipeline (appendix E.3: compaction overlaps
        decoding and the decision's cost is not modelled). ``growpage calibrate`` measures them
        on the local engine (``growpage.engine.profiling.profile.measure_boundary_costs``).
        """
        price = functools.partial(getattr, self)
        decisions = decided * price("boundary_s", 0.0)
        decisions += price("boundary_step_s", 0.0) if decided else 0.0
        compacting = compactions * price("compaction_s", 0.0)
        compacting += price("compaction_step_s", 0.0) if compactions else 0.0
        return decisions + compacting

    def describe(self) -> dict[str, Any]:
        """The model's kind (class name) and, for an attrs class, its fields."""
        fields = attrs.asdict(self, recurse=True) if _is_attrs(self) else {}
        return {"kind": type(self).__name__, **fields}


def _is_attrs(cost: object) -> TypeIs[attrs.AttrsInstance]:
    return attrs.has(type(cost))


CostModelT = TypeVar("CostModelT", bound=CostModel)

#: The yardstick step of ``check_step_times``, heavy but real: ``SimConfig``'s default 256
#: running sequences, each reading 131072 KV tokens, beside a prefill of its default 16384-token
#: budget, and a decision and a compaction per sequence at the step's boundary.
REFERENCE_NUM_SEQS = 256
REFERENCE_CONTEXT_TOKENS = 131072
REFERENCE_PREFILL_TOKENS = 16384
#: Most seconds the yardstick step may take (about 32 years). No machine takes that long over
#: one step, so a model pricing it higher holds a coefficient out of any scale (a broken
#: timer's 1e308 fitted by ``growpage calibrate``); below it a run's clock, a sum of steps, and
#: what is derived from it (milliseconds, tokens per second) stay finite even over 1e9 steps.
MAX_STEP_S = 1e9


def check_step_times(cost: CostModel, needs_progress: bool = True) -> None:
    """A ``ConfigError`` unless ``cost`` prices the yardstick step (``REFERENCE_*``) at a finite
    time of at most ``MAX_STEP_S``, and (``needs_progress``) a decode step of one request
    reading one KV token at more than 0 s, without which simulated time would not advance.

    NOTE: the built-in models check the bound alone when built: a free model is a fine part
    (``LinearCostModel()``, boundary prices alone). ``load_cost_model``, ``simulate`` and the
    fits of ``growpage calibrate`` ask for both."""
    n, context, prefill = REFERENCE_NUM_SEQS, REFERENCE_CONTEXT_TOKENS, REFERENCE_PREFILL_TOKENS
    with np.errstate(over="ignore", invalid="ignore"):
        step_s = float(cost.step_time(n, n * context, prefill)) + cost.boundary_time(n, n)
        one_s = float(cost.decode_time(1, 1, 1)) if needs_progress else 1.0
    if not step_s <= MAX_STEP_S:  # NaN too
        raise ConfigError(
            f"cost model {cost.name!r} prices a step of {n} sequences of {context} KV tokens, "
            f"a {prefill}-token prefill and a decision and a compaction per sequence at "
            f"{step_s:.3g} s, more than the {MAX_STEP_S:g} s any machine would take: a "
            "coefficient is out of scale"
        )
    if not (math.isfinite(one_s) and one_s > 0):
        raise ConfigError(
            f"cost model {cost.name!r} prices a decode step at {one_s:g} s: simulated time "
            "would not advance and throughput is undefined"
        )


STEP_COEFFICIENTS = ("base_s", "per_seq_s", "per_kv_token_s", "per_prefill_token_s")


@attrs.frozen(kw_only=True)
class _FittedCostModel(CostModel):
    """What the fitted models share: per-token costs, capacity-control prices, ``padded_kv``."""

    per_kv_token_s: float = attrs.field(
        default=0.0, converter=_plain_number, validator=non_negative_number
    )
    per_prefill_token_s: float = attrs.field(
        default=0.0, converter=_plain_number, validator=non_negative_number
    )
    boundary_s: float = _seconds()  # per decision
    compaction_s: float = _seconds()  # per compaction
    boundary_step_s: float = _seconds()  # per step that decides
    compaction_step_s: float = _seconds()  # per step that compacts
    padded_kv: bool = attrs.field(default=False, converter=_plain_bool, validator=flag)

    def __attrs_post_init__(self) -> None:
        check_step_times(self, needs_progress=False)


@attrs.frozen(kw_only=True)
class LinearCostModel(_FittedCostModel):
    """Linear step time (seconds); coefficients in seconds per unit."""

    base_s: float = attrs.field(default=0.0, converter=_plain_number, validator=non_negative_number)
    per_seq_s: float = attrs.field(
        default=0.0, converter=_plain_number, validator=non_negative_number
    )
    name: str = "linear"

    def step_time(
        self, num_seqs: ArrayLike, kv_tokens: ArrayLike, prefill_tokens: ArrayLike = 0
    ) -> ArrayLike:
        return (
            self.base_s
            + self.per_seq_s * num_seqs
            + self.per_kv_token_s * kv_tokens
            + self.per_prefill_token_s * prefill_tokens
        )

    def decode_lines(self, num_seqs: int) -> tuple[float, list[tuple[float, float]]]:
        return self.base_s + self.per_seq_s * num_seqs, [(0.0, self.per_kv_token_s)]

    def save(self, path: str | os.PathLike) -> Path:
        return _save(self, "linear", path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> LinearCostModel:
        return _load(cls, "linear", STEP_COEFFICIENTS, path)


def _save(cost: attrs.AttrsInstance, kind: str, path: str | os.PathLike) -> Path:
    """Write the model as JSON; readers see the old file or the new one, never half of one (a
    failed write, a full disk, leaves the old model in place)."""
    from growpage.core.traces import atomic_write

    path = Path(path)
    text = json.dumps({"kind": kind, **attrs.asdict(cost)}, indent=1) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def _read_model(path: str | os.PathLike) -> dict[str, Any]:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read a cost model ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f'{path}: not a cost model (expected a JSON object with a "kind")')
    return d


FittedT = TypeVar("FittedT", "LinearCostModel", "PiecewiseCostModel")


def _load(
    cls: type[FittedT], kind: str, required: tuple[str, ...], path: str | os.PathLike
) -> FittedT:
    d = _read_model(path)
    if d.pop("kind", None) != kind:
        raise ConfigError(f'{path}: not a {kind} cost model (expected "kind": "{kind}")')
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"{path}: cost model lacks {', '.join(missing)}")
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"{path}: bad cost model fields ({e})") from None
    except ConfigError as e:  # a validator's message names the field, not the file
        raise ConfigError(f"{path}: {e}") from None


def _batch_sizes(inst: object, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    ok = isinstance(value, tuple) and len(value) > 0
    ok = ok and all(non_negative_int.accepts(b) and is_finite(b) for b in value)
    ok = ok and all(a < b for a, b in itertools.pairwise(value))
    check(inst, attribute.name, ok, "one or more increasing whole numbers >= 0")


def _batch_seconds(
    inst: PiecewiseCostModel, attribute: attrs.Attribute, value: tuple[float, ...]
) -> None:
    check(inst, attribute.name, isinstance(value, tuple), "a list of seconds")
    n = len(inst.batch_sizes)
    check(inst, attribute.name, len(value) == n, f"one value per batch size ({n} values)")
    check(inst, attribute.name, all(is_number(x) and x >= 0 for x in value), "finite numbers >= 0")


def _plain_tuple(value: Any, kind: type, numpy_kind: type) -> Any:
    """A list, tuple, range or numpy array as a tuple, its numpy scalars of ``numpy_kind`` as
    ``kind`` (anything else is left for the validator to refuse)."""
    if not isinstance(value, (list, tuple, range, np.ndarray)):
        return value
    items = value.tolist() if isinstance(value, np.ndarray) else value
    return tuple(
        kind(v) if isinstance(v, numpy_kind) and not isinstance(v, np.bool_) else v for v in items
    )


def _int_tuple(value: Any) -> Any:
    return _plain_tuple(value, int, np.integer)


def _float_tuple(value: Any) -> Any:
    return _plain_tuple(value, float, np.number)


@functools.lru_cache(maxsize=64)
def _trend(sizes: tuple[int, ...], seconds: tuple[float, ...]) -> float:
    points = [(n, t) for n, t in zip(sizes, seconds, strict=True) if n >= 1]
    if len(points) < 2:
        return 0.0
    x, y = np.array(points, dtype=np.float64).T
    return max(float(np.polyfit(x, y, 1)[0]), 0.0)


@attrs.frozen(kw_only=True)
class PiecewiseCostModel(_FittedCostModel):
    """Step time with a measured cost per batch size (seconds):
    ``t = batch_time(num_seqs) + per_kv_token * kv_tokens + per_prefill_token * prefill_tokens``.

    ``batch_time`` is piecewise linear through the measured decode sizes ``(batch_sizes[i],
    batch_s[i])`` (sizes >= 1) and extended past either end with their overall slope
    (``trend_s``; never below 0); a size of 0 is a prefill-only step's fixed cost, used for
    prefill-only steps alone. ``growpage calibrate --kind piecewise`` fits it with one
    ``batch_s`` per batch size measured, so measure every size the simulation will run (an
    unmeasured size is interpolated, which is what the linear model does everywhere).
    """

    batch_sizes: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_batch_sizes)
    batch_s: tuple[float, ...] = attrs.field(converter=_float_tuple, validator=_batch_seconds)
    name: str = "piecewise"

    @property
    def trend_s(self) -> float:
        """Seconds per sequence beyond the measured decode sizes: the slope of the least-squares
        line through them (sizes >= 1), never below 0 (0 with fewer than two). One segment's
        slope would carry a quirk of two sizes far (16 sequences cost less than 15 on the
        project's CPU)."""
        return _trend(self.batch_sizes, self.batch_s)

    def batch_time(self, num_seqs: ArrayLike) -> ArrayLike:
        """Seconds of a step of ``num_seqs`` sequences beyond its KV and prompt tokens.

        Decode sizes (>= 1) interpolate between the measured decode sizes and follow
        ``trend_s`` past them; size 0 (a prefill-only step) is its own measurement, or the
        decode sizes' line taken down to 0 when it was not measured.
        """
        n = np.asarray(num_seqs, dtype=np.float64)
        decode = [(b, t) for b, t in zip(self.batch_sizes, self.batch_s, strict=True) if b >= 1]
        if not decode:  # only prefill-only steps were measured
            return np.broadcast_to(np.float64(self.batch_s[0]), n.shape)[()]
        sizes, seconds = (np.array(c, dtype=np.float64) for c in zip(*decode, strict=True))
        trend = self.trend_s
        out = np.where(
            n < sizes[0],
            seconds[0] - trend * (sizes[0] - n),
            np.where(
                n > sizes[-1], seconds[-1] + trend * (n - sizes[-1]), np.interp(n, sizes, seconds)
            ),
        )
        if self.batch_sizes[0] == 0:
            out = np.where(n == 0, self.batch_s[0], out)
        return np.maximum(out, 0.0)[()]

    def step_time(
        self, num_seqs: ArrayLike, kv_tokens: ArrayLike, prefill_tokens: ArrayLike = 0
    ) -> ArrayLike:
        return (
            self.batch_time(num_seqs)
            + self.per_kv_token_s * np.asarray(kv_tokens)
            + self.per_prefill_token_s * np.asarray(prefill_tokens)
        )[()]

    def decode_lines(self, num_seqs: int) -> tuple[float, list[tuple[float, float]]]:
        return float(self.batch_time(num_seqs)), [(0.0, self.per_kv_token_s)]

    def save(self, path: str | os.PathLike) -> Path:
        return _save(self, "piecewise", path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PiecewiseCostModel:
        return _load(
            cls,
            "piecewise",
            ("batch_sizes", "batch_s", "per_kv_token_s", "per_prefill_token_s"),
            path,
        )


@attrs.frozen(kw_only=True)
class RooflineCostModel(CostModel):
    """Roofline step time of a dense decoder on one accelerator.

    Decode FLOPs are ``2 * params`` per new token plus ``4 * L * Hq * d`` per KV token read by
    attention (QK^T and PV); bytes are the weights once per step plus every resident KV token.
    Prefill adds ``2 * params`` FLOPs and one KV write per prompt token (the quadratic prompt
    attention is ignored: prompts here are short).
    """

    hardware: HardwareSpec
    model: ModelSpec
    # achieved shares of peak FLOP/s and of peak bandwidth
    mfu: float = attrs.field(
        default=0.5, converter=_plain_number, validator=in_range(0, 1, lo_open=True)
    )
    mbu: float = attrs.field(
        default=0.8, converter=_plain_number, validator=in_range(0, 1, lo_open=True)
    )
    overhead_s: float = attrs.field(
        default=0.002,
        converter=_plain_number,  # per step
        validator=non_negative_number,
    )
    boundary_s: float = _seconds()  # per decision
    compaction_s: float = _seconds()  # per compaction
    boundary_step_s: float = _seconds()  # per step that decides
    compaction_step_s: float = _seconds()  # per step that compacts
    name: str = "roofline"

    def __attrs_post_init__(self) -> None:
        check_step_times(self, needs_progress=False)

    def step_time(
        self, num_seqs: ArrayLike, kv_tokens: ArrayLike, prefill_tokens: ArrayLike = 0
    ) -> ArrayLike:
        m, hw = self.model, self.hardware
        attn_flops_per_kv = 4.0 * m.num_layers * m.num_q_heads * m.head_dim
        flops = (
            2.0 * m.num_params * (np.asarray(num_seqs) + prefill_tokens)
            + attn_flops_per_kv * kv_tokens
        )
        num_bytes = m.weight_bytes + m.kv_bytes_per_token * (np.asarray(kv_tokens) + prefill_tokens)
        compute_s = flops / (hw.peak_flops * self.mfu)
        memory_s = num_bytes / (hw.memory_bandwidth * self.mbu)
        return self.overhead_s + np.maximum(compute_s, memory_s)

    def decode_lines(self, num_seqs: int) -> tuple[float, list[tuple[float, float]]]:
        m, hw = self.model, self.hardware
        flops_rate, byte_rate = hw.peak_flops * self.mfu, hw.memory_bandwidth * self.mbu
        compute = (
            2.0 * m.num_params * num_seqs / flops_rate,
            4.0 * m.num_layers * m.num_q_heads * m.head_dim / flops_rate,
        )
        memory = (m.weight_bytes / byte_rate, m.kv_bytes_per_token / byte_rate)
        return self.overhead_s, [compute, memory]

    def kv_pages(self, page_size: int) -> int:
        """Pages of ``page_size`` tokens that fit in the hardware's KV memory for this model."""
        return self.hardware.kv_pages(self.model, page_size)


def _sum_of_max(lines: list[tuple[float, float]], kv0: float, step: float, n: int) -> float:
    """``sum_{i<n} max_j(a_j + b_j * (kv0 + step * i))``, exactly, for a few lines."""
    if n <= 0:
        return 0.0
    # Breakpoints where the maximum may switch lines, as step indices.
    cuts = {0, n}
    for a1, b1 in lines:
        for a2, b2 in lines:
            if b1 != b2 and step:
                x = ((a2 - a1) / (b1 - b2) - kv0) / step
                if 0 < x < n:
                    cuts.add(int(math.ceil(x)))
    total, bounds = 0.0, sorted(cuts)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        mid = kv0 + step * (lo + hi - 1) / 2.0  # the max is one line on [lo, hi)
        a, b = max(lines, key=lambda line: line[0] + line[1] * mid)
        count = hi - lo
        total += count * a + b * (count * kv0 + step * (lo + hi - 1) * count / 2.0)
    return total


def with_boundary_costs(
    cost: CostModelT,
    boundary_s: float | None = None,
    compaction_s: float | None = None,
    boundary_step_s: float | None = None,
    compaction_step_s: float | None = None,
) -> CostModelT:
    """``cost`` with its capacity-control prices replaced where given (None keeps them)."""
    given = {
        "boundary_s": boundary_s,
        "compaction_s": compaction_s,
        "boundary_step_s": boundary_step_s,
        "compaction_step_s": compaction_step_s,
    }
    changes = {k: v for k, v in given.items() if v is not None}
    if not changes:
        return cost
    fields: dict[str, attrs.Attribute[Any]] = (
        attrs.fields_dict(type(cost)) if _is_attrs(cost) else {}
    )
    if not all(f in fields for f in changes):
        raise ConfigError(
            f"cost model {type(cost).__name__} has no boundary_s/compaction_s fields to set"
        )
    # An attrs instance (its fields were found above); mypy's attrs plugin cannot see that
    # from a check at run time, and refuses any type it cannot prove is an attrs class.
    return attrs.evolve(cost, **changes)  # type: ignore[misc]  # attrs class, checked above


#: The fitted kinds a cost model's JSON file may hold (its ``"kind"``).
FITTED_KINDS: dict[str, type[LinearCostModel] | type[PiecewiseCostModel]] = {
    "linear": LinearCostModel,
    "piecewise": PiecewiseCostModel,
}


def load_cost_model(spec: str) -> CostModel:
    """A roofline preset by name (``sim.hardware.PRESETS``) or a fitted model's JSON file
    (linear or piecewise, as its ``"kind"`` says), which prices steps as ``check_step_times``
    asks (a ``ConfigError`` naming the file, else)."""
    if spec in PRESETS:
        hardware, model = PRESETS[spec]
        return RooflineCostModel(hardware=hardware, model=model)
    # NOTE: not an empty name, which Path reads as "." (the current directory) and exists.
    if spec and (Path(spec).suffix == ".json" or Path(spec).exists()):
        kind = _read_model(spec).get("kind")
        if not isinstance(kind, str) or kind not in FITTED_KINDS:
            raise ConfigError(
                f"{spec}: unknown cost model kind {kind!r} (expected "
                f"{' or '.join(map(repr, FITTED_KINDS))})"
            )
        cost = FITTED_KINDS[kind].load(spec)
        try:
            check_step_times(cost)
        except ConfigError as e:
            raise ConfigError(f"{spec}: {e}") from None
        return cost
    raise ConfigError(
        f"unknown cost model {spec!r}: give a preset ({', '.join(PRESETS)}) or a "
        "JSON file written by `growpage calibrate`"
    )
