"""Reading a model's final answer: the number after the last ``####``, or the last ``\\boxed{}``.

One rule serves the generated maths task and the benchmarks. A problem names the form its
prompt asks for (``prefer``: ``"####"`` for the maths task, ``"boxed"`` for the benchmarks); the
last answer of that form is read, and only a text with no marker of that form at all is read in
the other form. A marker of the preferred form that holds no number is no answer, whatever the
text says before it::

    #### 1,234                        -> 1234     (the number right after the last ####)
    ... \\boxed{\\dfrac{3}{4}} ...       -> 3/4      (the whole box: a number, maybe with units)
    \\boxed{3\\sqrt{2}}                 -> None     (an expression is not a number)

The two forms are read differently. After ``####`` the number that comes first counts and
anything after it is ignored (``#### 42 apples.``), as GSM8K's solutions are written. A box
must hold one number alone: ``$``, ``%``, degrees, LaTeX spacing and ``\\text{}`` wrappers are
dropped, unit words after a space are allowed (``\\boxed{18 \\text{ dollars}}``), anything else
(``x = 5``, ``2^{10}``, ``3, 4``, ``\\frac{3}{4}\\pi``) makes the box no answer.
"""

from __future__ import annotations

import re
from fractions import Fraction

from growpage.eval.maths_templates import Number, normal

__all__ = ["FORMS", "answer_form", "extract_answer", "read_answer"]

#: The answer forms a prompt may ask for, as ``answer_form`` names them.
FORMS = ("####", "boxed")

_MARK = re.compile(r"#{4,}")
_BOXED = re.compile(r"\\boxed\s*\{")

# The number right after ``####``: markdown and LaTeX openers skipped, anything after it ignored.
_AFTER_MARK = re.compile(
    r"""(?:\s|\*|_|\$|\\\$|\\\(|\\\[|\\boxed\{|\\text(?:bf)?\{|\{)*   # space, markdown, LaTeX
    (?P<sign>[-\N{MINUS SIGN}])?\s*(?:\\?\$)?\s*
    (?:\\d?frac\{(?P<fnum>\d+)\}\{(?P<fden>\d+)\}                 # \frac{3}{4}
      |(?P<num>\d{1,3}(?:,\d{3})+(?!\d)|\d+)
       (?:[ \t]+(?P<mnum>\d+)/(?P<mden>\d+)                     # 1 3/4
         |(?P<dec>\.\d+)?(?:\s*/\s*(?P<den>\d+))?)              # 1,234.5 or 3/4
      |(?P<bare>\.\d+))                                                       # .75
    """,
    re.VERBOSE,
)

# A box's whole content once tidied (``_tidy_box``): one number, then unit words or nothing.
_BOX_NUMBER = re.compile(
    r"""(?P<sign>-)?\s*
    (?:\\frac\{(?P<fnum>\d+)\}\{(?P<fden>\d+)\}                   # \frac{3}{4}
      |(?P<num>\d{1,3}(?:,\d{3})+(?!\d)|\d+)
       (?:\s*\\frac\{(?P<mnum>\d+)\}\{(?P<mden>\d+)\}           # 1\frac{3}{4}
         |[ \t]+(?P<snum>\d+)/(?P<sden>\d+)                     # 1 3/4
         |(?P<dec>\.\d+)?(?:\s*/\s*(?P<den>\d+))?)              # 1,234.5 or 3/4
      |(?P<bare>\.\d+))                                         # .75
    (?:\s+[A-Za-z]+(?:[ /.-]+[A-Za-z]+)*(?:\^\{?[23]\}?)?)?       # 18 dollars, 12 km/h, 9 m^2
    \s*\.?\s*""",
    re.VERBOSE,
)
# What a box may hold around its number, dropped before it is read.
_BOX_NOISE = re.compile(
    r"\\[$%]|[$%\N{DEGREE SIGN}~]|\^\s*\{?\\circ\}?|\\circ|\\[,;:! ]|\\left|\\right"
)
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def extract_answer(text: str, prefer: str = "####") -> Number | None:
    """The final answer of ``text``: the last answer in the form ``prefer`` (``"####"`` or
    ``"boxed"``), or, when the text holds no marker of that form at all, the last answer in
    the other form; None when the marker read gives no number (the module's docstring gives
    the rules of each form)."""
    return read_answer(text, prefer)[0]


