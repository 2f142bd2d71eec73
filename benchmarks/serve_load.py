"""Load test of an OpenAI-compatible server (``growpage serve``, or any other).

Sends the requests of a workload file (the simulator's CSV or JSON Lines format:
``arrival_s,prompt_tokens,output_tokens`` and optionally ``prefix,prefix_tokens``) at their
arrival times, or as Poisson arrivals at ``--arrival-rate``, each as a streamed
``/v1/completions`` request whose prompt is ``prompt_tokens`` token ids (random, seeded; the
requests naming one prefix share their first ``prefix_tokens`` ids) and which generates exactly
``output_tokens`` tokens (``max_tokens`` with ``ignore_eos``, an extension growpage and vLLM
accept). So the server runs the workload the simulator simulates, token for token.

Per request: TTFT (send to first text), ITL (gaps between streamed chunks), TPOT ((end - first
text) / (tokens - 1)) and E2E (send to end), timed on the client; reported at p50/p90/p99 with
throughput (output tokens per second from the first arrival to the last finish) and goodput
(requests per second meeting ``--slo-ttft-ms`` and ``--slo-tpot-ms``), as a table and JSON.

Run: ``growpage serve --port 8000 &`` then
``python benchmarks/serve_load.py --url http://127.0.0.1:8000 --workload load.csv
--arrival-rate 2 --out results/load``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from growpage.latency import PERCENTILES
from growpage.sim.workload_csv import WorkloadRequest, load_workload_csv, load_workload_jsonl


@attrs.define
class RequestResult:
    """One request as the client saw it (seconds on the client's clock, from the load's
    start at the first arrival)."""

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # asked for
    sent_s: float = 0.0
    first_text_s: float | None = None
    end_s: float | None = None
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
        return list(np.diff(self.chunk_s)) if len(self.chunk_s) > 1 else []


def load_workload(path: str | Path) -> list[WorkloadRequest]:
    """A workload file: JSON Lines for ``.jsonl`` / ``.ndjson``, CSV otherwise."""
    path = Path(path)
    if path.suffix in (".jsonl", ".ndjson"):
        return load_workload_jsonl(path)
    return load_workload_csv(path)


def arrivals(
    requests: Sequence[WorkloadRequest], rate_per_s: float | None, seed: int = 0
) -> list[float]:
    """Each request's send time (seconds from the first): the file's ``arrival_s``, or Poisson
    arrivals at ``rate_per_s`` drawn as the simulator and ``LLM.generate`` draw them
    (``growpage.engine.inputs.poisson_arrivals``), the first at 0."""
    if rate_per_s is None:
        first = min(r.arrival_s for r in requests)
        return [r.arrival_s - first for r in requests]
    from growpage.engine.inputs import poisson_arrivals

    times = poisson_arrivals(len(requests), rate_per_s, seed)
    return [t - times[0] for t in times]


def prompt_ids(
    requests: Sequence[WorkloadRequest], vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Seeded random token ids, ``prompt_tokens`` per request, from the upper three quarters
    of the vocabulary (clear of the special tokens most tokenizers put first); the requests
    naming one prefix begin with the same ``prefix_tokens`` ids."""
    rng = random.Random(seed)
    low = vocab_size // 4
    prefixes: dict[str, list[int]] = {}
    out = []
    for r in requests:
        head: list[int] = []
        if r.prefix is not None:
            known = prefixes.setdefault(r.prefix, [])
            while len(known) < r.prefix_tokens:
                known.append(rng.randrange(low, vocab_size))
            head = known[: r.prefix_tokens]
        out.append(
            head + [rng.randrange(low, vocab_size) for _ in range(r.prompt_tokens - len(head))]
        )
    return out


async def _send(
    client: Any, model: str, result: RequestResult, ids: list[int], start: float, bar: Any
) -> None:
    await asyncio.sleep(max(0.0, start + result.arrival_s - time.perf_counter()))
    result.sent_s = time.perf_counter() - start
    try:
        stream = await client.completions.create(
            model=model,
            prompt=ids,
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
    requests: Sequence[WorkloadRequest],
    send_s: Sequence[float],
    ids: Sequence[list[int]],
    model: str | None = None,
    progress: bool = True,
) -> tuple[list[RequestResult], str]:
    """Send every request at its time; their results and the model's name."""
    import openai
    from tqdm.auto import tqdm

    client = openai.AsyncOpenAI(
        base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=3600
    )
    async with client:
        if model is None:
            model = (await client.models.list()).data[0].id
        results = [
            RequestResult(r.request_id, t, r.prompt_tokens, r.output_tokens)
            for r, t in zip(requests, send_s, strict=True)
        ]
        with tqdm(total=len(results), desc="requests", unit="req", disable=not progress) as bar:
            start = time.perf_counter()
            await asyncio.gather(
                *(_send(client, model, r, p, start, bar) for r, p in zip(results, ids, strict=True))
            )
    return results, model


async def vocab_size_of(url: str) -> int:
    """The served model's vocabulary size (growpage's ``/v1/models`` card gives it)."""
    import openai

    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none") as client:
        card = (await client.models.list()).data[0]
    size = getattr(card, "vocab_size", None) or (card.model_extra or {}).get("vocab_size")
    if not size:
        raise SystemExit("the server's /v1/models card has no vocab_size: pass --vocab-size")
    return int(size)


