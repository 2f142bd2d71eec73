"""``growpage bench serve``: a load client for an OpenAI-compatible server (``growpage serve``,
vLLM, or any other).

Every request is a streamed ``/v1/completions`` request sent at its time (the dataset's arrival
times, or Poisson arrivals at ``--request-rate``), at most ``--max-concurrency`` in flight, that
generates exactly its output tokens (``max_tokens`` with ``ignore_eos``). Per request, timed on
the client: TTFT (send to first text), ITL (gaps between streamed chunks), TPOT ((end - first
text) / (tokens - 1)) and E2E (send to end); reported as the mean and percentiles, with
throughput (output tokens per second from the first send to the last finish) and goodput
(requests per second meeting ``--slo-ttft-ms`` and ``--slo-tpot-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
from tqdm.auto import tqdm

from growpage.bench.report import (
    Latency,
    latency_fields,
    latency_table,
    lines,
    out_path,
    write_result,
)
from growpage.bench.workload import BenchRequest, bench_requests, send_times
from growpage.errors import ConfigError
from growpage.latency import PERCENTILES
from growpage.validators import positive_number

LATENCIES: list[Latency] = [
    ("ttft", "s", "TTFT (s)", 1.0),
    ("tpot", "ms", "TPOT (ms)", 1e3),
    ("itl", "ms", "ITL (ms)", 1e3),
    ("e2e", "s", "E2E (s)", 1.0),
]


@attrs.define
class RequestResult:
    """One request as the client saw it (seconds on the client's clock, from the load's
    start)."""

    request_id: str
    arrival_s: float  # when it was due
    output_tokens: int  # asked for
    sent_s: float = 0.0  # when it went out (later than due while --max-concurrency are busy)
    first_text_s: float | None = None
    end_s: float | None = None
    num_prompt_tokens: int = 0  # the server's usage
    num_tokens: int = 0  # generated (the server's usage)
    chunk_s: list[float] = attrs.field(factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_text_s is not None

    @property
    def ttft_s(self) -> float:
        return (self.first_text_s or self.sent_s) - self.sent_s

    @property
    def e2e_s(self) -> float:
        return (self.end_s or self.sent_s) - self.sent_s

    @property
    def tpot_s(self) -> float:
        if self.num_tokens <= 1 or self.end_s is None or self.first_text_s is None:
            return 0.0
        return (self.end_s - self.first_text_s) / (self.num_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [float(x) for x in np.diff(self.chunk_s)] if len(self.chunk_s) > 1 else []


def check_url(url: str) -> str:
    """``url`` when it is an http(s) URL with a host, else a ``ConfigError``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"--base-url {url!r}: expected the server's http(s) URL, such as http://127.0.0.1:8000"
        )
    return url.rstrip("/").removesuffix("/v1")


def _client(url: str) -> Any:
    try:
        import openai
    except ModuleNotFoundError:
        raise ConfigError(
            "growpage bench serve needs the openai client: pip install 'growpage[bench]'"
        ) from None
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600.0)


async def model_card(url: str) -> Any:
    """The first model ``/v1/models`` lists; a ``ConfigError`` saying why when the server cannot
    be reached or is no OpenAI-compatible one."""
    import openai

    async with _client(url) as client:
        try:
            cards = (await client.models.list()).data
        except openai.APIConnectionError as e:
            raise ConfigError(
                f"--base-url {url}: cannot reach the server ({e.__cause__ or e})"
            ) from None
        except openai.APIStatusError as e:
            raise ConfigError(
                f"--base-url {url}: GET /v1/models answered {e.status_code}: not an "
                "OpenAI-compatible server?"
            ) from None
    if not cards:
        raise ConfigError(f"--base-url {url}: the server lists no model (GET /v1/models)")
    return cards[0]


async def _send(
    client: Any,
    model: str,
    result: RequestResult,
    prompt: str | list[int],
    start: float,
    gate: asyncio.Semaphore | contextlib.AbstractAsyncContextManager[Any],
    bar: Any,
) -> None:
    await asyncio.sleep(max(0.0, start + result.arrival_s - time.perf_counter()))
    async with gate:
        result.sent_s = time.perf_counter() - start
        try:
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=result.output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                now = time.perf_counter() - start
                if chunk.usage is not None:
                    result.num_tokens = chunk.usage.completion_tokens
                    result.num_prompt_tokens = chunk.usage.prompt_tokens
                if any(c.text for c in chunk.choices):
                    if result.first_text_s is None:
                        result.first_text_s = now
                    result.chunk_s.append(now)
            result.end_s = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - a failed request is reported, the load goes on
            result.error = f"{type(exc).__name__}: {exc}"
    bar.update(1)


async def run_load(
    url: str,
    requests: Sequence[BenchRequest],
    send_s: Sequence[float],
    model: str,
    max_concurrency: int | None = None,
    progress: bool = True,
) -> list[RequestResult]:
    """Send every request at its time (``send_s``, seconds from the start), at most
    ``max_concurrency`` in flight; their results."""
    results = [
        RequestResult(r.request_id, t, r.output_tokens)
        for r, t in zip(requests, send_s, strict=True)
    ]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with _client(url) as client:
        with tqdm(total=len(results), desc="requests", unit="req", disable=not progress) as bar:
            start = time.perf_counter()
            await asyncio.gather(
                *(
                    _send(client, model, res, req.prompt, start, gate, bar)
                    for res, req in zip(results, requests, strict=True)
                )
            )
    return results


