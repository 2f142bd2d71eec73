"""The paged LLM engine: models, loaders, tokenizer, attention backends.

Submodules import torch; this package stays light so ``import growpage.engine`` is cheap.
Import from the submodules: ``growpage.engine.loader.load_model``,
``growpage.engine.tokenizer.load_tokenizer``, ``growpage.engine.context.use_context``.
"""
