"""``growpage serve`` with the official ``openai`` client, over a tiny random model: greedy
outputs over HTTP equal ``LLM.generate``, streamed or not; 32 concurrent streams all finish;
disconnects, aborts and failures give every page back; errors are OpenAI error bodies; a full
queue gets a 429, a policy error fails its request alone; ``/metrics`` parses and matches the
engine; SIGTERM drains a real ``growpage serve`` process, which exits 0."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import attrs
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL_NAME, ServerThread, free_port, post_json, write_tiny_model

from growpage.core.capacity import Decision
from growpage.engine.llm import LLM
from growpage.engine.sampling_params import SamplingParams
from growpage.policies.base import CapacityPolicy
from growpage.server.app import ServerConfig, create_app
from growpage.sim.workload_csv import WorkloadRequest

pytestmark = pytest.mark.usefixtures("one_thread")

# 96 pages of 4 tokens (384) under a context of 512: a prompt of 400 tokens fits the context
# and not the pool; 32 clients at once make growpage compress when the pool runs out.
ENGINE = dict(policy="growpage", page_size=4, recent_window=2, kv_pages=96)
PROMPTS = ["Hello", "The quick brown fox", "2+2=", "abcabcabcabcabcabcabc"]
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


def _llm(model_dir: Path, **kwargs) -> LLM:
    return LLM(str(model_dir), **{**ENGINE, **kwargs})


@pytest.fixture(scope="module")
def served(model_dir, one_thread):
    """``(server, llm)``: one server for the module (its engine's counters add up over it)."""
    llm = _llm(model_dir)
    with ServerThread(create_app(llm, ServerConfig(model_name=MODEL_NAME))) as server:
        yield server, llm


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="none", max_retries=0)


def _expected(model_dir: Path, prompt: str, chat: bool, policy=None, **params) -> object:
    """What ``LLM.generate`` gives for ``prompt`` alone, on an engine of its own."""
    llm = _llm(model_dir) if policy is None else _llm(model_dir, policy=policy)
    return llm.generate([prompt], SamplingParams(**params), chat=chat)[0]


def _wait_all_returned(llm: LLM, timeout_s: float = 20.0) -> None:
    """Wait until the engine is idle with every page and query slot free, then check the
    pool's bookkeeping."""
    kv, deadline = llm.engine.kv, time.monotonic() + timeout_s
    while llm.engine.has_unfinished() or kv.pool.num_free_pages != kv.num_pages:
        assert time.monotonic() < deadline, "the pool did not come back"
        time.sleep(0.02)
    time.sleep(0.05)  # the engine thread may still be between commands: let it settle
    kv.pool.check_invariants()
    assert kv.pool.num_free_pages == kv.num_pages
    assert kv.query_pool.num_free_slots == kv.query_pool.max_slots


