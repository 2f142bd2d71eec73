"""``growpage policies``: list the registered policies and their hyperparameters."""

from __future__ import annotations

import argparse

import attrs


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("policies", help="list the registered capacity policies")
    p.set_defaults(func=run)


def _params(cls: type) -> str:
    if not attrs.has(cls):
        return ""
    return ", ".join(f"{f.name}={f.default!r}" for f in attrs.fields(cls))


def run(args: argparse.Namespace) -> int:
    from growpage.policies import registered_policies

    policies = registered_policies()
    width = max(len(name) for name in policies)
    for name, cls in policies.items():
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())  # first paragraph
        print(f"{name:<{width}}  {cls.__name__}({_params(cls)})")
        print(f"{'':<{width}}  {doc}")
    return 0
