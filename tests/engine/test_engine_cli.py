"""``growpage generate`` / ``growpage record``: a user's mistake is ``growpage: error: ...``
and exit status 2, never a traceback. No model is loaded: ``_build_llm`` is replaced."""

from __future__ import annotations

import pytest

from growpage import cli
from growpage.engine import cli as engine_cli
from growpage.engine import prompt_files
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


@pytest.mark.parametrize(
    "line,words",
    [
        ('{"prompt": null}', "'prompt' must be a string, got NoneType"),
        ('{"prompt": ["a", "b"]}', "'prompt' must be a string, got list"),
        ('{"prompt": 5}', "'prompt' must be a string, got int"),
        (
            '{"text": "hi"}',
            '(no \'prompt\' key; each line holds an object such as {"prompt": "..."})',
        ),
        ('["hi"]', "(not a JSON object; each line holds an object such as"),
        ("[1, 2", "(not JSON: Expecting ',' delimiter: line 1 column 6 (char 5))"),
    ],
)
def test_jsonl_prompts_must_be_strings(tmp_path, capsys, no_model, line, words):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n\n{line}\n')
    err = error_of(["generate", "--prompts", str(path)], capsys)
    assert f"{path}:3: " in err and words in err
    path.write_text('{"prompt": "fine"}\n\n{"prompt": "[1]", "n": 2}\n')
    assert prompt_files.read_prompts(path) == ["fine", "[1]"]


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


@pytest.mark.parametrize(
    "flags,use_tqdm", [([], None), (["--progress"], True), (["--no-progress"], False)]
)
def test_progress_flag_reaches_generate(monkeypatch, capsys, flags, use_tqdm):
    fake = _Recorded()
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    error_of(["generate", "--prompt", "hi", *flags], capsys)
    assert fake.calls[-1]["use_tqdm"] is use_tqdm


def test_counts_of_one_are_singular(monkeypatch, capsys):
    from types import SimpleNamespace

    out = SimpleNamespace(text="Hello", token_ids=[5], finish_reason="length")
    fake = SimpleNamespace(
        generate=lambda *a, **kw: [out], last_stats=SimpleNamespace(table=lambda: "stats")
    )
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    assert "finish reason  length (1 token)\n" in capsys.readouterr().out


class _Built(Exception):
    """Raised by ``_llm_arguments``'s stand-in for ``_build_llm``: the CLI got that far."""


def _llm_arguments(monkeypatch, argv: list[str], when_built=None) -> dict:
    """The keyword arguments ``argv`` builds its ``LLM`` with (no model is loaded);
    ``when_built()`` runs at that moment."""
    seen: dict = {}

    def build(**kw):
        seen.update(kw)
        if when_built is not None:
            when_built()
        raise _Built

    monkeypatch.setattr(engine_cli, "_build_llm", build)
    with pytest.raises(_Built):
        cli.main(argv)
    return seen


@pytest.mark.parametrize("flag", ["--param", "--policy-arg"])
def test_generate_takes_policy_params_as_the_simulator_does(monkeypatch, flag):
    seen = _llm_arguments(
        monkeypatch,
        [
            "generate",
            "--prompt",
            "hi",
            "--policy",
            "fixed",
            flag,
            "budget_tokens=128",
            flag,
            "tau=None",
        ],
    )
    assert seen["policy"] == "fixed" and seen["policy_kwargs"] == {
        "budget_tokens": 128,
        "tau": None,
    }


@pytest.mark.parametrize("flags, window", [([], None), (["--recent-window", "8"], 8)])
def test_generate_takes_the_recent_window_as_the_simulator_does(monkeypatch, flags, window):
    seen = _llm_arguments(monkeypatch, ["generate", "--prompt", "hi", "--page-size", "32", *flags])
    assert seen["page_size"] == 32 and seen.get("recent_window") == window


def test_threads_sets_torch_s_threads_before_the_engine_is_built(monkeypatch):
    import torch

    calls: list = []
    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("set", n)))
    when_built = lambda: calls.append(torch.get_num_threads())  # noqa: E731
    _llm_arguments(monkeypatch, ["generate", "--prompt", "hi", "--threads", "3"], when_built)
    _llm_arguments(monkeypatch, ["generate", "--prompt", "hi"], when_built)  # torch's own
    assert calls == [("set", 3), before, before]


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_a_bad_thread_count_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--prompt", "hi", "--threads", value])
    assert exit_info.value.code == 2
    assert "--threads: expected an integer >= 1" in capsys.readouterr().err


def test_a_bad_recent_window_is_a_clean_error(capsys):
    err = error_of(
        [
            "generate",
            "--prompt",
            "hi",
            "--page-size",
            "16",
            "--recent-window",
            "20",
            "--model",
            "/nonexistent.gguf",
        ],
        capsys,
    )
    assert "recent_window" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--param", "--policy-arg"])
