"""The paged LLM engine: models, loaders, tokenizer, attention backends, scheduler, ``LLM``.

Submodules import torch; this package stays light so ``import growpage.engine`` is cheap:
``LLM``, ``SamplingParams``, ``EngineConfig`` and ``poisson_arrivals`` are imported on first
use. Everything else comes from the submodules: ``growpage.engine.loading.loader.load_model``,
``growpage.engine.loading.tokenizer.load_tokenizer``,
``growpage.engine.modeling.step_context.use_context``.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "growpage.engine.llm",
    "SamplingParams": "growpage.engine.sampling_params",
    "EngineConfig": "growpage.engine.config",
    "poisson_arrivals": "growpage.engine.inputs",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'growpage.engine' has no attribute {name!r}")
