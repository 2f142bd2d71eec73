"""The GPU check script's --smoke mode runs every section on tiny shapes (CPU interpreter)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--smoke",
            "--no-sweep",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        # One intra-op thread: tiny matrices, and two threads contend for a loaded CPU.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    # Written after every section, so a run cut short by a timeout keeps what it measured.
    partial = json.loads(out.with_suffix(".partial.json").read_text())
    assert {"decode", "ema", "boundary", "hostwork", "engine", "step", "paper"} <= set(partial)
    assert "[gpu_check] engine growpage+async: " in proc.stdout  # each engine row as it ends
    assert "[gpu_check] engine growpage+async-decisions: " in proc.stdout
    assert report["smoke"] and report["tests"] == {"skipped": "--smoke/--skip-tests/--sections"}
    decode = report["decode"]
    assert len(decode) == 4 and all(row["ms"] > 0 and row["gbps"] > 0 for row in decode)
    (ema,) = report["ema"]
    assert {"plain_ms", "fused_ms", "unfused_ms", "fused_overhead_pct"} <= ema.keys()
    boundary = report["boundary"]
    assert boundary["num_keep"] == boundary["context"] - 8  # one page of 8 slots freed
    assert boundary["compaction_direct_ms"] > 0 and boundary["demand_total_ms"] > 0
    host = report["hostwork"]["rows"]  # tiny model, Triton path under the interpreter
    assert host["compress"]["launches"] > 0 and host["compress"]["syncs"] >= 1
    phases = report["hostwork"]["phases"]  # by phase, in a run of their own
    assert phases["calls"]["compact"] == host["compress"]["boundaries"]
    engine = report["engine"]  # SmolLM2 on CPU, two short requests per policy
    assert engine["fullkv"]["tokens_per_s"] > 0 and engine["growpage"]["tokens_per_s"] > 0
    assert 0 <= engine["growpage"]["boundary_pct"] < 100
    assert (
        engine["growpage"]["boundary_phases"]["boundaries"]
        == engine["growpage"]["events"]["boundaries"]
    )
    assert report["targets"]["boundary_pct_of_run"] == engine["growpage"]["boundary_pct"]
    # Nothing compiles on CPU (interpreter): every timed row reports zero compiles.
    assert report["targets"]["compiles_in_engine_runs"] == {
        "fullkv": 0,
        "growpage": 0,
        "growpage+async": 0,
        "growpage+async-decisions": 0,
    }
    # The rows with deferred work (async compaction, late boundaries): on the CPU a step waits
    # for all of it; the target takes the best of them.
    rows = [engine["growpage+async"], engine["growpage+async-decisions"]]
    for deferred in rows:
        assert "error" not in deferred and deferred["deferred_s"] == deferred["deferred_waited_s"]
        assert deferred["boundary_critical_pct"] == deferred["boundary_pct"]
    assert report["targets"]["boundary_critical_pct_async"] == min(
        row["boundary_critical_pct"] for row in rows
    )
    assert report["targets"]["no_compiles_met"]
    # Where a decode step goes: phases (adding up to the step), a profiled window, a trace.
    step = report["step"]
    assert step["policy"] == "fullkv" and not step["cuda_graphs"] and step["kv_pages"] == 32
    assert step["plain"]["decode_steps"] == step["phases"]["decode_steps"] == 7  # 8 tokens
    assert sum(step["phases"]["ms"].values()) == pytest.approx(step["phases"]["ms_per_step"])
    window = step["window"]
    assert window["decode_steps"] == 2 and window["device_busy_ms_per_step"] is None
    assert any(row["name"] == "aten::mm" for row in window["top_host"])
    trace = out.with_name(out.name + ".step.trace.json.gz")
    assert window["trace"] == trace.name and json.loads(gzip.decompress(trace.read_bytes()))
    # The paper's scale, shrunk: a random Llama-shaped model built in place, both policies with
    # the engine's defaults, the boundary share set against the paper's.
    paper = report["paper"]
    assert paper["requests"] == 2 and paper["dtype"] == "float32"  # the CPU's default
    for policy in ("fullkv", "growpage"):
        row = paper[policy]
        assert row["tokens_per_s"] > 0 and row["steps"] > 0
        assert row["ms_per_step"] == pytest.approx(1000 * row["total_s"] / row["steps"])
    assert paper["growpage"]["events"]["boundaries"] > 0
    assert (
        report["targets"]["paper_boundary_critical_pct"]
        == (paper["growpage"]["boundary_critical_pct"])
    )
    assert "[gpu_check] engine paper growpage: " in proc.stdout
    assert "Paper scale (tiny-random" in out.with_suffix(".md").read_text()
    markdown = out.with_suffix(".md").read_text()
    assert "| batch | context |" in markdown and "Boundary event" in markdown
    assert "| growpage |" in markdown and "Host work per boundary" in markdown
    assert "Profiled window: 2 decode" in markdown and "| `aten::mm` |" in markdown
