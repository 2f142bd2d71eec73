"""Triton kernels, importable as ``growpage.kernels`` (see issue: GPU path)."""