@pytest.mark.parametrize(
    "values,words",
    [(["foo"], "expects KEY=VALUE, got 'foo'"), (["tau=0.1", "tau=0.2"], "tau given twice")],
)
def test_a_bad_policy_param_is_named_by_the_documented_flag(capsys, no_model, flag, values, words):
    """``--param`` is what the docs and ``--help`` name (``--policy-arg`` its older alias), as
    the simulator's errors name it."""
    argv = ["generate", "--prompt", "hi"]
    for value in values:
        argv += [flag, value]
    err = error_of(argv, capsys)
    assert f"growpage: error: --param {words}" in err


def _output(i: int, text: str):
    from growpage.engine.outputs import RequestOutput

    return RequestOutput(
        request_id=str(i),
        prompt=f"p{i}",
        prompt_token_ids=[1, 2],
        text=text,
        token_ids=[7, 8, 9],
        finish_reason="stop",
        trajectory=[(64, 2, "grow")],
        events={"grow": 1},
        ttft_s=0.5,
        tpot_s=0.25,
        e2e_s=1.0,
    )


class _Answers:
    """An ``LLM`` stand-in that answers each prompt and keeps the sampling parameters."""

    def __init__(self):
        from types import SimpleNamespace

        from growpage.core.events import EventCounters
        from growpage.engine.loop.stats import StatsCollector

        self.params = None
        self.config = SimpleNamespace(max_num_seqs=4)
        collector = StatsCollector(EventCounters())
        for pages, running in ((3, 2), (5, 2), (2, 1), (0, 0)):
            collector.on_step(0.01, running, [], pages, running)
        self.last_stats = collector.summary("growpage", 16, 8)

    def generate(self, prompts, params, **kwargs):
        self.params = params
        return [_output(i, f"answer {i} ünïcode") for i in range(len(prompts))]


def test_generate_passes_stop_strings_and_ignore_eos(monkeypatch, capsys):
    fake = _Answers()
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    assert (
        cli.main(["generate", "--prompt", "hi", "--stop", "\n\n", "--stop", "END", "--ignore-eos"])
        == 0
    )
    assert fake.params.stop == ("\n\n", "END") and fake.params.ignore_eos is True
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    assert fake.params.stop == () and fake.params.ignore_eos is False


