"""Testing tools for policy authors: hypothesis strategies and the conformance kit."""

from growpage.testing.conformance import (
    RULES,
    PolicyConformanceError,
    PolicyConformanceWarning,
    check_case,
    check_policy,
)
from growpage.testing.serving import (
    ServingCase,
    check_serving,
    check_serving_case,
    serving_cases,
)
from growpage.testing.strategies import BoundaryCase, boundary_cases, boundary_contexts

__all__ = [
    "RULES",
    "BoundaryCase",
    "PolicyConformanceError",
    "PolicyConformanceWarning",
    "ServingCase",
    "boundary_cases",
    "boundary_contexts",
    "check_case",
    "check_policy",
    "check_serving",
    "check_serving_case",
    "serving_cases",
]
