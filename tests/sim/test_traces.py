"""Trace format: round trips, atomic writes, validation, corruption fuzzing, trace sets."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import growpage.core.trace_set as trace_set_mod
import growpage.core.traces as traces_mod
from growpage.core.rope import RopeConfig
from growpage.core.traces import (
    HEADER_KEY,
    Trace,
    TraceSet,
    read_trace,
    read_trace_header,
    read_trace_set,
    write_trace,
)
from growpage.errors import ConfigError, TraceError

FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory, make_trace) -> Path:
    return write_trace(tmp_path_factory.mktemp("valid") / "t.safetensors", make_trace())


def read_metadata(path: Path) -> str:
    """The raw header JSON text of a trace file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))["__metadata__"][HEADER_KEY]


def _rewrite(src: Path, dst: Path, tensors=None, header=None, metadata=None) -> Path:
    """Copy a trace file with its tensors and/or header JSON changed by callbacks."""
    ts = load_file(src)
    d = json.loads(read_metadata(src))
    if tensors:
        ts = tensors(ts) or ts
    if header:
        d = header(d) or d
    save_file(ts, dst, metadata=metadata if metadata is not None else {HEADER_KEY: json.dumps(d)})
    return dst


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_values", [True, False])
def test_round_trip_is_exact_within_storage_dtype(tmp_path, make_trace, dtype, has_values):
    trace = make_trace(has_values=has_values)
    path = write_trace(tmp_path / "a.safetensors", trace, dtype=dtype)
    back = read_trace(path)
    assert back.header == trace.header
    assert back.queries.dtype == torch.float32
    for name in ("queries", "keys", "values"):
        want = getattr(trace, name)
        got = getattr(back, name)
        if want is None:
            assert got is None
        else:
            assert torch.equal(got, want.to(dtype).float()), name
    assert read_trace(path, dtype=dtype).keys.dtype == dtype
    assert read_trace_header(path) == trace.header


def test_trace_properties(make_trace):
    trace = make_trace(num_tokens=12, prompt_len=5)
    assert (trace.num_tokens, trace.prompt_len, trace.num_generated) == (12, 5, 7)
    assert trace.header.num_recorded_layers == 2 and trace.request_id == "req-0"


# --- writer ---------------------------------------------------------------------------------------


def _bad_shape(t: Trace) -> None:
    t.queries = t.queries[:, :-1]


def _inf(t: Trace) -> None:
    t.keys[0, 3, 1, 2] = float("inf")


def _fp16_overflow(t: Trace) -> None:
    t.queries[1, 0, 0, 0] = 1e6


def _values_dropped(t: Trace) -> None:
    t.values = None


def _bad_meta(t: Trace) -> None:
    t.header.meta["x"] = object()


@pytest.mark.parametrize("corrupt", [_bad_shape, _inf, _fp16_overflow, _values_dropped, _bad_meta])
def test_writer_validates_and_leaves_old_file_untouched(tmp_path, make_trace, corrupt):
    path = write_trace(tmp_path / "a.safetensors", make_trace(seed=1))
    before = path.read_bytes()
    trace = make_trace(seed=2)
    corrupt(trace)
    with pytest.raises(TraceError, match="a.safetensors"):
        write_trace(path, trace)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_writer_cleans_up_when_saving_fails(tmp_path, make_trace, monkeypatch):
    def boom(*args, **kwargs):
        Path(args[1]).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(traces_mod, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_trace(tmp_path / "a.safetensors", make_trace())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_umask_like_any_other_file(tmp_path, make_trace, umask):
    """A trace and its set's index are readable by whoever the umask lets read new files (the
    temporary file behind the atomic rename would otherwise keep mkstemp's 0o600)."""
    old = os.umask(umask)
    try:
        plain = tmp_path / "plain"
        plain.write_text("x")
        path = write_trace(tmp_path / "a.safetensors", make_trace())
        ts = TraceSet(tmp_path / "set", create=True)
        ts.write(make_trace(request_id="r"))
    finally:
        os.umask(old)
    expected = stat.S_IMODE(plain.stat().st_mode)
    assert expected == 0o666 & ~umask
    files = [path, tmp_path / "set" / "index.json", *(tmp_path / "set").glob("*.safetensors")]
    assert len(files) == 3
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files} == {
        f.name: oct(expected) for f in files
    }


