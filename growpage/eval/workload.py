"""The evaluation workload: reasoning prompts and a retrieval task, written for this project.

``reasoning_prompts(n)`` gives chat-style prompts that ask for long step-by-step answers (the
engine policy table, trace recording). ``retrieval_items(n)`` gives prompts that place facts
at the start and then ask for a long explanation; after a long generated stretch the facts are
asked for, and the answer is scored by teacher forcing (``answer_spans`` + ``ScoreOutput``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs

# 48 prompts: arithmetic and algebra, logic, planning, explanation. Each asks for the steps.
_REASONING = [
    "A train leaves at 9:40 and the trip takes 2 hours 35 minutes. When does it arrive? "
    "Explain every step.",
    "Sara has 3 boxes with 14 apples each. She gives away 17 apples. How many are left? "
    "Show your reasoning step by step.",
    "What is 25% of 360, and what is 360 increased by 25%? Work it out carefully.",
    "A rectangle has a perimeter of 46 cm and one side of 9 cm. Find its area step by step.",
    "Solve for x: 3x + 7 = 2x + 19. Explain each step you take.",
    "Is 221 a prime number? Check it step by step and explain how you decided.",
    "A shop sells pens at 3 for 2 dollars. How much do 18 pens cost? Reason it through.",
    "Tom is twice as old as Ana. In 6 years their ages will add up to 48. How old is each now? "
    "Think step by step.",
    "Convert 3.75 hours into hours and minutes, then into seconds. Show the working.",
    "A recipe for 4 people uses 300 g of flour. How much flour is needed for 10 people? "
    "Explain the proportion.",
    "Find the sum of all whole numbers from 1 to 60 and explain the method you used.",
    "A car uses 6 litres of fuel per 100 km. How much fuel does a 420 km trip need? "
    "Explain step by step.",
    "Three friends split a bill of 87 dollars, and one of them pays 9 dollars more than each of "
    "the others. How much does each pay? Reason carefully.",
    "Which is larger, 7/9 or 11/14? Compare them step by step.",
    "A tank fills in 6 hours with one pipe and in 3 hours with another. How long with both "
    "pipes open? Work through it.",
    "List the first ten square numbers and explain the pattern in the differences between them.",
    "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain the "
    "logic step by step.",
    "Anna, Ben and Chloe each own one pet: a cat, a dog or a fish. Ben does not own the cat, and "
    "Chloe owns the fish. Who owns which pet? Explain your reasoning.",
    "Five people shake hands with each other exactly once. How many handshakes are there? "
    "Explain two different ways to count them.",
    "A clock shows 3:15. What is the angle between the hour and minute hands? Work it out.",
    "You have a 3-litre jug and a 5-litre jug. How can you measure exactly 4 litres? "
    "Describe each step.",
    "A farmer has chickens and cows, 30 heads and 74 legs in total. How many of each? "
    "Solve it step by step.",
    "Explain why the sum of two odd numbers is always even, using a clear argument.",
    "What day of the week is 100 days after a Tuesday? Show how you figured it out.",
    "Plan a study schedule for a student who has four exams in two weeks. Explain the "
    "reasoning behind each choice.",
    "Describe, step by step, how to make a cup of tea, and explain why each step matters.",
    "Explain how you would sort a list of ten numbers by hand, and walk through an example.",
    "Plan a three-day trip to a city you have never visited. Explain how you decide what to "
    "do each day.",
    "A class has 28 students and the ratio of boys to girls is 3:4. How many girls are there? "
    "Explain the ratio step by step.",
    "Explain how a thermostat keeps a room at a steady temperature, step by step.",
    "Estimate how many minutes a person sleeps in one year. Explain each assumption.",
    "Compare walking and cycling to work for a 5 km trip. Reason through time, cost and health.",
    "A number doubled and then decreased by 8 gives 30. What is the number? Show each step.",
    "Explain why dividing by a fraction is the same as multiplying by its reciprocal, with an "
    "example.",
    "How many different three-letter codes can be made from the letters A, B, C and D without "
    "repeating a letter? Explain the counting.",
    "A bag has 4 red and 6 blue marbles. What is the chance of drawing two red marbles in a "
    "row without putting the first back? Work it out.",
    "Explain the steps to find the greatest common divisor of 84 and 126.",
    "A price rises by 10% and then falls by 10%. Is it back where it started? Explain why.",
    "Describe how water moves through the water cycle, one stage at a time.",
    "You are organizing a bake sale. Plan what to bake, how much, and how to price it. "
    "Explain your reasoning.",
    "Explain step by step how to check whether a year is a leap year, and test it on 1900, "
    "2000 and 2024.",
    "A snail climbs 3 metres up a 10 metre wall each day and slides back 2 metres each night. "
    "On which day does it reach the top? Reason it through.",
    "Explain how compound interest works, and compute 1000 dollars at 5% for 3 years step by step.",
    "Write out the steps to convert the binary number 101101 to decimal, and explain each one.",
    "Explain how you would find a lost item in a house, planning the search step by step.",
    "A runner runs 400 m laps in 92 seconds each. How long does 5 km take? Show the working.",
    "Explain why the angles of a triangle add up to 180 degrees, step by step.",
    "Compare two phone plans: 20 dollars a month plus 5 cents a minute, or 35 dollars with "
    "unlimited minutes. When is each cheaper? Reason it out.",
]
assert len(_REASONING) == 48

_OBJECTS = [
    "umbrella",
    "lantern",
    "notebook",
    "kettle",
    "compass",
    "scarf",
    "violin",
    "basket",
    "helmet",
    "teapot",
    "blanket",
    "camera",
]
_COLORS = [
    "red",
    "blue",
    "green",
    "yellow",
    "purple",
    "orange",
    "black",
    "white",
    "silver",
    "brown",
]
_NAMES = ["Mira", "Jonas", "Priya", "Tomas", "Leila", "Oscar", "Ines", "Kenji", "Nadia", "Felix"]
_CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Hanoi", "Quito", "Dublin", "Perth", "Tunis", "Riga"]
_TASKS = [
    "Now explain in detail, step by step, how a library could organize its books so that "
    "visitors find them quickly.",
    "Now describe in detail, step by step, how to plan a garden that has flowers all year.",
    "Now explain in detail, step by step, how a small bakery could reduce its food waste.",
    "Now describe in detail, step by step, how to teach someone to ride a bicycle.",
    "Now explain in detail, step by step, how a school could organize a science fair.",
    "Now describe in detail, step by step, how to prepare for a long hiking trip.",
]


def reasoning_prompts(n: int = 48) -> list[str]:
    """``n`` chat prompts asking for step-by-step answers (cycling through the 48 written ones)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [_REASONING[i % len(_REASONING)] for i in range(n)]


