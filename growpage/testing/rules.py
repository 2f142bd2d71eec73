"""The conformance kit's rules and the primitives its checks share: ``RULES``,
``PolicyConformanceError``, calling a policy (a crash is a ``no-crash`` error), seeding the
global RNGs around a call, and the ``keep`` counts a boundary's ``select`` is asked for."""

from __future__ import annotations

import contextlib
import copy
import random
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from growpage.core.boundary_context import BoundaryContext, missing_sums_hint
from growpage.errors import GrowPageError

if TYPE_CHECKING:
    from growpage.testing.serving import ServingCase
    from growpage.testing.strategies import BoundaryCase

RULES = {
    "valid-decision": "decide() returns a growpage.Decision",
    "exact-selection": "select() returns an integer tensor [L, Hkv, keep] of unique slot "
    "indices within the resident tokens, the protected recent window (and a protected prompt, "
    "ctx.num_protected_prefix) included",
    "deterministic": "the same context gives the same decision and selection",
    "order-independent": "a boundary gets the same decision and selection when another "
    "request's decide() and select() come between its own (asynchronous "
    "compaction runs a step's selections after all of its decisions)",
    "no-mutation": "decide() and select() leave the context and its KV view unchanged",
    "no-crash": "decide() and select() work on any valid small context (CPU tensors)",
    "serves": "served by the simulator on a small workload under a tight page pool "
    "(check_serving), every request finishes with all its tokens, every page comes "
    "back, and a fresh copy of the policy serves it with the same events",
}


class PolicyConformanceError(GrowPageError, AssertionError):
    """A policy broke a conformance rule; ``rule`` is its key in ``RULES``."""

    def __init__(
        self, rule: str, detail: str, case: BoundaryCase | ServingCase | None = None
    ) -> None:
        self.rule, self.detail, self.case = rule, detail, case
        msg = f"[{rule}] {RULES[rule]}: {detail}"
        if case is not None:
            msg += f"\n  example: {case}"
        super().__init__(msg)


class PolicyConformanceWarning(UserWarning):
    """The kit checked less than it would have: the policy cannot be deep-copied, so the parts
    of ``deterministic`` and ``serves`` that run fresh copies of it were left out."""


def copy_policy(policy: object, instead: str) -> object | None:
    """A deep copy of ``policy``; None, with a ``PolicyConformanceWarning`` saying what the
    kit does ``instead``, when ``copy.deepcopy`` fails (a policy holding a lock, an open
    file...: not a broken rule, the simulator and the engine serve such a policy)."""
    try:
        return copy.deepcopy(policy)
    except Exception as exc:  # noqa: BLE001 - whatever deepcopy raises, the answer is the same
        name = getattr(policy, "name", type(policy).__name__)
        warnings.warn(
            PolicyConformanceWarning(
                f"policy {name!r} cannot be deep-copied ({type(exc).__name__}: {exc}): {instead}; "
                "a __deepcopy__ that leaves out what cannot be copied has that checked too"
            ),
            stacklevel=3,
        )
        return None


def call_policy(
    policy: object, method: str, ctx: BoundaryContext, case: BoundaryCase, *args: object
) -> Any:
    """``policy.method(ctx, *args)``; what it raises is a ``no-crash`` error naming the call."""
    try:
        return getattr(policy, method)(ctx, *args)
    except Exception as exc:
        call = f"{method}(ctx{', keep=' + str(args[0]) if args else ''})"
        raise PolicyConformanceError(
            "no-crash", f"{call} raised {type(exc).__name__}: {exc}{missing_sums_hint(ctx)}", case
        ) from exc


@contextlib.contextmanager
def global_rngs_seeded(seed: int) -> Iterator[None]:
    """Seed Python's, numpy's and torch's process-wide RNGs; restore them afterwards.

    NOTE: hypothesis reseeds them identically for every example, so without this a policy
    drawing from them makes the same draws on both runs of ``check_case`` and looks
    deterministic. Torch's CPU generator only (the kit's tensors are on the CPU):
    ``torch.manual_seed`` would also seed the accelerators' generators, which ``fork_rng``
    does not restore, and costs a stack capture per call where CUDA is not initialized."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def seeded_call(
    policy: object, method: str, ctx: BoundaryContext, case: BoundaryCase, seed: int, *args: object
) -> Any:
    """``call_policy`` with the global RNGs seeded for this one call."""
    with global_rngs_seeded(seed):
        return call_policy(policy, method, ctx, case, *args)


def keeps_of(case: BoundaryCase) -> list[int]:
    """The ``keep`` counts ``select`` is asked for: a compression's, and a shrink's."""
    keeps = [(case.num_pages - 1) * case.page_size]
    if case.num_pages >= 3:
        keeps.append((case.num_pages - 2) * case.page_size)
    return keeps
