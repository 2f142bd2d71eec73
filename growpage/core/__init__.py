"""Shared core: config, demand maths, RoPE, selection, pages, request state, controller."""
