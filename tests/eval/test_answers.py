"""One scorer for the maths task and the benchmarks, on hand-written model outputs: the form the
prompt asks for is read first (``####`` for the maths task, ``\\boxed{}`` for the benchmarks),
a box holds one number alone, and ``score`` grades both kinds of problem alike."""

from __future__ import annotations

from fractions import Fraction

import pytest

from growpage.eval.answers import answer_form, extract_answer, read_answer
from growpage.eval.datasets import BenchmarkProblem
from growpage.eval.maths import Problem, is_correct, score

# A Qwen2.5-style solution to a MATH-500 problem, the final answer boxed in display maths.
QWEN_DIVISORS = r"""To find the number of positive divisors of \(196\), we start with its prime
factorization:
\[
196 = 2^2 \times 7^2
\]
A divisor is \(2^a 7^b\) with \(0 \le a \le 2\) and \(0 \le b \le 2\), so there are
\((2 + 1)(2 + 1) = 9\) choices.

Therefore, the number of positive whole-number divisors of 196 is \(\boxed{9}\)."""

# A box early on (an intermediate result) and the final one later: the last counts.
QWEN_TWO_BOXES = r"""First, the area of one equilateral triangle is \(\boxed{\frac{\sqrt{3}}{4}s^2}\)
where \(s\) is the side. The perimeter of one triangle is \(3s = 21\), so \(s = 7\).
The hexagon's perimeter is \(6s\):
\[
6 \times 7 = 42
\]
**Final Answer**
\[
\boxed{42}
\]"""

# GSM8K's own style: the worked solution, then "#### <answer>" with a thousands comma.
GSM8K_STYLE = """Josh buys the house for $80,000 and spends $50,000 on repairs: 80,000 + 50,000 =
<<80000+50000=130000>>130,000 dollars.
The value rises by 150%: 80,000 * 1.5 = <<80000*1.5=120000>>120,000, so it is worth
120,000 + 80,000 = <<120000+80000=200000>>200,000.
His profit is 200,000 - 130,000 = <<200000-130000=70000>>70,000.
#### 70,000"""

