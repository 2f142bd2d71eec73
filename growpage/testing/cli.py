"""``growpage check``: the conformance kit from the command line.

    growpage check my_policy.py:CappedGrowPage --param max_pages=8

runs ``check_policy`` (every rule of ``RULES`` but ``serves`` on random small boundaries) and
then ``check_serving`` (rule ``serves``: small random workloads served by the simulator), and
prints what passed. A broken rule ends the check with the rule, what went wrong and the
smallest example hypothesis found, and exit status 1 (a failed check, as pytest's); a policy
that cannot be built is a usage error (status 2), as everywhere in ``growpage``.
"""

from __future__ import annotations

import argparse
import time
import warnings

from growpage._argtypes import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check", help="check a capacity policy against the conformance rules",
        description="Check a capacity policy against the conformance kit's rules "
                    "(growpage.testing): its decisions and selections on random small "
                    "boundaries, then small workloads served by the simulator.")
    p.add_argument("policy", help="registered name, 'module:Class' or 'file.py:Class'")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="policy hyperparameter (repeatable; VALUE read as JSON, else as a "
                        "Python literal such as None, else kept as a string)")
    p.add_argument("--examples", type=positive_int, default=40,
                   help="random boundaries for the per-boundary rules (default 40)")
    p.add_argument("--serving-examples", type=positive_int, default=15,
                   help="random workloads for the serving rule (default 15)")
    p.add_argument("--no-serving", dest="serving", action="store_false",
                   help="skip the serving rule (the per-boundary rules only)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: the kit's tensors are tiny, and on a "
                        "shared machine one thread is several times faster)")
    p.set_defaults(func=run)


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
    print(f"checking policy {policy.name!r} ({type(policy).__name__}); rules: "
          f"{', '.join(per_boundary)}{', serves' if args.serving else ''}")
    steps = [(f"per-boundary rules on {args.examples} random boundaries",
              lambda: check_policy(policy, max_examples=args.examples))]
    if args.serving:
        steps.append((f"serves on {args.serving_examples} random workloads in the simulator",
                      lambda: check_serving(policy, max_examples=args.serving_examples)))
    notes: list[str] = []
    for what, check in steps:
        print(f"  {what} ...", end=" ", flush=True)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", PolicyConformanceWarning)
                check()
            notes += [str(w.message) for w in caught
                      if issubclass(w.category, PolicyConformanceWarning)
                      and str(w.message) not in notes]
        except PolicyConformanceError as exc:
            print("FAILED")
            print(f"\n{exc}")
            where = policy_raised_at(exc) if exc.__cause__ is not None else ""
            if where:   # a crash: the line of the policy's code that raised
                print(f"  raised at {where.strip().removeprefix('(').removesuffix(')')}")
            return 1
        print(f"ok ({time.perf_counter() - start:.1f} s)")
    skipped = "" if args.serving else " (serving rule skipped)"
    print(f"policy {policy.name!r} passes every rule checked{skipped}")
    for note in notes:   # what the kit could not check (a policy it cannot copy)
        print(f"note: {note}")
    if args.serving:
        from growpage.testing.serving import script_mode_problem

        problem = script_mode_problem(policy)
        if problem is not None:   # not a broken rule: trace mode serves it
            print(f"note: script mode (the default of `growpage sim serve`) cannot serve it: "
                  f"{problem}")
    return 0

