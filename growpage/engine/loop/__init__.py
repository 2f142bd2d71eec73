"""The engine's step loop: scheduler, KV manager, model runner and the per-request state they share.

One step is schedule -> run -> update (``LLMEngine.step``). Imports ``modeling``, never ``loading``.
"""
