"""``growpage bench serve|throughput|latency``: argument parsing (vLLM's ``vllm bench`` names
where they fit). The commands are in ``bench.serve`` and ``bench.offline``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from growpage._argtypes import non_negative_int, path_arg, path_text, positive_int
from growpage.bench.workload import DEFAULT_INPUT_LEN, DEFAULT_NUM_PROMPTS, DEFAULT_OUTPUT_LEN
from growpage.engine.cli_flags import add_llm_flags
from growpage.latency import PERCENTILES


def percentile_list(text: str) -> tuple[float, ...]:
    """``50,90,99``: percentiles in (0, 100], each once, in the order given."""
    try:
        values = tuple(dict.fromkeys(float(x) for x in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected percentiles such as 50,90,99, got {text!r}"
        ) from None
    bad = [q for q in values if not 0 < q <= 100]
    if bad:
        raise argparse.ArgumentTypeError(f"percentiles lie in (0, 100], got {bad[0]:g}")
    return values


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected requests per second (or inf), got {text!r}"
        ) from None


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of ``growpage.bench.<module>``, imported only when it runs (the
    engine and the HTTP client are heavy)."""

    def run(args: argparse.Namespace) -> int:
        from growpage.bench import offline, serve

        command: Callable[[argparse.Namespace], int] = getattr(
            {"serve": serve, "offline": offline}[module], name
        )
        return command(args)

    return run


def _requests(p: argparse.ArgumentParser, dataset: bool = True) -> None:
    if dataset:
        p.add_argument(
            "--dataset-path",
            type=path_arg,
            metavar="FILE",
            help='a .jsonl file of prompts ({"prompt": ..., "output_tokens": ...} per '
            "line), or a simulator workload (.csv or .jsonl of arrival_s, prompt_tokens, "
            "output_tokens: random token prompts of those lengths) (default: synthetic "
            "prompts of --input-len random tokens)",
        )
        p.add_argument(
            "--num-prompts",
            type=positive_int,
            default=None,
            help=f"requests: the first of the dataset's (default all), or synthetic ones "
            f"(default {DEFAULT_NUM_PROMPTS})",
        )
    p.add_argument(
        "--input-len",
        type=positive_int,
        default=None if dataset else DEFAULT_INPUT_LEN,
        help=f"tokens of a synthetic prompt (default {DEFAULT_INPUT_LEN})",
    )
    p.add_argument(
        "--output-len",
        type=positive_int,
        default=None if dataset else DEFAULT_OUTPUT_LEN,
        help=f"tokens every request generates, EOS ignored (default {DEFAULT_OUTPUT_LEN}; a "
        "workload file has its own)",
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        help="seed of the random prompts and arrivals (default 0)",
    )


def _report(p: argparse.ArgumentParser, percentiles: bool = True) -> None:
    if percentiles:
        p.add_argument(
            "--metric-percentiles",
            type=percentile_list,
            default=PERCENTILES,
            metavar="LIST",
            help=f"latency percentiles to report (default {','.join(map(str, PERCENTILES))})",
        )
    p.add_argument(
        "--out", type=path_text, metavar="FILE", help="also write the results as JSON to FILE"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bar on stderr (default on)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmark a server (serve) or the engine (throughput, latency)"
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)

    p = sub.add_parser(
        "serve",
        help="load test of an OpenAI-compatible server (growpage serve, vLLM, ...): "
        "TTFT, TPOT, ITL and E2E percentiles, throughput, goodput",
    )
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server, without /v1 (default %(default)s)",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    _requests(p)
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=None,
        metavar="REQ_PER_S",
        help="Poisson arrivals at this many requests per second, seeded by --seed, the "
        "first at once; inf: all at once (default: a workload's arrival_s, else all at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        metavar="N",
        help="most requests in flight; one due later waits for a free place (default: no limit)",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="vocabulary of the random token prompts (default: the /v1/models card's "
        "vocab_size, which growpage serve gives and vLLM does not)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput's TTFT bound")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput's TPOT bound")
    _report(p)
    p.set_defaults(func=_lazy("serve", "run_serve"))

    p = sub.add_parser(
        "throughput",
        help="the engine over a workload, offline: tokens per second, steps, boundary share",
    )
    _requests(p)
    add_llm_flags(p)
    _report(p, percentiles=False)
    p.set_defaults(func=_lazy("offline", "run_throughput"))

    p = sub.add_parser(
        "latency", help="the engine at one batch size: batch, step and request latencies"
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="requests per batch (default %(default)s)"
    )
    _requests(p, dataset=False)
    p.add_argument(
        "--num-iters", type=int, default=5, help="batches measured (default %(default)s)"
    )
    p.add_argument(
        "--num-iters-warmup",
        type=int,
        default=1,
        help="batches run before them, not measured (default %(default)s)",
    )
    add_llm_flags(p)
    _report(p)
    p.set_defaults(func=_lazy("offline", "run_latency"))
