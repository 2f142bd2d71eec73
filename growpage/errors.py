"""Error types. Every error the library raises on bad input derives from ``GrowPageError``."""


class GrowPageError(Exception):
    """Base class of the library's own errors."""


class ConfigError(GrowPageError, ValueError):
    """An invalid configuration value; the message names the field."""


class PolicyError(GrowPageError):
    """A policy failed: it returned something the controller cannot execute, or raised (the
    original exception is the cause), or it cannot be found or built. Nothing was changed."""


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
