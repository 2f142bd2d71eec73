"""``growpage bench throughput`` and ``growpage bench latency`` on a tiny random model: the
counts in the table and the JSON are those of the requests asked for, the policy is the one
named, the boundary share is the engine's boundary seconds over the run's, and the latency
percentiles cover every measured batch, step and request (the warmup batches left out)."""

from __future__ import annotations

import json

import pytest

from growpage.bench.workload import read_dataset, send_times, synthetic_requests
from growpage.cli import main

ENGINE = ["--page-size", "4", "--threads", "1", "--kv-pages", "64", "--no-progress"]


def test_throughput_of_synthetic_prompts_under_a_named_policy(model_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    argv = ["bench", "throughput", "--model", str(model_dir), *ENGINE, "--out", str(out)]
    argv += ["--num-prompts", "4", "--input-len", "12", "--output-len", "10"]
    assert main([*argv, "--policy", "fixed", "--param", "budget_tokens=8"]) == 0
    printed = capsys.readouterr().out
    assert "under fixed, pages of 4 tokens" in printed and "48 in, 40 out" in printed
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (4, 48, 40)
    assert r["stats"]["policy"] == "fixed" and r["settings"]["policy_arg"] == ["budget_tokens=8"]
    assert r["num_steps"] >= 10  # one token per request and step after the prompt's
    assert r["boundary_share"] == pytest.approx(r["boundary_s"] / r["total_s"])
    assert r["events"]["compress"] > 0  # 22 tokens held in 8: the budget compresses
    assert r["output_throughput_tok_s"] == pytest.approx(40 / r["total_s"], rel=1e-6)
    assert f"{100 * r['boundary_share']:.1f}% ({r['boundary_s']:.3f} s" in printed


def test_throughput_of_prompt_and_workload_files(model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Hello there", "output_tokens": 6}\n{"prompt": "2+2=", "output_tokens": 9}\n'
    )
    workload = tmp_path / "load.csv"
    workload.write_text("arrival_s,prompt_tokens,output_tokens\n0,5,3\n1,9,4\n2,7,2\n")
    out = tmp_path / "t.json"
    base = ["bench", "throughput", "--model", str(model_dir), *ENGINE, "--out", str(out)]
    assert main([*base, "--dataset-path", str(prompts)]) == 0
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["output_tokens"]) == (2, 15) and r["input_tokens"] >= 15
    assert main([*base, "--dataset-path", str(workload), "--num-prompts", "2"]) == 0
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (2, 14, 7)


def test_latency_percentiles_over_the_measured_batches(model_dir, tmp_path, capsys):
    out = tmp_path / "l.json"
    argv = ["bench", "latency", "--model", str(model_dir), *ENGINE, "--out", str(out)]
    argv += ["--batch-size", "3", "--input-len", "8", "--output-len", "6", "--num-iters", "2"]
    assert main([*argv, "--num-iters-warmup", "1", "--metric-percentiles", "50,99"]) == 0
    printed = capsys.readouterr().out
    assert "2 batches of 3 requests, 8 prompt and 6 output tokens each, after 1 warmup batch" in (
        " ".join(printed.split())
    )
    assert "step (ms)" in printed and "TPOT (ms)" in printed
    r = json.loads(out.read_text())
    assert (r["num_iters"], r["num_requests"], r["output_tokens"]) == (2, 6, 36)
    assert r["num_steps"] >= 2 * 6  # a step per output token of a batch, at least
    for key, unit in (("latency", "s"), ("step", "ms"), ("ttft", "s"), ("tpot", "ms")):
        assert 0 < r[f"{key}_p50_{unit}"] <= r[f"{key}_p99_{unit}"]
        assert f"{key}_p90_{unit}" not in r
    assert r["e2e_mean_s"] <= r["latency_mean_s"]  # a request ends inside its batch
    # The steps of the 2 measured batches fit in them: the warmup batch's are not counted.
    assert r["step_mean_ms"] * r["num_steps"] / 1e3 <= 2 * r["latency_mean_s"]


@pytest.mark.parametrize(
    "command, argv, says",
    [
        ("throughput", ["--dataset-path", "load.csv", "--input-len", "4"], "--input-len: "),
        ("throughput", ["--dataset-path", "bad.csv"], "bad.csv, line 2"),
        ("throughput", ["--policy", "nope"], "nope"),
        ("latency", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        ("latency", ["--num-iters-warmup", "-1"], "--num-iters-warmup must be >= 0"),
    ],
)
def test_bad_input_ends_in_one_line(model_dir, command, argv, says, tmp_path, capsys):
    (tmp_path / "load.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,4,4\n")
    (tmp_path / "bad.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,four,4\n")
    argv = [a if not a.endswith(".csv") else str(tmp_path / a) for a in argv]
    assert main(["bench", command, "--model", str(model_dir), *ENGINE, *argv]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("growpage: error: ") and says in line


def test_synthetic_prompts_and_send_times():
    a, b = synthetic_requests(3, 5, 2, 100, seed=1), synthetic_requests(3, 5, 2, 100, seed=1)
    assert a == b and a != synthetic_requests(3, 5, 2, 100, seed=2)
    assert all(len(r.prompt) == 5 and 25 <= min(r.prompt) and max(r.prompt) < 100 for r in a)
    assert send_times(a, float("inf")) == [0.0] * 3 and send_times(a, None) == [0.0] * 3
    poisson = send_times(a, 5.0, seed=0)
    assert poisson[0] == 0 and poisson == sorted(poisson) and poisson[-1] > 0


def test_a_workload_keeps_its_arrivals_from_the_first(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        '{"arrival_s": 2.5, "prompt_tokens": 6, "output_tokens": 3, "prefix": "p", '
        '"prefix_tokens": 4}',
        '{"arrival_s": 1.0, "prompt_tokens": 5, "output_tokens": 2, "prefix": "p", '
        '"prefix_tokens": 4}',
    ]
    path.write_text("\n".join(lines) + "\n")
    first, second = read_dataset(path, None, lambda: 50)
    assert (first.arrival_s, second.arrival_s) == (0.0, 1.5)  # arrival order, from the first
    assert (first.prompt_tokens, second.prompt_tokens) == (5, 6)
    assert first.prompt[:4] == second.prompt[:4]  # the shared prefix
