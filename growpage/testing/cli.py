"""``growpage check``: the conformance kit from the command line.

    growpage check my_policy.py:CappedGrowPage --param max_pages=8

runs ``check_policy`` (every rule of ``RULES`` but ``serves`` on random small boundaries) and
then ``check_serving`` (rule ``serves``: small random workloads served by the simulator), and
prints what passed. ``--max-pages``, ``--page-sizes`` and ``--max-output`` make the contexts and
requests longer, for a policy whose trouble starts past the defaults' 96-token contexts. A
broken rule ends the check with the rule, what went wrong and the smallest example hypothesis
found, and exit status 1 (a failed check, as pytest's); a policy that cannot be built is a usage
error (status 2), as everywhere in ``growpage``.
"""

from __future__ import annotations

import argparse
import time
import warnings

from growpage._argtypes import positive_int, size_list


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="check a capacity policy against the conformance rules",
        description="Check a capacity policy against the conformance kit's rules "
        "(growpage.testing): its decisions and selections on random small "
        "boundaries, then small workloads served by the simulator.",
    )
    p.add_argument("policy", help="registered name, 'module:Class' or 'file.py:Class'")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policy hyperparameter (repeatable; VALUE read as JSON, else as a "
        "Python literal such as None, else kept as a string)",
    )
    p.add_argument(
        "--examples",
        type=positive_int,
        default=40,
        help="random boundaries for the per-boundary rules (default 40)",
    )
    p.add_argument(
        "--serving-examples",
        type=positive_int,
        default=15,
        help="random workloads for the serving rule (default 15)",
    )
    p.add_argument(
        "--max-pages",
        type=_at_least_two,
        default=6,
        help="largest context of the per-boundary rules, in pages (default 6; "
        "contexts reach max-pages x the largest page size tokens)",
    )
    p.add_argument(
        "--page-sizes",
        type=_page_sizes,
        default=(4, 8, 16),
        metavar="SIZES",
        help="page sizes to draw, as 4,8,16 (the default) or 8-12; each >= 2, for both halves",
    )
    p.add_argument(
        "--max-output",
        type=positive_int,
        default=120,
        help="longest output of a served request, in tokens (default 120)",
    )
    p.add_argument(
        "--no-serving",
        dest="serving",
        action="store_false",
        help="skip the serving rule (the per-boundary rules only)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (default 1: the kit's tensors are tiny, and on a "
        "shared machine one thread is several times faster)",
    )
    p.set_defaults(func=run)


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:  # decisions start at min_capacity, 2 pages
        raise argparse.ArgumentTypeError(f"expected an integer >= 2, got {value}")
    return value


def _page_sizes(text: str) -> tuple[int, ...]:
    sizes = size_list(text)
    if sizes[0] < 2:  # serving protects a recent window of at least one token inside a page
        raise argparse.ArgumentTypeError(f"expected page sizes >= 2, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    import torch

    from growpage.errors import policy_raised_at
    from growpage.policies.registry import parse_policy_params, resolve_policy
    from growpage.testing import (
        RULES,
        PolicyConformanceError,
        PolicyConformanceWarning,
        check_policy,
        check_serving,
    )

    torch.set_num_threads(args.threads)
    policy = resolve_policy(args.policy, **parse_policy_params(args.param, "--param"))
    per_boundary = [rule for rule in RULES if rule != "serves"]
    print(
        f"checking policy {policy.name!r} ({type(policy).__name__}); rules: "
        f"{', '.join(per_boundary)}{', serves' if args.serving else ''}"
    )
    sizes = tuple(args.page_sizes)
    steps = [
        (
            f"per-boundary rules on {args.examples} random boundaries",
            lambda: check_policy(
                policy, max_examples=args.examples, max_pages=args.max_pages, page_sizes=sizes
            ),
        )
    ]
    if args.serving:
        steps.append(
            (
                f"serves on {args.serving_examples} random workloads in the simulator",
                lambda: check_serving(
                    policy,
                    max_examples=args.serving_examples,
                    page_sizes=sizes,
                    max_output=args.max_output,
                ),
            )
        )
    notes: list[str] = []
    for what, check in steps:
        print(f"  {what} ...", end=" ", flush=True)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PolicyConformanceWarning)
                check()
            notes += [
                str(w.message)
                for w in caught
                if issubclass(w.category, PolicyConformanceWarning) and str(w.message) not in notes
            ]
        except PolicyConformanceError as exc:
            print("FAILED")
            print(f"\n{exc}")
            where = policy_raised_at(exc) if exc.__cause__ is not None else ""
            if where:  # a crash: the line of the policy's code that raised
                print(f"  raised at {where.strip().removeprefix('(').removesuffix(')')}")
            return 1
        print(f"ok ({time.perf_counter() - start:.1f} s)")
    skipped = "" if args.serving else " (serving rule skipped)"
    print(f"policy {policy.name!r} passes every rule checked{skipped}")
    for note in notes:  # what the kit could not check (a policy it cannot copy)
        print(f"note: {note}")
    if args.serving:
        from growpage.testing.serving import script_mode_problem

        problem = script_mode_problem(policy)
        if problem is not None:  # not a broken rule: trace mode serves it
            print(
                f"note: script mode (the default of `growpage sim serve`) cannot serve it: "
                f"{problem}"
            )
    return 0
