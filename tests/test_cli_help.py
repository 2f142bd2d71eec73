"""Every option of every ``growpage`` command says what it does, and its default where it has
one that matters (a number, a name, a path): users read ``--help``, not the source."""

from __future__ import annotations

import argparse

from growpage.cli import build_parser


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def _states_default(action: argparse.Action) -> bool:
    if action.default in (None, False, [], argparse.SUPPRESS) or isinstance(
        action, (argparse._StoreTrueAction, argparse._StoreFalseAction)
    ):
        return True  # nothing worth stating
    return "default" in action.help


def test_every_option_of_every_command_has_help_and_states_its_default():
    options = list(_options(build_parser()))
    assert {"generate", "record", "sim replay", "sim serve", "sim sweep", "calibrate"} <= {
        command for command, _ in options
    }
    bare = [f"{command} {a.option_strings[0]}" for command, a in options if not a.help]
    assert bare == []
    silent = [
        f"{command} {a.option_strings[0]} (default {a.default!r})"
        for command, a in options
        if not _states_default(a)
    ]
    assert silent == []
