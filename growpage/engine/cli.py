"""``growpage generate`` and ``growpage record``: the engine from the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from growpage._argtypes import path_arg, positive_int
from growpage.engine.cli_flags import (
    NO_FLAG,
    add_engine_flags,
    engine_kwargs,
    kv_flags,
    llm_kwargs,
    model_flags,
)
from growpage.engine.config import plural
from growpage.engine.prompt_files import read_prompt_file, read_prompts
from growpage.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from growpage.engine.llm import LLM
    from growpage.engine.outputs import EngineStats, RequestOutput, StreamChunk
    from growpage.engine.sampling_params import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "generate", help="generate text with the paged engine and print engine statistics"
    )
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="a prompt text (repeat it for several, served as one batch)",
    )
    source.add_argument(
        "--prompts",
        type=path_arg,
        default=None,
        help="text file, one prompt per line (or JSONL with a 'prompt' field "
        "and, on every line or none, an 'arrival_s' field: seconds)",
    )
    _common(g, default_policy="growpage", default_max_tokens=256)
    g.add_argument(
        "--arrival-rate",
        type=float,
        default=None,
        metavar="REQ_PER_S",
        help="serve the prompts as Poisson arrivals at this many requests per "
        "second over wall-clock time, the first at once (seeded by "
        "--arrival-seed; default: all at once, or a JSONL file's 'arrival_s')",
    )
    g.add_argument(
        "--arrival-seed",
        type=int,
        default=None,
        metavar="S",
        help="seed of --arrival-rate's arrival times (default 0)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling mass in (0, 1] (default 1: the whole distribution)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the requests' sampling (default: none; a run is reproducible "
        "anyway, the engine's generator starting from seed 0)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar over requests, or over the tokens of a single prompt "
        "(default: with more than one prompt, on a terminal)",
    )
    g.add_argument(
        "--stream",
        action="store_true",
        help="print the answer as it is generated (a single prompt)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop string: the answer ends before it (repeatable; default none)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --max-tokens tokens whatever the model's end token says "
        "(default: stop at it)",
    )
    g.add_argument(
        "--out",
        type=path_arg,
        default=None,
        metavar="DIR",
        help="also write outputs.jsonl (one line per prompt: text, tokens, finish "
        "reason, latencies, capacity events), stats.json (the engine "
        "statistics and the settings) and pool.png (KV pages in use and running "
        "requests over the run) into DIR (default: print only)",
    )
    g.set_defaults(func=run_generate)

    r = subparsers.add_parser(
        "record",
        help="record full-KV traces (fullkv policy) of prompts into a trace set for the simulator",
    )
    r.add_argument(
        "--prompts",
        required=True,
        type=path_arg,
        help="text file, one prompt per line (or JSONL with a 'prompt' field)",
    )
    r.add_argument("--out", required=True, type=path_arg, help="trace-set directory")
    r.add_argument(
        "--layers", default=None, help="comma-separated model layers to record (default: all)"
    )
    r.add_argument("--no-values", dest="values", action="store_false", help="do not record values")
    r.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bar over requests, or over the tokens of a single prompt (default on)",
    )
    _common(r, default_policy=None, default_max_tokens=512)
    r.set_defaults(func=run_record)


def _common(
    p: argparse.ArgumentParser, default_policy: str | None, default_max_tokens: int
) -> None:
    model_flags(p, default_policy)
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=default_max_tokens,
        help=f"most tokens to generate per prompt (default {default_max_tokens})",
    )
    kv_flags(p)
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the model's chat template (default on)",
    )
    add_engine_flags(p, NO_FLAG)


def _build_llm(**kwargs: Any) -> LLM:
    """Build the ``LLM`` (tests replace this to reuse a loaded model)."""
    from growpage.engine.llm import LLM

    return LLM(**kwargs)


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EngineError(
            f"--layers: expected comma-separated layer numbers, got {text!r}"
        ) from None


def run_generate(args: argparse.Namespace) -> int:
    from growpage.engine.sampling_params import SamplingParams

    prompts, arrivals = (
        (args.prompt, None) if args.prompts is None else read_prompt_file(args.prompts)
    )
    if args.arrival_seed is not None and args.arrival_rate is None:
        raise ConfigError(
            f"--arrival-seed {args.arrival_seed} seeds --arrival-rate's arrival "
            "times: give --arrival-rate too"
        )
    if args.arrival_rate is not None:
        if arrivals is not None:
            raise ConfigError(
                f"{args.prompts} gives its own arrival times ('arrival_s'): "
                f"leave out --arrival-rate"
            )
        from growpage.engine.inputs import poisson_arrivals

        arrivals = poisson_arrivals(len(prompts), args.arrival_rate, args.arrival_seed or 0)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.stream and len(prompts) != 1:
        raise ConfigError(
            f"--stream prints one answer as it comes: give a single prompt (got {len(prompts)})"
        )
    with _named_by_line(args.prompts):
        if args.out is None:
            return _generate(args, prompts, arrivals, params)
        with _out_dir(args.out, "an output directory", keep=lambda: False):
            return _generate(args, prompts, arrivals, params)


@contextlib.contextmanager
def _named_by_line(path: Path | None) -> Iterator[None]:
    """An engine error about one of several prompts read from ``path`` names the file's line
    (``p.jsonl:7``) where the engine names the prompt's index (``prompts[5]``)."""
    try:
        yield
    except EngineError as exc:
        found = re.search(r" \(prompts\[(\d+)\]\)", str(exc))
        if path is None or found is None:
            raise
        lines = [
            n for n, line in enumerate(path.read_text("utf-8").splitlines(), 1) if line.strip()
        ]
        where = f" ({path}:{lines[int(found[1])]})"
        raise EngineError(str(exc).replace(found[0], where, 1)) from None


