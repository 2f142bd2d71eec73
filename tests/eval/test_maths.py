"""The maths task: worked solutions re-evaluated by an independent arithmetic evaluator, answer
extraction on tricky outputs, and the Wilson interval against published values."""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from growpage.errors import ConfigError, WorkloadError
from growpage.eval.maths import (
    DIFFICULTIES,
    TEMPLATES,
    Problem,
    extract_answer,
    format_number,
    generate_problems,
    is_correct,
    make_problem,
    prompt,
    score,
    wilson_interval,
)

SEEDS = st.integers(min_value=0, max_value=2**40)

# Facts a worked solution may use without the question stating them.
KNOWN_FACTS = {
    2: "twice, there and back, a perimeter, a chicken's legs",
    4: "a square's sides, a cow's legs",
    7: "days in a week",
    10: "millimetres in a centimetre",
    12: "months in a year",
    60: "minutes in an hour",
    100: "per cent, cents in a dollar",
    1000: "metres in a kilometre, grams in a kilogram, millilitres in a litre",
}


# ---------------------------------------------------------------------------------------------
# The oracle: a tiny evaluator of the steps' arithmetic, written here, without eval().

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
}


def evaluate(expression: str) -> tuple[Fraction, list[Fraction]]:
    """The exact value of ``expression`` (numbers, + - * / // and parentheses only) and the
    numbers it is written with."""
    literals: list[Fraction] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            text = ast.get_source_segment(expression, node)
            assert text is not None and re.fullmatch(r"\d+(\.\d+)?", text), text
            literals.append(Fraction(text))
            return literals[-1]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return Fraction(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        raise AssertionError(f"not plain arithmetic: {ast.dump(node)} in {expression!r}")

    return walk(ast.parse(expression, mode="eval")), literals


def question_numbers(question: str) -> set[Fraction]:
    """Every number written in the question: 1,250 and 2.75 as one number each, 3/4 as 3 and 4."""
    found = re.findall(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?", question)
    return {Fraction(text.replace(",", "")) for text in found}


def check_worked_solution(problem: Problem) -> None:
    template = next(t for t in TEMPLATES if t.name == problem.template)
    stated = question_numbers(problem.question)
    known = {Fraction(c) for c in template.constants}
    assert set(template.constants) <= set(KNOWN_FACTS), template.name
    values: list[Fraction] = []
    used: set[Fraction] = set()
    for expression, value in problem.steps:
        exact, literals = evaluate(expression)
        assert exact == value, (problem.question, expression, value)
        assert value > 0, (problem.question, expression)
        hidden = [x for x in literals if x not in stated | set(values) | known]
        assert hidden == [], (problem.question, expression, hidden)
        used.update(literals)
        values.append(exact)
    assert values[-1] == problem.answer
    # The question states nothing the solution ignores (no stray or mistyped numbers).
    assert stated <= used | set(values), (problem.question, stated - used)
    if template.answer_kind == "integer":
        assert all(type(v) is int for _, v in problem.steps), problem.steps
        assert type(problem.answer) is int and problem.answer > 0
    elif template.answer_kind == "decimal":
        assert all((100 * Fraction(v)).denominator == 1 for _, v in problem.steps)


@settings(max_examples=30, deadline=None)
@given(seed=SEEDS, difficulty=st.sampled_from(DIFFICULTIES))
def test_every_template_writes_a_solution_that_reads_the_question(seed, difficulty):
    import random

    for template in TEMPLATES:
        problem = make_problem(template, random.Random(seed), difficulty)
        assert 2 <= problem.num_steps <= 6, (template.name, problem.num_steps)
        check_worked_solution(problem)


def test_the_oracle_catches_a_wrong_step_and_a_hidden_number():
    problem = generate_problems(1, seed=5)[0]
    expression, value = problem.steps[0]
    wrong = Problem(
        problem.id,
        problem.template,
        problem.question,
        problem.answer,
        ((expression, value + 1), *problem.steps[1:]),
    )
    with pytest.raises(AssertionError):
        check_worked_solution(wrong)
    hidden = Problem(
        problem.id,
        problem.template,
        problem.question,
        problem.answer,
        ((f"{value} * 9731 / 9731", value), *problem.steps[1:]),
    )
    with pytest.raises(AssertionError):
        check_worked_solution(hidden)
    with pytest.raises(AssertionError, match="not plain arithmetic"):
        evaluate("__import__('os')")
    assert evaluate("(7 + 5) // 5 * 2.5 - 1/4") == (
        Fraction(19, 4),
        [7, 5, 5, Fraction(5, 2), 1, 4],
    )


def test_steps_per_template_and_difficulty_are_fixed_and_more_at_higher_difficulty():
    """Each template takes a fixed number of steps at each difficulty (the table in
    docs/evaluation.md); difficulty never lowers it, and raises it for most templates."""
    import random

    steps = {
        (t.name, d): {make_problem(t, random.Random(s), d).num_steps for s in range(12)}
        for t in TEMPLATES
        for d in DIFFICULTIES
    }
    assert all(len(counts) == 1 for counts in steps.values()), steps
    grows = 0
    for t in TEMPLATES:
        (one,), (two,), (three,) = (steps[t.name, d] for d in DIFFICULTIES)
        assert 2 <= one <= two <= three <= 6, t.name
        grows += three > one
    assert grows >= 0.8 * len(TEMPLATES)
    assert len(TEMPLATES) >= 40 and len({t.name for t in TEMPLATES}) == len(TEMPLATES)


def test_docs_table_lists_every_template_with_its_steps():
    import pathlib
    import random

    text = (pathlib.Path(__file__).parents[2] / "docs/evaluation.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| (\d) / (\d) / (\d) \|", text, re.MULTILINE)
    table = {name: tuple(map(int, counts)) for name, *counts in rows}
    assert table == {
        t.name: tuple(make_problem(t, random.Random(0), d).num_steps for d in DIFFICULTIES)
        for t in TEMPLATES
    }


def test_numbers_grow_with_difficulty():
    def largest(difficulty):
        problems = generate_problems(3 * len(TEMPLATES), seed=1, difficulty=difficulty)
        return sum(max(Fraction(v) for _, v in p.steps) for p in problems)

    assert largest(1) < largest(2) < largest(3)


# ---------------------------------------------------------------------------------------------
# Generation


@settings(max_examples=10, deadline=None)
@given(seed=SEEDS, difficulty=st.sampled_from(DIFFICULTIES))
def test_generation_is_seeded_and_prefix_stable(seed, difficulty):
    problems = generate_problems(60, seed=seed, difficulty=difficulty)
    assert problems == generate_problems(60, seed=seed, difficulty=difficulty)
    assert problems[:17] == generate_problems(17, seed=seed, difficulty=difficulty)
    other = generate_problems(60, seed=seed + 1, difficulty=difficulty)
    assert sum(a.question != b.question for a, b in zip(problems, other, strict=True)) > 50
    assert len({p.id for p in problems}) == 60


def test_generation_cycles_fairly_over_every_template():
    num = len(TEMPLATES)
    problems = generate_problems(3 * num + 7, seed=3)
    for cycle in range(3):
        block = problems[cycle * num : (cycle + 1) * num]
        assert sorted(p.template for p in block) == sorted(t.name for t in TEMPLATES)
    counts = Counter(p.template for p in problems)
    assert set(counts.values()) == {3, 4} and sum(v == 4 for v in counts.values()) == 7
    # The order within a cycle is shuffled by the seed, so a small sample is not always the
    # same few templates.
    firsts = {tuple(p.template for p in generate_problems(5, seed=s)) for s in range(4)}
    assert len(firsts) == 4


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_two_hundred_problems_are_distinct_and_positive_integers_where_promised(difficulty):
    problems = generate_problems(200, seed=11, difficulty=difficulty)
    assert len({p.question for p in problems}) == 200
    kinds = {t.name: t.answer_kind for t in TEMPLATES}
    for p in problems:
        if kinds[p.template] == "integer":
            assert type(p.answer) is int and p.answer > 0
        else:
            assert isinstance(p.answer, int | Fraction) and p.answer > 0
    # The fraction template says its answer is a fraction, and it always is one.
    fractions = [p for p in problems if kinds[p.template] == "fraction"]
    assert fractions and all(isinstance(p.answer, Fraction) for p in fractions)


def test_a_repeated_question_is_redrawn_and_too_few_questions_are_refused(monkeypatch):
    import growpage.eval.maths as maths

    def four_questions(rng, difficulty):  # only four different questions to draw from
        k = rng.randint(1, 4)
        return f"What is {k} + {k}?", [(f"{k} + {k}", 2 * k), (f"{2 * k} * 1", 2 * k)]

    monkeypatch.setattr(maths, "TEMPLATES", (maths.Template("tiny", "test", four_questions),))
    problems = maths.generate_problems(4, seed=0)
    assert sorted(p.answer for p in problems) == [2, 4, 6, 8]
    with pytest.raises(ConfigError, match="cannot draw 5 distinct maths problems"):
        maths.generate_problems(5, seed=0)


def test_a_template_that_breaks_its_promises_is_a_bug_not_a_problem():
    import random

    import growpage.eval.maths as maths

    def negative(rng, difficulty):
        return "How much is 2 - 5, times 1?", [("2 - 5", -3), ("-3 * 1", -3)]

    def one_step(rng, difficulty):
        return "How much is 2 + 5?", [("2 + 5", 7)]

    def halves(rng, difficulty):
        return "Half of 5, plus 1?", [("5 / 2", Fraction(5, 2)), ("5 / 2 + 1", Fraction(7, 2))]

    for build, message in [(negative, "not positive"), (one_step, "1 steps"), (halves, "whole")]:
        with pytest.raises(RuntimeError, match=f"template bug in 'bad'.*{message}"):
            maths.make_problem(maths.Template("bad", "test", build), random.Random(0))


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ConfigError, match="difficulty must be one of"):
        generate_problems(3, difficulty=4)
    with pytest.raises(ConfigError, match="n must be"):
        generate_problems(-1)
    with pytest.raises(ConfigError, match="seed must be an integer"):
        generate_problems(2, seed="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no maths template named 'nope'"):
        import random

        make_problem("nope", random.Random(0))
    assert generate_problems(0) == []


def test_prompt_asks_for_steps_and_the_final_line():
    problem = generate_problems(1)[0]
    text = prompt(problem)
    assert text.startswith(problem.question) and "step by step" in text and "#### <number>" in text
    assert str(problem.answer) not in text.replace(problem.question, "")


# ---------------------------------------------------------------------------------------------
# Answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("So she pays 12 + 30 = 42 dollars.\n#### 42", 42),
        ("#### 7 is wrong, let me redo it.\n...\n#### 9", 9),  # the last #### counts
        ("#### Step 1\n3 * 4 = 12\n#### Step 2\n#### 12", 12),
        ("#### 1,234", 1234),
        ("#### 12,345,678.5", Fraction(24691357, 2)),
        ("#### $12", 12),
        ("#### $ 1,050.", 1050),
        ("#### 12.0", 12),
        ("#### 12.50 dollars", Fraction(25, 2)),
        ("#### -3", -3),
        ("#### $-3", -3),
        ("#### 3/4", Fraction(3, 4)),
        ("#### 6/8 of a cake", Fraction(3, 4)),
        ("#### .75", Fraction(3, 4)),
        ("#### 1 3/4 cakes", Fraction(7, 4)),
        ("#### 2 apples and 3/4 of a pie", 2),  # not a mixed number
        ("#### 1,2345", 1),  # a malformed group is not read as 12345
        ("#### 42.", 42),
        ("#### 42 apples", 42),
        ("#### 25%", 25),
        ("#### **42**", 42),
        ("####42", 42),
        ("#### \\boxed{12}", 12),
        ("#### \\frac{5}{2}", Fraction(5, 2)),
        ("The answer is \\boxed{12}.", 12),  # no #### at all: the last box
        ("\\(\\boxed{3}\\) then \\(\\boxed{\\frac{1}{5}}\\)", Fraction(1, 5)),
        ("\\[ \\boxed{3.67} \\]", Fraction(367, 100)),
        ("\\boxed{x = 5}", None),
        ("\\boxed{12}\n#### ", None),  # a #### with no number: the box before it is not read
        ("\\boxed{12}\n#### 13", 13),
        ("#### Final answer: 12", None),  # no number right after the last ####
        ("#### 12\n#### Summary", None),
        ("#### 3/0", None),
        ("The answer is 42.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    got = extract_answer(text)
    assert got == expected and type(got) is type(expected)


def test_answer_form_says_where_the_answer_was_found():
    from growpage.eval.maths import answer_form

    assert answer_form("so 3 * 4 = 12\n#### 12") == "####"
    assert answer_form("so \\(\\boxed{12}\\)") == "boxed"
    assert answer_form("\\boxed{12}\n#### done") is None
    assert answer_form("12") is None
    problems = [Problem(str(i), "t", "q", 12, (("3 * 4", 12), ("12 * 1", 12))) for i in range(3)]
    graded = score(problems, ["#### 12", "\\boxed{12}", "12"])
    assert [r.form for r in graded.records] == ["####", "boxed", None]
    assert [r.correct for r in graded.records] == [True, True, False]


def test_is_correct_is_an_exact_numeric_match():
    problem = Problem("p", "t", "q", 12, (("3 * 4", 12), ("12 * 1", 12)))
    half = Problem(
        "h", "t", "q", Fraction(3, 4), (("3 / 4", Fraction(3, 4)), ("1 - 1/4", Fraction(3, 4)))
    )
    assert is_correct(problem, "#### 12") and is_correct(problem, "#### 12.0")
    assert is_correct(problem, "#### $12.00.") and not is_correct(problem, "#### 12.5")
    assert not is_correct(problem, "12") and not is_correct(problem, "#### 121")
    assert is_correct(half, "#### 0.75") and is_correct(half, "#### 3/4")
    assert not is_correct(half, "#### 0.7") and not is_correct(half, "#### 3")
    assert format_number(Fraction(3, 4)) == "0.75" and format_number(Fraction(1, 3)) == "1/3"
    assert format_number(Fraction(-25, 2)) == "-12.5" and format_number(Fraction(8, 2)) == "4"


# ---------------------------------------------------------------------------------------------
# Scoring


@pytest.mark.parametrize(
    ("successes", "trials", "low", "high"),
    [
        # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I,
        # method 3 (score interval without continuity correction).
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
        # By hand: z = 1.959964; 8 of 10: centre (0.8 + 0.19207) / 1.38415 = 0.71677, half
        # 1.959964 / 1.38415 * sqrt(0.016 + 0.0096037) = 0.22660.
        (8, 10, 0.4902, 0.9433),
        (10, 10, 0.7225, 1.0),
    ],
)
def test_wilson_interval_matches_published_values(successes, trials, low, high):
    got = wilson_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-4)


def test_wilson_interval_properties_and_bad_input():
    low, high = wilson_interval(30, 60)
    assert low + high == pytest.approx(1.0) and low < 0.5 < high
    assert wilson_interval(30, 60, confidence=0.99)[0] < low  # wider at higher confidence
    assert wilson_interval(300, 600)[1] - wilson_interval(300, 600)[0] < high - low
    with pytest.raises(ConfigError, match="num_successes"):
        wilson_interval(5, 4)
    with pytest.raises(ConfigError, match="num_trials >= 1"):
        wilson_interval(0, 0)
    with pytest.raises(ConfigError, match="confidence"):
        wilson_interval(1, 2, confidence=1.5)


def test_score_counts_exact_answers_and_keeps_a_record_per_problem():
    problems = generate_problems(4, seed=2)
    outputs = [
        f"Working...\n#### {format_number(problems[0].answer)}",
        f"#### {problems[1].answer + 1}",
        "I think it is 7.",
        f"#### {format_number(problems[3].answer)} dollars\n",
    ]
    result = score(problems, outputs)
    assert (result.num_correct, result.num_problems, result.accuracy) == (2, 4, 0.5)
    assert result.interval == wilson_interval(2, 4)
    assert [r.correct for r in result.records] == [True, False, False, True]
    assert [r.extracted for r in result.records][1:3] == [problems[1].answer + 1, None]
    assert [r.id for r in result.records] == [p.id for p in problems]
    assert [r.template for r in result.records] == [p.template for p in problems]
    assert [r.expected for r in result.records] == [p.answer for p in problems]
    assert [r.num_output_chars for r in result.records] == [len(o) for o in outputs]
    as_json = result.to_dict()
    assert as_json["num_correct"] == 2 and as_json["records"][2]["extracted"] is None
    with pytest.raises(WorkloadError, match="4 problems but 3 outputs"):
        score(problems, outputs[:3])
    with pytest.raises(WorkloadError, match="no problems"):
        score([], [])


# ---------------------------------------------------------------------------------------------
# The docs and the command line


def test_docs_example_scores_a_model(capsys):
    import pathlib

    text = (pathlib.Path(__file__).parents[2] / "docs/evaluation.md").read_text()
    (example,) = [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]
    questions = {prompt(p): p for p in generate_problems(50, seed=0, difficulty=2)}

    def answer(message: str) -> str:  # right on the first 30 problems, silent on the rest
        problem = questions[message]
        right = int(problem.id.rsplit("-", 1)[1]) < 30
        return f"...\n#### {format_number(problem.answer)}" if right else "no idea"

    scope = {"answer": answer}
    exec(compile(example, "docs/evaluation.md", "exec"), scope)
    assert scope["result"].num_correct == 30
    low, high = wilson_interval(30, 50)
    assert capsys.readouterr().out == f"60.0%, 95% interval {low:.1%} to {high:.1%}\n"


def test_cli_shows_problems_with_their_worked_solutions(capsys):
    from growpage.cli import main

    assert main(["eval", "maths", "--show", "3", "--seed", "4", "--difficulty", "3"]) == 0
    out = capsys.readouterr().out
    problems = generate_problems(3, seed=4, difficulty=3)
    for problem in problems:
        assert f"[{problem.id}] {problem.template}, {problem.num_steps} steps" in out
        assert problem.question in out
        for i, (expression, value) in enumerate(problem.steps, 1):
            assert f"  {i}. {expression} = {format_number(value)}\n" in out
    assert out.count("####") == 3
    with pytest.raises(SystemExit):
        main(["eval", "maths", "--difficulty", "4"])
    assert "expected 1, 2 or 3" in capsys.readouterr().err
