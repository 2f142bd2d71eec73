"""``growpage eval ...``: evaluation tasks (argument parsing; the work is in the task modules).

Each subcommand is a function ``_add_NAME(sub)`` that declares its parser and sets ``func``;
listing it in ``SUBCOMMANDS`` adds it to the group.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from growpage._argtypes import positive_int


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

    d = AccuracySettings()
    p = sub.add_parser(
        "accuracy",
        help="accuracy at a KV budget, policy by policy, on the maths task (docs/evaluation.md)",
        description="Every policy answers the same maths problems in the engine under one KV "
        "pool; writes results.json, table.md, outputs/<policy>.jsonl and a plot to --out.",
    )
    p.add_argument("--model", default=d.model, help=f"model name or path (default {d.model})")
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
    p.add_argument(
        "--policies",
        nargs="+",
        choices=ALL_POLICIES,
        default=list(ALL_POLICIES),
        metavar="POLICY",
        help=f"among {', '.join(ALL_POLICIES)} (default: all)",
    )
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the table in --out (same settings), skipping finished runs",
    )
    p.set_defaults(func=run_accuracy)


def run_accuracy(args: argparse.Namespace) -> int:
    from growpage.eval.accuracy import AccuracySettings, run_table

    settings = AccuracySettings(
        model=args.model,
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


#: The ``eval`` subcommands, in the order ``growpage eval --help`` lists them.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_maths, _add_accuracy)


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("eval", help="evaluation tasks: look at them, score models")
    sub = group.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
