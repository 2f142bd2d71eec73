"""One list of engine settings: ``EngineConfig``'s fields. ``LLM`` takes each as a keyword with
EngineConfig's default, and every engine command has a flag for each (with the field's
default) or names it in its ``NO_FLAG`` with the reason. A new field fails here until it is
given a sample below, which shows ``LLM`` and the flags carry it to the config."""

from __future__ import annotations

import attrs
import pytest
import torch

import growpage.engine.llm as llm_module
from growpage import cli
from growpage.engine import cli as engine_cli
from growpage.engine import cli_flags
from growpage.engine.config import SETTINGS, EngineConfig
from growpage.server import cli as server_cli

NAMES = {f.name for f in SETTINGS}

# name: (LLM keyword value, flag value or None when no command has the flag, config value).
# Run with torch.cuda.is_available() patched True, so that "auto" means "cuda".
SAMPLES = {
    "kv_pages": (8, "8", 8),
    "kv_cache_memory": (2**20, "1048576", 2**20),
    "max_num_seqs": (3, "3", 3),
    "max_num_batched_tokens": (100, "100", 100),
    "enable_prefix_caching": (False, False, False),
    "dtype": ("bfloat16", "bf16", torch.bfloat16),
    "device": ("auto", "cuda", "cuda"),
    "attention_backend": ("torch", "torch", "torch"),
    "boundary_kernels": (False, False, False),
    "warmup": (False, False, False),
    "cuda_graphs": (False, False, False),
    "async_compaction": (True, True, True),
    "async_decisions": (True, True, True),
    "record_traces": ("set-dir", None, "set-dir"),
    "record_layers": ([2, 0, 2], None, (0, 2)),
    "record_values": (False, None, False),
    "seed": (7, "7", 7),
}
# command: (its arguments before any engine flag, its NO_FLAG)
COMMANDS = {
    "generate": (["--prompt", "x"], cli_flags.NO_FLAG),
    "record": (["--prompts", "PROMPTS", "--out", "OUT"], cli_flags.NO_FLAG),
    "serve": ([], server_cli.NO_FLAG),
}


class _Built(Exception):
    """Raised where the ``LLM`` (or, inside it, the model) would be built."""


@pytest.fixture
def gpu_seen(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_the_settings_are_the_fields_of_engine_config_but_growpage():
    # growpage: its fields are LLM keywords (and --page-size, --recent-window) of their own
    assert {f.name for f in attrs.fields(EngineConfig)} - NAMES == {"growpage"}
    assert set(SAMPLES) == NAMES, "give the new EngineConfig field a sample above"
    assert all(f.metadata["help"] and not f.metadata["help"].endswith(".") for f in SETTINGS)


def _config_of_llm(monkeypatch, **settings) -> EngineConfig:
    """The ``EngineConfig`` that ``LLM(policy="fullkv", **settings)`` builds (no model)."""
    seen = []

    def load(model, tokenizer, config):
        seen.append(config)
        raise _Built

    monkeypatch.setattr(llm_module, "_load", load)
    with pytest.raises(_Built):
        llm_module.LLM(policy="fullkv", **settings)
    return seen[0]


def test_llm_defaults_are_engine_config_defaults(monkeypatch):
    assert _config_of_llm(monkeypatch) == EngineConfig()


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_llm_takes_each_setting_to_the_config(monkeypatch, gpu_seen, name):
    given, _, want = SAMPLES[name]
    # record_layers picks what record_traces records: it comes with a trace set (the config's
    # rule), and recording turns the prefix cache off (LLM's rule).
    needs = {"record_traces": "set-dir"} if name == "record_layers" else {}
    config = _config_of_llm(monkeypatch, **{name: given}, **needs)
    also = {"enable_prefix_caching": False} if "record_traces" in {name, *needs} else {}
    assert config == EngineConfig(**{name: want, **needs, **also})


def _subparser(command: str):
    return cli.build_parser()._subparsers._group_actions[0].choices[command]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_setting_has_a_flag_or_a_reason(command):
    skip = COMMANDS[command][1]
    helps = {f.name: f.metadata["help"] for f in SETTINGS}
    flagged = {  # generate's own --seed (the requests') is not the engine's
        a.dest for a in _subparser(command)._actions if a.help.startswith(helps.get(a.dest, "-"))
    }
    assert all(skip.values()), "each setting without a flag says why"
    assert flagged.isdisjoint(skip) and flagged | set(skip) == NAMES


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flag_defaults_are_engine_config_defaults(command):
    argv, skip = COMMANDS[command]
    args = _subparser(command).parse_args(argv)
    # device: the commands run where torch sees a GPU ("auto"); LLM's default stays "cpu"
    assert EngineConfig(**cli_flags.engine_settings(args, skip)) == EngineConfig(device="auto")


def _llm_keywords(monkeypatch, tmp_path, command: str, flags: list[str]) -> dict:
    """The keywords ``growpage COMMAND ... FLAGS`` builds its ``LLM`` with."""
    argv, _ = COMMANDS[command]
    (tmp_path / "p.txt").write_text("hello\n")
    paths = {"PROMPTS": str(tmp_path / "p.txt"), "OUT": str(tmp_path / "out")}
    seen: dict = {}

    def build(*args, **kw):
        seen.update(kw)
        raise _Built

    monkeypatch.setattr(engine_cli, "_build_llm", build)
    monkeypatch.setattr(llm_module, "LLM", build)  # serve builds it directly
    with pytest.raises(_Built):
        cli.main([command, *[paths.get(a, a) for a in argv], *flags])
    return seen


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_flag_carries_its_setting_to_the_llm(monkeypatch, tmp_path, gpu_seen, command):
    skip = COMMANDS[command][1]
    base = _llm_keywords(monkeypatch, tmp_path, command, [])
    for name in sorted(NAMES - set(skip)):
        _, text, want = SAMPLES[name]
        flag = cli_flags.flag_name(attrs.fields_dict(EngineConfig)[name])
        flags = [flag if text else "--no-" + flag[2:]] if isinstance(text, bool) else [flag, text]
        seen = _llm_keywords(monkeypatch, tmp_path, command, flags)
        assert seen == {**base, name: seen[name]}  # it changes its own keyword only
        settings = {k: v for k, v in seen.items() if k in NAMES}
        assert getattr(EngineConfig(**settings), name) == want


def test_record_sets_the_recording_settings_with_its_own_flags(monkeypatch, tmp_path):
    flags = ["--layers", "3,1", "--no-values"]
    seen = _llm_keywords(monkeypatch, tmp_path, "record", flags)
    assert (seen["record_traces"], seen["record_layers"], seen["record_values"]) == (
        tmp_path / "out",
        [3, 1],
        False,
    )
