"""``growpage bench serve`` against the project's own server (in this process, over a tiny
random model): every request gets exactly its prompt and output lengths, no earlier than its
arrival and never more than ``--max-concurrency`` at once, and the summary adds up; bad input
and an unreachable or foreign server end in one line naming the problem."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest
from server_helpers import MODEL_NAME, ServerThread, free_port

from growpage.bench import serve as load
from growpage.bench.workload import BenchRequest, send_times, token_prompts
from growpage.cli import main
from growpage.engine.llm import LLM
from growpage.server.app import ServerConfig, create_app
from growpage.sim.workload_csv import WorkloadRequest


@pytest.fixture(scope="module")
def served(model_dir):
    llm = LLM(str(model_dir), policy="growpage", page_size=4, recent_window=2, kv_pages=96)
    with ServerThread(create_app(llm, ServerConfig(model_name=MODEL_NAME))) as server:
        yield server, llm


def test_the_load_client_sends_a_workload_and_times_it(served):
    """On a small workload with a shared prefix: every request gets exactly its prompt and
    output lengths, sent no earlier than its Poisson arrival."""
    server, llm = served
    workload = [
        WorkloadRequest(
            f"req-{i}",
            0.0,
            12 + i,
            6 + i,
            prefix="sys" if i % 2 else None,
            prefix_tokens=8 if i % 2 else 0,
        )
        for i in range(8)
    ]
    ids = token_prompts(workload, llm.model.config.vocab_size, seed=1)
    assert [len(p) for p in ids] == [r.prompt_tokens for r in workload]
    assert ids[1][:8] == ids[3][:8] == ids[5][:8] and ids[1][8:] != ids[3][8 : 8 + 5]
    requests = [
        BenchRequest(r.request_id, p, r.output_tokens) for r, p in zip(workload, ids, strict=True)
    ]
    send_s = send_times(requests, rate_per_s=20.0, seed=1)
    assert send_s[0] == 0 and send_s == sorted(send_s) and send_s[-1] > 0
    results = asyncio.run(load.run_load(server.url, requests, send_s, MODEL_NAME, progress=False))
    assert [r.num_tokens for r in results] == [r.output_tokens for r in workload]
    assert [r.num_prompt_tokens for r in results] == [r.prompt_tokens for r in workload]
    assert all(r.ok and r.sent_s >= r.arrival_s - 1e-3 for r in results)
    assert all(0 < r.ttft_s <= r.e2e_s and r.tpot_s > 0 for r in results)
    summary = load.summarize(results, slo_ttft_ms=1e6, slo_tpot_ms=1e6)
    assert summary["num_completed"] == 8 and summary["goodput_req_s"] == pytest.approx(
        summary["request_throughput_req_s"]
    )
    assert summary["throughput_tok_s"] == pytest.approx(
        sum(r.output_tokens for r in workload) / summary["duration_s"]
    )
    for name, unit in (("ttft", "s"), ("tpot", "ms"), ("itl", "ms"), ("e2e", "s")):
        assert 0 < summary[f"{name}_p50_{unit}"] <= summary[f"{name}_p90_{unit}"]
        assert summary[f"{name}_p90_{unit}"] <= summary[f"{name}_p99_{unit}"]
    strict = load.summarize(results, slo_ttft_ms=0.0)
    assert strict["goodput_req_s"] == 0 and strict["slo_attained"] == 0
    assert "TTFT (s)" in load.table(summary)


def test_bench_serve_runs_a_workload_file_at_most_n_at_once(served, tmp_path, capsys):
    server, _ = served
    workload = tmp_path / "load.csv"
    workload.write_text(
        "arrival_s,prompt_tokens,output_tokens,prefix,prefix_tokens\n"
        + "".join(f"{0.01 * i},{10 + i},{4 + i},,\n" for i in range(6))
    )
    out = tmp_path / "out" / "serve.json"
    argv = ["bench", "serve", "--base-url", server.url + "/v1/", "--dataset-path", str(workload)]
    argv += ["--max-concurrency", "2", "--metric-percentiles", "50,95", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"{MODEL_NAME} at {server.url}: 6 requests" in printed and "at most 2 at once" in printed
    assert "6 completed, 0 failed" in printed and "p95" in printed and "p99" not in printed
    result = json.loads(out.read_text())
    assert result["model"] == MODEL_NAME and result["settings"]["max_concurrency"] == 2
    rows = result["requests"]
    assert [(r["num_prompt_tokens"], r["num_tokens"]) for r in rows] == [
        (10 + i, 4 + i) for i in range(6)
    ]
    assert all(r["error"] is None and r["sent_s"] >= r["arrival_s"] - 1e-3 for r in rows)
    for r in rows:  # never more than two in flight
        assert sum(o["sent_s"] <= r["sent_s"] < o["end_s"] for o in rows) <= 2
    summary = result["summary"]
    assert summary["output_tokens"] == sum(4 + i for i in range(6))
    assert summary["ttft_p50_s"] <= summary["ttft_p95_s"] and "ttft_p99_s" not in summary


def test_bench_serve_sends_text_and_synthetic_prompts(served, tmp_path, capsys):
    server, _ = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello there", "output_tokens": 5}\n\n{"prompt": "2+2="}\n')
    out = tmp_path / "text.json"
    argv = ["bench", "serve", "--base-url", server.url, "--no-progress", "--out", str(out)]
    assert main([*argv, "--dataset-path", str(prompts), "--output-len", "3"]) == 0
    rows = json.loads(out.read_text())["requests"]
    assert [r["num_tokens"] for r in rows] == [5, 3]
    assert rows[0]["num_prompt_tokens"] > rows[1]["num_prompt_tokens"] > 0  # 11 > 4 characters
    synthetic = ["--num-prompts", "3", "--input-len", "7", "--output-len", "2", "--seed", "3"]
    assert main([*argv, *synthetic, "--request-rate", "inf"]) == 0
    rows = json.loads(out.read_text())["requests"]
    assert [(r["num_prompt_tokens"], r["num_tokens"]) for r in rows] == [(7, 2)] * 3
    assert "all at once" in capsys.readouterr().out


def test_failed_requests_are_reported_and_the_run_exits_1(served, tmp_path, capsys):
    """Prompts past the tiny model's context (512): the server refuses them, the run goes on,
    writes what it measured and says how many failed."""
    server, _ = served
    out = tmp_path / "failed.json"
    argv = ["bench", "serve", "--base-url", server.url, "--no-progress", "--out", str(out)]
    assert main([*argv, "--num-prompts", "2", "--input-len", "600", "--output-len", "2"]) == 1
    captured = capsys.readouterr()
    assert "0 completed, 2 failed" in captured.out
    [line] = captured.err.splitlines()
    assert line.startswith("growpage: 2 of 2 requests failed: BadRequestError")
    rows = json.loads(out.read_text())["requests"]
    assert [r["error"] is not None and r["num_tokens"] == 0 for r in rows] == [True, True]


class _NotOpenAI(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def foreign_server():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _NotOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--base-url", "localhost:8000"], "--base-url 'localhost:8000': expected the server's"),
        (["--base-url", "ftp://x"], "expected the server's http(s) URL"),
        (["--dataset-path", "nowhere.jsonl"], "--dataset-path nowhere.jsonl: no such file"),
        (["--dataset-path", "load.txt"], "expected a .jsonl file of prompts"),
        (["--dataset-path", "bad.jsonl"], "bad.jsonl, line 2: not valid JSON"),
        (["--dataset-path", "typo.jsonl"], "typo.jsonl, line 1: expected an object with 'prompt'"),
        (["--dataset-path", "load.csv", "--output-len", "4"], "--output-len: "),
        (["--dataset-path", "load.csv", "--input-len", "4"], "--input-len: for synthetic"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--request-rate", "1e-320"], "--request-rate 1e-320 is too small: the mean gap"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--out", "."], "--out .: is a directory"),
        (["--out", "load.txt/x.json"], "--out load.txt/x.json: load.txt is not a folder"),
        (["--out", "/dev/null/x.json"], "--out /dev/null/x.json: /dev/null is not a folder"),
        (["--dataset-path", "nowhere"], "--dataset-path nowhere: no such file"),
        (["--dataset-path", "."], "--dataset-path .: is a directory"),
        (["--slo-ttft-ms", "-1"], "--slo-ttft-ms must be a finite number > 0, got -1.0"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be a finite number > 0, got 0.0"),
        (["--slo-tpot-ms", "nan"], "--slo-tpot-ms must be a finite number > 0, got nan"),
        (["--slo-tpot-ms", "inf"], "--slo-tpot-ms must be a finite number > 0, got inf"),
    ],
)
def test_bad_input_ends_in_one_line(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "load.txt").write_text("x")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "typo.jsonl").write_text('{"prompt": "a", "output_len": 3}\n')
    (tmp_path / "load.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,4,4\n")
    url = ["--base-url", f"http://127.0.0.1:{free_port()}"]  # nobody: checks come first
    assert main(["bench", "serve", *url, *argv, "--no-progress"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("growpage: error: ") and says in line


def test_a_run_that_fails_leaves_no_out_folder(tmp_path, capsys):
    """``--out``'s missing folders are made when the results are written: a bad flag, or a
    server that cannot be reached, leaves none."""
    out = tmp_path / "new" / "run.json"
    url = f"http://127.0.0.1:{free_port()}"
    for argv in (["--slo-ttft-ms", "nan"], ["--vocab-size", "100"], ["--max-concurrency", "0"]):
        assert main(["bench", "serve", "--base-url", url, *argv, "--out", str(out)]) == 2
        assert not (tmp_path / "new").exists()
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--base-url", url, "--seed", "-1"])
    assert "--seed: expected an integer >= 0, got -1" in capsys.readouterr().err


def test_an_unreachable_or_foreign_server_is_named(foreign_server, capsys):
    port = free_port()
    base = ["bench", "serve", "--vocab-size", "100", "--no-progress"]
    assert main([*base, "--base-url", f"http://127.0.0.1:{port}"]) == 2
    assert f"http://127.0.0.1:{port}: cannot reach the server" in capsys.readouterr().err
    assert main([*base, "--base-url", foreign_server]) == 2
    err = capsys.readouterr().err
    assert "GET /v1/models answered 404: not an OpenAI-compatible server?" in err
