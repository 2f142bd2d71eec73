"""``CapacityPolicy``: the one class a policy author subclasses."""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from growpage.core.boundary_context import BoundaryContext
from growpage.core.decision import Decision
from growpage.core.selection import growpage_select


class CapacityPolicy(abc.ABC):
    """Decides, at a request's capacity boundary, whether to grow, compress or shrink, and which
    KV slots a compression keeps. The same object runs in the simulator and the engine.

    Subclasses are usually small ``attrs`` classes whose fields are their hyperparameters.
    """

    name: ClassVar[str] = "custom"
    # When GROW is refused by the pool: compress instead (a *fallback*), or, when False, ask
    # the caller to preempt (plain PagedAttention / vLLM behaviour, used by ``fullkv``).
    fallback_to_compress: ClassVar[bool] = True
    #: True when ``select``/``decide`` read ``ctx.accumulated_attention()`` (H2O): the simulator's
    #: trace views then accumulate every replayed query's attention, which costs replay time;
    #: the engine keeps a per-slot fp32 sum beside the KV cache, adds every step's attention
    #: into it and turns prefix caching off (``growpage.engine.modeling.accumulation``).
    needs_accumulated_attention: ClassVar[bool] = False
    _named_by_class: ClassVar[bool] = False  # ``name`` is the class name, no written one

    @property
    def needs_recent_queries(self) -> int:
        """How many of the request's most recent queries ``select``/``decide`` read through
        ``ctx.recent_queries(w)`` / ``ctx.window_attention(w)`` (SnapKV's observation window,
        ``w`` at most this); 0 = none. The engine then keeps, per running request, a ring of
        its last queries (``growpage.engine.loop.recent_queries``); the simulator reads them from
        the trace. A subclass overrides it with a property or a plain class attribute
        (``needs_recent_queries = 8``; not annotated in an attrs class, which would make it a
        field)."""
        return 0

    @abc.abstractmethod
    def decide(self, ctx: BoundaryContext) -> Decision:
        """Return ``Decision.GROW``, ``Decision.COMPRESS`` or ``Decision.SHRINK``.

        GROW may be refused by the controller when the pool has no page above its watermark;
        COMPRESS then runs instead (a *fallback*), or, for a policy with
        ``fallback_to_compress = False``, the caller preempts the request.
        """

    def select(self, ctx: BoundaryContext, keep: int) -> torch.Tensor:
        """Slots to keep, ``[L, Hkv, keep]`` int64, ascending per layer and KV head.

        ``keep`` counts the protected recent window (the last ``ctx.recent_window`` slots)
        and the protected prompt (the first ``ctx.num_protected_prefix`` slots), which must
        always be included. Default: GrowPage selection, s = max(a^S, a^L) (Eq. 9)
        with a block-local quota of ``ctx.config.local_quota`` per page plus global top-k
        (Eq. 10).
        """
        return growpage_select(
            ctx.scores(),
            ctx.num_tokens,
            ctx.recent_window,
            keep,
            ctx.page_size,
            ctx.config.local_quota,
            ctx.num_protected_prefix,
        )

    @property
    def has_default_selection(self) -> bool:
        """Whether ``select`` is this class's (GrowPage selection): the engine then selects
        for all of a step's compressions in one pass (``core.compaction_batch``), with the
        same slots; a policy's own ``select`` runs request by request."""
        return type(self).select is CapacityPolicy.select

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Errors and reports name an unnamed policy by its class: its own, not the name a base
        # class got the same way (a subclass of an unnamed helper base is not that base).
        if "name" in cls.__dict__:
            cls._named_by_class = cls.__dict__.get("_named_by_class", False)
        elif cls._named_by_class or getattr(cls, "name", "custom") == "custom":
            cls.name, cls._named_by_class = cls.__name__, True

    def __str__(self) -> str:
        return self.name
