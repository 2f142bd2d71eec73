"""``growpage generate --help`` and ``growpage record --help``: every option says what it does."""

from __future__ import annotations

import pytest

from growpage.cli import build_parser


def subparser(command: str):
    return build_parser()._subparsers._group_actions[0].choices[command]


@pytest.mark.parametrize("command", ["generate", "record"])
def test_every_option_has_help_text(command):
    bare = [
        a.option_strings[0] for a in subparser(command)._actions if a.option_strings and not a.help
    ]
    assert bare == []


@pytest.mark.parametrize("command,max_tokens", [("generate", 256), ("record", 512)])
def test_help_states_the_max_tokens_default(command, max_tokens):
    text = " ".join(subparser(command).format_help().split())
    assert f"most tokens to generate per prompt (default {max_tokens})" in text
    assert (
        subparser(command)
        .parse_args(
            ["--prompts", "p.txt", "--out", "d"] if command == "record" else ["--prompt", "x"]
        )
        .max_tokens
        == max_tokens
    )


def test_top_level_help_lists_every_command():
    text = build_parser().format_help()
    for command in ("demo", "policies", "generate", "record", "sim", "calibrate"):
        assert f"    {command}" in text
    assert "'growpage COMMAND --help' lists a command's options" in " ".join(text.split())
