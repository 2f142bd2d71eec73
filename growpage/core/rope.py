"""Rotary position embedding (RoPE), shared by the engine's models and the demand estimator.

Layout is the "rotate-half" (GPT-NeoX / Hugging Face Llama) convention: the head dimension is
split into two halves ``x = [x1, x2]`` and rotated as ``[x1*cos - x2*sin, x2*cos + x1*sin]``.
Weights stored in the interleaved (GGUF / Meta) convention must be permuted on load.
"""

from __future__ import annotations

import math

import attrs
import torch

from growpage.validators import Check, optional, positive_int, positive_number

_EVEN = Check("an even positive integer", lambda v: positive_int.accepts(v) and v % 2 == 0)


@attrs.frozen
class RopeConfig:
    """RoPE parameters as they appear in a model config (and a trace header)."""

    head_dim: int = attrs.field(validator=_EVEN)
    theta: float = attrs.field(default=10000.0, validator=positive_number)
    # Llama-3 style frequency scaling; None means plain RoPE.
    # NOTE: a zero scaling factor or equal frequency factors divide by zero in
    # inv_frequencies, which would turn every rotated query and key into NaN.
    scaling_factor: float | None = attrs.field(default=None, validator=optional(positive_number))
    low_freq_factor: float = attrs.field(default=1.0, validator=positive_number)
    high_freq_factor: float = attrs.field(default=4.0, validator=positive_number)
    original_max_position: int = attrs.field(default=8192, validator=positive_number)

    def __attrs_post_init__(self) -> None:
        if self.scaling_factor is not None and self.low_freq_factor == self.high_freq_factor:
            raise ValueError(
                f"RopeConfig: low_freq_factor and high_freq_factor must differ "
                f"(both {self.low_freq_factor}) when scaling_factor is set"
            )

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RopeConfig:
        return cls(**d)


def inv_frequencies(cfg: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` in fp32, with Llama-3 scaling when configured."""
    inv = 1.0 / (
        cfg.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    )
    if cfg.scaling_factor is not None:
        low_wavelen = cfg.original_max_position / cfg.low_freq_factor
        high_wavelen = cfg.original_max_position / cfg.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (cfg.original_max_position / wavelen - cfg.low_freq_factor) / (
            cfg.high_freq_factor - cfg.low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / cfg.scaling_factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        blended = (1 - smooth) * inv / cfg.scaling_factor + smooth * inv
        inv = torch.where(mid, blended, scaled)
    return inv.to(torch.float32)


_INV_CACHE: dict[tuple[RopeConfig, torch.device], torch.Tensor] = {}


def inv_frequencies_on(cfg: RopeConfig, device: torch.device) -> torch.Tensor:
    """``inv_frequencies(cfg)`` on ``device``, computed and copied there once."""
    key = (cfg, torch.device(device))
    inv = _INV_CACHE.get(key)
    if inv is None:
        inv = _INV_CACHE[key] = inv_frequencies(cfg).to(device)
    return inv


def cos_sin(
    cfg: RopeConfig, positions: torch.Tensor, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[*positions.shape, head_dim]`` (fp32)."""
    inv = inv_frequencies_on(cfg, device if device is not None else positions.device)
    angles = positions.to(inv.device, torch.float32).unsqueeze(-1) * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., head_dim]`` with ``cos``/``sin`` broadcastable to it; computed in fp32."""
    out = x.float() * cos + rotate_half(x.float()) * sin
    return out.to(x.dtype)


def rope_at(cfg: RopeConfig, x: torch.Tensor, position: int) -> torch.Tensor:
    """Rotate every vector of ``x [..., head_dim]`` to one absolute ``position``.

    Used at capacity boundaries to align the pre-RoPE query summaries with the current
    decoding position (paper appendix E.1).
    """
    # NOTE: the angles are built on x's device from a Python int: no host-to-device copy per
    # boundary (same fp32 product as ``cos_sin`` of a one-element position tensor).
    angles = inv_frequencies_on(cfg, x.device) * float(position)
    angles = torch.cat([angles, angles])
    return apply_rope(x, angles.cos(), angles.sin())


def rope_at_each(cfg: RopeConfig, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """``x [R, ..., head_dim]`` with row r rotated to ``positions[r]``: row r is bitwise
    ``rope_at(cfg, x[r], positions[r])`` (the same fp32 products, one pass for all rows)."""
    inv = inv_frequencies_on(cfg, x.device)
    at = torch.tensor(positions, dtype=torch.float32, device=x.device).unsqueeze(-1)
    angles = at * inv
    angles = torch.cat([angles, angles], dim=-1)
    shape = (len(positions),) + (1,) * (x.dim() - 2) + (cfg.head_dim,)
    return apply_rope(x, angles.cos().view(shape), angles.sin().view(shape))
