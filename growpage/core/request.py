"""Per-request capacity state, the same in the simulator and the engine."""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from growpage.core.events import EventCounters


@attrs.define
class RequestState:
    """A request's pages and token counts as the capacity controller sees them.

    Attributes:
        request_id: any hashable id.
        block_table: page ids, in order; slot ``i`` lives in page ``block_table[i // b]``.
        num_tokens: resident tokens (used KV slots), ``<= len(block_table) * page_size``.
        position: absolute position of the next token to be written (tokens seen so far).
        num_prompt_tokens: the request's prompt length (its first ``num_prompt_tokens``
            positions); 0 when unknown.
        events: this request's boundary events.
        trajectory: ``(position, num_pages, action)`` after every boundary.
    """

    request_id: Hashable
    block_table: list[int] = attrs.field(factory=list)
    num_tokens: int = 0
    position: int = 0
    num_prompt_tokens: int = 0
    events: EventCounters = attrs.field(factory=EventCounters)
    trajectory: list[tuple[int, int, str]] = attrs.field(factory=list)

    @property
    def num_pages(self) -> int:
        return len(self.block_table)

    def capacity(self, page_size: int) -> int:
        return self.num_pages * page_size

    def is_at_boundary(self, page_size: int) -> bool:
        """All slots are used: the next token needs a capacity decision."""
        return self.num_tokens >= self.num_pages * page_size