def _percentiles(name: str, values: Sequence[float], unit: str, scale: float) -> dict:
    xs = np.asarray(values, dtype=np.float64) * scale
    qs = np.percentile(xs, PERCENTILES) if len(xs) else [0.0] * len(PERCENTILES)
    out = {f"{name}_mean_{unit}": float(xs.mean()) if len(xs) else 0.0}
    out.update({f"{name}_p{q}_{unit}": float(v) for q, v in zip(PERCENTILES, qs, strict=True)})
    return out


def summarize(
    results: Sequence[RequestResult],
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """Latency percentiles over the completed requests, throughput and goodput."""
    done = [r for r in results if r.ok]
    end = max((r.end_s or 0.0 for r in done), default=0.0)
    duration = end - min((r.arrival_s for r in results), default=0.0)

    def meets(r: RequestResult) -> bool:
        return (slo_ttft_ms is None or 1e3 * r.ttft_s <= slo_ttft_ms) and (
            slo_tpot_ms is None or 1e3 * r.tpot_s <= slo_tpot_ms
        )

    good = [r for r in done if meets(r)]
    tokens = sum(r.num_tokens for r in done)
    return {
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / duration if duration > 0 else 0.0,
        "request_throughput_req_s": len(done) / duration if duration > 0 else 0.0,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "slo_attained": len(good) / len(results) if results else 0.0,
        "goodput_req_s": len(good) / duration if duration > 0 else 0.0,
        **_percentiles("ttft", [r.ttft_s for r in done], "s", 1.0),
        **_percentiles("tpot", [r.tpot_s for r in done if r.num_tokens > 1], "ms", 1e3),
        **_percentiles("itl", [x for r in done for x in r.itl_s], "ms", 1e3),
        **_percentiles("e2e", [r.e2e_s for r in done], "s", 1.0),
    }


def table(summary: dict[str, Any]) -> str:
    """The latencies (mean and percentiles) and the totals, as text."""
    qs = ["mean", *(f"p{q}" for q in PERCENTILES)]
    rows = [("latency", *qs)]
    for name, unit, label in (
        ("ttft", "s", "TTFT (s)"),
        ("tpot", "ms", "TPOT (ms)"),
        ("itl", "ms", "ITL (ms)"),
        ("e2e", "s", "E2E (s)"),
    ):
        fmt = ".3f" if unit == "s" else ".1f"
        rows.append((label, *(format(summary[f"{name}_{q}_{unit}"], fmt) for q in qs)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    slo = (
        f"TTFT <= {summary['slo_ttft_ms']} ms, TPOT <= {summary['slo_tpot_ms']} ms"
        if summary["slo_ttft_ms"] is not None or summary["slo_tpot_ms"] is not None
        else "none"
    )
    lines += [
        "",
        f"requests      {summary['num_completed']} completed, {summary['num_failed']} failed",
        f"duration      {summary['duration_s']:.2f} s (first arrival to last finish)",
        f"throughput    {summary['throughput_tok_s']:.1f} tok/s, "
        f"{summary['request_throughput_req_s']:.3f} req/s",
        f"goodput       {summary['goodput_req_s']:.3f} req/s "
        f"({100 * summary['slo_attained']:.1f}% of the requests meet the SLO: {slo})",
    ]
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    """``payload`` as JSON at ``path``, atomically (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)"
    )
    ap.add_argument("--workload", required=True, help="workload file (.csv or .jsonl)")
    ap.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="Poisson arrivals at this rate, seeded by --seed, the first at once "
        "(default: the file's arrival_s)",
    )
    ap.add_argument(
        "--seed", type=int, default=0, help="seed of arrivals and prompt ids (default 0)"
    )
    ap.add_argument("--model", default=None, help="model name (default: the server's first)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: from /v1/models")
    ap.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput's TTFT bound")
    ap.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput's TPOT bound")
    ap.add_argument("--out", default=None, help="directory for load.json (default: print only)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON too")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = load_workload(args.workload)
    send_s = arrivals(requests, args.arrival_rate, args.seed)
    vocab = args.vocab_size or asyncio.run(vocab_size_of(args.url))
    ids = prompt_ids(requests, vocab, args.seed)
    results, model = asyncio.run(run_load(args.url, requests, send_s, ids, args.model))
    summary = summarize(results, args.slo_ttft_ms, args.slo_tpot_ms)
    print(table(summary))
    if args.json:
        print(json.dumps(summary, indent=1))
    if args.out is not None:
        payload = {
            "command": " ".join(["python benchmarks/serve_load.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": model,
            "summary": summary,
            "requests": [
                {
                    **attrs.asdict(r, filter=lambda a, _: a.name != "chunk_s"),
                    "ttft_s": r.ttft_s,
                    "tpot_s": r.tpot_s,
                    "e2e_s": r.e2e_s,
                }
                for r in results
            ],
        }
        write_json(Path(args.out) / "load.json", payload)
        print(f"results in {args.out}/load.json")
    return 0 if summary["num_failed"] == 0 else 1


if __name__ == "__main__":
    from script_main import run_main

    raise SystemExit(run_main(main))
