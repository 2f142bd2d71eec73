"""The templates of the maths task (``growpage.eval.maths``): grade-school word problems.

A template is a function ``build(rng, difficulty) -> (question, steps)`` registered with
``@_template(topic, ...)``. It draws names, items and numbers from ``rng`` so that every step's
value is a positive whole number (or whole cents, or a fraction, where the template says so),
and writes each step as the arithmetic a person would do: ``w("12 * 3", 12 * 3)`` records the
expression and returns its value. Steps use only numbers of the question, values of earlier
steps and the template's ``constants`` (60 minutes in an hour, ...); tests/eval/test_maths.py
re-evaluates every step with its own evaluator and checks that.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import NamedTuple, TypeVar

import attrs

Number = int | Fraction
Step = tuple[str, Number]  # (arithmetic expression, its exact value), e.g. ("12 * 3", 36)
N = TypeVar("N", int, Fraction)

ANSWER_KINDS = ("integer", "decimal", "fraction")


@attrs.frozen
class Template:
    """A family of word problems. ``build(rng, difficulty)`` returns the question and the steps.

    ``answer_kind``: "integer" (every value a whole number), "decimal" (values in cents, such as
    12.75) or "fraction". ``constants``: facts the steps may use that the question does not
    state (60 minutes in an hour, 100 for a percentage, 2 for "twice")."""

    name: str
    topic: str
    build: Callable[[random.Random, int], tuple[str, list[Step]]] = attrs.field(repr=False)
    answer_kind: str = attrs.field(default="integer", validator=attrs.validators.in_(ANSWER_KINDS))
    constants: tuple[int, ...] = ()


_TEMPLATES: list[Template] = []
_Build = Callable[[random.Random, int], "tuple[str, _Work]"]


def _template(
    topic: str, answer_kind: str = "integer", constants: tuple[int, ...] = ()
) -> Callable[[_Build], _Build]:
    def add(build: _Build) -> _Build:
        def run(rng: random.Random, difficulty: int) -> tuple[str, list[Step]]:
            question, work = build(rng, difficulty)
            return question, work.steps

        _TEMPLATES.append(Template(build.__name__, topic, run, answer_kind, constants))
        return build

    return add


class _Work:
    """The worked solution as it is written: ``w("3 * 4", 3 * 4)`` records a step, returns 12."""

    def __init__(self) -> None:
        self.steps: list[Step] = []

    def __call__(self, expression: str, value: N) -> N:
        self.steps.append((expression, normal(value)))
        return value


def normal(value: Number) -> Number:
    """A whole ``Fraction`` as an ``int``; anything else as it is."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return int(value)
    return value


def _div(a: int, b: int) -> int:
    """``a / b`` for a template that drew its numbers so that it divides exactly."""
    if b <= 0 or a % b:
        raise RuntimeError(f"maths template bug: {a} / {b} is not a whole number")
    return a // b


def _tries(limit: int = 10_000) -> Iterator[int]:
    """Rejection sampling for a template's numbers; a template that never fits is a bug."""
    yield from range(limit)
    raise RuntimeError("maths template bug: no numbers fit after 10,000 draws")


class _Person(NamedTuple):
    name: str
    they: str
    their: str

    @property
    def They(self) -> str:  # the pronoun to start a sentence
        return self.they.capitalize()


_PEOPLE = [
    _Person(name, *("she", "her") if i % 2 == 0 else ("he", "his"))
    for i, name in enumerate(
        "Maya Leo Amara Kenji Sofia Omar Priya Lucas Zara Mateo Chloe Tariq Ingrid Diego Aisha "
        "Felix Nadia Samir Elena Kofi Hana Jonas Lucia Ravi Mei Oscar Fatima Theo Grace Yusuf".split()
    )
]
_GOODS = (
    "notebooks pens apples oranges candles mugs pencils stickers lemons socks bowls plates "
    "towels batteries buttons postcards".split()
)
_FOODS = (
    ("coffee", "coffees"),
    ("muffin", "muffins"),
    ("sandwich", "sandwiches"),
    ("juice", "juices"),
    ("bagel", "bagels"),
    ("cookie", "cookies"),
    ("tea", "teas"),
    ("salad", "salads"),
)
_FRACTIONS = ((1, 2), (1, 3), (2, 3), (1, 4), (3, 4), (1, 5), (2, 5), (3, 5), (3, 8), (5, 6))
_PERCENTS = (5, 10, 15, 20, 25, 30, 40, 50, 60, 75)


def _people(rng: random.Random, k: int) -> list[_Person]:
    return rng.sample(_PEOPLE, k)


def _n(x: int) -> str:
    """An integer as a question writes it: 1,250."""
    return f"{x:,}"


def _usd(x: Number) -> str:
    if isinstance(x, int):
        return f"${x:,}"
    cents = int(x * 100)
    return f"${cents // 100:,}.{cents % 100:02d}"


def _plural(num: int, word: str) -> str:
    return f"{_n(num)} {word}" if num == 1 else f"{_n(num)} {word}s"


def _a(num: int) -> str:
    """The article before a number: "an 80-page book", "a 120-page book"."""
    return "an" if str(num).startswith("8") or num in (11, 18) else "a"


def _frac(a: int, b: int) -> str:
    return f"{a}/{b}"


