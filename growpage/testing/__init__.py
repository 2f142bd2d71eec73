"""Testing tools for policy authors: hypothesis strategies and the conformance kit."""

from growpage.testing.conformance import RULES, PolicyConformanceError, check_case, check_policy
from growpage.testing.strategies import BoundaryCase, boundary_cases, boundary_contexts

__all__ = ["RULES", "BoundaryCase", "PolicyConformanceError", "boundary_cases",
           "boundary_contexts", "check_case", "check_policy"]
