"""``benchmarks/wrapper_host.py``: the launch wrappers run with their launches stubbed out."""

from __future__ import annotations

from benchmark_scripts import load_benchmark
from kernel_helpers import DEVICE

from growpage.kernels.variants import KERNELS


def test_every_wrapper_is_timed_and_the_stubs_are_removed():
    result = load_benchmark("wrapper_host").measure(3, DEVICE)
    assert len(result) == 5 and all(
        plain > 0 and checked > 0 for plain, checked in result.values()
    ), result
    assert all("run" not in kernel.__dict__ for kernel in KERNELS.values())


def test_the_first_column_checks_no_index_values_as_a_gpu_does(monkeypatch):
    """Timed as a GPU runs by default: the index-value checks (always on under the
    interpreter) run in the second column's calls only."""
    from growpage.kernels import compaction

    checked = []
    real = compaction.check_keep
    monkeypatch.setattr(
        compaction, "check_keep", lambda *a, **k: checked.append(1) or real(*a, **k)
    )
    load_benchmark("wrapper_host").measure(4, DEVICE)
    assert len(checked) == 4  # compact_kv ran 8 times, the 4 checked ones checked
