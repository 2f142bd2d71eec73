"""``growpage eval ...``: evaluation tasks (argument parsing; the work is in the task modules).

Each subcommand is a function ``_add_NAME(sub)`` that declares its parser and sets ``func``;
listing it in ``SUBCOMMANDS`` adds it to the group.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from growpage._argtypes import non_negative_int, positive_int


def _difficulty(text: str) -> int:
    if text not in ("1", "2", "3"):
        raise argparse.ArgumentTypeError(f"expected 1, 2 or 3, got {text!r}")
    return int(text)


def _add_maths(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "maths",
        help="grade-school maths word problems with exact answers (docs/evaluation.md)",
        description="Print maths problems with their worked solutions.",
    )
    p.add_argument(
        "--show",
        type=positive_int,
        default=5,
        metavar="N",
        help="print the first N problems with their worked solutions (default 5)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the problems (default 0)")
    p.add_argument(
        "--difficulty",
        type=_difficulty,
        default=1,
        help="1, 2 or 3: larger numbers and more steps (default 1)",
    )
    p.set_defaults(func=run_maths)


def run_maths(args: argparse.Namespace) -> int:
    from growpage.eval.maths import format_number, generate_problems

    for problem in generate_problems(args.show, seed=args.seed, difficulty=args.difficulty):
        print(f"[{problem.id}] {problem.template}, {problem.num_steps} steps")
        print(problem.question)
        for i, (expression, value) in enumerate(problem.steps, 1):
            print(f"  {i}. {expression} = {format_number(value)}")
        print(f"  #### {format_number(problem.answer)}\n")
    return 0


def _add_accuracy(sub: argparse._SubParsersAction) -> None:
    from growpage.eval.accuracy import ALL_POLICIES, AccuracySettings
    from growpage.eval.datasets import TASKS

    d = AccuracySettings()
    p = sub.add_parser(
        "accuracy",
        help="accuracy at a KV budget, policy by policy, on a maths task (docs/evaluation.md)",
        description="Every policy (or every --row) answers the same problems in the engine "
        "under one KV pool; writes results.json, table.md, outputs/<row>.jsonl and a plot to "
        "--out.",
        epilog="Example, a policy of your own beside fixed budgets: --row "
        "mine=my_policy.py:MyPolicy:threshold=0.1 --row fixed-256=fixed:budget_tokens=256 "
        "--row h2o=h2o:budget_tokens=@mine.budget",
    )
    p.add_argument("--model", default=d.model, help=f"model name or path (default {d.model})")
    p.add_argument(
        "--task",
        choices=TASKS,
        default=d.task,
        help=f"the generated maths problems or a real benchmark fetched with "
        f"'growpage data fetch' (default {d.task})",
    )
    p.add_argument(
        "--problems",
        type=positive_int,
        default=d.num_problems,
        help=f"number of problems (default {d.num_problems})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed (default {d.seed})")
    p.add_argument(
        "--difficulty",
        type=_difficulty,
        default=d.difficulty,
        help=f"1, 2 or 3 (default {d.difficulty})",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=d.max_tokens,
        help=f"generated tokens at most per problem (default {d.max_tokens})",
    )
    p.add_argument(
        "--page-size",
        type=positive_int,
        default=d.page_size,
        help=f"tokens per KV page (default {d.page_size})",
    )
    p.add_argument(
        "--kv-pages",
        type=positive_int,
        default=None,
        help="pages in the pool (default: --pool-fraction of a full batch's need)",
    )
    p.add_argument(
        "--pool-fraction",
        type=float,
        default=d.pool_fraction,
        help=f"pool as a share of what --max-num-seqs requests need at full length "
        f"(default {d.pool_fraction})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=d.max_num_seqs,
        help=f"requests running at once at most (default {d.max_num_seqs})",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=d.dtype,
        help=f"weights and KV (default {d.dtype})",
    )
    rows = p.add_mutually_exclusive_group()
    rows.add_argument(
        "--policies",
        nargs="+",
        choices=ALL_POLICIES,
        default=list(ALL_POLICIES),
        metavar="POLICY",
        help=f"the planned table's policies, among {', '.join(ALL_POLICIES)} (default: all)",
    )
    rows.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="LABEL=POLICY[:k=v,...]",
        help="a row of your own, instead of the planned table (repeat it): POLICY is a "
        "built-in name, package.module:Class or file.py:Class; each k=v a hyperparameter of "
        "it or a GrowPageConfig setting of this row (floor_tokens, beta_long, "
        "summary_start, ...); a value @LABEL.budget or @LABEL.grow_ratio is taken from an "
        "earlier row's results",
    )
    p.add_argument(
        "--protect-prompt",
        action=argparse.BooleanOptionalAction,
        default=d.protect_prompt,
        help="keep every prompt token out of compression, for every row alike (default off: "
        "the paper's, the prompt is evictable)",
    )
    p.add_argument(
        "--floor-tokens",
        type=non_negative_int,
        default=d.floor_tokens,
        metavar="N",
        help="every request grows freely until a compression would keep N tokens above its "
        "prompt (default none: the paper's two pages)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the table in --out (same settings), skipping finished runs; the rows "
        "this command names run first, in its order",
    )
    p.set_defaults(func=run_accuracy)


def run_accuracy(args: argparse.Namespace) -> int:
    from growpage.eval.accuracy import AccuracySettings, run_table

    settings = AccuracySettings(
        model=args.model,
        task=args.task,
        protect_prompt=args.protect_prompt,
        floor_tokens=args.floor_tokens,
        rows=tuple(args.row),
        num_problems=args.problems,
        seed=args.seed,
        difficulty=args.difficulty,
        max_tokens=args.max_tokens,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        pool_fraction=args.pool_fraction,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        policies=tuple(args.policies),
    )
    report = run_table(settings, args.out, resume=args.resume, threads=args.threads)
    from growpage.eval.accuracy import to_markdown

    print(to_markdown(report))
    return 0


def _table_command(
    sub: argparse._SubParsersAction, name: str, help: str, description: str
) -> argparse.ArgumentParser:
    """A command that reads a stored accuracy table: its parser, with the table's folder."""
    from growpage._argtypes import path_arg

    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("out", type=path_arg, help="the table's folder (growpage eval accuracy --out)")
    return p