def _metrics(url: str) -> dict[str, float]:
    """``/metrics`` through Prometheus' own text parser: ``{sample name{labels}: value}``."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def _open_stream(port: int, body: dict, path: str = "/v1/completions") -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return response


def _events(response: http.client.HTTPResponse):
    """The ``data:`` payloads of a server-sent event stream, as they come."""
    for line in response:
        line = line.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: ") :]


# ---- the API -------------------------------------------------------------------------------
def test_models_and_health(served, client):
    server, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert json.loads(urllib.request.urlopen(server.url + "/health").read()) == {"status": "ok"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_greedy_outputs_over_http_equal_generate(served, client, model_dir, chat, stream):
    for i, prompt in enumerate(PROMPTS):
        stop = ["o"] if i == 1 else None  # a stop string cuts the text as generate's does
        want = _expected(model_dir, prompt, chat, max_tokens=24, ignore_eos=True, stop=stop)
        args = dict(model=MODEL_NAME, stop=stop, **GREEDY)
        if chat:
            call = client.chat.completions.create
            args["messages"] = [{"role": "user", "content": prompt}]
        else:
            call = client.completions.create
            args["prompt"] = prompt
        if not stream:
            reply = call(**args)
            choice = reply.choices[0]
            text = choice.message.content if chat else choice.text
            reason, usage = choice.finish_reason, reply.usage
        else:
            text, reason, usage = "", None, None
            for chunk in call(**args, stream=True, stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    text += (choice.delta.content or "") if chat else choice.text
                    reason = choice.finish_reason or reason
        assert (text, reason) == (want.text, want.finish_reason), prompt
        assert usage.prompt_tokens == len(want.prompt_token_ids)
        assert usage.completion_tokens == len(want.token_ids)
    _wait_all_returned(served[1])


def test_32_concurrent_streaming_clients_all_finish(served):
    server, llm = served

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        text, reason, tokens = "", None, 0
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Client {i} says hello"}],
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
        return text, reason, tokens

    async def all_of_them() -> list:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    compressions = llm.engine.kv.controller.events.compress
    results = asyncio.run(all_of_them())
    assert [(reason, tokens) for _, reason, tokens in results] == [("length", 24)] * 32
    assert all(text for text, _, _ in results)
    assert llm.engine.kv.controller.events.compress > compressions  # the pool ran short
    _wait_all_returned(llm)


# ---- faults --------------------------------------------------------------------------------
def test_a_client_that_disconnects_aborts_its_request_and_its_pages_come_back(served):
    server, llm = served
    before = _metrics(server.url)["growpage_requests_finished_total{reason=abort}"]
    long = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True}
    response = _open_stream(server.port, {**long, "stream": True})
    events = _events(response)
    for _ in range(3):
        assert json.loads(next(events))["choices"][0]["finish_reason"] is None
    response.close()  # mid-stream
    # A whole (non-streamed) request whose client gives up while it runs.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while not llm.engine.scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.close()
    _wait_all_returned(llm)
    after = _metrics(server.url)["growpage_requests_finished_total{reason=abort}"]
    assert after == before + 2


def _error(status: int, body: dict, code: str | None = None, param: str | None = None) -> str:
    """The error's message, after checking the OpenAI error body."""
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param) or code is None and param is None
    return error["message"]


def test_bad_requests_get_4xx_openai_error_bodies(served, client):
    server, llm = served
    url, ok = server.url, {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}
    status, body = post_json(url, "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and "not valid JSON" in _error(status, body, "invalid_json")
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi")
    assert info.value.code == "model_not_found" and "'gpt-4' does not exist" in str(info.value)
    status, body = post_json(url, "/v1/completions", {**ok, "max_tokens": -1})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    assert "greater than or equal to 1" in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:  # 600 tokens > the context of 512
        client.completions.create(model=MODEL_NAME, prompt="x" * 600)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="cannot fit in the KV cache"):
        client.chat.completions.create(  # within the context, beyond the pool's 384 tokens
            model=MODEL_NAME, messages=[{"role": "user", "content": "y" * 400}]
        )
    status, body = post_json(url, "/v1/completions", {**ok, "n": 2})
    assert status == 400 and body["error"]["param"] == "n"
    status, body = post_json(url, "/v1/completions", {**ok, "stop": ["x", ""]})  # SamplingParams'
    assert status == 400 and body["error"]["param"] == "stop"
    status, body = post_json(url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = post_json(url, "/v1/nothing", ok)
    assert status == 404 and body["error"]["type"] == "not_found_error"
    assert client.completions.create(**ok).choices[0].finish_reason in ("stop", "length")
    _wait_all_returned(llm)


def test_a_full_queue_gets_a_429(model_dir):
    """One request runs at a time and one may wait: once one runs, of three more sent together
    those that find the queue full get a 429; the others finish."""
    llm = _llm(model_dir, policy="fullkv", kv_pages=256, max_num_seqs=1)
    config = ServerConfig(model_name=MODEL_NAME, max_waiting=1)
    with ServerThread(create_app(llm, config)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        def one(i: int) -> object:
            try:
                return client.completions.create(
                    model=MODEL_NAME, prompt=f"Request {i}", **{**GREEDY, "max_tokens": 200}
                )
            except openai.RateLimitError as exc:
                return exc

        results: list = [None] * 4
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, one(i))) for i in range(4)
        ]
        threads[0].start()
        # the others are sent once the first runs (before, it would hold the waiting place)
        deadline = time.monotonic() + 30
        while _metrics(server.url)["growpage_requests_running"] < 1:
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.005)
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join(60)
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        served_ = [r for r in results if not isinstance(r, openai.RateLimitError)]
        assert 1 <= len(refused) <= 2 and len(served_) >= 2
        assert all(r.status_code == 429 and r.code == "queue_full" for r in refused)
        assert all(r.usage.completion_tokens == 200 for r in served_)
        metrics = _metrics(server.url)
        assert metrics["growpage_requests_rejected_total{reason=queue_full}"] == len(refused)
        _wait_all_returned(llm)