def test_rewriting_a_file_keeps_its_permissions(tmp_path, make_trace):
    path = write_trace(tmp_path / "a.safetensors", make_trace(seed=1))
    path.chmod(0o640)
    write_trace(path, make_trace(seed=2))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_writer_rejects_other_storage_dtypes(tmp_path, make_trace):
    with pytest.raises(TraceError, match="float16 or bfloat16"):
        write_trace(tmp_path / "a.safetensors", make_trace(), dtype=torch.float32)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"prompt_len": 13}, "prompt_len"),
        ({"prompt_len": 0}, "prompt_len"),
        ({"layer_ids": [3, 1]}, "layer_ids"),
        ({"layer_ids": [1, 4]}, "layer_ids"),
        ({"num_q_heads": 3}, "multiple"),
        ({"rope": RopeConfig(head_dim=16)}, "rope.head_dim"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"token_ids": []}, "token_ids"),
        ({"has_values": 1}, "has_values"),
    ],
)
def test_header_validates_fields(make_trace, change, problem):
    import attrs

    with pytest.raises(TraceError, match=problem):
        attrs.evolve(make_trace().header, **change)


def test_trace_validates_shapes(make_trace):
    t = make_trace()
    with pytest.raises(TraceError, match="keys have shape"):
        Trace(header=t.header, queries=t.queries, keys=t.keys[:, :, :1], values=t.values)
    with pytest.raises(TraceError, match="values are missing"):
        Trace(header=t.header, queries=t.queries, keys=t.keys)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["queries", "keys", "values"])
def test_a_trace_built_in_memory_rejects_non_finite_values(make_trace, name, bad):
    """As the reader and the writer do: a NaN key would make every score NaN downstream."""
    t = make_trace()
    tensors = {"queries": t.queries.clone(), "keys": t.keys.clone(), "values": t.values.clone()}
    tensors[name][0, 1, 0, 0] = bad
    with pytest.raises(TraceError, match=f"{name} have non-finite"):
        Trace(header=t.header, **tensors)


def test_reading_as_a_non_float_dtype_names_the_file(tmp_path, make_trace):
    path = write_trace(tmp_path / "t.safetensors", make_trace())
    with pytest.raises(TraceError, match=f"^{path}: .*floating-point dtype"):
        read_trace(path, dtype=torch.int32)


# --- reader: each problem gets its own clear error -----------------------------------------------


def _set(key, value):
    def f(d):
        d[key] = value

    return f


def _drop_layer(ts):
    return {k: v for k, v in ts.items() if not k.startswith("layer.3.")}


def _drop_values(ts):
    return {k: v for k, v in ts.items() if not k.endswith(".v")}


def _to_fp32(ts):
    return {k: v.float() for k, v in ts.items()}


def _shorter_key(ts):
    ts["layer.1.k"] = ts["layer.1.k"][:-1].clone()


def _one_head_key(ts):
    ts["layer.1.k"] = ts["layer.1.k"][:, :1].clone()


def _nan(ts):
    ts["layer.3.v"][2, 0, 0] = float("nan")


def _extra(ts):
    ts["layer.2.q"] = ts["layer.1.q"].clone()


READ_CASES = {
    "unsupported format version": dict(header=_set("version", 2)),
    "not a 'growpage-trace'": dict(header=_set("format", "other")),
    "header dtype": dict(header=_set("dtype", "float32")),
    "missing ['layer.3.q'": dict(tensors=_drop_layer),
    "missing ['layer.1.v'": dict(tensors=_drop_values),
    "unexpected ['layer.1.v'": dict(header=_set("has_values", False)),
    "unexpected ['layer.2.q'": dict(tensors=_extra),
    "torch.float32": dict(tensors=_to_fp32),
    "layer.1.k holds 11 tokens": dict(tensors=_shorter_key),
    "layer.1.k is": dict(tensors=_one_head_key),
    "non-finite": dict(tensors=_nan),
    "prompt_len=13": dict(header=_set("prompt_len", 13)),
    "token_ids has 11": dict(header=_set("token_ids", list(range(11)))),
    "missing ['model']": dict(header=lambda d: d.pop("model") and None),
    "unknown ['extra']": dict(header=_set("extra", 1)),
    "'rope' is invalid": dict(header=_set("rope", {"head_dim": 8, "bogus": 1})),
    "non-finite number": dict(header=_set("softmax_scale", float("inf"))),
    "no 'growpage.trace' header": dict(metadata={"other": "x"}),
    "not valid JSON": dict(metadata={HEADER_KEY: "{nope"}),
}