def answer_form(text: str, prefer: str = "####") -> str | None:
    """Where ``extract_answer`` found the answer: ``"####"``, ``"boxed"``, or ``None``."""
    return read_answer(text, prefer)[1]


def read_answer(text: str, prefer: str = "####") -> tuple[Number | None, str | None]:
    """``(extract_answer(text, prefer), answer_form(text, prefer))`` in one pass."""
    if prefer not in FORMS:
        raise ValueError(f"prefer must be one of {FORMS}, got {prefer!r}")
    marks = list(_MARK.finditer(text))
    boxes = list(_BOXED.finditer(text))
    if marks and (prefer == "####" or not boxes):
        value = _after_mark(text, marks[-1].end())
        return (value, "####") if value is not None else (None, None)
    if boxes:
        value = _box(text, boxes[-1].end())
        return (value, "boxed") if value is not None else (None, None)
    return None, None


def _after_mark(text: str, start: int) -> Number | None:
    m = _AFTER_MARK.match(text, start)
    if m is None:
        return None
    if m["fnum"] is not None:
        return _value(m["sign"], m["fnum"], m["fden"])
    if m["bare"] is not None:
        return _value(m["sign"], "0" + m["bare"])
    return _value(m["sign"], m["num"] + (m["dec"] or ""), m["den"], m["mnum"], m["mden"])


def _box(text: str, start: int) -> Number | None:
    """The number a box holds, its content running from ``start`` to its closing brace (or to
    the end of a text cut short inside it); None unless it holds one number alone."""
    depth, end = 0, start
    while end < len(text) and (text[end] != "}" or depth > 0):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        end += 1
    m = _BOX_NUMBER.fullmatch(_tidy_box(text[start:end]))
    if m is None:
        return None
    if m["fnum"] is not None:
        return _value(m["sign"], m["fnum"], m["fden"])
    if m["bare"] is not None:
        return _value(m["sign"], "0" + m["bare"])
    whole = m["num"] + (m["dec"] or "")
    return _value(m["sign"], whole, m["den"], m["mnum"] or m["snum"], m["mden"] or m["sden"])


def _tidy_box(content: str) -> str:
    """A box's content with its LaTeX decoration gone: ``\\dfrac`` as ``\\frac``, ``\\frac34``
    as ``\\frac{3}{4}``, ``1{,}234`` as ``1,234``, ``\\text{ km}`` as `` km``; ``$``, ``%``,
    degrees and spacing commands removed."""
    content = re.sub(r"\\[dt]frac", r"\\frac", content)
    content = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", content)
    content = content.replace("{,}", ",").replace("\N{MINUS SIGN}", "-")
    for _ in range(3):  # \text{\textbf{12}}: nested wrappers, innermost first
        content = _TEXT.sub(r" \1", content)
    content = _BOX_NOISE.sub("", content)
    if content.strip().startswith("{") and content.strip().endswith("}"):
        content = content.strip()[1:-1]  # \boxed{{12}}
    return content.strip()


def _value(
    sign: str | None,
    num: str,
    den: str | None = None,
    mixed_num: str | None = None,
    mixed_den: str | None = None,
) -> Number | None:
    """``sign (num / den + mixed_num / mixed_den)`` exactly; None for a zero denominator."""
    if den is not None and int(den) == 0 or mixed_den is not None and int(mixed_den) == 0:
        return None
    value = Fraction(num.replace(",", "")) / int(den or 1)
    if mixed_num is not None and mixed_den is not None:
        value += Fraction(int(mixed_num), int(mixed_den))
    return normal(-value if sign else value)