@attrs.define
class FailsForBoom(CapacityPolicy):
    """Grows; every decision for a request whose id holds ``boom`` raises."""

    name = "fails-for-boom"

    def decide(self, ctx):
        if "boom" in str(ctx.request_id):
            raise RuntimeError("policy bug")
        return Decision.GROW


def test_a_policy_error_fails_its_request_alone_with_a_500(model_dir):
    llm = _llm(model_dir, policy=FailsForBoom())
    with ServerThread(create_app(llm, ServerConfig(model_name=MODEL_NAME))) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        outcomes: dict[str, object] = {}

        def run(name: str, stream: bool) -> None:
            args = dict(model=MODEL_NAME, prompt=f"Request {name}", **{**GREEDY, "max_tokens": 60})
            try:
                if stream:
                    chunks = client.completions.create(
                        **args, stream=True, extra_headers={"X-Request-Id": name}
                    )
                    outcomes[name] = "".join(c.choices[0].text for c in chunks if c.choices)
                else:
                    reply = client.completions.create(**args, extra_headers={"X-Request-Id": name})
                    outcomes[name] = reply.choices[0].text
            except openai.APIError as exc:
                outcomes[name] = exc

        cases = [("ok-1", False), ("boom-1", False), ("ok-2", True), ("boom-2", True)]
        threads = [threading.Thread(target=run, args=case) for case in cases]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        whole = outcomes["boom-1"]
        assert isinstance(whole, openai.InternalServerError) and whole.status_code == 500
        assert whole.body["type"] == "server_error" and "policy bug" in whole.body["message"]
        assert isinstance(outcomes["boom-2"], openai.APIError)  # an error event in the stream
        assert "policy bug" in str(outcomes["boom-2"])
        for name in ("ok-1", "ok-2"):
            want = _expected(
                model_dir, f"Request {name}", False, FailsForBoom(), max_tokens=60, ignore_eos=True
            )
            assert outcomes[name] == want.text
        assert _metrics(server.url)["growpage_requests_finished_total{reason=error}"] == 2
        _wait_all_returned(llm)


# ---- metrics -------------------------------------------------------------------------------
def test_metrics_parse_and_match_the_engine(served):
    """Run last: the module's requests have grown, compressed and hit the prefix cache."""
    server, llm = served
    _wait_all_returned(llm)
    m = _metrics(server.url)
    engine, kv = llm.engine, llm.engine.kv
    events = kv.controller.events
    assert events.compress > 0 and events.grow > 0 and kv.prefix_hit_tokens > 0
    assert m["growpage_grows_total"] == events.grow
    assert m["growpage_forced_grows_total"] == events.forced_grow
    assert m["growpage_compressions_total"] == events.compress
    assert m["growpage_shrinks_total"] == events.shrink
    assert m["growpage_fallbacks_total"] == events.fallback
    assert m["growpage_preemptions_total"] == engine.scheduler.num_preemptions
    assert m["growpage_prefix_cache_hit_tokens_total"] == kv.prefix_hit_tokens
    assert m["growpage_boundary_seconds_total"] == pytest.approx(kv.boundary_s)
    assert m["growpage_requests_running"] == m["growpage_requests_waiting"] == 0
    assert m["growpage_kv_pages_used"] == kv.pool.num_used_pages == 0
    assert m["growpage_kv_pages_free"] == m["growpage_kv_pages_total"] == kv.num_pages
    done = sum(m[f"growpage_requests_finished_total{{reason={r}}}"] for r in ("stop", "length"))
    assert done >= 32 + 16
    for name in ("time_to_first_token", "e2e_request_latency"):
        assert m[f"growpage_{name}_seconds_count"] == done
    assert m["growpage_requests_rejected_total{reason=invalid}"] == 1  # the pool's refusal


