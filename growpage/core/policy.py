"""``Policy``: what the capacity controller asks of a policy, as a typing protocol.

``growpage.policies.CapacityPolicy`` is the class a policy author subclasses, and it implements
this protocol; the controller is typed against the protocol so that ``core`` needs nothing from
the layer above it (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.core.decision import Decision


class Policy(Protocol):
    """The four members ``CapacityController`` reads; see ``CapacityPolicy`` for their
    contract."""

    @property
    def name(self) -> str: ...

    @property
    def fallback_to_compress(self) -> bool: ...

    def decide(self, ctx: BoundaryContext) -> Decision: ...

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor: ...


#: The policy type a ``CapacityController`` holds (``controller.policy`` is the one given).
PolicyT = TypeVar("PolicyT", bound=Policy)
