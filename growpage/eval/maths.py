"""Grade-school maths word problems with exact answers, generated from templates written here.

Each template draws names, items and numbers from a seeded ``random.Random`` and writes the
question together with its worked solution: steps, each an arithmetic expression over numbers
of the question (or values of earlier steps) and its exact value; the last value is the answer.
Numbers are drawn so that every value is a positive integer (or, where a template says so, a
clean decimal or a fraction).

    problems = generate_problems(100, seed=0, difficulty=2)
    outputs = [my_model(prompt(p)) for p in problems]      # each ends "#### <number>"
    print(score(problems, outputs).accuracy)

``difficulty`` (1, 2, 3) scales the numbers and adds steps where a template can; every problem
takes 2 to 6 steps. docs/evaluation.md lists the templates.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from fractions import Fraction
from typing import Protocol

import attrs

from growpage.errors import ConfigError, WorkloadError
from growpage.eval.answers import answer_form, extract_answer, read_answer
from growpage.eval.maths_templates import TEMPLATES, Number, Step, Template, format_number
from growpage.validators import is_int, non_negative_int

__all__ = [
    "DIFFICULTIES",
    "TEMPLATES",
    "MathsRecord",
    "MathsScore",
    "Number",
    "Problem",
    "Step",
    "Template",
    "answer_form",
    "extract_answer",
    "format_number",
    "generate_problems",
    "is_correct",
    "make_problem",
    "prompt",
    "score",
    "ScoredProblem",
    "template_names",
    "wilson_interval",
]

DIFFICULTIES = (1, 2, 3)
MIN_STEPS, MAX_STEPS = 2, 6
#: Redraws of one problem whose question repeats an earlier one, before giving up.
MAX_REDRAWS = 50


@attrs.frozen
class Problem:
    """One word problem: ``answer`` is the value of the last of ``steps``."""

    id: str
    template: str
    question: str
    answer: Number
    steps: tuple[Step, ...]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def prompt_form(self) -> str:
        """The answer form ``prompt`` asks for, read first by the scorer."""
        return "####"


class ScoredProblem(Protocol):
    """What ``score`` needs of a problem: a maths ``Problem`` or a benchmark's
    (``growpage.eval.datasets.BenchmarkProblem``). ``template`` labels the records: the
    maths template, or the benchmark's task name; ``prompt_form`` is the answer form the
    problem's prompt asks for (``"####"`` or ``"boxed"``, see ``growpage.eval.answers``)."""

    @property
    def id(self) -> str: ...

    @property
    def template(self) -> str: ...

    @property
    def answer(self) -> Number: ...

    @property
    def prompt_form(self) -> str: ...


_BY_NAME = {t.name: t for t in TEMPLATES}


# ---------------------------------------------------------------------------------------------
# Problems


def template_names() -> list[str]:
    return [t.name for t in TEMPLATES]


def make_problem(
    template: str | Template, rng: random.Random, difficulty: int = 1, problem_id: str = ""
) -> Problem:
    """One problem of ``template`` drawn with ``rng``; checks the template's promises."""
    if isinstance(template, str):
        if template not in _BY_NAME:
            raise ConfigError(f"no maths template named {template!r}; known: {template_names()}")
        template = _BY_NAME[template]
    _check_difficulty(difficulty)
    question, steps = template.build(rng, difficulty)
    problem = Problem(
        problem_id or template.name,
        template.name,
        question,
        steps[-1][1] if steps else 0,
        tuple(steps),
    )
    _check(template, problem)
    return problem


def generate_problems(n: int, seed: int = 0, difficulty: int = 1) -> list[Problem]:
    """``n`` distinct problems cycling fairly over the templates: each run of ``len(TEMPLATES)``
    problems from the start holds every template once, in an order shuffled by ``seed``.
    Deterministic in (n, seed, difficulty), and the first ``k`` of ``n`` problems are the ``k``
    problems of ``generate_problems(k, ...)``."""
    if not non_negative_int.accepts(n):
        raise ConfigError(f"n must be a whole number >= 0, got {n!r}")
    if not is_int(seed):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    _check_difficulty(difficulty)
    problems: list[Problem] = []
    seen: set[str] = set()
    order: list[Template] = []
    for i in range(n):
        if i % len(TEMPLATES) == 0:
            order = list(TEMPLATES)
            random.Random(f"maths-order:{seed}:{i // len(TEMPLATES)}").shuffle(order)
        problem_id = f"maths-s{seed}-d{difficulty}-{i:05d}"
        for attempt in range(MAX_REDRAWS):
            rng = random.Random(f"maths:{seed}:{difficulty}:{i}:{attempt}")
            problem = make_problem(order[i % len(TEMPLATES)], rng, difficulty, problem_id)
            if problem.question not in seen:
                break
        else:
            raise ConfigError(
                f"cannot draw {n} distinct maths problems: template {problem.template!r} repeats "
                f"its questions after {len(seen)} problems; ask for fewer"
            )
        seen.add(problem.question)
        problems.append(problem)
    return problems


