"""The models and the attention backends under them: decoder, KV cache tensor, step context.

Imports nothing of ``loop`` or ``loading``.
"""