def test_generate_out_writes_every_output_and_the_stats(monkeypatch, capsys, tmp_path):
    import json

    fake = _Answers()
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: fake)
    out = tmp_path / "run" / "one"
    assert (
        cli.main(
            [
                "generate",
                "--prompt",
                "a",
                "--prompt",
                "b",
                "--policy",
                "fixed",
                "--param",
                "budget_tokens=128",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert f"results in {out}/ (outputs.jsonl, stats.json, pool.png)" in capsys.readouterr().out
    assert (out / "pool.png").stat().st_size > 0
    rows = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert [r["text"] for r in rows] == ["answer 0 ünïcode", "answer 1 ünïcode"]
    assert rows[1]["token_ids"] == [7, 8, 9] and rows[1]["num_output_tokens"] == 3
    assert rows[0]["trajectory"] == [[64, 2, "grow"]] and rows[0]["e2e_s"] == 1.0
    payload = json.loads((out / "stats.json").read_text())
    assert payload["stats"]["policy"] == "growpage" and "ttft_p99_s" in payload["stats"]
    assert [row[1:] for row in payload["stats"]["pool_timeline"]] == [
        [3, 2],
        [5, 2],
        [2, 1],
        [0, 0],
    ]
    assert payload["settings"]["policy"] == "fixed"
    assert payload["settings"]["policy_arg"] == ["budget_tokens=128"]
    assert payload["settings"]["out"] == str(out)


def test_generate_out_must_be_a_directory_it_can_create(tmp_path, capsys, no_model):
    file = tmp_path / "f"
    file.write_text("")
    err = error_of(["generate", "--prompt", "hi", "--out", str(file)], capsys)
    assert f"--out {file} is a file, not an output directory" in err


@pytest.mark.parametrize(
    "line,words",
    [
        ('{"prompt": ""}', "empty prompt"),
        (r'{"prompt": "a\ud800"}', r"'prompt' is not valid Unicode text ('\ud800' at character 1"),
        ('{"prompt": "hi", "arival_s": 2}', "unknown key 'arival_s'; did you mean 'arrival_s'?"),
        ('{"promt": "hi", "prompt": "hi"}', "unknown key 'promt'; did you mean 'prompt'?"),
    ],
)
def test_a_jsonl_prompt_mistake_names_its_line(tmp_path, capsys, no_model, line, words):
    path = tmp_path / "p.jsonl"
    path.write_text(f'{{"prompt": "fine"}}\n{line}\n')
    err = error_of(["generate", "--prompts", str(path)], capsys)
    assert f"{path}:2: {words}" in err


@pytest.mark.parametrize("suffix", [".jsonl", ".ndjson"])
def test_a_jsonl_prompt_may_carry_other_keys(tmp_path, suffix):
    """A data set's own fields (growpage data prompts writes id and answer) are not typos."""
    path = tmp_path / f"p{suffix}"
    path.write_text('{"id": "a-1", "prompt": "hi", "answer": 5, "prompt_id": 3, "n": 2}\n')
    assert prompt_files.read_prompt_file(path) == (["hi"], None)


def failing_engine(made: list):
    """A ``_build_llm`` that starts a trace set in its ``--out`` (as the recorder does) and
    then fails, as a model that cannot load or a pool too small would."""

    def build(**kwargs):
        out = kwargs.get("record_traces")
        if out is not None:
            from growpage.core.trace_set import TraceSet

            TraceSet(out, create=True)
            made.append(out)
        raise EngineError("the engine cannot be built")

    return build


def test_a_failed_record_leaves_no_folder_or_empty_trace_set(tmp_path, capsys, monkeypatch):
    made: list = []
    monkeypatch.setattr(engine_cli, "_build_llm", failing_engine(made))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    new = tmp_path / "new" / "traces"
    err = error_of(["record", "--prompts", str(prompts), "--out", str(new)], capsys)
    assert "the engine cannot be built" in err and made == [new]
    assert not (tmp_path / "new").exists()  # the parent it created goes too
    empty = tmp_path / "empty"
    empty.mkdir()
    error_of(["record", "--prompts", str(prompts), "--out", str(empty)], capsys)
    assert empty.is_dir() and not list(empty.iterdir())


def test_a_failed_record_keeps_a_trace_set_that_was_there(tmp_path, capsys, monkeypatch):
    from growpage.core.trace_set import INDEX_NAME

    monkeypatch.setattr(engine_cli, "_build_llm", failing_engine([]))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    there = tmp_path / "set"
    there.mkdir()
    (there / INDEX_NAME).write_text('{"traces": []}')
    (there / "notes.txt").write_text("mine")
    error_of(["record", "--prompts", str(prompts), "--out", str(there)], capsys)
    assert sorted(p.name for p in there.iterdir()) == [INDEX_NAME, "notes.txt"]


def test_a_failed_generate_removes_the_out_folder_it_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(engine_cli, "_build_llm", failing_engine([]))
    new = tmp_path / "a" / "b"
    error_of(["generate", "--prompt", "hi", "--out", str(new)], capsys)
    assert not (tmp_path / "a").exists()
    there = tmp_path / "there"
    there.mkdir()
    error_of(["generate", "--prompt", "hi", "--out", str(there)], capsys)
    assert there.is_dir()


def test_a_prompt_that_is_not_unicode_text_is_named():
    from growpage.engine.inputs import encode_continuation, encode_prompt
    from growpage.engine.loading.tokenizer import load_tokenizer

    tok = load_tokenizer()
    with pytest.raises(EngineError, match=r"^the prompt is not valid Unicode text: '\\udcff' at"):
        encode_prompt("ok \udcff", tok, chat=False)  # argv's undecodable byte 0xff
    with pytest.raises(EngineError, match=r"not valid Unicode text.* \(prompts\[2\]\)$"):
        encode_prompt("\ud800", tok, chat=True, at=" (prompts[2])")
    with pytest.raises(EngineError, match=r"^the continuation is not valid Unicode text"):
        encode_continuation("x\ud800", tok)
    assert encode_prompt("ok", tok, chat=False) == (tok.encode("ok"), "ok")


class _RefusingLLM:
    """Refuses the second prompt as the engine names it: by its index among the prompts."""

    def generate(self, prompts, *args, **kwargs):
        raise EngineError("the request cannot fit the KV pool (prompts[1])")


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_an_engine_error_about_a_file_prompt_names_its_line(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(engine_cli, "_build_llm", lambda **kw: _RefusingLLM())
    path = tmp_path / name
    lines = ["one", "", "two"] if name == "p.txt" else ['{"prompt": "one"}', "", '{"prompt": "2"}']
    path.write_text("\n".join(lines) + "\n")
    err = error_of(["generate", "--prompts", str(path)], capsys)
    assert err.strip().endswith(f"the request cannot fit the KV pool ({path}:3)")
    err = error_of(["generate", "--prompt", "a", "--prompt", "b"], capsys)
    assert err.strip().endswith("(prompts[1])")  # no file: the index, as the API says it
