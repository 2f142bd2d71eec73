"""``growpage sim replay|serve|sweep|check-traces`` and ``growpage calibrate``: argument parsing.

The commands themselves are in ``commands.sim`` and ``commands.calibrate``; this module only
declares their options.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from growpage._argtypes import path_text, positive_int, size_list
from growpage.executors.options import add_executor_arguments

DEFAULT_POINTS = ["growpage", "fullkv", "fixed@budget_tokens=1024,2048,4096,8192"]


def _common(p: argparse.ArgumentParser, policy: bool = True) -> None:
    if policy:
        p.add_argument(
            "--policy",
            default="growpage",
            help="registered name, 'module:Class' or 'file.py:Class' (default growpage)",
        )
        p.add_argument(
            "--param",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="policy hyperparameter (repeatable; VALUE read as JSON, else as a "
            "Python literal such as None, else kept as a string)",
        )
    p.add_argument("--page-size", type=int, default=256, help="tokens per KV page (default 256)")
    p.add_argument(
        "--recent-window",
        type=int,
        default=None,
        help="protected recent tokens (default 16, or page size / 4 for pages of 16 "
        "tokens or fewer, as the engine's)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic traces (replay: trace i gets seed + i), the "
        "workload's lengths and arrivals, and the scripts (default 0)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (default 1: best on a shared machine; sweep: per worker process)",
    )
    p.add_argument(
        "--out", metavar="DIR", type=path_text, help="write JSON/CSV results and PNG plots here"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _serving(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    p.add_argument(
        "--workload",
        required=True,
        metavar="NAME_OR_FILE",
        type=path_text,
        help="mixed, amc23, aime24, gsm8k, small, tiny, a CSV file or a .jsonl file",
    )
    p.add_argument(
        "--arrival-rate",
        type=float,
        metavar="REQ_PER_S",
        nargs="+" if sweep else None,
        help="named workloads: Poisson arrivals at this many requests per second "
        "(same requests, seeded by --seed; default: all at t = 0)"
        + ("; several rates: every point at each" if sweep else ""),
    )
    p.add_argument(
        "--cost",
        default="a100-qwen3-8b",
        help="roofline preset (a100-qwen3-8b, a100-r1-llama-8b) or a JSON file "
        "from `growpage calibrate` (default a100-qwen3-8b)",
    )
    p.add_argument(
        "--boundary-ms",
        type=float,
        metavar="MS",
        help="charge MS per policy decision at a capacity boundary (default: the "
        "cost model's, 0 for the presets: asynchronous, as the paper)",
    )
    p.add_argument(
        "--compaction-ms",
        type=float,
        metavar="MS",
        help="charge MS per KV compaction (default: the cost model's)",
    )
    p.add_argument(
        "--boundary-step-ms",
        type=float,
        metavar="MS",
        help="charge MS per step with policy decisions, beside --boundary-ms per decision "
        "(the engine decides a step's boundaries in one pass; default: the cost model's)",
    )
    p.add_argument(
        "--compaction-step-ms",
        type=float,
        metavar="MS",
        help="charge MS per step with compactions, beside --compaction-ms per compaction "
        "(default: the cost model's)",
    )
    p.add_argument(
        "--async-compaction",
        action="store_true",
        help="as the engine's: a compacting request sits the next decode step out "
        "while its compaction (--compaction-ms) runs beside it",
    )
    p.add_argument(
        "--async-decisions",
        action="store_true",
        help="as the engine's (beyond the paper): a request whose boundary its "
        "policy decides sits the next decode step out while the whole boundary "
        "(--boundary-ms, --compaction-ms) runs beside it",
    )
    p.add_argument(
        "--kv-pages",
        type=int,
        metavar="N",
        help="pages in the KV pool (default: what the preset's GPU holds, else 1500)",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests running at once (default 256)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=16384,
        help="most prompt tokens one prefill step computes; a longer prompt goes "
        "on in the next steps (chunked prefill, as the engine) (default 16384)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        dest="chunked_prefill",
        action="store_false",
        help="prefill whole prompts, as nano-vLLM: one waits for a step with room "
        "for it, one longer than --max-num-batched-tokens runs alone",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="no prefix cache: every prefill computes all its tokens (the engine's "
        "enable_prefix_caching=False)",
    )
    p.add_argument(
        "--admission-reserve",
        type=float,
        default=0.05,
        help="share of the pool a new request must leave free (default 0.05)",
    )
    p.add_argument(
        "--decisions",
        choices=["script", "trace"],
        default="script",
        help="script: played-back signals (scales); trace: a KV view per request (default script)",
    )
    p.add_argument(
        "--traces", metavar="DIR", type=path_text, help="trace set for --decisions trace"
    )
    p.add_argument(
        "--num-scripts",
        type=int,
        default=8,
        help="script mode: synthetic traces the requests share, one per length group (default 8)",
    )


def _check_traces_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check-traces",
        choices=["headers", "deep"],
        default=None,
        help="how --traces is checked before the work: headers (default) reads "
        "every file's header; deep also reads and validates every trace's "
        "tensors, one at a time, as `growpage sim check-traces --deep` does, so "
        "that bad tensor data stops the run at once, not in its middle",
    )


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """The command ``name`` of ``growpage.commands.<module>``, imported only when it runs."""

    def run(args: argparse.Namespace) -> int:
        from growpage.commands import calibrate, sim

        command: Callable[[argparse.Namespace], int] = getattr(
            {"sim": sim, "calibrate": calibrate}[module], name
        )
        return command(args)

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("sim", help="trace replay and serving simulation")
    sub = sim.add_subparsers(dest="sim_command", metavar="SIM_COMMAND", required=True)

    p = sub.add_parser("replay", help="replay traces under a policy: decisions and fidelity")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", metavar="DIR", type=path_text, help="a trace set directory")
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic traces instead")
    p.add_argument("--gen-len", type=int, help="synthetic: generated tokens (default 4096)")
    p.add_argument("--schedule", help="synthetic: regime schedule (default random)")
    p.add_argument(
        "--fidelity-queries",
        type=int,
        default=8,
        help="future queries sampled per boundary (0: decisions only; default 8)",
    )
    p.add_argument(
        "--signals",
        action="store_true",
        help="also measure Delta_t quality (Spearman, growth advantage; slower)",
    )
    add_executor_arguments(p, jobs=1, what="traces")
    _common(p)
    p.set_defaults(func=_lazy("sim", "run_replay"), seed=None)  # None: not given (--synthetic only)

    _check_traces_flag(p)

    p = sub.add_parser("serve", help="simulate serving a workload under a policy")
    _serving(p)
    _check_traces_flag(p)
    _common(p)
    p.set_defaults(func=_lazy("sim", "run_serve"))

    p = sub.add_parser("sweep", help="policies x parameters: serving and fidelity, in parallel")
    _serving(p, sweep=True)
    p.add_argument(
        "--points",
        nargs="+",
        default=DEFAULT_POINTS,
        metavar="SPEC",
        help="NAME or NAME@key=v1,v2;key2=v3, values read as --param reads them "
        "(default: %(default)s)",
    )
    add_executor_arguments(p, jobs=2)
    p.add_argument(
        "--fidelity-traces",
        type=int,
        default=4,
        help="traces replayed per point for fidelity: the first of --traces with "
        "--decisions trace, else synthetic ones (0: none; default 4)",
    )
    _check_traces_flag(p)
    _common(p, policy=False)
    p.set_defaults(func=_lazy("sim", "run_sweep"))

    p = sub.add_parser(
        "check-traces",
        help="check a trace set before using it: every file's "
        "header against the index, with --deep every trace's tensors too",
    )
    p.add_argument("traces", metavar="DIR", type=path_text, help="a trace set directory")
    p.add_argument(
        "--deep",
        action="store_true",
        help="also read every trace's tensors, one trace at a time, and validate "
        "them as a replay reads them: names, dtypes and shapes against the "
        "header, finite values, queries and keys small enough for float32 "
        "attention (reads all the data: slower)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--deep: progress bar over the traces (default on)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (default 1, as the other sim commands)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a line")
    p.set_defaults(func=_lazy("sim", "run_check_traces"))

    p = subparsers.add_parser("calibrate", help="fit a step-time model to the engine")
    p.add_argument(
        "--measurements",
        metavar="FILE",
        type=path_text,
        help="CSV/JSON rows num_seqs,kv_tokens,prefill_tokens,step_s (default: "
        "measure the local engine)",
    )
    p.add_argument(
        "--kind",
        choices=("linear", "piecewise"),
        default="linear",
        help="linear: base + per sequence + per KV token + per prompt token; "
        "piecewise: a fixed cost measured for each batch size (interpolated "
        "between them) + per KV token + per prompt token, for engines whose "
        "step time is not linear in the batch size (default %(default)s)",
    )
    p.add_argument(
        "--batch-sizes",
        type=size_list,
        metavar="LIST",
        help="decode batch sizes to measure on the engine, as 1,4,16 or 1-16 "
        "(default 1,4,16; with --kind piecewise 1-16: measure every size the "
        "simulation will run)",
    )
    p.add_argument(
        "--padded-kv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="price a decode step's KV as batch size x the longest context, as an "
        "attention that pads to the longest sequence reads it (default: what the "
        "local engine's backend does, the torch backend pads; with "
        "--measurements, no)",
    )
    p.add_argument(
        "--contexts",
        type=size_list,
        metavar="LIST",
        help="KV tokens per sequence of the measured decode steps (default 128,512,1024)",
    )
    p.add_argument(
        "--out",
        default="costmodel.json",
        type=path_text,
        help="where to write the model (default: %(default)s)",
    )
    p.add_argument(
        "--no-boundaries",
        dest="boundaries",
        action="store_false",
        help="do not measure the seconds per capacity decision and per compaction "
        "(a short run of --boundary-policy on the engine; default: measure)",
    )
    p.add_argument(
        "--boundary-policy",
        default=None,
        help="the policy whose capacity control is priced on the local engine (what "
        "a decision costs depends on it; default growpage; not with "
        "--measurements)",
    )
    p.set_defaults(func=_lazy("calibrate", "run_calibrate"))
