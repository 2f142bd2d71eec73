"""Error types. Every error the library raises on bad input derives from ``GrowPageError``."""

from __future__ import annotations

import traceback
from collections.abc import Hashable


class GrowPageError(Exception):
    """Base class of the library's own errors."""


class ConfigError(GrowPageError, ValueError):
    """An invalid configuration value; the message names the field."""


class PolicyError(GrowPageError):
    """A policy failed: it returned something the controller cannot execute, or raised (the
    original exception is the cause), or it cannot be found or built. Nothing was changed.

    ``request_id``: the request at whose capacity boundary it failed (None when it failed
    outside one), so that a server can fail that request alone."""

    def __init__(self, message: str, request_id: Hashable | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class PoolExhaustedError(GrowPageError):
    """The page pool cannot satisfy an allocation (nothing was allocated)."""


class TraceError(GrowPageError, ValueError):
    """A malformed or inconsistent trace file; the message names the file and the problem."""


class WorkloadError(GrowPageError, ValueError):
    """A malformed workload specification or file."""


class SimulationError(GrowPageError):
    """The simulator cannot model what was asked (e.g. a signal a script did not record)."""


class EngineError(GrowPageError):
    """Bad input to the engine (empty prompt, prompt that can never fit, missing model...)."""


def raised_at(exc: BaseException, skip: tuple[str, ...] = ()) -> str:
    """`` (file:line, in function)`` of the last frame that raised the root of ``exc``'s
    ``__cause__`` chain, leaving out files under the ``skip`` prefixes (and ``<...>`` ones when
    any are given); ``""`` when no frame is left.

    NOTE: simpy re-raises a process's exception as a copy caused by the original, and a policy
    error is caused by the policy's own exception: the root holds the frame that matters."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    frames = [
        f
        for f in traceback.extract_tb(root.__traceback__)
        if not skip or not (f.filename.startswith(skip) or f.filename.startswith("<"))
    ]
    return f" ({frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""


def policy_raised_at(exc: BaseException) -> str:
    """``raised_at`` for the policy author's code: the last frame outside growpage, installed
    packages and the standard library (a context method that refuses the policy's argument
    raises inside growpage, but the bug is on the policy's line); ``""`` when none is left."""
    import pathlib
    import sysconfig

    paths = sysconfig.get_paths()
    return raised_at(exc, (str(pathlib.Path(__file__).parent), paths["purelib"], paths["stdlib"]))


def describe_error(exc: BaseException) -> str:
    """``Type: message (file:line, in function)``, for a failed point of a grid or sweep: the
    line of the policy author's code that raised, else, for an error that is not a policy's,
    the frame that raised first. A ``PolicyError`` without a line of the policy's (a wrong
    return value, a call its signature refuses) gets none: its message names the policy, the
    method and the boundary, and a frame of the controller that found the problem would point
    at the library instead."""
    where = policy_raised_at(exc)
    if not where and not isinstance(exc, PolicyError):
        where = raised_at(exc)
    return f"{type(exc).__name__}: {exc}{where}"