def _add_rescore(sub: argparse._SubParsersAction) -> None:
    p = _table_command(
        sub,
        "rescore",
        "read an accuracy table's stored outputs again with the current answer reader",
        "Re-reads every output of an accuracy table (outputs/*.jsonl) with the current answer "
        "reader and rewrites its rows' accuracy, results.json, table.md and the plot; prints "
        "how many verdicts changed per row. Generates nothing.",
    )
    p.set_defaults(func=run_rescore)


def run_rescore(args: argparse.Namespace) -> int:
    from growpage.eval.accuracy import rescore, to_markdown

    report, changed = rescore(args.out)
    print(to_markdown(report))
    for label, n in changed.items():
        print(f"[rescore] {label}: {n} verdict(s) changed")
    return 0


def _add_paired(sub: argparse._SubParsersAction) -> None:
    p = _table_command(
        sub,
        "paired",
        "one row of an accuracy table against others, problem by problem (McNemar)",
        "Compares row ROW of the accuracy table in OUT with each row AGAINST on the same "
        "problems: both right, only ROW right, only AGAINST right, the difference in accuracy "
        "and McNemar's exact two-sided p-value. Reads the stored outputs; generates nothing.",
    )
    p.add_argument("row", help="the row's label")
    p.add_argument("against", nargs="+", help="labels of the rows to compare it with")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_paired)


def run_paired(args: argparse.Namespace) -> int:
    import json

    from growpage.eval.paired import pair, to_dict, to_markdown

    results = [pair(args.out, args.row, other) for other in args.against]
    print(json.dumps(to_dict(results), indent=1) if args.json else to_markdown(results, args.out))
    return 0


def _add_signal(sub: argparse._SubParsersAction) -> None:
    from growpage._argtypes import path_arg, size_list
    from growpage.eval.signal_study import HORIZONS, StudySettings

    d = StudySettings()
    p = sub.add_parser(
        "signal",
        help="the Delta_t study in the paper's method (Fig. 6 and 7) on recorded traces",
        description="Replays full-KV traces recorded at every layer (growpage record) and "
        "measures Delta_t against the next page's demand change and against the growth "
        "advantage: the reference trajectory's next page teacher-forced under Compress & Hold "
        "and under Grow. Writes signal.json, report.md and signal.png (Fig. 7: the advantage "
        "by Delta_t) to --out.",
    )
    p.add_argument("--traces", type=path_arg, required=True, help="trace set (all layers)")
    p.add_argument("--model", required=True, help="the model the traces were recorded with")
    p.add_argument(
        "--page-sizes",
        type=size_list,
        default=d.page_sizes,
        help="page sizes b (default 16,32,64)",
    )
    p.add_argument(
        "--horizons",
        nargs="+",
        default=list(d.horizons),
        choices=HORIZONS,
        help="query-summary horizons: paper (beta_L 0.999 from the first query), average "
        "(bias-corrected start), scaled (beta_L scaled to the answers' length, bias-corrected) "
        "(default paper scaled)",
    )
    p.add_argument("--max-traces", type=positive_int, default=None, help="the first N traces")
    p.add_argument(
        "--bootstrap",
        type=non_negative_int,
        default=d.bootstrap,
        metavar="N",
        help=f"bootstrap resamples of each interval, 0 for no intervals (default {d.bootstrap})",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument(
        "--out",
        type=path_arg,
        required=True,
        help="output folder; each measured trace, page size and horizon is kept in OUT/items",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="reuse the items an earlier run with the same settings left in OUT/items",
    )
    p.set_defaults(func=run_signal)


def run_signal(args: argparse.Namespace) -> int:
    import json

    import torch

    from growpage.errors import ConfigError
    from growpage.eval.signal_study import StudySettings, plot_study, report_markdown, run_study

    settings = StudySettings(
        page_sizes=tuple(args.page_sizes),
        horizons=tuple(args.horizons),
        bootstrap=args.bootstrap,
        max_traces=args.max_traces,
    )
    if args.out.exists() and not args.out.is_dir():
        raise ConfigError(f"--out {args.out} is a file, not a folder")
    if args.threads:
        torch.set_num_threads(args.threads)
    # OUT/items (and OUT) are made by the first measured item: a refused study leaves nothing.
    report = run_study(
        args.traces, args.model, settings, items=args.out / "items", resume=args.resume
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "signal.json").write_text(json.dumps(report, indent=1))
    text = report_markdown(report)
    (args.out / "report.md").write_text(text)
    plot_study(report, args.out / "signal.png")
    print(text)
    print(f"wrote {args.out / 'signal.json'}, report.md and signal.png")
    return 0


#: The ``eval`` subcommands, in the order ``growpage eval --help`` lists them.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_maths,
    _add_accuracy,
    _add_rescore,
    _add_paired,
    _add_signal,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("eval", help="evaluation tasks: look at them, score models")
    sub = group.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
