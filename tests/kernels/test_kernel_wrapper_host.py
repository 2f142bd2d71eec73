"""``benchmarks/wrapper_host.py``: the launch wrappers run with their launches stubbed out."""

from __future__ import annotations

from benchmark_scripts import load_benchmark
from growpage.kernels.variants import KERNELS
from kernel_helpers import DEVICE


def test_every_wrapper_is_timed_and_the_stubs_are_removed():
    result = load_benchmark("wrapper_host").measure(3, DEVICE)
    assert len(result) == 5 and all(us > 0 for us in result.values()), result
    assert all("run" not in kernel.__dict__ for kernel in KERNELS.values())
