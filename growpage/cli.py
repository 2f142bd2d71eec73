"""The ``growpage`` command line.

Each face adds its own subcommands through a ``register(subparsers)`` function in its own
module (``growpage/engine/cli.py``, ``growpage/commands/cli.py``, ...), so this file stays a
dispatcher.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules that contribute subcommands; a module that is not there yet is skipped.
SUBCOMMAND_MODULES = (
    "growpage.demo",
    "growpage.policies.cli",
    "growpage.testing.cli",
    "growpage.engine.cli",
    "growpage.engine.loading.catalog_cli",
    "growpage.commands.cli",
    "growpage.server.cli",
    "growpage.eval.cli",
    "growpage.eval.data_cli",
    "growpage.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="growpage",
        description="On-demand KV-cache budgeting: one capacity-policy API for a trace-replay "
        "simulator and a paged-attention engine.",
        epilog="'growpage COMMAND --help' lists a command's options; docs/engine.md and "
        "docs/simulator.md describe them.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of the output went away (`growpage ... | head`): stop quietly, as Unix
        # tools do; stdout goes to /dev/null so that its flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 - a CLI prints errors, it does not dump tracebacks
        from growpage.errors import GrowPageError

        if isinstance(exc, (GrowPageError, OSError)):  # OSError: a file the user named
            print(f"growpage: error: {exc}{_where(exc)}", file=sys.stderr)
            return 2
        raise


def _where(exc: BaseException) -> str:
    """`` (file:line, in function)`` of the policy author's code a policy error came from (the
    last frame outside growpage and installed packages), as ``sim sweep`` reports a failed
    point: a policy author needs the line of their bug, not only its message."""
    from growpage.errors import PolicyError, policy_raised_at

    if not isinstance(exc, PolicyError) or exc.__cause__ is None:
        return ""
    return policy_raised_at(exc)


if __name__ == "__main__":
    sys.exit(main())