def _join(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _bill(total: Number) -> int:
    return next(b for b in (10, 20, 50, 100, 200, 500, 1000, 2000) if b > total)


def format_number(x: Number) -> str:
    """An exact number as text: ``12``, ``12.75`` (a decimal when it ends), else ``3/7``."""
    x = normal(x)
    if isinstance(x, int):
        return str(x)
    den = x.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den != 1:
        return f"{x.numerator}/{x.denominator}"
    places = 0
    while (x * 10**places).denominator != 1:
        places += 1
    sign, mag = ("-" if x < 0 else ""), abs(x)
    scaled = int(mag * 10**places)
    return f"{sign}{scaled // 10**places}.{scaled % 10**places:0{places}d}"


# ---------------------------------------------------------------------------------------------
# Shopping


@_template("shopping")
def shopping_total(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    costs, parts = [], []
    for item in rng.sample(_GOODS, 2 if d == 1 else 3):
        qty, price = rng.randint(2, 3 + 2 * d), rng.randint(2, 4 + 4 * d)
        costs.append(w(f"{qty} * {price}", qty * price))
        parts.append(f"{qty} {item} at {_usd(price)} each")
    total = w(" + ".join(map(str, costs)), sum(costs))
    q = f"{p.name} buys {_join(parts)}."
    if d < 3:
        return f"{q} How many dollars does {p.they} spend?", w
    bill = _bill(total)
    w(f"{bill} - {total}", bill - total)
    return (
        f"{q} {p.They} pays with a {_usd(bill)} note. How many dollars of change does {p.they} get?",
        w,
    )


@_template("shopping")
def change_from_note(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    items = rng.sample(_GOODS, 1 if d == 1 else 2)
    costs, parts = [], []
    for item in items:
        qty, price = rng.randint(2, 4 * d + 2), rng.randint(2, 5 * d + 3)
        costs.append(w(f"{qty} * {price}", qty * price))
        parts.append(f"{qty} {item} that cost {_usd(price)} each")
    total = costs[0] if d == 1 else w(f"{costs[0]} + {costs[1]}", sum(costs))
    q = f"At the market {p.name} picks {_join(parts)}."
    if d == 3:
        coupon = rng.randint(2, min(15, total - 1))
        total = w(f"{total} - {coupon}", total - coupon)
        q += f" A coupon takes {_usd(coupon)} off the total."
    bill = _bill(total)
    w(f"{bill} - {total}", bill - total)
    return (
        f"{q} {p.They} pays with a {_usd(bill)} note. How many dollars of change does {p.they} get?",
        w,
    )


@_template("shopping")
def packs_needed(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    kinds = rng.sample(
        ("paper cups", "paper plates", "napkins", "balloons", "party hats"), 1 if d == 1 else 2
    )
    costs, needs, packs = [], [], []
    for what in kinds:
        size, num_packs, price = (
            rng.choice((4, 5, 6, 8, 10, 12)),
            rng.randint(2, 4 * d + 2),
            rng.randint(2, 3 * d + 4),
        )
        need = size * num_packs
        bought = w(f"{need} / {size}", _div(need, size))
        costs.append(w(f"{bought} * {price}", bought * price))
        needs.append(f"{_n(need)} {what}")
        packs.append(f"{what} come in packs of {size} for {_usd(price)} a pack")
    q = f"For a party {p.name} needs {_join(needs)}. {_join(packs).capitalize()}."
    if d == 1:
        return f"{q} How many dollars does {p.they} spend?", w
    total = w(f"{costs[0]} + {costs[1]}", sum(costs))
    if d == 2:
        return f"{q} How many dollars does {p.they} spend in all?", w
    bill = _bill(total)
    w(f"{bill} - {total}", bill - total)
    return (
        f"{q} {p.They} pays with a {_usd(bill)} note. How many dollars of change does {p.they} get?",
        w,
    )


@_template("shopping")
def spend_the_rest(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    first, second, last = rng.sample(_GOODS, 3)
    a, pa = rng.randint(2, 3 * d + 2), rng.randint(2, 4 * d + 2)
    b, pb = rng.randint(2, 3 * d + 2), rng.randint(2, 4 * d + 2)
    count, price = rng.randint(2, 5 * d + 3), rng.randint(2, 3 * d + 3)
    spent = [w(f"{a} * {pa}", a * pa)]
    parts = [f"{a} {first} at {_usd(pa)} each"]
    if d == 3:
        spent.append(w(f"{b} * {pb}", b * pb))
        parts.append(f"{b} {second} at {_usd(pb)} each")
    money = sum(spent) + count * price
    rest = w(f"{money} - " + " - ".join(map(str, spent)), money - sum(spent))
    w(f"{rest} / {price}", _div(rest, price))
    return (
        f"{p.name} has {_usd(money)}. {p.They} buys {_join(parts)}, then spends all the money "
        f"left on {last} that cost {_usd(price)} each. How many {last} does {p.they} buy?",
        w,
    )


@_template("shopping")
def bake_sale(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    item = rng.choice(("muffins", "cupcakes", "brownies", "cookies", "pies"))
    for _ in _tries():
        made, cost, price = (
            rng.randint(10, 30 * d),
            rng.randint(1, 2 * d + 1),
            rng.randint(2, 3 * d + 3),
        )
        unsold, fee = rng.randint(2, 3 + 2 * d), rng.randint(3, 8 * d)
        sold = made - unsold if d >= 2 else made
        if price > cost and sold * price - made * cost - (fee if d == 3 else 0) > 0:
            break
    spent = w(f"{made} * {cost}", made * cost)
    q = f"{p.name} bakes {made} {item} for a bake sale. Each costs {_usd(cost)} to make and sells for {_usd(price)}."
    if d >= 2:
        sold = w(f"{made} - {unsold}", made - unsold)
        q += f" {unsold} {item} are not sold."
    income = w(f"{sold} * {price}", sold * price)
    profit = w(f"{income} - {spent}", income - spent)
    if d == 3:
        w(f"{profit} - {fee}", profit - fee)
        q += f" The stall costs {_usd(fee)} to rent."
    return f"{q} How many dollars of profit does {p.name} make?", w


@_template("shopping", answer_kind="decimal")
def cafe_order(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    costs, prices, orders = [], [], []
    for food, foods in rng.sample(_FOODS, 2 if d == 1 else 3):
        price, qty = Fraction(rng.randint(5, 19), 4), rng.randint(2, 2 + 2 * d)
        costs.append(w(f"{format_number(price)} * {qty}", price * qty))
        prices.append(f"a {food} costs {_usd(price)}")
        orders.append(f"{qty} {foods}")
    total = w(" + ".join(format_number(c) for c in costs), sum(costs, Fraction(0)))
    q = f"At a cafe {_join(prices)}. {p.name} orders {_join(orders)}."
    if d < 3:
        return f"{q} How many dollars does the order cost?", w
    bill = _bill(total)
    w(f"{bill} - {format_number(total)}", bill - total)
    return (
        f"{q} {p.They} pays with a {_usd(bill)} note. How many dollars of change does {p.they} get?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Percentages


@_template("percentages", constants=(100,))
def sale_price(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    item = rng.choice(("jacket", "lamp", "backpack", "chair", "bicycle helmet", "rug", "kettle"))
    for _ in _tries():
        price, off, more, qty = (
            20 * rng.randint(2, 10 * d),
            rng.choice(_PERCENTS[:-1]),
            rng.choice(_PERCENTS[:6]),
            rng.randint(2, 4),
        )
        sale = price - price * off // 100
        if price * off % 100 == 0 and (d < 3 or sale * more % 100 == 0):
            break
    cut = w(f"{price} * {off} / 100", _div(price * off, 100))
    sale = w(f"{price} - {cut}", price - cut)
    q = f"A {item} costs {_usd(price)}. It is on sale for {off}% off."
    if d == 3:
        extra = w(f"{sale} * {more} / 100", _div(sale * more, 100))
        sale = w(f"{sale} - {extra}", sale - extra)
        q += f" At the till a further {more}% is taken off the sale price."
    if d == 1:
        return f"{q} How many dollars does {p.name} pay for it?", w
    w(f"{sale} * {qty}", sale * qty)
    return f"{q} {p.name} buys {qty} of them. How many dollars does {p.they} pay?", w


@_template("percentages", constants=(100,))
def price_changes(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    item = rng.choice(
        ("a train ticket", "a bag of rice", "a concert ticket", "a bus pass", "a box of tea")
    )
    changes = [("rises", 1)] + [("falls", -1), ("rises", 1)][: d - 1]
    for _ in _tries():
        price, rates = 20 * rng.randint(2, 15 * d), [rng.choice(_PERCENTS[:6]) for _ in changes]
        value, ok = price, True
        for (_, sign), rate in zip(changes, rates, strict=True):
            ok = ok and value * rate % 100 == 0
            value += sign * value * rate // 100
        if ok:
            break
    value, told = price, []
    for (verb, sign), rate in zip(changes, rates, strict=True):
        change = w(f"{value} * {rate} / 100", _div(value * rate, 100))
        value = w(f"{value} {'+' if sign > 0 else '-'} {change}", value + sign * change)
        told.append(f"{verb} by {rate}%")
    first, *later = told
    q = f"The price of {item} is {_usd(price)}. In March it {first}."
    if later:
        q += " Then it " + ", and after that it ".join(later) + "."
    return f"{q} What is the price now, in dollars?", w


@_template("percentages", constants=(100,))
def percent_group(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        total, walk, bus = 20 * rng.randint(2, 6 * d), rng.choice(_PERCENTS), rng.choice(_PERCENTS)
        rest = total - total * walk // 100
        if (
            total * walk % 100 == 0
            and walk < 100
            and (d == 1 or (rest * bus % 100 == 0 and bus < 100))
        ):
            break
    walkers = w(f"{total} * {walk} / 100", _div(total * walk, 100))
    rest = w(f"{total} - {walkers}", total - walkers)
    q = f"A school has {_n(total)} students. {walk}% of them walk to school."
    if d == 1:
        return f"{q} How many students do not walk to school?", w
    riders = w(f"{rest} * {bus} / 100", _div(rest * bus, 100))
    w(f"{rest} - {riders}", rest - riders)
    return f"{q} Of the others, {bus}% come by bus and the rest cycle. How many students cycle?", w


@_template("percentages", constants=(100,))
def test_score(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        num, pct, gain, loss = (
            rng.choice((20, 25, 40, 50)) * d,
            rng.choice(_PERCENTS[2:]),
            rng.randint(2, 5),
            rng.randint(1, 2),
        )
        right = num * pct // 100
        if num * pct % 100 == 0 and right < num and right * gain > (num - right) * loss:
            break
    right = w(f"{num} * {pct} / 100", _div(num * pct, 100))
    points = w(f"{right} * {gain}", right * gain)
    q = f"A quiz has {num} questions and each correct answer earns {gain} points. {p.name} answers {pct}% of the questions correctly."
    if d == 1:
        return f"{q} How many points does {p.they} earn?", w
    wrong = w(f"{num} - {right}", num - right)
    lost = w(f"{wrong} * {loss}", wrong * loss)
    w(f"{points} - {lost}", points - lost)
    return (
        f"{q} Each of the other answers is wrong and loses {_plural(loss, 'point')}. What is {p.their} final score?",
        w,
    )


@_template("percentages", constants=(100,))
def simple_interest(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        deposit, rate, years = (
            100 * rng.randint(2, 20 * d),
            rng.randint(2, 8),
            rng.randint(2, 2 + 2 * d),
        )
        if deposit * rate % 100 == 0:
            break
    yearly = w(f"{deposit} * {rate} / 100", _div(deposit * rate, 100))
    interest = w(f"{yearly} * {years}", yearly * years)
    q = f"{p.name} puts {_usd(deposit)} in a savings account that pays {rate}% simple interest each year."
    if d == 1:
        return f"{q} How many dollars of interest does {p.they} earn in {years} years?", w
    w(f"{deposit} + {interest}", deposit + interest)
    return f"{q} How many dollars are in the account after {years} years?", w


@_template("percentages", constants=(100,))
def restaurant_tip(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        bill, tip, diners = (
            10 * rng.randint(4, 20 * d),
            rng.choice((10, 15, 20, 25)),
            rng.randint(2, 3 + 2 * d),
        )
        if bill * tip % 100 == 0 and (d == 1 or (bill + bill * tip // 100) % diners == 0):
            break
    added = w(f"{bill} * {tip} / 100", _div(bill * tip, 100))
    total = w(f"{bill} + {added}", bill + added)
    q = f"A dinner bill is {_usd(bill)} and the diners add a {tip}% tip."
    if d == 1:
        return f"{q} How many dollars do they pay in all?", w
    w(f"{total} / {diners}", _div(total, diners))
    return f"{q} The {diners} diners split the total equally. How many dollars does each pay?", w


@_template("percentages", constants=(100,))
def sales_commission(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        base, rate = 100 * rng.randint(8, 20), rng.choice((2, 4, 5, 8, 10))
        sales = [100 * rng.randint(10, 50 * d) for _ in range(1 if d == 1 else d)]
        if sum(sales) * rate % 100 == 0:
            break
    total = sales[0] if d == 1 else w(" + ".join(map(str, sales)), sum(sales))
    earned = w(f"{total} * {rate} / 100", _div(total * rate, 100))
    w(f"{base} + {earned}", base + earned)
    weeks = ["in the first week", "in the second week", "in the third week"][: len(sales)]
    sold = (
        _join([f"{_usd(s)} {when}" for s, when in zip(sales, weeks, strict=True)])
        if d > 1
        else f"{_usd(sales[0])}"
    )
    return (
        f"{p.name} earns {_usd(base)} a month plus {rate}% of {p.their} sales. This month {p.they} "
        f"sells {sold}. How many dollars does {p.they} earn this month?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Rates, speeds and distances


@_template("rates")
def unit_price(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    item = rng.choice(("mangoes", "pencils", "eggs", "bread rolls", "stamps", "tulips"))
    each, known, wanted = rng.randint(2, 4 * d + 2), rng.randint(2, 6), rng.randint(7, 5 * d + 10)
    unit = w(f"{known * each} / {known}", _div(known * each, known))
    cost = w(f"{unit} * {wanted}", unit * wanted)
    q = f"{known} {item} cost {_usd(known * each)}. {p.name} buys {wanted} {item} at the same price each."
    if d == 1:
        return f"{q} How many dollars does {p.they} pay?", w
    bill = _bill(cost)
    w(f"{bill} - {cost}", bill - cost)
    return (
        f"{q} {p.They} pays with a {_usd(bill)} note. How many dollars of change does {p.they} get?",
        w,
    )


@_template("distances")
def trip_distance(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    legs = [
        (rng.randint(2, 4 + d), 5 * rng.randint(6, 12 + 2 * d)) for _ in range(2 if d == 1 else 3)
    ]
    parts = [w(f"{hours} * {speed}", hours * speed) for hours, speed in legs]
    total = w(" + ".join(map(str, parts)), sum(parts))
    said = [f"{hours} hours at {speed} km per hour" for hours, speed in legs]
    q = f"{p.name} drives for {_join(said)}."
    if d < 3:
        return f"{q} How many kilometres does {p.they} drive?", w
    trip = total + 10 * rng.randint(3, 30)
    w(f"{trip} - {total}", trip - total)
    return (
        f"{p.name} is on a {_n(trip)} km trip. {p.They} drives for {_join(said)}. How many kilometres are left?",
        w,
    )


@_template("distances", constants=(60,))
def travel_minutes(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    stop = rng.randint(5, 25)
    legs = []
    for _ in range(1 if d < 3 else 2):
        for _ in _tries():
            dist, speed = rng.randint(3, 20 * d), rng.choice((8, 9, 10, 12, 15, 16, 18, 20, 24, 30))
            if dist * 60 % speed == 0 and dist * 60 // speed > 10:
                break
        legs.append((dist, speed))
    times = []
    for dist, speed in legs:
        scaled = w(f"{dist} * 60", dist * 60)
        times.append(w(f"{scaled} / {speed}", _div(scaled, speed)))
    said = [f"{dist} km at {speed} km per hour" for dist, speed in legs]
    if d == 1:
        return f"{p.name} cycles {said[0]}. How many minutes does the ride take?", w
    w(" + ".join(map(str, times)) + f" + {stop}", sum(times) + stop)
    return (
        f"{p.name} cycles {' and then '.join(said)}, with a {stop}-minute rest on the way. "
        "How many minutes does the whole trip take?",
        w,
    )


@_template("distances")
def average_speed(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        legs = [(rng.randint(1, 3 + d), 5 * rng.randint(6, 14)) for _ in range(2 if d < 3 else 3)]
        if (
            sum(h * s for h, s in legs) % sum(h for h, _ in legs) == 0
            and len({s for _, s in legs}) > 1
        ):
            break
    if d == 1:
        dist = w(" + ".join(str(h * s) for h, s in legs), sum(h * s for h, s in legs))
        said = [f"{h * s} km in {_plural(h, 'hour')}" for h, s in legs]
    else:
        parts = [w(f"{h} * {s}", h * s) for h, s in legs]
        dist = w(" + ".join(map(str, parts)), sum(parts))
        said = [f"{_plural(h, 'hour')} at {s} km per hour" for h, s in legs]
    hours = w(" + ".join(str(h) for h, _ in legs), sum(h for h, _ in legs))
    w(f"{dist} / {hours}", _div(dist, hours))
    verb = "drives" if d == 1 else "drives for"
    return (
        f"{p.name} {verb} {', then '.join(said)}. What is {p.their} average speed for the whole "
        "drive, in km per hour?",
        w,
    )


@_template("rates", constants=(2,))
def fuel_for_trip(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    rate, dist, price = rng.randint(4, 9), 100 * rng.randint(2, 4 * d + 2), rng.randint(2, 3)
    q = f"{p.name}'s car uses {rate} litres of fuel per 100 km."
    if d == 3:
        dist = w(f"{dist} * 2", dist * 2)
        q += f" {p.They} drives to a town {_n(dist // 2)} km away and back."
    else:
        q += f" {p.They} drives {_n(dist)} km."
    hundreds = w(f"{dist} / 100", _div(dist, 100))
    litres = w(f"{hundreds} * {rate}", hundreds * rate)
    if d == 1:
        return f"{q} How many litres of fuel does the car use?", w
    w(f"{litres} * {price}", litres * price)
    return f"{q} Fuel costs {_usd(price)} a litre. How many dollars does the fuel cost?", w


@_template("rates")
def reading_days(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        per_day, days, later = (
            rng.randint(8, 10 * d + 10),
            rng.randint(3, 8),
            rng.randint(10, 10 * d + 20),
        )
        pages = per_day * days + later * rng.randint(2, 4 + d)
        if later != per_day:
            break
    read = w(f"{per_day} * {days}", per_day * days)
    left = w(f"{pages} - {read}", pages - read)
    q = f"A book has {_n(pages)} pages. {p.name} reads {per_day} pages a day for {days} days."
    if d == 1:
        return f"{q} How many pages are left to read?", w
    w(f"{left} / {later}", _div(left, later))
    return (
        f"{q} Then {p.they} reads {later} pages a day. How many more days does {p.they} need to finish the book?",
        w,
    )


@_template("rates")
def filling_tank(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        (a, b), size, flow = (
            rng.choice(_FRACTIONS),
            10 * rng.randint(6, 40 * d),
            rng.randint(3, 5 * d + 5),
        )
        empty = size - size * a // b
        if size * a % b == 0 and empty % flow == 0:
            break
    water = w(f"{size} * {a} / {b}", _div(size * a, b))
    empty = w(f"{size} - {water}", size - water)
    q = f"A water tank holds {_n(size)} litres and is {_frac(a, b)} full."
    if d == 1:
        return f"{q} How many more litres fit in the tank?", w
    w(f"{empty} / {flow}", _div(empty, flow))
    return (
        f"{q} A pump adds {flow} litres a minute. How many minutes does it take to fill the tank?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Ages


@_template("ages")
def ages_sum(rng: random.Random, d: int) -> tuple[str, _Work]:
    a, b, c, e = _people(rng, 4)
    w = _Work()
    age, times, younger, older = (
        rng.randint(3, 6 + 2 * d),
        rng.randint(2, 3 + d),
        rng.randint(2, 5),
        rng.randint(2, 9),
    )
    b_age = w(f"{age} * {times}", age * times)
    c_age = w(f"{b_age} - {younger}", b_age - younger)
    q = f"{a.name} is {age} years old. {b.name} is {times} times as old as {a.name}. {c.name} is {younger} years younger than {b.name}."
    if d == 1:
        return f"{q} How old is {c.name}?", w
    if d == 2:
        w(f"{age} + {b_age} + {c_age}", age + b_age + c_age)
        return f"{q} What is the sum of their three ages?", w
    e_age = w(f"{c_age} + {older}", c_age + older)
    w(f"{age} + {b_age} + {c_age} + {e_age}", age + b_age + c_age + e_age)
    return (
        f"{q} {e.name} is {older} years older than {c.name}. What is the sum of their four ages?",
        w,
    )


@_template("ages")
def ages_back_then(rng: random.Random, d: int) -> tuple[str, _Work]:
    a, b = _people(rng, 2)
    w = _Work()
    gap, now = rng.randint(3, 10 * d + 5), rng.randint(10, 15 * d + 12)
    then = rng.randint(2, now - 2)
    b_now = w(f"{now} + {gap}", now + gap)
    ago = w(f"{now} - {then}", now - then)
    w(f"{b_now} - {ago}", b_now - ago)
    return (
        f"{a.name} is {now} years old and {b.name} is {gap} years older. How old was {b.name} when {a.name} was {then}?",
        w,
    )


@_template("ages")
def ages_in_future(rng: random.Random, d: int) -> tuple[str, _Work]:
    a, b = _people(rng, 2)
    w = _Work()
    age, times, later = rng.randint(3, 8 + 2 * d), rng.randint(2, 4), rng.randint(2, 5 * d + 5)
    b_age = w(f"{age} * {times}", age * times)
    q = f"{a.name} is {age} years old and {b.name} is {times} times as old."
    if d == 1:
        w(f"{b_age} + {later}", b_age + later)
        return f"{q} How old will {b.name} be in {later} years?", w
    a_then = w(f"{age} + {later}", age + later)
    b_then = w(f"{b_age} + {later}", b_age + later)
    w(f"{a_then} + {b_then}", a_then + b_then)
    return f"{q} What will the sum of their ages be in {later} years?", w


# ---------------------------------------------------------------------------------------------
# Fractions of a quantity


@_template("fractions")
def fraction_spent(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    uses = rng.sample(
        ("a book", "a gift", "lunch", "a game", "a plant", "bus fares", "a poster"), d
    )
    for _ in _tries():
        money, fracs = 10 * rng.randint(3, 30 * d), [rng.choice(_FRACTIONS) for _ in uses]
        left, ok = money, True
        for a, b in fracs:
            ok = ok and left * a % b == 0 and left * a // b < left
            left -= left * a // b
        if ok:
            break
    left, said = money, []
    for i, ((a, b), use) in enumerate(zip(fracs, uses, strict=True)):
        spent = w(f"{left} * {a} / {b}", _div(left * a, b))
        left = w(f"{left} - {spent}", left - spent)
        said.append(f"{_frac(a, b)} of {'it' if i == 0 else 'what is left'} on {use}")
    return f"{p.name} has {_usd(money)}. {p.They} spends " + ", then ".join(
        said
    ) + ". How many dollars are left?", w


@_template("fractions")
def fraction_of_guests(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    (a, b), gift, adult_gift = rng.choice(_FRACTIONS), rng.randint(2, 3 + d), rng.randint(1, 3)
    guests = b * rng.randint(2, 6 * d)
    adults = w(f"{guests} * {a} / {b}", _div(guests * a, b))
    kids = w(f"{guests} - {adults}", guests - adults)
    q = f"{_n(guests)} guests come to a picnic, and {_frac(a, b)} of them are adults. The rest are children."
    if d == 1:
        return f"{q} How many children come?", w
    sweets = w(f"{kids} * {gift}", kids * gift)
    if d == 2:
        return f"{q} Each child gets {gift} sweets. How many sweets are given out?", w
    grown = w(f"{adults} * {adult_gift}", adults * adult_gift)
    w(f"{sweets} + {grown}", sweets + grown)
    return (
        f"{q} Each child gets {gift} sweets and each adult gets {adult_gift}. How many sweets are given out?",
        w,
    )


@_template("fractions")
def pizza_slices(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        pizzas, slices, (a, b), friends = (
            rng.randint(2, 3 * d + 2),
            rng.choice((6, 8, 10, 12)),
            rng.choice(_FRACTIONS),
            rng.randint(2, 6),
        )
        total = pizzas * slices
        if total * a % b == 0 and (d == 1 or (total - total * a // b) % friends == 0):
            break
    total = w(f"{pizzas} * {slices}", pizzas * slices)
    eaten = w(f"{total} * {a} / {b}", _div(total * a, b))
    left = w(f"{total} - {eaten}", total - eaten)
    q = f"There are {pizzas} pizzas, each cut into {slices} slices. At lunch {_frac(a, b)} of the slices are eaten."
    if d == 1:
        return f"{q} How many slices are left?", w
    w(f"{left} / {friends}", _div(left, friends))
    return (
        f"{q} The slices left are shared equally by {friends} friends. How many slices does each friend get?",
        w,
    )


@_template("fractions")
def fraction_compare(rng: random.Random, d: int) -> tuple[str, _Work]:
    a, b = _people(rng, 2)
    w = _Work()
    for _ in _tries():
        (n1, d1), (n2, d2) = rng.choice(_FRACTIONS), rng.choice(_FRACTIONS)
        p1, p2 = 40 * rng.randint(2, 4 * d + 3), 40 * rng.randint(2, 4 * d + 3)
        if p1 * n1 % d1 == 0 and p2 * n2 % d2 == 0 and p1 * n1 // d1 > p2 * n2 // d2:
            break
    first = w(f"{p1} * {n1} / {d1}", _div(p1 * n1, d1))
    second = w(f"{p2} * {n2} / {d2}", _div(p2 * n2, d2))
    w(f"{first} - {second}", first - second)
    return (
        f"{a.name} reads {_frac(n1, d1)} of {_a(p1)} {p1}-page book. {b.name} reads "
        f"{_frac(n2, d2)} of {_a(p2)} {p2}-page book. How many more pages does {a.name} read than {b.name}?",
        w,
    )


@_template("fractions", answer_kind="fraction")
def cake_shares(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        morning, afternoon, kept, people = (
            rng.randint(2, 4 * d + 2),
            rng.randint(2, 5),
            rng.randint(1, 3),
            rng.randint(3, 4 + 2 * d),
        )
        baked = morning + (afternoon if d > 1 else 0)
        if baked > kept and (baked - kept) % people:
            break
    if d > 1:
        baked = w(f"{morning} + {afternoon}", morning + afternoon)
        q = f"{p.name} bakes {morning} cakes in the morning and {afternoon} in the afternoon."
    else:
        q = f"{p.name} bakes {baked} cakes."
    rest = w(f"{baked} - {kept}", baked - kept)
    w(f"{rest} / {people}", Fraction(rest, people))
    return (
        f"{q} {p.They} keeps {kept} and shares the rest equally among {people} neighbours. How "
        "much cake does each neighbour get? Give the answer as a fraction of a cake.",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Unit conversion


@_template("units", constants=(60,))
def practice_hours(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    hobby = rng.choice(("the piano", "the violin", "chess", "football", "drawing", "swimming"))
    for _ in _tries():
        minutes, days, extra, weekend = (
            5 * rng.randint(4, 6 + 3 * d),
            rng.randint(3, 6 * d),
            5 * rng.randint(6, 18),
            rng.randint(2, 4 * d),
        )
        if (minutes * days + (extra * weekend if d > 1 else 0)) % 60 == 0:
            break
    total = w(f"{minutes} * {days}", minutes * days)
    q = f"{p.name} practises {hobby} for {minutes} minutes a day on {days} days."
    if d > 1:
        more = w(f"{extra} * {weekend}", extra * weekend)
        total = w(f"{total} + {more}", total + more)
        q += f" {p.They} also has {weekend} longer sessions of {extra} minutes each."
    w(f"{total} / 60", _div(total, 60))
    return f"{q} How many hours does {p.they} practise in all?", w


@_template("units", constants=(1000,))
def running_km(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        track, laps, days = (
            rng.choice((200, 250, 400, 500)),
            rng.randint(4, 6 * d + 6),
            rng.randint(3, 4 * d),
        )
        if track * laps * (days if d > 1 else 1) % 1000 == 0:
            break
    metres = w(f"{track} * {laps}", track * laps)
    q = f"A running track is {track} metres around. {p.name} runs {laps} laps a day"
    if d > 1:
        metres = w(f"{metres} * {days}", metres * days)
        q += f" for {days} days. How many kilometres does {p.they} run in all?"
    else:
        q += f". How many kilometres does {p.they} run each day?"
    w(f"{metres} / 1000", _div(metres, 1000))
    return q, w


@_template("units", constants=(1000,))
def flour_kilograms(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        grams, bags, price = (
            rng.choice((250, 400, 500, 750, 800)),
            rng.randint(4, 8 * d + 4),
            rng.randint(2, 3 + d),
        )
        if grams * bags % 1000 == 0:
            break
    total = w(f"{grams} * {bags}", grams * bags)
    kilos = w(f"{total} / 1000", _div(total, 1000))
    q = f"{p.name} buys {bags} bags of flour with {grams} grams in each bag."
    if d == 1:
        return f"{q} How many kilograms of flour does {p.they} buy?", w
    w(f"{kilos} * {price}", kilos * price)
    return (
        f"{q} The flour is priced at {_usd(price)} per kilogram. How many dollars does {p.they} pay?",
        w,
    )


@_template("units", constants=(1000,))
def bottle_glasses(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    drink = rng.choice(("lemonade", "orange juice", "iced tea", "apple juice", "water"))
    litres, glass, bottles = rng.randint(1, 3), rng.choice((125, 200, 250)), rng.randint(2, 4 * d)
    ml = w(f"{litres} * 1000", litres * 1000)
    if d == 1:
        w(f"{ml} / {glass}", _div(ml, glass))
        unit = "litre" if litres == 1 else "litres"
        return (
            f"A bottle holds {litres} {unit} of {drink}. How many glasses of {glass} ml can be filled from it?",
            w,
        )
    ml = w(f"{ml} * {bottles}", ml * bottles)
    w(f"{ml} / {glass}", _div(ml, glass))
    unit = "litre" if litres == 1 else "litres"
    return (
        f"There are {bottles} bottles of {drink}, each holding {litres} {unit}. How many glasses of {glass} ml can be filled?",
        w,
    )


@_template("units", constants=(7, 10))
def plant_growth(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    plant = rng.choice(("bean plant", "sunflower", "bamboo shoot", "tomato plant", "vine"))
    for _ in _tries():
        weeks, rate, start = (
            rng.randint(2, 2 + 2 * d),
            rng.randint(2, 5 * d + 5),
            rng.randint(5, 30),
        )
        if d == 1 or weeks * 7 * rate % 10 == 0:
            break
    days = w(f"{weeks} * 7", weeks * 7)
    grown = w(f"{days} * {rate}", days * rate)
    q = f"A {plant} grows {rate} millimetres every day."
    if d == 1:
        return f"{q} How many millimetres does it grow in {weeks} weeks?", w
    cm = w(f"{grown} / 10", _div(grown, 10))
    if d == 2:
        return f"{q} How many centimetres does it grow in {weeks} weeks?", w
    w(f"{start} + {cm}", start + cm)
    return (
        f"A {plant} is {start} centimetres tall and grows {rate} millimetres every day. How tall is it after {weeks} weeks, in centimetres?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Work and time


@_template("work")
def packing_together(rng: random.Random, d: int) -> tuple[str, _Work]:
    crew = _people(rng, 2 if d < 3 else 3)
    w = _Work()
    for _ in _tries():
        rates = [rng.randint(3, 6 * d + 6) for _ in crew]
        alone, hours = rng.randint(1, 3), rng.randint(2, 3 + 2 * d)
        head = rates[0] * alone if d > 1 else 0
        if len(set(rates)) == len(rates):
            break
    boxes = head + sum(rates) * hours
    said = _join([f"{c.name} packs {r} boxes an hour" for c, r in zip(crew, rates, strict=True)])
    names = _join([c.name for c in crew])
    if d == 1:
        both = w(f"{rates[0]} + {rates[1]}", sum(rates))
        w(f"{boxes} / {both}", _div(boxes, both))
        return (
            f"{said}. Working together, how many hours do {names} take to pack {_n(boxes)} boxes?",
            w,
        )
    done = w(f"{rates[0]} * {alone}", head)
    left = w(f"{boxes} - {done}", boxes - done)
    all_rate = w(" + ".join(map(str, rates)), sum(rates))
    w(f"{left} / {all_rate}", _div(left, all_rate))
    hour = "hour" if alone == 1 else "hours"
    return (
        f"{said}. They must pack {_n(boxes)} boxes. {crew[0].name} works alone for the first "
        f"{alone} {hour}, then {names} all work together. How many hours do they work together?",
        w,
    )


@_template("work")
def workers_days(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    job = rng.choice(
        ("paint a school", "build a wall", "pick an orchard", "tile a pool", "fix a road")
    )
    for _ in _tries():
        workers, days, others, jobs = (
            rng.randint(2, 4 * d + 2),
            rng.randint(2, 5 * d + 3),
            rng.randint(2, 4 * d + 4),
            rng.randint(2, 4),
        )
        if others != workers and workers * days * (jobs if d > 1 else 1) % others == 0:
            break
    effort = w(f"{workers} * {days}", workers * days)
    q = f"{workers} workers take {days} days to {job}. All workers work at the same rate."
    if d == 1:
        w(f"{effort} / {others}", _div(effort, others))
        return f"{q} How many days would {others} workers take to {job}?", w
    effort = w(f"{effort} * {jobs}", effort * jobs)
    w(f"{effort} / {others}", _div(effort, others))
    return f"{q} How many days would {others} workers take to do this {jobs} times over?", w


@_template("work", constants=(2,))
def shift_pay(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    hours, days, rate, extra = (
        rng.randint(3, 8),
        rng.randint(3, 3 * d + 3),
        rng.randint(8, 8 * d + 10),
        rng.randint(2, 6),
    )
    worked = w(f"{hours} * {days}", hours * days)
    pay = w(f"{worked} * {rate}", worked * rate)
    q = f"{p.name} earns {_usd(rate)} an hour and works {hours} hours a day for {days} days."
    if d == 1:
        return f"{q} How many dollars does {p.they} earn?", w
    double = w(f"{rate} * 2", rate * 2)
    bonus = w(f"{extra} * {double}", extra * double)
    w(f"{pay} + {bonus}", pay + bonus)
    return (
        f"{q} {p.They} also works {extra} hours of overtime, paid at twice the hourly rate. How many dollars does {p.they} earn in all?",
        w,
    )


@_template("work")
def bus_stops(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    riders = rng.randint(10, 20 * d + 20)
    said, count = [], riders
    for stop in ("first", "second", "third")[:d]:
        off, on = rng.randint(1, count - 1), rng.randint(1, 8 * d + 4)
        count = w(f"{count} - {off}", count - off)
        count = w(f"{count} + {on}", count + on)
        said.append(f"At the {stop} stop {off} get off and {on} get on.")
    return (
        f"A bus leaves the depot with {riders} passengers. {' '.join(said)} How many passengers are on the bus now?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Sharing


@_template("sharing")
def share_marbles(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        bags, per_bag, kept, friends = (
            rng.randint(2, 3 * d + 3),
            rng.randint(6, 10 * d + 10),
            rng.randint(2, 9),
            rng.randint(2, 3 + 2 * d),
        )
        pool = bags * per_bag - (kept if d > 1 else 0)
        if pool > 0 and pool % friends == 0:
            break
    total = w(f"{bags} * {per_bag}", bags * per_bag)
    q = f"{p.name} has {bags} bags with {per_bag} marbles in each."
    if d > 1:
        total = w(f"{total} - {kept}", total - kept)
        q += f" {p.They} keeps {kept} marbles and shares the rest equally among {friends} friends."
    else:
        q += f" {p.They} shares them equally among {friends} friends."
    w(f"{total} / {friends}", _div(total, friends))
    return f"{q} How many marbles does each friend get?", w


@_template("sharing")
def share_by_ratio(rng: random.Random, d: int) -> tuple[str, _Work]:
    crew = _people(rng, 2 if d == 1 else 3)
    w = _Work()
    parts = rng.sample(range(1, 8), len(crew))
    unit_value = 5 * rng.randint(2, 10 * d)
    money = sum(parts) * unit_value
    shares = ":".join(map(str, parts))
    q = f"{_join([c.name for c in crew])} share {_usd(money)} in the ratio {shares}."
    total = w(" + ".join(map(str, parts)), sum(parts))
    unit = w(f"{money} / {total}", _div(money, total))
    if d == 1:
        big = max(range(2), key=lambda i: parts[i])
        w(f"{unit} * {parts[big]}", unit * parts[big])
        return f"{q} How many dollars does {crew[big].name} get?", w
    hi, lo = max(range(3), key=lambda i: parts[i]), min(range(3), key=lambda i: parts[i])
    most = w(f"{unit} * {parts[hi]}", unit * parts[hi])
    least = w(f"{unit} * {parts[lo]}", unit * parts[lo])
    w(f"{most} - {least}", most - least)
    return f"{q} How many more dollars does {crew[hi].name} get than {crew[lo].name}?", w


@_template("sharing")
def share_leftover(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        bags, per_bag, kids = (
            rng.randint(2, 5),
            rng.randint(8, 10 * d + 10),
            rng.randint(3, 4 * d + 5),
        )
        candies = bags * per_bag
        if candies % kids and candies > kids:
            break
    if d == 1:
        q = f"A teacher has {candies} candies for {kids} children."
    else:
        candies = w(f"{bags} * {per_bag}", candies)
        q = f"A teacher has {bags} bags of {per_bag} candies for {kids} children."
    each = w(f"{candies} // {kids}", candies // kids)
    given = w(f"{each} * {kids}", each * kids)
    w(f"{candies} - {given}", candies - given)
    return (
        f"{q} Every child gets the same whole number of candies, as many as possible, and the "
        "teacher keeps the candies left over. How many candies does the teacher keep?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Recipes


@_template("recipes")
def recipe_scale(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    servings, wanted = rng.randint(2, 6), rng.randint(3, 6 * d + 6)
    flour, sugar = 10 * servings * rng.randint(2, 8), 5 * servings * rng.randint(1, 6)
    while wanted == servings:
        wanted += 1
    per = w(f"{flour} / {servings}", _div(flour, servings))
    need = w(f"{per} * {wanted}", per * wanted)
    if d == 1:
        return (
            f"A recipe for {servings} servings uses {flour} grams of flour. How many grams of flour does {p.name} need for {wanted} servings?",
            w,
        )
    per_sugar = w(f"{sugar} / {servings}", _div(sugar, servings))
    sweet = w(f"{per_sugar} * {wanted}", per_sugar * wanted)
    w(f"{need} + {sweet}", need + sweet)
    return (
        f"A recipe for {servings} servings uses {flour} grams of flour and {sugar} grams of sugar. "
        f"{p.name} makes {wanted} servings. How many grams of flour and sugar together does {p.they} use?",
        w,
    )


@_template("recipes")
def cookie_batches(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        per_batch, eggs, batches, box = (
            rng.randint(8, 30),
            rng.randint(2, 4),
            rng.randint(2, 4 * d + 2),
            rng.choice((6, 10, 12)),
        )
        if d == 1 or eggs * batches % box == 0:
            break
    cookies = per_batch * batches
    made = w(f"{cookies} / {per_batch}", _div(cookies, per_batch))
    used = w(f"{made} * {eggs}", made * eggs)
    q = f"One batch of cookies makes {per_batch} cookies and needs {eggs} eggs. {p.name} wants to bake {cookies} cookies."
    if d == 1:
        return f"{q} How many eggs does {p.they} need?", w
    w(f"{used} / {box}", _div(used, box))
    return f"{q} Eggs come in boxes of {box}. How many boxes of eggs does {p.they} use?", w


@_template("recipes")
def cake_cost(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    flour, flour_price, sugar, sugar_price = (
        rng.randint(2, 5),
        rng.randint(1, 3 * d),
        rng.randint(1, 3),
        rng.randint(2, 3 * d + 1),
    )
    cakes = rng.randint(2, 4 * d)
    a = w(f"{flour} * {flour_price}", flour * flour_price)
    b = w(f"{sugar} * {sugar_price}", sugar * sugar_price)
    one = w(f"{a} + {b}", a + b)
    cup = "cup" if sugar == 1 else "cups"
    q = f"A cake needs {flour} cups of flour at {_usd(flour_price)} a cup and {sugar} {cup} of sugar at {_usd(sugar_price)} a cup."
    if d == 1:
        return f"{q} How many dollars do the flour and sugar for one cake cost?", w
    w(f"{one} * {cakes}", one * cakes)
    return f"{q} {p.name} bakes {cakes} cakes. How many dollars do the flour and sugar cost?", w


# ---------------------------------------------------------------------------------------------
# Distances


@_template("distances", constants=(2,))
def map_distance(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    for _ in _tries():
        cm, scale, speed = (
            rng.randint(2, 4 * d + 4),
            rng.choice((5, 10, 15, 20, 25)),
            rng.choice((30, 40, 50, 60, 75, 80)),
        )
        if cm * scale * (2 if d > 1 else 1) % speed == 0:
            break
    km = w(f"{cm} * {scale}", cm * scale)
    q = f"On a map, each centimetre stands for {scale} km. Two towns are {cm} cm apart on the map."
    if d > 1:
        km = w(f"{km} * 2", km * 2)
        q += f" {p.name} drives from one town to the other and back at {speed} km per hour."
    else:
        q += f" {p.name} drives from one town to the other at {speed} km per hour."
    w(f"{km} / {speed}", _div(km, speed))
    return f"{q} How many hours does {p.they} drive?", w


@_template("distances", constants=(1000,))
def laps_to_goal(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    pool, goal = rng.choice((25, 50)), rng.randint(1, 2 * d + 1)
    laps = rng.randint(4, goal * 1000 // pool - 4)
    done = w(f"{pool} * {laps}", pool * laps)
    metres = w(f"{goal} * 1000", goal * 1000)
    left = w(f"{metres} - {done}", metres - done)
    q = f"{p.name} wants to swim {goal} km this week. The pool is {pool} metres long and {p.they} has swum {laps} lengths so far."
    if d < 3:
        return f"{q} How many more metres must {p.they} swim?", w
    w(f"{left} / {pool}", _div(left, pool))
    return f"{q} How many more lengths must {p.they} swim?", w


# ---------------------------------------------------------------------------------------------
# Savings


@_template("savings")
def savings_weeks(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    item = rng.choice(("a bicycle", "a tablet", "a guitar", "a tent", "a telescope", "skates"))
    has, save, chores, weeks = (
        rng.randint(5, 20 * d),
        rng.randint(3, 5 * d + 5),
        rng.randint(2, 6),
        rng.randint(3, 4 * d + 6),
    )
    price = has + (save + (chores if d > 1 else 0)) * weeks
    need = w(f"{price} - {has}", price - has)
    weekly = save
    q = f"{p.name} wants {item} that costs {_usd(price)}. {p.They} has {_usd(has)} and saves {_usd(save)} a week."
    if d > 1:
        weekly = w(f"{save} + {chores}", save + chores)
        q += f" {p.They} also earns {_usd(chores)} a week doing chores and saves all of it."
    w(f"{need} / {weekly}", _div(need, weekly))
    return f"{q} How many weeks does {p.they} need to save?", w


@_template("savings", constants=(12,))
def savings_years(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    monthly, years, gift = (
        5 * rng.randint(2, 6 * d + 4),
        rng.randint(2, 2 * d + 2),
        10 * rng.randint(2, 10),
    )
    months = w(f"{years} * 12", years * 12)
    saved = w(f"{months} * {monthly}", months * monthly)
    q = f"{p.name} saves {_usd(monthly)} every month for {years} years."
    if d == 1:
        return f"{q} How many dollars does {p.they} save?", w
    gifts = w(f"{years} * {gift}", years * gift)
    w(f"{saved} + {gifts}", saved + gifts)
    return (
        f"{q} Each year {p.they} also puts a {_usd(gift)} birthday gift into savings. How many dollars does {p.they} save in all?",
        w,
    )


@_template("savings", constants=(100,))
def coin_jar(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    kinds = rng.sample((5, 10, 20, 25, 50), 2 if d == 1 else 3)
    for _ in _tries():
        counts = [rng.randint(3, 10 * d + 10) for _ in kinds]
        if d < 3 or sum(c * k for c, k in zip(counts, kinds, strict=True)) % 100 == 0:
            break
    parts = [w(f"{c} * {k}", c * k) for c, k in zip(counts, kinds, strict=True)]
    cents = w(" + ".join(map(str, parts)), sum(parts))
    q = (
        f"{p.name}'s coin jar holds "
        + _join([f"{c} coins worth {k} cents each" for c, k in zip(counts, kinds, strict=True)])
        + "."
    )
    if d < 3:
        return f"{q} How many cents are in the jar?", w
    w(f"{cents} / 100", _div(cents, 100))
    return f"{q} How many dollars are in the jar?", w


# ---------------------------------------------------------------------------------------------
# Areas and perimeters


@_template("areas")
def floor_cost(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    length, width, price = (
        rng.randint(3, 4 * d + 6),
        rng.randint(2, 3 * d + 4),
        rng.randint(5, 10 * d + 10),
    )
    cup_l, cup_w = rng.randint(1, min(3, length - 1)), rng.randint(1, min(2, width - 1))
    room = w(f"{length} * {width}", length * width)
    q = f"A room is {length} m long and {width} m wide. New flooring costs {_usd(price)} per square metre."
    if d > 1:
        cupboard = w(f"{cup_l} * {cup_w}", cup_l * cup_w)
        room = w(f"{room} - {cupboard}", room - cupboard)
        q += f" A built-in cupboard covers {cup_l} m by {cup_w} m of the floor, which needs no flooring."
    w(f"{room} * {price}", room * price)
    return f"{q} How many dollars does the flooring cost?", w


@_template("areas", constants=(2,))
def fence_cost(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    length, width, price, gate = (
        rng.randint(5, 10 * d + 10),
        rng.randint(3, 6 * d + 6),
        rng.randint(3, 4 * d + 8),
        rng.randint(1, 3),
    )
    half = w(f"{length} + {width}", length + width)
    fence = w(f"2 * {half}", 2 * half)
    q = f"A rectangular garden is {length} m long and {width} m wide."
    if d == 1:
        return f"{q} What is its perimeter in metres?", w
    if d == 3:
        fence = w(f"{fence} - {gate}", fence - gate)
        q += f" A fence goes all the way around it except for a gate {gate} m wide."
    else:
        q += " A fence goes all the way around it."
    w(f"{fence} * {price}", fence * price)
    return f"{q} Fencing costs {_usd(price)} per metre. How many dollars does the fencing cost?", w


@_template("areas", constants=(4,))
def square_from_perimeter(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    side, price = rng.randint(3, 10 * d + 5), rng.randint(2, 5 * d)
    side = w(f"{4 * side} / 4", _div(4 * side, 4))
    area = w(f"{side} * {side}", side * side)
    q = f"A square patio has a perimeter of {4 * side} m."
    if d == 1:
        return f"{q} What is its area in square metres?", w
    w(f"{area} * {price}", area * price)
    return (
        f"{q} Sealing it costs {_usd(price)} per square metre. How many dollars does sealing it cost?",
        w,
    )


@_template("areas")
def paint_cans(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        length, height, walls, cover = (
            rng.randint(3, 3 * d + 5),
            rng.randint(2, 4),
            rng.randint(2, 4),
            rng.choice((4, 5, 6, 8, 10, 12)),
        )
        if length * height * (walls if d > 1 else 1) % cover == 0:
            break
    area = w(f"{length} * {height}", length * height)
    if d == 1:
        w(f"{area} / {cover}", _div(area, cover))
        return (
            f"A wall is {length} m long and {height} m high. One can of paint covers {cover} square metres. How many cans are needed to paint the wall once?",
            w,
        )
    area = w(f"{area} * {walls}", area * walls)
    w(f"{area} / {cover}", _div(area, cover))
    return (
        f"A hall has {walls} walls, each {length} m long and {height} m high. One can of paint covers {cover} square metres. How many cans are needed to paint all the walls once?",
        w,
    )


@_template("areas")
def lawn_area(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    length, width, side, beds = (
        rng.randint(8, 10 * d + 10),
        rng.randint(6, 5 * d + 8),
        rng.randint(2, 3),
        rng.randint(2, 3),
    )
    lawn = w(f"{length} * {width}", length * width)
    bed = w(f"{side} * {side}", side * side)
    q = f"A lawn is {length} m long and {width} m wide."
    if d == 1:
        w(f"{lawn} - {bed}", lawn - bed)
        return (
            f"{q} A square flower bed with sides of {side} m is dug in it. How many square metres of grass are left?",
            w,
        )
    beds_area = w(f"{bed} * {beds}", bed * beds)
    w(f"{lawn} - {beds_area}", lawn - beds_area)
    return (
        f"{q} {beds} square flower beds, each with sides of {side} m, are dug in it. How many square metres of grass are left?",
        w,
    )


# ---------------------------------------------------------------------------------------------
# Counting


@_template("counting", constants=(2, 4))
def farm_legs(rng: random.Random, d: int) -> tuple[str, _Work]:
    p, w = _people(rng, 1)[0], _Work()
    hens, cows, ducks = (
        rng.randint(3, 10 * d + 10),
        rng.randint(2, 5 * d + 5),
        rng.randint(2, 8 * d),
    )
    q = f"{p.name}'s farm has {hens} chickens and {cows} cows."
    if d > 1:
        birds = w(f"{hens} + {ducks}", hens + ducks)
        q = f"{p.name}'s farm has {hens} chickens, {ducks} ducks and {cows} cows."
    else:
        birds = hens
    bird_legs = w(f"{birds} * 2", birds * 2)
    cow_legs = w(f"{cows} * 4", cows * 4)
    w(f"{bird_legs} + {cow_legs}", bird_legs + cow_legs)
    return f"{q} How many legs do the animals have in all?", w


@_template("counting")
def theatre_seats(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    for _ in _tries():
        rows, per_row, taken, groups, size = (
            rng.randint(5, 10 * d + 5),
            rng.randint(8, 5 * d + 15),
            rng.randint(10, 40 * d),
            rng.randint(2, 4),
            rng.randint(5, 12),
        )
        if rows * per_row - taken - (groups * size if d > 1 else 0) > 0:
            break
    seats = w(f"{rows} * {per_row}", rows * per_row)
    free = w(f"{seats} - {taken}", seats - taken)
    q = f"A theatre has {rows} rows of {per_row} seats. {taken} seats are already taken."
    if d == 1:
        return f"{q} How many seats are free?", w
    arriving = w(f"{groups} * {size}", groups * size)
    w(f"{free} - {arriving}", free - arriving)
    return (
        f"{q} Then {groups} school groups of {size} pupils each take seats. How many seats are still free?",
        w,
    )


@_template("counting", constants=(2,))
def shop_stock(rng: random.Random, d: int) -> tuple[str, _Work]:
    w = _Work()
    item = rng.choice(("umbrellas", "scarves", "lamps", "kites", "puzzles", "backpacks"))
    monday, delivery, wed = (
        rng.randint(4, 10 * d + 5),
        rng.randint(10, 20 * d + 10),
        rng.randint(3, 12),
    )
    stock = 3 * monday + rng.randint(5, 30 * d)
    tuesday = w(f"{monday} * 2", monday * 2)
    left = w(f"{stock} - {monday} - {tuesday}", stock - monday - tuesday)
    q = f"A shop has {stock} {item}. It sells {monday} on Monday and twice as many on Tuesday."
    if d == 1:
        return f"{q} How many {item} are left?", w
    left = w(f"{left} + {delivery}", left + delivery)
    if d == 2:
        return (
            f"{q} A delivery of {delivery} more arrives on Wednesday morning. How many {item} does the shop have then?",
            w,
        )
    w(f"{left} - {wed}", left - wed)
    return (
        f"{q} A delivery of {delivery} more arrives on Wednesday morning, and {wed} are sold that day. How many {item} are left at the end of Wednesday?",
        w,
    )


TEMPLATES: tuple[Template, ...] = tuple(_TEMPLATES)
