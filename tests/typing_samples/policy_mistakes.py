"""Mistakes mypy must catch in a policy author's code (tests/test_typing.py expects exactly the
errors marked ``# error: CODE`` on their lines)."""

from __future__ import annotations

import attrs

from growpage import BoundaryContext, CapacityPolicy, Decision


@attrs.define
class ReturnsText(CapacityPolicy):
    name = "returns-text"

    def decide(self, ctx: BoundaryContext) -> str:  # error: override
        return "grow"


@attrs.define
class NameAsField(CapacityPolicy):
    # Annotated, ``name`` would become an attrs field (docs/policy-guide.md): refused.
    name: str = "name-as-field"  # error: misc

    def decide(self, ctx: BoundaryContext) -> Decision:
        return Decision.GROW


@attrs.define
class ComparesAString(CapacityPolicy):
    name = "compares-a-string"

    def decide(self, ctx: BoundaryContext) -> Decision:
        return Decision.GROW if ctx.delta() > "0.5" else Decision.COMPRESS  # error: operator
