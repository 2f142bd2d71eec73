"""How much memory a new CPU allocation may take: the host's ``MemAvailable`` and the room left
under the process's cgroup memory limits (a container's limit is one), whichever is smallest.

    /proc/meminfo                       MemAvailable: <kB>
    /proc/self/cgroup                   0::/<path>              (cgroup v2)
                                        <n>:...memory...:/<path>  (cgroup v1)
    v2  /sys/fs/cgroup/<path>/          memory.max - memory.current
    v1  /sys/fs/cgroup/memory/<path>/   memory.limit_in_bytes - memory.usage_in_bytes

The cgroup and each of its ancestors is read (a parent's limit binds its children too, and in a
container whose cgroup path is the host's the limit sits on the mount's root). A limit of
``max`` or of at least ``NO_LIMIT_BYTES`` means none. A file that is missing, unreadable or
malformed is skipped: the figure it would give is unknown, never an error.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

NO_LIMIT_BYTES = 2**60  # cgroup v1 writes "unlimited" as about 2**63 rounded to a page


class MemoryFigure(NamedTuple):
    """Bytes a new allocation may take, and the limit that says so (for error messages)."""

    num_bytes: int
    source: str


def available_memory(root: str | Path = "/") -> MemoryFigure | None:
    """The smallest of the figures below ``root`` (``/``; a test passes a fake tree); None
    when none can be read."""
    root = Path(root)
    figures = [_meminfo(root), *_cgroups(root)]
    known = [f for f in figures if f is not None]
    return min(known, key=lambda f: f.num_bytes) if known else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo(root: Path) -> MemoryFigure | None:
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "MemAvailable:" and fields[1].isdigit():
            return MemoryFigure(int(fields[1]) * 1024, "MemAvailable in /proc/meminfo")
    return None


def _cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """The process's cgroup v2 path and its cgroup v1 memory path, from /proc/self/cgroup."""
    v2 = v1 = None
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


#: Per cgroup version: where its hierarchy is mounted, its limit and usage files.
_CGROUP_FILES = (
    ("sys/fs/cgroup", "memory.max", "memory.current", "cgroup v2"),
    ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "cgroup v1"),
)


def _cgroups(root: Path) -> list[MemoryFigure | None]:
    """The room under each cgroup limit of the process and its ancestors, v2 then v1."""
    figures: list[MemoryFigure | None] = []
    for path, (mount, limit, usage, label) in zip(_cgroup_paths(root), _CGROUP_FILES, strict=True):
        if path is not None:
            figures += [_room(root, d, limit, usage, label) for d in _ancestors(mount, path)]
    return figures


def _ancestors(mount: str, path: str) -> list[str]:
    """``mount/a/b``, ``mount/a``, ``mount`` for the cgroup path ``/a/b``."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return ["/".join([mount, *parts[:n]]) for n in range(len(parts), -1, -1)]


def _room(
    root: Path, directory: str, limit_name: str, usage_name: str, version: str
) -> MemoryFigure | None:
    limit, usage = (_read_int(root / directory / name) for name in (limit_name, usage_name))
    if limit is None or limit >= NO_LIMIT_BYTES or usage is None:
        return None
    return MemoryFigure(
        max(limit - usage, 0),
        f"{version} limit: {limit_name} {limit} minus {usage_name} {usage} in /{directory}",
    )


def _read_int(path: Path) -> int | None:
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None
