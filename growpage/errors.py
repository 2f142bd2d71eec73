"""Error types. Every error the library raises on bad input derives from ``GrowPageError``."""


class GrowPageError(Exception):
    """Base class of the library's own errors."""


class ConfigError(GrowPageError, ValueError):
    """An invalid configuration value; the message names the field."""


class PolicyError(GrowPageError):
    """A policy returned something the controller cannot execute (nothing was changed)."""


class PoolExhaustedError(GrowPageError):
    """The page pool cannot satisfy an allocation (nothing was allocated)."""


class TraceError(GrowPageError, ValueError):
    """A malformed or inconsistent trace file; the message names the file and the problem."""


class WorkloadError(GrowPageError, ValueError):
    """A malformed workload specification or file."""


class EngineError(GrowPageError):
    """Bad input to the engine (empty prompt, prompt that can never fit, missing model...)."""
