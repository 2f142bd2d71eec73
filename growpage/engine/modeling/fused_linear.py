"""``FusedLinear``: several Hugging Face projections of one input as a single ``nn.Linear``."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


class FusedLinear(nn.Linear):
    """Several Hugging Face projections of the same input as one ``nn.Linear``: their output
    rows side by side (``q|k|v``, ``gate|up``), so one GEMM instead of several.

    Registered on the parent module, the fused weight keeps the HF names in the state dict:
    ``state_dict()`` splits it into views ``<part>.weight`` (and ``.bias``), and
    ``load_state_dict`` concatenates the parts back (any loader, ``assign=True`` too).
    """

    def __init__(
        self, parent: nn.Module, name: str, in_features: int, parts: dict[str, int], bias: bool
    ) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.name, self.parts = name, dict(parts)
        # partials, not bound methods: torch marks the hooks it registers with an attribute
        parent.register_state_dict_post_hook(functools.partial(FusedLinear._split_state, self))
        parent.register_load_state_dict_pre_hook(functools.partial(FusedLinear._merge_state, self))

    def _split_state(
        self,
        parent: nn.Module,
        state_dict: dict[str, torch.Tensor],
        prefix: str,
        local_metadata: dict[str, Any],
    ) -> None:
        items = list(state_dict.items())
        state_dict.clear()
        for key, value in items:  # the parts take the fused entry's place: HF order
            suffix = key.rpartition(".")[2]
            if key != f"{prefix}{self.name}.{suffix}":
                state_dict[key] = value
                continue
            for part, t in zip(self.parts, value.split(list(self.parts.values())), strict=True):
                state_dict[f"{prefix}{part}.{suffix}"] = t

    def _merge_state(
        self, parent: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *args: object
    ) -> None:
        for suffix in ("weight", "bias"):
            keys = [f"{prefix}{part}.{suffix}" for part in self.parts]
            if all(k in state_dict for k in keys):  # else strict loading reports the gap
                state_dict[f"{prefix}{self.name}.{suffix}"] = torch.cat(
                    [state_dict.pop(k) for k in keys]
                )