@pytest.mark.parametrize("problem", list(READ_CASES))
def test_reader_names_file_and_problem(tmp_path, valid_file, problem):
    path = _rewrite(valid_file, tmp_path / "bad.safetensors", **READ_CASES[problem])
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert str(path) in str(err.value) and problem in str(err.value)


def test_overflowing_json_numbers_are_rejected(tmp_path, valid_file):
    def overflow(d):
        return {HEADER_KEY: json.dumps(d).replace('"theta": 10000.0', '"theta": 1e400')}

    d = json.loads(read_metadata(valid_file))
    path = _rewrite(valid_file, tmp_path / "b.safetensors", metadata=overflow(d))
    with pytest.raises(TraceError, match="rope.*theta must be a finite number > 0, got inf"):
        read_trace(path)


def test_head_dim_mismatch_with_rope_is_rejected(tmp_path, valid_file):
    path = _rewrite(valid_file, tmp_path / "b.safetensors", header=_set("head_dim", 16))
    with pytest.raises(TraceError, match="rope.head_dim"):
        read_trace(path)


@pytest.mark.parametrize("content", [b"", b"hello, not a trace", b"\x08" + b"\x00" * 7 + b"{}"])
def test_non_safetensors_files(tmp_path, content):
    path = tmp_path / "x.safetensors"
    path.write_bytes(content)
    with pytest.raises(TraceError, match="x.safetensors"):
        read_trace(path)


