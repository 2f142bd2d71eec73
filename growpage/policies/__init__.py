"""Capacity policies: the base class, the built-ins and the registry."""

from growpage.core.decision import Decision
from growpage.policies.base import CapacityPolicy
from growpage.policies.builtin import (
    EntropyPolicy,
    FixedBudgetPolicy,
    FullKVPolicy,
    GrowPagePolicy,
    H2OPolicy,
    InversePolicy,
    RandomPolicy,
    ShrinkPolicy,
    SnapKVPolicy,
    StreamingLLMPolicy,
)
from growpage.policies.registry import register_policy, registered_policies, resolve_policy

__all__ = [
    "CapacityPolicy",
    "Decision",
    "EntropyPolicy",
    "FixedBudgetPolicy",
    "FullKVPolicy",
    "GrowPagePolicy",
    "H2OPolicy",
    "InversePolicy",
    "RandomPolicy",
    "ShrinkPolicy",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "register_policy",
    "registered_policies",
    "resolve_policy",
]