def _generate(
    args: argparse.Namespace,
    prompts: list[str],
    arrivals: list[float] | None,
    params: SamplingParams,
) -> int:
    llm = _build_llm(**llm_kwargs(args))
    if args.stream:
        out = _print_stream(
            llm.stream(prompts, params, chat=args.chat, use_tqdm=bool(args.progress))
        )
        _print_finish(out)
        outs = [out]
    else:
        outs = llm.generate(
            prompts, params, chat=args.chat, use_tqdm=args.progress, arrival_s=arrivals
        )
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            if len(outs) > 1:
                print(f"### {i + 1}/{len(outs)}: {_clip(prompt)}")
            print(out.text.strip())
            _print_finish(out)
    stats = llm.last_stats
    assert stats is not None, "a finished generate call leaves its stats"
    print(stats.table())
    if args.out is not None:
        _write_generate_results(args, outs, stats, llm.config.max_num_seqs)
    return 0


def _write_generate_results(
    args: argparse.Namespace, outs: list[RequestOutput], stats: EngineStats, max_num_seqs: int
) -> None:
    """``outputs.jsonl`` (one line per prompt, in prompt order), ``stats.json`` and
    ``pool.png`` (the KV pool over the run's steps)."""

    with open(args.out / "outputs.jsonl", "w", encoding="utf-8") as f:
        for i, out in enumerate(outs):
            # ``prompt`` is the text given (not the chat-templated one); its ids are templated.
            row = {"index": i, **attrs.asdict(out), "num_output_tokens": len(out.token_ids)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    settings = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in vars(args).items()
        if k not in ("func", "prompt") and not callable(v)
    }
    payload = {"stats": attrs.asdict(stats), "settings": settings}
    (args.out / "stats.json").write_text(
        json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    from growpage.plots import plot_pool

    plot_pool(
        {stats.policy: stats.pool_timeline},
        args.out / "pool.png",
        stats.num_pages,
        max_num_seqs,
        title=f"KV pool under {stats.policy}",
    )
    print(f"results in {args.out}/ (outputs.jsonl, stats.json, pool.png)")


def _print_finish(out: RequestOutput) -> None:
    print()
    print(f"finish reason  {out.finish_reason} ({plural(len(out.token_ids), 'token')})")
    print()


def _print_stream(chunks: Iterator[StreamChunk]) -> RequestOutput:
    """Print a lone request's text as it comes (leading blanks dropped, as ``generate``'s
    printout strips them); its output."""
    started, output = False, None
    for chunk in chunks:
        text = chunk.text if started else chunk.text.lstrip()
        if text:
            started = True
            print(text, end="", flush=True)
        output = chunk.output or output
    assert output is not None, "a stream ends with its request's output"
    print()
    return output


def _clip(text: str, width: int = 70) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 3] + "..."


def run_record(args: argparse.Namespace) -> int:
    from growpage.core.trace_set import INDEX_NAME

    prompts = read_prompts(args.prompts)
    layers = None if args.layers is None else _layers(args.layers)
    index = args.out / INDEX_NAME
    had_index = index.is_file()
    with (
        _named_by_line(args.prompts),
        _out_dir(args.out, "a trace-set directory", keep=lambda: _num_traces(args.out) > 0),
    ):
        try:
            return _record(args, prompts, layers)
        except BaseException:
            if not had_index and index.is_file() and not _num_traces(args.out):
                index.unlink()  # the empty set this run began: later commands would refuse it
            raise


def _record(args: argparse.Namespace, prompts: list[str], layers: list[int] | None) -> int:
    from growpage.engine.sampling_params import SamplingParams

    before = _num_traces(args.out)
    llm = _build_llm(
        policy="fullkv",
        record_traces=args.out,
        record_layers=layers,
        record_values=args.values,
        **engine_kwargs(args),
    )
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=args.max_tokens), chat=args.chat, use_tqdm=args.progress
    )
    tokens = sum(len(o.token_ids) for o in outs)
    print(
        f"recorded {plural(len(outs), 'trace')} ({plural(tokens, 'generated token')}) into "
        f"{args.out}"
    )
    if before:
        print(
            f"  added to the {plural(before, 'trace')} already there: the set now holds "
            f"{_num_traces(args.out)}; a request id already in it got a -N suffix"
        )
    stats = llm.last_stats
    assert stats is not None, "a finished generate call leaves its stats"
    print(stats.table())
    return 0


def _num_traces(out: Path) -> int:
    """Traces in the trace set at ``out`` (0 when there is none yet)."""
    from growpage.core.trace_set import INDEX_NAME, TraceSet

    return len(TraceSet(out)) if (out / INDEX_NAME).is_file() else 0


@contextlib.contextmanager
def _out_dir(out: Path, what: str, keep: Callable[[], bool]) -> Iterator[None]:
    """``--out``, created before the model loads, so a bad path fails at once; when the run
    inside fails, the folders it created go again, unless ``keep()`` says they hold results."""
    made = _make_out_dir(out, what)
    try:
        yield
    except BaseException:
        if made is not None and not keep():
            shutil.rmtree(made, ignore_errors=True)
        raise


def _make_out_dir(out: Path, what: str) -> Path | None:
    """Create ``out`` (and missing parents); the topmost folder created, None when ``out``
    was there."""
    if out.exists() and not out.is_dir():
        raise EngineError(f"--out {out} is a file, not {what}")
    made = next((p for p in reversed((out, *out.parents)) if not p.exists()), None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EngineError(f"--out {out}: cannot create the directory ({exc.strerror})") from None
    return made