def test_missing_file(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.safetensors")


# --- corruption fuzzing: nothing but TraceError, ever --------------------------------------------


def _read_or_trace_error(path: Path) -> None:
    try:
        trace = read_trace(path)
    except TraceError as e:
        assert str(path) in str(e)
    else:
        assert torch.isfinite(trace.queries).all()


@FUZZ
@given(data=st.data())
def test_truncated_files_always_raise_trace_error(tmp_path_factory, valid_file, data):
    raw = valid_file.read_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    path = tmp_path_factory.mktemp("trunc") / "t.safetensors"
    path.write_bytes(raw[:cut])
    with pytest.raises(TraceError):
        read_trace(path)


@FUZZ
@given(data=st.data())
def test_flipped_bytes_never_raise_anything_else(tmp_path_factory, valid_file, data):
    raw = bytearray(valid_file.read_bytes())
    header_len = 8 + int.from_bytes(raw[:8], "little")
    # Half the flips land in the safetensors header, where they matter most.
    region = data.draw(st.sampled_from([(0, header_len), (0, len(raw))]))
    for pos in data.draw(
        st.lists(st.integers(*region).filter(lambda i: i < len(raw)), min_size=1, max_size=6)
    ):
        raw[pos] ^= data.draw(st.integers(1, 255))
    path = tmp_path_factory.mktemp("flip") / "t.safetensors"
    path.write_bytes(bytes(raw))
    _read_or_trace_error(path)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def header_mutation(draw):
    def mutate(d):
        for _ in range(draw(st.integers(1, 3))):
            nested = isinstance(d.get("rope"), dict) and draw(st.booleans())
            target = d["rope"] if nested else d
            key = draw(st.sampled_from(sorted(target) + ["new"]))
            if draw(st.integers(0, 3)) == 0:
                target.pop(key, None)
            else:
                target[key] = draw(JSON)
        return d

    return mutate


@FUZZ
@given(mutate=header_mutation())
def test_header_mutations_never_raise_anything_else(tmp_path_factory, valid_file, mutate):
    path = tmp_path_factory.mktemp("mut") / "t.safetensors"
    _read_or_trace_error(_rewrite(valid_file, path, header=mutate))


# --- trace sets ------------------------------------------------------------------------------------


def test_trace_set_round_trip_and_lazy_iteration(tmp_path, make_trace, monkeypatch):
    ts = TraceSet(tmp_path / "set", create=True)
    written = [make_trace(num_tokens=10 + i, request_id=f"r/{i}", seed=i) for i in range(3)]
    entries = [ts.write(t, tags=["a"] if i else []) for i, t in enumerate(written)]
    reopened = read_trace_set(tmp_path / "set")
    assert len(reopened) == 3 and reopened.index == tuple(entries)
    assert entries[1].num_tokens == 11 and entries[1].tags == ("a",)
    assert "/" not in entries[1].file
    calls = []
    real = trace_set_mod.read_trace
    monkeypatch.setattr(
        trace_set_mod, "read_trace", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    it = iter(reopened)
    first = next(it)
    assert len(calls) == 1 and first.header == written[0].header
    assert [t.request_id for t in it] == ["r/1", "r/2"]
    assert torch.equal(reopened.read("r/2").keys, written[2].keys.half().float())
    assert reopened.read(2).request_id == "r/2"
    for position in (3, -1):  # no wrap-around: -1 is a mistake, not "the last one"
        with pytest.raises(TraceError, match=f"no trace at position {position} .*holds 3"):
            reopened.read(position)
    with pytest.raises(TypeError, match="a TraceEntry, a position or a request id"):
        reopened.read(1.0)
    with pytest.raises(TraceError, match="already in the set"):
        reopened.write(written[0])


def test_read_all_takes_the_first_traces_and_refuses_an_empty_set(tmp_path, make_trace):
    ts = TraceSet(tmp_path / "set", create=True)
    with pytest.raises(TraceError, match="the trace set is empty"):
        ts.read_all()
    for i in range(3):
        ts.write(make_trace(num_tokens=10 + i, request_id=f"r{i}", seed=i))
    assert [t.request_id for t in ts.read_all()] == ["r0", "r1", "r2"]
    assert [t.request_id for t in ts.read_all(2)] == ["r0", "r1"]
    assert [t.request_id for t in ts.read_all(9)] == ["r0", "r1", "r2"]
    assert ts.read_all(1, dtype=torch.float64)[0].keys.dtype == torch.float64
    with pytest.raises(ConfigError, match="limit must be >= 1"):
        ts.read_all(0)


def test_opening_a_non_set_fails(tmp_path):
    with pytest.raises(TraceError, match="not a trace set"):
        read_trace_set(tmp_path)


def _index(path: Path) -> dict:
    return json.loads((path / "index.json").read_text())


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda d: d.update(version=9), "unsupported version"),
        (lambda d: d["traces"][0].update(file="../escape.safetensors"), "bad file name"),
        (lambda d: d["traces"][0].update(prompt_len=99), "prompt_len > num_tokens"),
        (lambda d: d["traces"].append(dict(d["traces"][0])), "duplicate"),
        (lambda d: d["traces"][0].pop("num_tokens"), "must have exactly"),
    ],
)
def test_bad_index_is_rejected(tmp_path, make_trace, edit, problem):
    ts = TraceSet(tmp_path, create=True)
    ts.write(make_trace())
    d = _index(tmp_path)
    edit(d)
    (tmp_path / "index.json").write_text(json.dumps(d))
    with pytest.raises(TraceError, match=problem):
        read_trace_set(tmp_path)


def test_index_disagreeing_with_file_is_rejected(tmp_path, make_trace):
    TraceSet(tmp_path, create=True).write(make_trace())
    d = _index(tmp_path)
    d["traces"][0]["num_tokens"] = 11
    (tmp_path / "index.json").write_text(json.dumps(d))
    with pytest.raises(TraceError, match="disagrees"):
        read_trace_set(tmp_path).read(0)
    with pytest.raises(TraceError, match="disagrees"):
        read_trace_set(tmp_path).check()


