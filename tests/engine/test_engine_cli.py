"""``growpage generate`` / ``growpage record``: a user's mistake is ``growpage: error: ...``
and exit status 2, never a traceback. No model is loaded: ``_build_llm`` is replaced."""

from __future__ import annotations

import pytest

from growpage import cli
from growpage.engine import cli as engine_cli
from growpage.errors import EngineError


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a command gets as far as building the engine."""
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: pytest.fail("engine built"))


def error_of(argv: list[str], capsys) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("growpage: error: "), captured.err
    return captured.err


def test_bad_prompt_files_are_errors(tmp_path, capsys, no_model):
    binary = tmp_path / "bin.txt"
    binary.write_bytes(bytes(range(256)))
    err = error_of(["generate", "--prompts", str(binary)], capsys)
    assert f"prompt file {binary} is not UTF-8 text (invalid start byte at byte 128)" in err
    err = error_of(["record", "--prompts", str(tmp_path), "--out", str(tmp_path / "o")], capsys)
    assert f"prompt file {tmp_path} is a directory" in err


@pytest.mark.parametrize("line,words", [
    ('{"prompt": null}', "'prompt' must be a string, got NoneType"),
    ('{"prompt": ["a", "b"]}', "'prompt' must be a string, got list"),
    ('{"prompt": 5}', "'prompt' must be a string, got int"),
    ('{"text": "hi"}', "bad JSONL line"),
    ("[1, 2", "bad JSONL line"),
])
def test_jsonl_prompts_must_be_strings(tmp_path, capsys, no_model, line, words):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{line}\n')
    err = error_of(["generate", "--prompts", str(path)], capsys)
    assert f"{path}:3: " in err and words in err
    path.write_text('{"prompt": "fine"}\n\n{"prompt": "[1]", "n": 2}\n')
    assert engine_cli.read_prompts(path) == ["fine", "[1]"]


def test_record_out_must_be_a_directory_it_can_create(tmp_path, capsys, no_model):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    err = error_of(["record", "--prompts", str(prompts), "--out", str(prompts)], capsys)
    assert f"--out {prompts} is a file, not a trace-set directory" in err
    err = error_of(["record", "--prompts", str(prompts), "--out", "/proc/nope"], capsys)
    assert "--out /proc/nope: cannot create the directory (No such file or directory)" in err


def test_os_errors_are_reported_not_dumped(monkeypatch, capsys):
    def missing(**kwargs):
        raise FileNotFoundError(2, "No such file or directory", "x.gguf")

    monkeypatch.setattr(engine_cli, "_build_llm", missing)
    err = error_of(["generate", "--prompt", "hi"], capsys)
    assert "No such file or directory: 'x.gguf'" in err


class _Recorded:
    """Stands in for ``LLM``: keeps what ``generate`` was asked."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate(self, prompts, params, **kwargs):
        self.calls.append(kwargs)
        raise EngineError("stop here")


@pytest.mark.parametrize("flags,use_tqdm", [([], None), (["--progress"], True),
                                            (["--no-progress"], False)])
def test_progress_flag_reaches_generate(monkeypatch, capsys, flags, use_tqdm):
    fake = _Recorded()
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    error_of(["generate", "--prompt", "hi", *flags], capsys)
    assert fake.calls[-1]["use_tqdm"] is use_tqdm


def test_counts_of_one_are_singular(monkeypatch, capsys):
    from types import SimpleNamespace

    out = SimpleNamespace(text="Hello", token_ids=[5], finish_reason="length")
    fake = SimpleNamespace(generate=lambda *a, **kw: [out],
                           last_stats=SimpleNamespace(table=lambda: "stats"))
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    assert "finish reason  length (1 token)\n" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--param", "--policy-arg"])
def test_generate_takes_policy_params_as_the_simulator_does(monkeypatch, flag):
    class Built(Exception):
        pass

    seen = {}

    def build(**kw):
        seen.update(kw)
        raise Built

    monkeypatch.setattr(engine_cli, "_build_llm", build)
    with pytest.raises(Built):
        cli.main(["generate", "--prompt", "hi", "--policy", "fixed", flag, "budget_tokens=128",
                  flag, "tau=None"])
    assert seen["policy"] == "fixed" and seen["policy_kwargs"] == {"budget_tokens": 128,
                                                                    "tau": None}
