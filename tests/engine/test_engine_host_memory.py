"""The up-front KV memory check reads the host's ``MemAvailable`` and the room under the
process's cgroup (container) limits, v2 and v1, from a fake /proc and /sys tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from growpage.core.host_memory import MemoryFigure, available_memory
from growpage.engine.modeling.attention import check_kv_cache_fits
from growpage.errors import EngineError

GiB = 2**30


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def meminfo(available_kb: int) -> str:
    return f"MemTotal:  99999999 kB\nMemFree:  1 kB\nMemAvailable:  {available_kb} kB\n"


def v2_tree(root: Path, limit: str, current: int, host_kb: int = 64 * 2**20) -> Path:
    return write(
        root,
        {
            "proc/meminfo": meminfo(host_kb),
            "proc/self/cgroup": "0::/box/job\n",
            "sys/fs/cgroup/box/job/memory.max": f"{limit}\n",
            "sys/fs/cgroup/box/job/memory.current": f"{current}\n",
        },
    )


def test_cgroup_v2_limit_below_the_host_is_the_figure(tmp_path):
    v2_tree(tmp_path, str(4 * GiB), 3 * GiB)
    assert available_memory(tmp_path) == MemoryFigure(
        GiB,
        f"cgroup v2 limit: memory.max {4 * GiB} minus memory.current {3 * GiB} "
        "in /sys/fs/cgroup/box/job",
    )
    with pytest.raises(
        EngineError,
        match=r"the KV cache would take 2147483648 bytes \(2.00 GiB\)"
        r" for 8 pages, but the host has 1073741824 bytes "
        r"\(1.00 GiB\) available \(cgroup v2 limit: memory.max "
        r"4294967296 minus memory.current 3221225472 in "
        r"/sys/fs/cgroup/box/job\); lower kv_pages",
    ):
        check_kv_cache_fits(2 * GiB, 8, "cpu", root=tmp_path)
    check_kv_cache_fits(GiB, 4, "cpu", root=tmp_path)  # fits exactly
    check_kv_cache_fits(2 * GiB, 8, "meta", root=tmp_path)  # not a CPU cache: not checked


def test_the_host_figure_wins_when_it_is_smaller_than_the_cgroup_room(tmp_path):
    v2_tree(tmp_path, str(4 * GiB), GiB, host_kb=2**20)  # host: 1 GiB, cgroup room: 3 GiB
    assert available_memory(tmp_path) == MemoryFigure(GiB, "MemAvailable in /proc/meminfo")
    with pytest.raises(EngineError, match=r"\(MemAvailable in /proc/meminfo\)"):
        check_kv_cache_fits(2 * GiB, 8, "cpu", root=tmp_path)


def test_cgroup_v2_max_or_an_absurd_limit_is_no_limit(tmp_path):
    v2_tree(tmp_path, "max", 3 * GiB, host_kb=2**20)
    assert available_memory(tmp_path) == MemoryFigure(GiB, "MemAvailable in /proc/meminfo")
    v2_tree(tmp_path, str(2**63 - 4096), 3 * GiB, host_kb=2**20)
    assert available_memory(tmp_path) == MemoryFigure(GiB, "MemAvailable in /proc/meminfo")


def test_a_parent_cgroup_limit_binds_and_usage_over_the_limit_leaves_nothing(tmp_path):
    v2_tree(tmp_path, "max", 0)
    write(
        tmp_path,
        {
            "sys/fs/cgroup/box/memory.max": f"{2 * GiB}\n",
            "sys/fs/cgroup/box/memory.current": f"{3 * GiB}\n",
        },
    )
    figure = available_memory(tmp_path)
    assert figure is not None and figure.num_bytes == 0
    assert figure.source.endswith("in /sys/fs/cgroup/box")


def test_cgroup_v1_memory_controller(tmp_path):
    write(
        tmp_path,
        {
            "proc/meminfo": meminfo(64 * 2**20),
            "proc/self/cgroup": "5:cpu,cpuacct:/other\n4:memory:/docker/abc\n0::/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{40 * GiB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": f"{2 * GiB}\n",
            "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes": f"{GiB // 2}\n",
        },
    )
    assert available_memory(tmp_path) == MemoryFigure(
        3 * GiB // 2,
        f"cgroup v1 limit: memory.limit_in_bytes {2 * GiB} minus "
        f"memory.usage_in_bytes {GiB // 2} in /sys/fs/cgroup/memory/docker/abc",
    )
    with pytest.raises(EngineError, match=r"available \(cgroup v1 limit: memory.limit_in_bytes"):
        check_kv_cache_fits(2 * GiB, 8, "cpu", root=tmp_path)


def test_a_v1_container_whose_cgroup_path_is_the_hosts_reads_the_mount_root(tmp_path):
    write(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/docker/abc\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2 * GiB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GiB}\n",
        },
    )
    assert available_memory(tmp_path) == MemoryFigure(
        GiB,
        f"cgroup v1 limit: memory.limit_in_bytes {2 * GiB} minus memory.usage_in_bytes "
        f"{GiB} in /sys/fs/cgroup/memory",
    )


def test_no_cgroup_files_leaves_the_host_figure_and_nothing_at_all_is_unknown(tmp_path):
    write(tmp_path, {"proc/meminfo": meminfo(2**20)})
    assert available_memory(tmp_path) == MemoryFigure(GiB, "MemAvailable in /proc/meminfo")
    assert available_memory(tmp_path / "empty") is None
    check_kv_cache_fits(2**50, 8, "cpu", root=tmp_path / "empty")  # unknown: torch decides


def test_unreadable_or_malformed_files_are_skipped_not_fatal(tmp_path):
    v2_tree(tmp_path, str(4 * GiB), 3 * GiB, host_kb=2**20)
    # a directory where memory.current should be: reading it raises IsADirectoryError
    (tmp_path / "sys/fs/cgroup/box/job/memory.current").unlink()
    (tmp_path / "sys/fs/cgroup/box/job/memory.current").mkdir()
    assert available_memory(tmp_path) == MemoryFigure(GiB, "MemAvailable in /proc/meminfo")
    write(
        tmp_path,
        {"proc/meminfo": "MemAvailable: lots kB\n", "proc/self/cgroup": "garbage\n0::/box/job\n"},
    )
    (tmp_path / "sys/fs/cgroup/box/job/memory.max").write_bytes(b"\xff\xfe")
    assert available_memory(tmp_path) is None
    (tmp_path / "proc/self/cgroup").unlink()
    (tmp_path / "proc/self/cgroup").mkdir()
    assert available_memory(tmp_path) is None