@pytest.mark.parametrize("damage", ["missing", "not-safetensors"])
def test_check_finds_a_broken_file_without_reading_the_others(
    tmp_path, make_trace, damage, monkeypatch
):
    ts = TraceSet(tmp_path, create=True)
    entries = [ts.write(make_trace(request_id=f"r{i}", seed=i)) for i in range(3)]
    ts.check()
    last = tmp_path / entries[-1].file
    if damage == "missing":
        last.unlink()
    else:
        last.write_text("not a trace")
    monkeypatch.setattr(trace_set_mod, "read_trace", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(TraceError, match=str(last)):
        read_trace_set(tmp_path).check()


@FUZZ
@given(data=st.data())
def test_corrupt_index_never_raises_anything_else(tmp_path_factory, make_trace, data):
    root = tmp_path_factory.mktemp("idx")
    TraceSet(root, create=True).write(make_trace())
    raw = bytearray((root / "index.json").read_bytes())
    for pos in data.draw(st.lists(st.integers(0, len(raw) - 1), min_size=1, max_size=4)):
        raw[pos] = data.draw(st.integers(0, 255))
    (root / "index.json").write_bytes(bytes(raw))
    try:
        for trace in read_trace_set(root):
            assert trace.num_tokens == 12
    except TraceError:
        pass


def test_trace_sets_still_import_from_the_trace_module():
    assert traces_mod.TraceSet is trace_set_mod.TraceSet
    assert traces_mod.read_trace_set is trace_set_mod.read_trace_set
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        traces_mod.NoSuchThing  # noqa: B018


def test_a_set_that_lost_its_index_is_not_overwritten(tmp_path, make_trace):
    ts = TraceSet(tmp_path / "set", create=True)
    ts.write(make_trace(request_id="r0"))
    before = (tmp_path / "set" / ts.index[0].file).read_bytes()
    (tmp_path / "set" / "index.json").unlink()
    with pytest.raises(
        TraceError,
        match=r"holds trace files \(000000-r0.safetensors\) but no "
        r"index.json",
    ):
        TraceSet(tmp_path / "set", create=True)
    assert (tmp_path / "set" / ts.index[0].file).read_bytes() == before
    assert not (tmp_path / "set" / "index.json").exists()
    with pytest.raises(TraceError, match="cannot create a trace set"):
        TraceSet(tmp_path / "set" / ts.index[0].file / "sub", create=True)


def test_write_never_takes_a_file_name_in_use(tmp_path, make_trace):
    # Entry "x" is removed from the index by hand; the next write (the set holds one entry,
    # so its number is 1 again) must not overwrite "a_b"'s file, whose name it would take.
    ts = TraceSet(tmp_path, create=True)
    ts.write(make_trace(request_id="x", seed=1))
    ts.write(make_trace(request_id="a_b", seed=2))
    d = _index(tmp_path)
    d["traces"] = [e for e in d["traces"] if e["request_id"] != "x"]
    (tmp_path / "index.json").write_text(json.dumps(d))
    reopened = read_trace_set(tmp_path)
    entry = reopened.write(make_trace(request_id="a/b", seed=3))
    assert entry.file not in ("000000-x.safetensors", "000001-a_b.safetensors")
    again = read_trace_set(tmp_path)
    assert [t.request_id for t in again] == ["a_b", "a/b"]
    assert torch.equal(
        again.read("a_b").keys, make_trace(request_id="a_b", seed=2).keys.half().float()
    )


def test_tags_may_be_any_iterable_of_strings(tmp_path, make_trace):
    ts = TraceSet(tmp_path, create=True)
    assert ts.write(make_trace(request_id="a"), tags={"x"}).tags == ("x",)
    assert ts.write(make_trace(request_id="b"), tags=(t for t in ["y", "z"])).tags == ("y", "z")


def test_a_directory_with_other_safetensors_files_can_hold_a_new_set(tmp_path, make_trace):
    (tmp_path / "model.safetensors").write_bytes(b"not ours")
    TraceSet(tmp_path, create=True).write(make_trace())
    assert len(read_trace_set(tmp_path)) == 1


@pytest.mark.parametrize("tags", [[1], "xyz", None, [b"a"], {"a": 1}])
def test_bad_tags_are_refused_before_anything_is_written(tmp_path, make_trace, tags):
    ts = TraceSet(tmp_path, create=True)
    with pytest.raises(TraceError, match="tags must be a list of strings"):
        ts.write(make_trace(), tags=tags)
    assert len(read_trace_set(tmp_path)) == 0 and not list(tmp_path.glob("*.safetensors"))


def test_a_trace_path_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "000000-0.safetensors"
    os.mkfifo(fifo)
    for read in (read_trace_header, read_trace):
        with pytest.raises(TraceError, match="not a regular file"):
            read(fifo)
    with pytest.raises(TraceError, match="not a regular file"):
        read_trace(tmp_path)


def test_values_that_would_make_a_replay_compute_nan_are_refused(tmp_path, make_trace):
    import attrs

    t = make_trace()
    # A softmax scale the header check allows (finite, > 0) but that overflows the logits:
    # the replay used to report NaN masses as missing and decide on a delta of 0.
    with pytest.raises(TraceError, match=r"would overflow attention in float32"):
        Trace(
            header=attrs.evolve(t.header, softmax_scale=1e300),
            queries=t.queries,
            keys=t.keys,
            values=t.values,
        )
    with pytest.raises(TraceError, match=r"would overflow attention in float32"):
        Trace(header=t.header, queries=t.queries * 1e20, keys=t.keys * 1e20, values=t.values)
    path = write_trace(tmp_path / "t.safetensors", t)
    bad = _rewrite(
        path, tmp_path / "bad.safetensors", header=lambda d: d["rope"].update(scaling_factor=0.0)
    )
    with pytest.raises(TraceError, match="rope.*scaling_factor must be a finite number > 0"):
        read_trace(bad)
    with pytest.raises(ValueError, match="low_freq_factor and high_freq_factor must differ"):
        RopeConfig(head_dim=16, scaling_factor=8.0, low_freq_factor=2.0, high_freq_factor=2.0)


@pytest.mark.parametrize("change", [{"token_ids": None}, {"layer_ids": 3}, {"token_ids": "ab"}])
def test_header_ids_that_are_not_lists_are_trace_errors(make_trace, change):
    import attrs

    with pytest.raises(TraceError, match="must be lists of integers"):
        attrs.evolve(make_trace().header, **change)


def test_results_name_the_traces_they_came_from(capsys, tmp_path):
    from growpage.cli import main
    from growpage.sim.synthetic import SyntheticSpec, write_synthetic_trace_set

    spec = SyntheticSpec(
        num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16, prompt_len=20, gen_len=1
    )
    write_synthetic_trace_set(tmp_path / "set", spec, output_lens=[40], seed=2)
    small = ["--page-size", "16", "--recent-window", "4"]
    assert (
        main(
            [
                "sim",
                "replay",
                "--traces",
                str(tmp_path / "set"),
                *small,
                "--out",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "r" / "replay.json").read_text())["source"] == {
        "traces": str(tmp_path / "set")
    }
    assert (
        main(
            [
                "sim",
                "replay",
                "--synthetic",
                "1",
                "--gen-len",
                "40",
                *small,
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "s" / "replay.json").read_text())["source"]["synthetic"] == 1
    assert (
        main(
            [
                "sim",
                "serve",
                "--workload",
                "tiny",
                *small,
                "--kv-pages",
                "200",
                "--decisions",
                "trace",
                "--traces",
                str(tmp_path / "set"),
                "--out",
                str(tmp_path / "v"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "v" / "metrics.json").read_text())["traces"] == str(
        tmp_path / "set"
    )
    capsys.readouterr()


def test_replay_json_records_the_synthetic_settings_it_used(capsys, tmp_path):
    """Left to their defaults, --gen-len, --schedule and --seed used to be recorded as null in
    replay.json's source: the file did not say which traces the numbers came from."""
    from growpage.cli import main
    from growpage.commands.sim import REPLAY_GEN_LEN, REPLAY_SCHEDULE

    small = ["--page-size", "16", "--recent-window", "4", "--fidelity-queries", "0"]
    assert main(["sim", "replay", "--synthetic", "1", *small, "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "replay.json").read_text())["source"] == {
        "synthetic": 1,
        "gen_len": REPLAY_GEN_LEN,
        "schedule": REPLAY_SCHEDULE,
        "seed": 0,
    }
    capsys.readouterr()