def summarize(
    results: Sequence[RequestResult],
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """Latency means and percentiles over the completed requests, throughput and goodput."""
    done = [r for r in results if r.ok]
    end = max((r.end_s or 0.0 for r in done), default=0.0)
    duration = end - min((r.sent_s for r in results), default=0.0)

    def meets(r: RequestResult) -> bool:
        return (slo_ttft_ms is None or 1e3 * r.ttft_s <= slo_ttft_ms) and (
            slo_tpot_ms is None or 1e3 * r.tpot_s <= slo_tpot_ms
        )

    good = [r for r in done if meets(r)]
    tokens = sum(r.num_tokens for r in done)
    values = {
        "ttft": [r.ttft_s for r in done],
        "tpot": [r.tpot_s for r in done if r.num_tokens > 1],
        "itl": [x for r in done for x in r.itl_s],
        "e2e": [r.e2e_s for r in done],
    }
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "input_tokens": sum(r.num_prompt_tokens for r in done),
        "output_tokens": tokens,
        "throughput_tok_s": tokens / duration if duration > 0 else 0.0,
        "request_throughput_req_s": len(done) / duration if duration > 0 else 0.0,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "slo_attained": len(good) / len(results) if results else 0.0,
        "goodput_req_s": len(good) / duration if duration > 0 else 0.0,
    }
    for key, unit, _, scale in LATENCIES:
        summary.update(latency_fields(key, values[key], unit, percentiles, scale))
    return summary


def table(summary: dict[str, Any], percentiles: Sequence[float] = PERCENTILES) -> str:
    """The latencies (mean and percentiles) and the totals, as text."""
    slo = (
        f"TTFT <= {summary['slo_ttft_ms']} ms, TPOT <= {summary['slo_tpot_ms']} ms"
        if summary["slo_ttft_ms"] is not None or summary["slo_tpot_ms"] is not None
        else "none"
    )
    totals = [
        ("requests", f"{summary['num_completed']} completed, {summary['num_failed']} failed"),
        ("tokens", f"{summary['input_tokens']} in, {summary['output_tokens']} out"),
        ("duration", f"{summary['duration_s']:.2f} s (first send to last finish)"),
        (
            "throughput",
            f"{summary['throughput_tok_s']:.1f} tok/s, "
            f"{summary['request_throughput_req_s']:.3f} req/s",
        ),
        (
            "goodput",
            f"{summary['goodput_req_s']:.3f} req/s ({100 * summary['slo_attained']:.1f}% "
            f"of the requests meet the SLO: {slo})",
        ),
    ]
    return latency_table(summary, LATENCIES, percentiles) + "\n\n" + lines(totals)


def run_serve(args: argparse.Namespace) -> int:
    url = check_url(args.base_url)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.request_rate is not None and not (args.request_rate > 0):
        raise ConfigError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.request_rate is not None and math.isinf(1.0 / args.request_rate):
        raise ConfigError(  # a subnormal rate: its mean gap passes the largest float
            f"--request-rate {args.request_rate} is too small: the mean gap between requests, "
            "1 / rate, passes the largest float"
        )
    for flag, slo_ms in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if slo_ms is not None:  # -1 or NaN: no request meets it, and goodput would read 0
            positive_number.require(flag, slo_ms)
    out = out_path(args.out)
    cards: list[Any] = []

    def card() -> Any:
        if not cards:
            cards.append(asyncio.run(model_card(url)))
        return cards[0]

    requests = bench_requests(args, lambda: _vocab_size(args, card))  # a bad file fails first
    served = card()  # the server answers, or the run stops here with why
    model = args.model or served.id
    send_s = send_times(requests, args.request_rate, args.seed)
    results = asyncio.run(
        run_load(url, requests, send_s, model, args.max_concurrency, args.progress)
    )
    summary = summarize(results, args.slo_ttft_ms, args.slo_tpot_ms, args.metric_percentiles)
    print(f"{model} at {url}: {len(requests)} requests, {_pace(args)}")
    print(table(summary, args.metric_percentiles))
    if out is not None:
        rows = [
            {
                **attrs.asdict(r, filter=lambda a, _: a.name != "chunk_s"),
                "ttft_s": r.ttft_s,
                "tpot_s": r.tpot_s,
                "e2e_s": r.e2e_s,
            }
            for r in results
        ]
        write_result(out, args, {"model": model, "summary": summary, "requests": rows})
    if summary["num_failed"]:  # measured and written, but not a clean run
        print(
            f"growpage: {summary['num_failed']} of {len(results)} requests failed: "
            + "; ".join(summary["errors"]),
            file=sys.stderr,
        )
        return 1
    return 0


def _vocab_size(args: argparse.Namespace, card: Callable[[], Any]) -> int:
    """``--vocab-size``, else the served model's (growpage's ``/v1/models`` card gives it)."""
    if args.vocab_size is not None:
        return int(args.vocab_size)
    served = card()
    size = getattr(served, "vocab_size", None) or (served.model_extra or {}).get("vocab_size")
    if not size:
        raise ConfigError(
            f"the server's /v1/models card of {served.id} has no vocab_size, which random "
            "token prompts are drawn from: pass --vocab-size"
        )
    return int(size)


def _pace(args: argparse.Namespace) -> str:
    rate = args.request_rate
    pace = (
        "the dataset's arrival times or all at once"
        if rate is None
        else ("all at once" if math.isinf(rate) else f"Poisson arrivals at {rate:g} req/s")
    )
    return pace + (f", at most {args.max_concurrency} at once" if args.max_concurrency else "")