# ---- SIGTERM -------------------------------------------------------------------------------
def test_sigterm_drains_the_requests_in_flight_and_exits_0(model_dir):
    """A real ``growpage serve``: on SIGTERM a short request in flight finishes, a long one is
    aborted at the shutdown timeout (its stream ends with finish reason "abort" and [DONE]),
    new requests are refused, and the process exits with status 0."""
    port = free_port()
    growpage = Path(sys.executable).parent / "growpage"
    command = [str(growpage), "serve", "--model", str(model_dir), "--served-model-name"]
    command += [MODEL_NAME, "--port", str(port), "--page-size", "4", "--kv-pages", "96"]
    command += ["--shutdown-timeout", "0.5", "--threads", "1", "--log-level", "warning"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        ends: dict[str, list] = {}

        def read(name: str, events) -> None:
            ends[name] = list(events)

        readers = []
        for name, max_tokens in (("long", 480), ("short", 24)):
            body = {"model": MODEL_NAME, "prompt": name, "max_tokens": max_tokens}
            events = _events(_open_stream(port, {**body, "stream": True, "ignore_eos": True}))
            next(events)  # running
            readers.append(threading.Thread(target=read, args=(name, events)))
            readers[-1].start()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        status, _ = _trypost_json(port)
        assert status != 200  # 503 while draining, or the socket is already closed
        for reader in readers:
            reader.join(20)
        assert proc.wait(timeout=20) == 0
        assert time.monotonic() - sent < 0.5 + 5
        for name, reason in (("short", "length"), ("long", "abort")):
            assert ends[name][-1] == "[DONE]"
            assert json.loads(ends[name][-2])["choices"][0]["finish_reason"] == reason
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()


def _trypost_json(port: int) -> tuple[int | None, str]:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        body = {"model": MODEL_NAME, "prompt": "late", "max_tokens": 2}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, response.read().decode()
    except OSError as exc:
        return None, str(exc)


def test_sim_vs_server_writes_a_workload_and_a_command_the_simulator_takes(tmp_path):
    """``benchmarks/sim_vs_server.py``'s simulator side: its workload file reads back as
    written, and its ``growpage sim serve`` command parses with the server's engine settings."""
    from benchmark_scripts import load_benchmark

    from growpage.cli import build_parser
    from growpage.sim.sweep import SweepPoint
    from growpage.sim.workload_csv import load_workload_csv

    sys.modules.setdefault("sim_vs_engine", load_benchmark("sim_vs_engine"))  # imported by name
    bench = load_benchmark("sim_vs_server")
    requests = [WorkloadRequest(f"req-{i}", 0.1 * i + 1 / 3, 10 + i, 5, str(i)) for i in range(3)]
    bench.write_workload(tmp_path / "workload.csv", requests)
    back = load_workload_csv(tmp_path / "workload.csv")
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens, r.trace) for r in back] == [
        (r.arrival_s, r.prompt_tokens, r.output_tokens, r.trace) for r in requests
    ]
    scenario = bench.sim_vs_engine.Scenario(kv_pages=48, page_size=16, arrival_rate=1.0)
    point = SweepPoint("fixed", (("budget_tokens", 128),))
    prices = {"boundary_s": 0.001, "compaction_s": 0.002}
    command = bench.sim_command(point, scenario, tmp_path, prices, tmp_path / "cost.json")
    args = build_parser().parse_args(command[1:])
    assert (args.kv_pages, args.page_size, args.max_num_seqs) == (48, 16, scenario.max_num_seqs)
    assert (args.policy, args.param, args.decisions) == ("fixed", ["budget_tokens=128"], "trace")
    assert (args.boundary_ms, args.compaction_ms, args.admission_reserve) == (1.0, 2.0, 0.0)
    assert args.prefix_caching is False