@attrs.frozen
class RetrievalItem:
    """Facts first, then a long task; ``questions`` are asked after the generated stretch.

    Each question is ``(question text, answer prefix, answer)``: the continuation ends with
    ``question + answer prefix + answer``, and the answer's tokens are what is scored.
    """

    prompt: str
    questions: tuple[tuple[str, str, str], ...]


def retrieval_items(
    n: int, seed: int = 0, num_facts: int = 6, num_questions: int = 2
) -> list[RetrievalItem]:
    """``n`` retrieval prompts with ``num_facts`` facts each, ``num_questions`` of them asked."""
    if n < 1 or not 1 <= num_questions <= num_facts <= len(_OBJECTS):
        raise ValueError(
            f"need n >= 1 and 1 <= num_questions <= num_facts <= {len(_OBJECTS)}; "
            f"got n={n}, num_facts={num_facts}, num_questions={num_questions}"
        )
    rng = random.Random(seed)
    items = []
    for i in range(n):
        objects = rng.sample(_OBJECTS, num_facts)
        facts, questions = [], []
        for j, obj in enumerate(objects):
            kind = (i + j) % 3
            if kind == 0:
                color = rng.choice(_COLORS)
                facts.append(f"The {obj} in room {j + 2} is {color}.")
                qa = (
                    f"What color is the {obj} in room {j + 2}?",
                    f"The {obj} in room {j + 2} is",
                    f" {color}",
                )
            elif kind == 1:
                name = rng.choice(_NAMES)
                facts.append(f"The {obj} belongs to {name}.")
                qa = (f"Who does the {obj} belong to?", f"The {obj} belongs to", f" {name}")
            else:
                city = rng.choice(_CITIES)
                facts.append(f"The {obj} was bought in {city}.")
                qa = (f"Where was the {obj} bought?", f"The {obj} was bought in", f" {city}")
            questions.append(qa)
        asked = rng.sample(questions, num_questions)
        prompt = (
            "Remember these facts, you will be asked about them later.\n"
            + "\n".join(f"- {f}" for f in facts)
            + "\n\n"
            + _TASKS[i % len(_TASKS)]
        )
        items.append(RetrievalItem(prompt=prompt, questions=tuple(asked)))
    return items


def retrieval_continuation(
    encode: Callable[[str], list[int]], stretch: Sequence[int], item: RetrievalItem
) -> tuple[list[int], list[tuple[int, int]]]:
    """The forced continuation of ``item`` after a generated ``stretch`` of token ids.

    Returns the token ids (stretch, then each question and its answer) and, per question, the
    ``[start, stop)`` span of the answer's tokens in them. ``encode`` is the tokenizer's
    ``encode`` without special tokens; every piece is encoded on its own, so spans are exact.
    """
    ids = list(stretch)
    spans = []
    for question, prefix, answer in item.questions:
        ids += encode(f"\n\nQuestion: {question}\nAnswer: {prefix}")
        answer_ids = encode(answer)
        if not answer_ids:
            raise ValueError(f"answer {answer!r} encodes to no tokens")
        spans.append((len(ids), len(ids) + len(answer_ids)))
        ids += answer_ids
    return ids, spans
