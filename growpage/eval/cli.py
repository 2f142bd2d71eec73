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


#: The ``eval`` subcommands, in the order ``growpage eval --help`` lists them.
SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_maths,)


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("eval", help="evaluation tasks: look at them, score models")
    sub = group.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