def _check_difficulty(difficulty: int) -> None:
    if isinstance(difficulty, bool) or difficulty not in DIFFICULTIES:
        raise ConfigError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")


def _check(template: Template, problem: Problem) -> None:
    """A template's promises: 2 to 6 steps, every value positive and of the template's kind."""
    bad = ""
    if not MIN_STEPS <= problem.num_steps <= MAX_STEPS:
        bad = f"{problem.num_steps} steps"
    for expression, value in problem.steps:
        if value <= 0:
            bad = f"step {expression} = {value} is not positive"
        elif template.answer_kind == "integer" and not isinstance(value, int):
            bad = f"step {expression} = {value} is not a whole number"
        elif template.answer_kind == "decimal" and 100 * value != int(100 * value):
            bad = f"step {expression} = {value} is not in whole cents"
    if bad:
        raise RuntimeError(f"maths template bug in {template.name!r}: {bad} ({problem.question})")


# ---------------------------------------------------------------------------------------------
# Prompting and scoring


def prompt(problem: Problem) -> str:
    """The user message: the question, then how to answer."""
    return (
        f"{problem.question}\n\nSolve the problem step by step. End with a final line of the "
        'form "#### <number>" that gives only the answer.'
    )


def is_correct(problem: ScoredProblem, text: str) -> bool:
    """Exact match of the final answer (``extract_answer`` in the problem's ``prompt_form``)
    with the problem's: 12.0 == 12, 0.75 == 3/4."""
    answer = extract_answer(text, problem.prompt_form)
    return answer is not None and Fraction(answer) == Fraction(problem.answer)


def wilson_interval(
    num_successes: int, num_trials: int, confidence: float = 0.95
) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (Wilson 1927):

        centre = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)

    with p = successes / n and z the normal quantile of (1 + confidence) / 2."""
    if num_trials < 1 or not 0 <= num_successes <= num_trials:
        raise ConfigError(
            f"need 0 <= num_successes <= num_trials and num_trials >= 1, got {num_successes} "
            f"of {num_trials}"
        )
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be between 0 and 1, got {confidence}")
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    n, p = num_trials, num_successes / num_trials
    scale = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z / scale * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


@attrs.frozen
class MathsRecord:
    """How one output was scored; ``extracted`` is None when it gave no answer. ``template``:
    the maths template, or the benchmark's task name."""

    id: str
    template: str
    expected: Number
    extracted: Number | None
    correct: bool
    num_output_chars: int
    form: str | None = None  # "####", "boxed" or None: see ``answer_form``


@attrs.frozen
class MathsScore:
    """Accuracy over a list of problems, with its 95% Wilson interval."""

    num_correct: int
    num_problems: int
    accuracy: float
    interval: tuple[float, float]
    records: tuple[MathsRecord, ...]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: exact numbers that are not whole are written as text (``"3/4"``)."""

        def number(x: Number | None) -> int | str | None:
            return x if x is None or isinstance(x, int) else format_number(x)

        return {
            "num_correct": self.num_correct,
            "num_problems": self.num_problems,
            "accuracy": self.accuracy,
            "interval": list(self.interval),
            "records": [
                {
                    **attrs.asdict(r),
                    "expected": number(r.expected),
                    "extracted": number(r.extracted),
                }
                for r in self.records
            ],
        }


def score(problems: Sequence[ScoredProblem], outputs: Sequence[str]) -> MathsScore:
    """Accuracy of ``outputs[i]`` on ``problems[i]`` and one record per problem; each output
    is read in the form its problem's prompt asks for (``is_correct``)."""
    if len(problems) != len(outputs):
        raise WorkloadError(f"{len(problems)} problems but {len(outputs)} outputs")
    if not problems:
        raise WorkloadError("no problems to score")
    records = []
    for problem, text in zip(problems, outputs, strict=True):
        if not isinstance(text, str):
            raise WorkloadError(f"output for {problem.id} is {type(text).__name__}, not text")
        got, form = read_answer(text, problem.prompt_form)
        right = got is not None and Fraction(got) == Fraction(problem.answer)
        records.append(
            MathsRecord(problem.id, problem.template, problem.answer, got, right, len(text), form)
        )
    num_correct = sum(r.correct for r in records)
    return MathsScore(
        num_correct,
        len(records),
        num_correct / len(records),
        wilson_interval(num_correct, len(records)),
        tuple(records),
    )
