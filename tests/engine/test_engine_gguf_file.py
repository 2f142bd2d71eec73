"""``GGUFFile`` against the ``gguf`` package's own reader (the oracle), and on broken files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from growpage.engine.loading.gguf_file import GGUFFile
from growpage.engine.loading.loader import default_model_path
from growpage.errors import EngineError


def assert_same_as_gguf_reader(path: Path) -> GGUFFile:
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert ours.version == ref.fields["GGUF.version"].contents()
    assert len(ours.tensors) == len(ref.tensors)
    for mine, theirs in zip(ours.tensors, ref.tensors, strict=True):
        assert (mine.name, mine.shape, mine.type, mine.offset, mine.num_bytes) == (
            theirs.name,
            tuple(theirs.shape.tolist()),
            int(theirs.tensor_type),
            theirs.data_offset,
            theirs.n_bytes,
        )
        raw = ours.raw(mine)
        assert raw.dtype == theirs.data.dtype and raw.shape == theirs.data.shape
        assert np.array_equal(raw, theirs.data)
    return ours


def test_the_default_model_reads_as_the_gguf_package_reads_it():
    ours = assert_same_as_gguf_reader(default_model_path())
    assert len(ours.value("tokenizer.ggml.tokens")) == 49152
    assert ours.value("llama.block_count") == 30 and ours.value("no.such.key", 7) == 7


def write_all_kinds(path: Path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -100)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 0.1)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "héllo ✓")
    w.add_array("k.ints", [3, -1, 7])
    w.add_array("k.strs", ["a", "", "ünï"])
    w.add_array("k.bools", [True, False, True])
    w.add_array("k.floats", [0.5, -2.25])
    w.add_array("k.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain.f16", rng.standard_normal((2, 4, 8)).astype(np.float16))
    q = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor(
        "quant.q8",
        gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), q),
        raw_dtype=q,
    )
    w.add_tensor("vector", np.arange(7, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind(tmp_path, alignment):
    path = tmp_path / "all.gguf"
    write_all_kinds(path, alignment)
    ours = assert_same_as_gguf_reader(path)
    assert ours.value("k.strs") == ["a", "", "ünï"] and ours.value("k.bools") == [True, False, True]
    assert ours.value("k.u64") == 2**63 + 5 and ours.value("k.str") == "héllo ✓"
    q8 = next(t for t in ours.tensors if t.name == "quant.q8")
    back = gguf.quants.dequantize(ours.raw(q8), gguf.GGMLQuantizationType(q8.type))
    assert back.shape == (4, 64)
    if alignment:
        assert all(t.offset % alignment == 0 for t in ours.tensors)


def test_truncated_files_are_named_errors(tmp_path):
    path = tmp_path / "all.gguf"
    write_all_kinds(path)
    data = path.read_bytes()
    tensors = GGUFFile(path).tensors
    header_end, data_end = tensors[0].offset, max(t.offset + t.num_bytes for t in tensors)
    for cut in (3, 10, 30, header_end // 2, header_end - 1, data_end - 1):
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(
            EngineError,
            match=f"cannot read GGUF file {broken}: (truncated|.*runs past the end|bad magic)",
        ):
            GGUFFile(broken)


def test_bad_magic_version_and_value_type(tmp_path):
    path = tmp_path / "all.gguf"
    write_all_kinds(path)
    data = bytearray(path.read_bytes())
    cases = {
        "magic": (b"GGUX" + data[4:], "not a GGUF file"),
        "version": (data[:4] + struct.pack("<I", 1) + data[8:], "unsupported GGUF version 1"),
    }
    # The first metadata value's type sits after the header (24 bytes) and the first key.
    key_len = struct.unpack_from("<Q", data, 24)[0]
    at = 24 + 8 + key_len
    cases["value type"] = (
        data[:at] + struct.pack("<I", 99) + data[at + 4 :],
        "unknown GGUF value type 99",
    )
    for name, (content, message) in cases.items():
        broken = tmp_path / f"{name.replace(' ', '_')}.gguf"
        broken.write_bytes(bytes(content))
        with pytest.raises(EngineError, match=message):
            GGUFFile(broken)
    with pytest.raises(EngineError, match="cannot read GGUF file"):
        GGUFFile(tmp_path / "missing.gguf")


def test_read_benchmark_compares_both_readers(tmp_path, capsys):
    from benchmark_scripts import load_benchmark

    path = tmp_path / "all.gguf"
    write_all_kinds(path)
    bench = load_benchmark("gguf_read")
    assert bench.ours(path) == bench.package(path)  # the same fields and tensors
    assert bench.main(["--repeat", "1", "--path", str(path)]) == 0
    out = capsys.readouterr().out
    assert "GGUFFile" in out and "gguf.GGUFReader" in out and "speed-up" in out


def test_block_sizes_are_ggmls_and_other_types_are_looked_up(tmp_path):
    from growpage.engine.loading.gguf_file import QUANT_SIZES, _quant_size

    for kind, size in QUANT_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)] == size, kind
    rare = int(gguf.GGMLQuantizationType.IQ2_XXS)  # not in our table: the package knows it
    assert rare not in QUANT_SIZES
    assert (
        _quant_size(rare, "t", tmp_path) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    )
    with pytest.raises(EngineError, match="tensor 't' has unknown type 99"):
        _quant_size(99, "t", tmp_path)


@pytest.mark.parametrize("text", ["ünï", "héllo ✓"], ids=["in a string array", "a string"])
def test_invalid_utf8_is_named_with_the_strings_end(tmp_path, text):
    path = tmp_path / "all.gguf"
    write_all_kinds(path)
    data = bytearray(path.read_bytes())
    encoded = text.encode()
    at = data.index(encoded)
    assert data.count(encoded) == 1
    data[at] = 0xFF  # no UTF-8 sequence starts with 0xff
    broken = tmp_path / "utf8.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(EngineError, match=f"invalid UTF-8 string at byte {at + len(encoded)}$"):
        GGUFFile(broken)