# A reasoning trace cut at the token limit: no final answer at all.
CUT_SHORT = r"""Let the speed be \(s\) km/h. The walk takes \(\frac{9}{s}\) hours, so
\[
\frac{9}{s} + \frac{t}{60} = 4 \quad\text{and}\quad \frac{9}{s+2} + \frac{t}{60} = 2.4 .
\]
Subtracting, \(\frac{9}{s} - \frac{9}{s+2} = 1.6\), which gives"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (QWEN_DIVISORS, 9),
        (QWEN_TWO_BOXES, 42),
        (GSM8K_STYLE, 70000),  # no box: the #### answer
        (CUT_SHORT, None),
        ("So she pays \\boxed{1,450,000} dollars.", 1450000),
        ("\\boxed{1{,}450{,}000}", 1450000),  # LaTeX's thousands separator
        ("\\boxed{18.00}", 18),
        ("\\boxed{\\$18}", 18),
        ("$\\boxed{\\$18.50}$", Fraction(37, 2)),
        ("\\boxed{12\\%}", 12),
        ("\\boxed{30^\\circ}", 30),
        ("\\boxed{18 \\text{ dollars}}", 18),
        ("\\boxed{\\text{18 dollars}}", 18),
        ("\\boxed{12\\,\\text{km/h}}", 12),
        ("\\boxed{49 \\text{ m}^2}", 49),
        ("\\boxed{\\textbf{7}}", 7),
        ("\\boxed{-50}", -50),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
        ("\\boxed{\\dfrac{1}{2}}", Fraction(1, 2)),
        ("\\boxed{\\tfrac{6}{8}}", Fraction(3, 4)),
        ("\\boxed{\\frac34}", Fraction(3, 4)),
        ("\\boxed{-\\frac{5}{2}}", Fraction(-5, 2)),
        ("\\boxed{1\\frac{2}{3}}", Fraction(5, 3)),  # a mixed number
        ("\\boxed{3/4}", Fraction(3, 4)),
        ("\\boxed{0.75}", Fraction(3, 4)),
        ("\\boxed {204}", 204),
        ("\\boxed{{204}}", 204),
        ("The answer is \\boxed{113", 113),  # cut inside the box
        # A box holds one number alone: an equation, an expression or a list is no answer.
        ("\\boxed{x = 5}", None),
        ("\\boxed{3\\sqrt{2}}", None),  # not 3
        ("\\boxed{2^{10}}", None),
        ("\\boxed{\\frac{3}{4}\\pi}", None),
        ("\\boxed{600 \\times 1.05}", None),
        ("\\boxed{3, 4}", None),
        ("\\boxed{5x}", None),
        ("\\boxed{\\frac{1}{0}}", None),
        ("\\boxed{}", None),
        ("no answer here, 42", None),
    ],
)
def test_a_benchmark_output_is_read_from_its_last_box(text, expected):
    got = extract_answer(text, prefer="boxed")
    assert got == expected and type(got) is type(expected)


def test_each_form_is_read_first_where_its_prompt_asks_for_it():
    both = "\\boxed{12}\n#### 13"
    assert read_answer(both, prefer="####") == (13, "####")
    assert read_answer(both, prefer="boxed") == (12, "boxed")
    # A marker of the preferred form without a number is no answer, whatever the other says.
    assert read_answer("\\boxed{12}\n#### done", prefer="####") == (None, None)
    assert read_answer("#### 12\nso \\boxed{x = 12}", prefer="boxed") == (None, None)
    # Only a text with no marker of the preferred form falls back to the other form.
    assert answer_form(GSM8K_STYLE, prefer="boxed") == "####"
    assert answer_form(QWEN_DIVISORS, prefer="####") == "boxed"
    assert answer_form(CUT_SHORT, prefer="boxed") is None
    with pytest.raises(ValueError, match="prefer must be one of"):
        extract_answer("#### 1", prefer="last")


def test_the_maths_task_reads_boxes_by_the_same_rule():
    problem = Problem("p", "t", "q", 12, (("3 * 4", 12), ("12 * 1", 12)))
    assert is_correct(problem, "So the total is \\(\\boxed{12}\\).")
    assert not is_correct(problem, "\\boxed{12 \\times 1}")  # an expression, not read as 12
    assert is_correct(problem, "\\boxed{12.0}") and is_correct(problem, "#### \\boxed{12}")


def test_score_grades_benchmark_and_maths_problems_alike():
    problems = [
        BenchmarkProblem("math500-0003", "math500", "How many divisors does 196 have?", 9),
        BenchmarkProblem("math500-0005", "math500", "Hexagon perimeter?", 42),
        BenchmarkProblem("gsm8k-0002", "gsm8k", "Josh flips a house...", 70000),
        BenchmarkProblem("aime24-0000", "aime24", "Aya walks...", 204),
        Problem("maths-0", "bake_sale", "q", 238, (("56 * 6", 336), ("336 - 98", 238))),
    ]
    outputs = [QWEN_DIVISORS, QWEN_TWO_BOXES.replace("{42}", "{41}"), GSM8K_STYLE, CUT_SHORT]
    outputs.append("\\boxed{200}\nSo the profit is 238 dollars.\n#### 238")
    graded = score(problems, outputs)
    assert (graded.num_correct, graded.num_problems) == (3, 5)
    rows = [(r.id, r.template, r.expected, r.extracted, r.correct, r.form) for r in graded.records]
    assert rows == [
        ("math500-0003", "math500", 9, 9, True, "boxed"),
        ("math500-0005", "math500", 42, 41, False, "boxed"),
        ("gsm8k-0002", "gsm8k", 70000, 70000, True, "####"),
        ("aime24-0000", "aime24", 204, None, False, None),
        ("maths-0", "bake_sale", 238, 238, True, "####"),
    ]
    assert graded.to_dict()["records"][0]["template"] == "math500"  # type: ignore[index]
