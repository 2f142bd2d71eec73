"""``TraceSet.check(deep=True)``: bad tensor data is found before a replay, not in its middle."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import growpage.core.trace_set as trace_set_mod
from growpage.cli import main
from growpage.core.trace_set import TraceSet
from growpage.errors import TraceError


def _write_set(root: Path, make_trace, num: int = 3) -> list[Path]:
    ts = TraceSet(root, create=True)
    return [
        root / ts.write(make_trace(request_id=f"r{i}", seed=i), dtype=torch.bfloat16).file
        for i in range(num)
    ]


def _rewrite_tensors(path: Path, change) -> None:
    """Save ``path`` again with its tensors changed by ``change`` and its header kept."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata=metadata)


def _set(name: str, make):
    def change(ts):
        ts[name] = make(ts[name])

    return change


def _drop(name: str):
    def change(ts):
        del ts[name]

    return change


def _overwrite_payload(path: Path) -> None:
    """Every byte of the tensor data becomes 0xff (a NaN in bf16); the file still parses."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start:] = b"\xff" * (len(raw) - start)
    path.write_bytes(bytes(raw))


# What a header-only check lets through, and what the deep check says about it.
BAD_TENSORS = {
    "shape": (_set("layer.3.k", lambda x: x[:, :1].clone()), "tensor layer.3.k is"),
    "token count": (
        _set("layer.1.q", lambda x: x[:-1].clone()),
        "tensor layer.1.q holds 11 tokens",
    ),
    "nan": (
        _set("layer.1.v", lambda x: x.index_fill(0, torch.tensor([4]), float("nan"))),
        "tensor layer.1.v has non-finite values",
    ),
    "inf": (
        _set("layer.3.q", lambda x: x.index_fill(0, torch.tensor([0]), float("inf"))),
        "tensor layer.3.q has non-finite values",
    ),
    "dtype": (_set("layer.1.k", lambda x: x.float()), "tensor layer.1.k is torch.float32"),
    "missing": (_drop("layer.3.v"), "tensors missing ['layer.3.v']"),
    "unexpected": (
        lambda ts: ts.update({"extra": ts["layer.1.q"].clone()}),
        "unexpected ['extra']",
    ),
    # finite in bf16, but |q| |k| softmax_scale far beyond LOGIT_BOUND: a replay's logits overflow
    "logit bound": (
        lambda ts: ts.update({k: v * 1e20 for k, v in ts.items() if k.endswith((".q", ".k"))}),
        "would overflow attention in float32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_deep_check_finds_bad_tensors_that_the_header_check_lets_through(
    tmp_path, make_trace, case
):
    files = _write_set(tmp_path, make_trace)
    change, problem = BAD_TENSORS[case]
    _rewrite_tensors(files[1], change)
    index_before = (tmp_path / "index.json").read_bytes()
    headers = TraceSet(tmp_path).check()
    assert [h.request_id for h in headers] == ["r0", "r1", "r2"]
    with pytest.raises(TraceError) as err:
        TraceSet(tmp_path).check(deep=True)
    assert str(err.value).startswith(f"{files[1]}: ") and problem in str(err.value)
    # a check changes nothing: the index and the other files are as they were
    assert (tmp_path / "index.json").read_bytes() == index_before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f.name for f in files] + ["index.json"]
    )


def test_deep_check_finds_a_corrupt_payload(tmp_path, make_trace):
    files = _write_set(tmp_path, make_trace)
    _overwrite_payload(files[2])
    TraceSet(tmp_path).check()
    with pytest.raises(TraceError, match=f"^{files[2]}: tensor layer.1.q has non-finite"):
        TraceSet(tmp_path).check(deep=True)


def test_deep_check_returns_the_headers_and_reads_one_trace_at_a_time(
    tmp_path, make_trace, monkeypatch
):
    _write_set(tmp_path, make_trace)
    ts = TraceSet(tmp_path)
    live: list[weakref.ref] = []
    real = trace_set_mod.read_trace

    def read_trace(*args, **kwargs):
        gc.collect()
        assert all(ref() is None for ref in live), "the previous trace is still held"
        trace = real(*args, **kwargs)
        live.append(weakref.ref(trace))
        return trace

    monkeypatch.setattr(trace_set_mod, "read_trace", read_trace)
    assert ts.check(deep=True) == ts.check()
    assert len(live) == 3
    monkeypatch.setattr(trace_set_mod, "read_trace", lambda *a, **k: pytest.fail("read"))
    ts.check()  # the default reads headers only


def test_deep_check_reads_every_header_before_any_tensor(tmp_path, make_trace, monkeypatch):
    files = _write_set(tmp_path, make_trace)
    files[2].unlink()
    monkeypatch.setattr(trace_set_mod, "read_trace", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(TraceError, match=f"^{files[2]}: no such trace file"):
        TraceSet(tmp_path).check(deep=True)


def test_deep_check_shows_progress_when_asked(tmp_path, make_trace, capsys):
    _write_set(tmp_path, make_trace)
    TraceSet(tmp_path).check(deep=True)
    assert "check traces" not in capsys.readouterr().err
    TraceSet(tmp_path).check(deep=True, progress=True)
    assert "check traces" in capsys.readouterr().err


# --- growpage sim check-traces -----------------------------------------------------------------


def test_check_traces_command(tmp_path, make_trace, capsys):
    files = _write_set(tmp_path, make_trace)
    assert main(["sim", "check-traces", str(tmp_path)]) == 0
    assert capsys.readouterr().out == (
        f"{tmp_path}: 3 traces, 36 tokens: headers (--deep: tensors too) ok\n"
    )
    assert main(["sim", "check-traces", str(tmp_path), "--deep", "--no-progress"]) == 0
    assert capsys.readouterr().out.endswith("3 traces, 36 tokens: headers and tensors ok\n")
    assert main(["sim", "check-traces", str(tmp_path), "--deep", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {"traces": str(tmp_path), "deep": True, "num_traces": 3, "num_tokens": 36}
    _rewrite_tensors(files[0], BAD_TENSORS["nan"][0])
    assert main(["sim", "check-traces", str(tmp_path)]) == 0  # headers only: it passes
    capsys.readouterr()
    assert main(["sim", "check-traces", str(tmp_path), "--deep", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{files[0]}: tensor layer.1.v has non-finite values" in err


def test_check_traces_command_refuses_what_is_not_a_set(tmp_path, capsys):
    assert main(["sim", "check-traces", str(tmp_path / "none")]) == 2
    assert "no such directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command",
    [
        ["replay", "--page-size", "16", "--recent-window", "4", "--fidelity-queries", "0"],
        [
            "serve",
            "--workload",
            "tiny",
            "--page-size",
            "16",
            "--recent-window",
            "4",
            "--kv-pages",
            "200",
            "--decisions",
            "trace",
        ],
        [
            "sweep",
            "--workload",
            "tiny",
            "--page-size",
            "16",
            "--recent-window",
            "4",
            "--kv-pages",
            "200",
            "--decisions",
            "trace",
            "--points",
            "fullkv",
        ],
    ],
)
def test_replay_serve_and_sweep_check_tensors_first_when_asked(
    tmp_path, make_trace, capsys, command, monkeypatch
):
    files = _write_set(tmp_path, make_trace)
    _rewrite_tensors(files[2], BAD_TENSORS["inf"][0])
    monkeypatch.setattr(
        "growpage.executors.grids.replay_trace", lambda *a, **k: pytest.fail("replayed")
    )
    import growpage.sim.serving as serving
    import growpage.sim.sweep as sweep

    monkeypatch.setattr(serving, "simulate", lambda *a, **k: pytest.fail("simulated"))
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("swept"))
    argv = ["sim", command[0], "--traces", str(tmp_path), *command[1:], "--check-traces", "deep"]
    assert main(argv) == 2
    assert f"{files[2]}: tensor layer.3.q has non-finite values" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [["replay", "--synthetic", "1"], ["serve", "--workload", "tiny"]]
)
def test_check_traces_flag_needs_a_trace_set(command, capsys):
    assert main(["sim", *command, "--check-traces", "deep"]) == 2
    assert "--check-traces: for --traces only" in capsys.readouterr().err


def test_check_traces_command_refuses_an_empty_set(tmp_path, capsys):
    TraceSet(tmp_path, create=True)
    assert main(["sim", "check-traces", str(tmp_path)]) == 2
    assert "the trace set is empty" in capsys.readouterr().err
