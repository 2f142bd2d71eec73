"""``benchmarks/step_profile.py``'s pieces: the device's busy time is the union of its kernels'
intervals, and the arguments are checked before anything loads. The whole script runs in the
GPU check's smoke test (``tests/kernels/test_kernel_gpu_check_smoke.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from benchmark_scripts import load_benchmark

step_profile = load_benchmark("step_profile")


def _event(start: float, end: float, device: bool = True) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=kind)


def test_busy_time_counts_overlapping_kernels_once_and_host_events_not_at_all() -> None:
    events = [
        _event(0, 10),
        _event(5, 12),  # overlaps the first: 12 so far
        _event(6, 8),  # inside: nothing more
        _event(20, 25),  # a gap of 8: not busy
        _event(0, 100, device=False),  # a host operator
    ]
    prof = SimpleNamespace(events=lambda: events[::-1])  # any order
    assert step_profile._busy_us(prof) == 17
    assert step_profile._busy_us(SimpleNamespace(events=lambda: [])) == 0


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--requests", "0"], "--requests must be at least 1"),
        (["--max-tokens", "8", "--window", "7"], "--window (7) must leave room"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        step_profile.parse_args(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err
