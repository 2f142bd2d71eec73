"""Boundary query summaries (Eq. 12 calibration + RoPE alignment) vs the library's torch path."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE, gen, randn

from growpage.core.demand import rms_calibrate
from growpage.core.rope import RopeConfig, inv_frequencies_on, rope_at
from growpage.kernels import boundary_queries, reference

# Kernel and reference both build the angles as the same fp32 product inv_freq * float(position)
# and take fp32 cos/sin of it, so even at position 131071 they agree to a few ulps: the tight
# fp32 tolerance of the other kernel tests holds.
ATOL, RTOL = 2e-5, 1e-5
POSITIONS = [0, 1, 7, 4093, 131071]
# (L, M, Hq, d): d a power of two and not (48 is masked to 64, 80 to 128), Hq 1 / 3 / 9; d=256
# with 17 heads spans two head blocks (16 heads of 256 per program)
SHAPES = [(2, 3, 1, 16), (1, 2, 3, 48), (2, 2, 9, 64), (1, 1, 3, 80), (1, 2, 17, 256)]


def rope_cfg(head_dim: int, scaled: bool) -> RopeConfig:
    if scaled:  # Llama-3 frequency scaling
        return RopeConfig(head_dim=head_dim, theta=500000.0, scaling_factor=8.0)
    return RopeConfig(head_dim=head_dim)


def make_pool(layers: int, slots: int, heads: int, d: int, seed: int = 0):
    g = gen(seed)
    summaries = randn(layers, slots, 2, heads, d, g=g)
    # EMAs shrink: give the summaries a different scale per view than the current query
    summaries[:, :, 1] *= 0.05
    current = randn(layers, slots, heads, d, g=g) * 2.0
    return summaries, current


def library(
    cfg: RopeConfig, summaries: torch.Tensor, current: torch.Tensor, slot: int, position: int
) -> torch.Tensor:
    """What ``growpage.core`` computes today at a boundary."""
    cur = current[:, slot]
    return torch.stack(
        [rope_at(cfg, rms_calibrate(summaries[:, slot, v], cur), position) for v in (0, 1)]
    )


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "llama3"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-M{}-H{}-d{}".format(*s))
def test_boundary_queries_match_library(shape: tuple[int, int, int, int], scaled: bool) -> None:
    layers, slots, heads, d = shape
    cfg = rope_cfg(d, scaled)
    inv = inv_frequencies_on(cfg, DEVICE)
    summaries, current = make_pool(layers, slots, heads, d, seed=d + heads)
    for slot in sorted({0, slots - 1}):
        for position in POSITIONS:
            out = boundary_queries(summaries, current, slot, position, inv)
            expected = library(cfg, summaries, current, slot, position)
            assert out.shape == (2, layers, heads, d) and out.dtype == torch.float32
            torch.testing.assert_close(
                out,
                expected,
                atol=ATOL,
                rtol=RTOL,
                msg=lambda m, s=slot, p=position: f"slot {s} pos {p}: {m}",
            )
            # the naive twin is the library's math verbatim
            twin = reference.boundary_queries(summaries, current, slot, position, inv)
            assert torch.equal(twin, expected)


def test_calibration_matches_current_rms() -> None:
    """RoPE is a rotation: each output row keeps the RMS of the current query row."""
    summaries, current = make_pool(2, 2, 3, 48, seed=5)
    inv = inv_frequencies_on(rope_cfg(48, True), DEVICE)
    out = boundary_queries(summaries, current, 1, 4093, inv)
    rms = out.pow(2).mean(-1).sqrt()
    expected = current[:, 1].pow(2).mean(-1).sqrt().expand(2, -1, -1)
    torch.testing.assert_close(rms, expected, atol=1e-5, rtol=1e-5)


def test_zero_summary_row_stays_zero() -> None:
    summaries, current = make_pool(2, 2, 3, 16, seed=1)
    summaries[1, 0, 1, 2] = 0.0  # layer 1, slot 0, long view, head 2
    summaries[0, 0, 0] = 0.0  # every head of layer 0's short view
    inv = inv_frequencies_on(rope_cfg(16, False), DEVICE)
    out = boundary_queries(summaries, current, 0, 7, inv)
    assert torch.isfinite(out).all(), "eps guard: no NaN/inf from a zero RMS"
    assert torch.equal(out[1, 1, 2], torch.zeros(16, device=DEVICE))
    assert torch.equal(out[0, 0], torch.zeros(3, 16, device=DEVICE))
    expected = library(rope_cfg(16, False), summaries, current, 0, 7)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("slot", [0, 1, 3])
def test_other_slots_never_leak(slot: int) -> None:
    layers, slots, heads, d = 2, 4, 3, 48
    summaries, current = make_pool(layers, slots, heads, d, seed=2)
    poisoned_s = torch.full_like(summaries, float("nan"))
    poisoned_c = torch.full_like(current, float("nan"))
    poisoned_s[:, slot] = summaries[:, slot]
    poisoned_c[:, slot] = current[:, slot]
    cfg = rope_cfg(d, True)
    out = boundary_queries(poisoned_s, poisoned_c, slot, 4093, inv_frequencies_on(cfg, DEVICE))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out, library(cfg, summaries, current, slot, 4093), atol=ATOL, rtol=RTOL
    )


def test_strided_pool_view() -> None:
    """A pool that is a view (non-contiguous outer dims) is read through its strides."""
    summaries, current = make_pool(2, 3, 6, 16, seed=3)
    sub_s, sub_c = summaries[:, :, :, ::2], current[:, :, 1::2]  # heads 0,2,4 / 1,3,5
    cfg = rope_cfg(16, False)
    out = boundary_queries(sub_s, sub_c, 2, 131071, inv_frequencies_on(cfg, DEVICE))
    torch.testing.assert_close(out, library(cfg, sub_s, sub_c, 2, 131071), atol=ATOL, rtol=RTOL)


def test_bad_inputs_raise() -> None:
    summaries, current = make_pool(1, 2, 3, 16, seed=4)
    inv = inv_frequencies_on(rope_cfg(16, False), DEVICE)
    with pytest.raises(ValueError, match=r"summaries: expected torch.float32"):
        boundary_queries(summaries.half(), current, 0, 1, inv)
    with pytest.raises(ValueError, match=r"current: expected torch.float32"):
        boundary_queries(summaries, current.double(), 0, 1, inv)
    with pytest.raises(ValueError, match=r"inv_freq: expected torch.float32"):
        boundary_queries(summaries, current, 0, 1, inv.double())
    for slot in (2, -1):
        with pytest.raises(ValueError, match=rf"slot {slot} out of range \[0, 2\)"):
            boundary_queries(summaries, current, slot, 1, inv)
    with pytest.raises(ValueError, match=r"position must be >= 0"):
        boundary_queries(summaries, current, 0, -3, inv)
    with pytest.raises(ValueError, match=r"inv_freq: expected length d/2 = 8, got 16"):
        boundary_queries(summaries, current, 0, 1, torch.ones(16, device=DEVICE))
    odd_s, odd_c = summaries[..., :15], current[..., :15]
    with pytest.raises(ValueError, match=r"head dim must be even"):
        boundary_queries(odd_s, odd_c, 0, 1, inv[:7])
    with pytest.raises(ValueError, match=r"summaries: expected 5 dims"):
        boundary_queries(summaries[0], current, 0, 1, inv)
    with pytest.raises(ValueError, match=r"expected \[L, M, 2, Hq, d\]"):
        boundary_queries(torch.cat([summaries, summaries], 2), current, 0, 1, inv)
    with pytest.raises(ValueError, match=r"current: expected shape"):
        boundary_queries(summaries, current[:, :, :2], 0, 1, inv)
    with pytest.raises(ValueError, match=r"last dimension must be contiguous"):
        boundary_queries(summaries.transpose(-1, -2), current, 0, 1, inv)
