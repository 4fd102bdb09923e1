"""A synthetic GSM8K-format generator: multi-step arithmetic word problems with worked answers.

Deterministic for a seed (same templates, same RNG calls in the same order), so the demo's numbers
and every test that counts on a problem stay stable. `synthetic_split` keeps train and eval apart.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Example:
    """One problem: `answer` holds worked steps ending in `#### <number>` (GSM8K format);
    `template`: the name of the problem template that wrote it (`bench task` gives each of two
    specialist teachers half of them)."""

    question: str
    answer: str
    template: str = ""


_NAMES = [("Tom", "he"), ("Mia", "she"), ("Ravi", "he"), ("Lena", "she"), ("Omar", "he"), ("Sofia", "she"),
          ("Ken", "he"), ("Ada", "she"), ("Luis", "he"), ("Noor", "she"), ("Jack", "he"), ("Yuki", "she"),
          ("Ben", "he"), ("Chloe", "she"), ("Ivan", "he"), ("Zara", "she"), ("Paul", "he"), ("Emma", "she")]
_GOODS = ["notebooks", "pencils", "apples", "mugs", "candles", "shirts", "books", "toy cars", "plants", "towels"]
_FRUIT = ["apples", "oranges", "cookies", "marbles", "stickers", "candies", "pears", "cards"]
_THINGS = ["bike", "guitar", "tablet", "camera", "skateboard", "telescope", "watch", "tent"]
_CROPS = [("tomato plants", "tomatoes"), ("pepper plants", "peppers"), ("bean plants", "beans"),
          ("apple trees", "apples"), ("strawberry plants", "strawberries")]
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a // b}


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    """`a op b = <<a op b=c>>c` with the result c (GSM8K calculator annotation)."""
    assert op != "/" or a % b == 0, (a, b)  # every step is exact integer arithmetic
    c = _OPS[op](a, b)
    return f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}", c


def _shopping(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    g1, g2 = r.sample(_GOODS, 2)
    a, p, b, q = r.randint(2, 9), r.randint(2, 25), r.randint(2, 9), r.randint(2, 25)
    s1, x = _eq(a, "*", p)
    s2, y = _eq(b, "*", q)
    s3, t = _eq(x, "+", y)
    steps = [f"The {g1} cost {s1} dollars.", f"The {g2} cost {s2} dollars.", f"In total {name} spends {s3} dollars."]
    q_text = f"{name} buys {a} {g1} at ${p} each and {b} {g2} at ${q} each."
    if r.random() < 0.5:
        bill = next(v for v in (50, 100, 200, 500) if v > t)
        s4, t = _eq(bill, "-", t)
        steps.append(f"The change is {s4} dollars.")
        return f"{q_text} {he.capitalize()} pays with a ${bill} bill. How much change does {name} get?", steps, t
    return f"{q_text} How much does {name} spend in total?", steps, t


def _sharing(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    fruit = r.choice(_FRUIT)
    mode = r.randrange(3)  # 0: give away, 1: share, 2: give away + share (+ maybe eat)
    b, k, f = r.randint(2, 9), r.randint(6, 24), r.randint(2, 6)
    if mode == 1:
        k = f * r.randint(2, 6)  # the boxes split evenly
    s1, total = _eq(b, "*", k)
    steps = [f"{name} has {s1} {fruit}."]
    q_text = f"{name} has {b} boxes with {k} {fruit} in each box."
    if mode != 1:
        g = r.randint(1, total // 3)
        if mode == 2:
            g += (total - g) % f  # the rest must split evenly
        s, total = _eq(total, "-", g)
        steps.append(f"After giving {g} away, {he} has {s} {fruit} left.")
        q_text += f" {he.capitalize()} gives {g} {fruit} to a neighbor."
        if mode == 0:
            return f"{q_text} How many {fruit} does {name} have left?", steps, total
    s, each = _eq(total, "/", f)
    steps.append(f"Each of the {f} friends gets {s} {fruit}.")
    q_text += f" {he.capitalize()} shares the rest equally among {f} friends."
    if mode == 2 and r.random() < 0.5 and each > 1:
        e = r.randint(1, each - 1)
        s, each = _eq(each, "-", e)
        steps.append(f"After eating {e}, each friend has {s} {fruit}.")
        return f"{q_text} Each friend eats {e} of them. How many {fruit} does each friend have now?", steps, each
    return f"{q_text} How many {fruit} does each friend get?", steps, each


def _travel(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    v1, h1, v2, h2 = r.randint(20, 70), r.randint(2, 5), r.randint(20, 70), r.randint(2, 5)
    s1, d1 = _eq(v1, "*", h1)
    s2, d2 = _eq(v2, "*", h2)
    s3, d = _eq(d1, "+", d2)
    steps = [f"First {he} drives {s1} miles.", f"Then {he} drives {s2} miles.", f"One way is {s3} miles."]
    q_text = (f"{name} drives at {v1} miles per hour for {h1} hours, then at {v2} miles per hour "
              f"for {h2} hours to reach a lake.")
    if r.random() < 0.5:
        s4, d = _eq(d, "*", 2)
        steps.append(f"There and back is {s4} miles.")
        return f"{q_text} {he.capitalize()} drives the same way back. How many miles does {he} drive in all?", steps, d
    return f"{q_text} How far is the lake?", steps, d


def _wages(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    rate, h, d = r.randint(8, 30), r.randint(2, 8), r.randint(2, 6)
    s1, day = _eq(rate, "*", h)
    s2, total = _eq(day, "*", d)
    steps = [f"{name} earns {s1} dollars a day.", f"Over {d} days {he} earns {s2} dollars."]
    q_text = f"{name} earns ${rate} per hour and works {h} hours a day for {d} days."
    if r.random() < 0.5:
        bonus = r.randint(1, 10) * 5
        s, total = _eq(total, "+", bonus)
        steps.append(f"With the bonus {he} has {s} dollars.")
        q_text += f" {he.capitalize()} also gets a ${bonus} bonus."
    if r.random() < 0.5:
        spend = r.randint(1, total - 1)
        s, total = _eq(total, "-", spend)
        steps.append(f"After spending {spend} dollars, {he} has {s} dollars.")
        return f"{q_text} Then {he} spends ${spend} on groceries. How much money is left?", steps, total
    return f"{q_text} How much does {name} earn?", steps, total


def _savings(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    thing = r.choice(_THINGS)
    if r.random() < 0.5:  # how many weeks until the goal
        have, per, weeks = r.randint(5, 80), r.randint(3, 25), r.randint(2, 15)
        price = have + per * weeks
        s1, need = _eq(price, "-", have)
        s2, w = _eq(need, "/", per)
        steps = [f"{name} still needs {s1} dollars.", f"At {per} dollars a week that takes {s2} weeks."]
        return (f"{name} wants a {thing} that costs ${price}. {he.capitalize()} has ${have} and saves ${per} "
                f"each week. How many weeks until {he} can buy it?"), steps, w
    have, per, weeks = r.randint(5, 80), r.randint(3, 25), r.randint(2, 12)
    s1, saved = _eq(per, "*", weeks)
    s2, total = _eq(have, "+", saved)
    price = r.randint(1, total - 1)
    s3, left = _eq(total, "-", price)
    steps = [f"{name} saves {s1} dollars.", f"{he.capitalize()} then has {s2} dollars.",
             f"After the {thing}, {s3} dollars are left."]
    return (f"{name} has ${have} and saves ${per} each week for {weeks} weeks. Then {he} buys a {thing} "
            f"for ${price}. How much money does {name} have left?"), steps, left


def _baking(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    cups, per_batch, batches = r.randint(2, 5), r.choice([6, 8, 10, 12, 24]), r.randint(2, 8)
    want = per_batch * batches
    s1, nb = _eq(want, "/", per_batch)
    s2, need = _eq(nb, "*", cups)
    steps = [f"{name} needs {s1} batches.", f"That takes {s2} cups of flour."]
    q_text = f"A recipe uses {cups} cups of flour for {per_batch} cookies. {name} wants to bake {want} cookies."
    if r.random() < 0.5:
        has = r.randint(1, need - 1)
        s3, more = _eq(need, "-", has)
        steps.append(f"{he.capitalize()} must buy {s3} more cups.")
        return f"{q_text} {he.capitalize()} has {has} cups. How many more cups does {he} need?", steps, more
    return f"{q_text} How many cups of flour does {he} need?", steps, need


def _reading(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    r1, d1 = r.randint(5, 30), r.randint(2, 7)
    s1, read = _eq(r1, "*", d1)
    steps = [f"In the first {d1} days {he} reads {s1} pages."]
    q_text = f"{name} reads {r1} pages a day for {d1} days"
    if r.random() < 0.5:
        r2, d2 = r.randint(5, 30), r.randint(2, 7)
        s2, more = _eq(r2, "*", d2)
        s3, read = _eq(read, "+", more)
        steps += [f"Then {he} reads {s2} pages.", f"Altogether {he} reads {s3} pages."]
        q_text += f", then {r2} pages a day for {d2} days"
    pages = read + r.randint(10, 200)
    s, left = _eq(pages, "-", read)
    steps.append(f"The book has {s} pages left.")
    return f"A book has {pages} pages. {q_text}. How many pages are left?", steps, left


def _garden(r: random.Random, name: str, he: str) -> tuple[str, list[str], int]:
    plant, crop = r.choice(_CROPS)
    rows, per_row = r.randint(2, 12), r.randint(3, 15)
    s1, n = _eq(rows, "*", per_row)
    steps = [f"{name} plants {s1} {plant}."]
    q_text = f"{name} plants {rows} rows of {per_row} {plant}."
    if r.random() < 0.5:
        dead = r.randint(1, n // 3)
        s, n = _eq(n, "-", dead)
        steps.append(f"{s} {plant} survive.")
        q_text += f" {dead} of them do not survive."
    y = r.randint(2, 12)
    s, total = _eq(n, "*", y)
    steps.append(f"{he.capitalize()} harvests {s} {crop}.")
    return f"{q_text} Each one gives {y} {crop}. How many {crop} does {name} harvest?", steps, total


_TEMPLATES: list[Callable[[random.Random, str, str], tuple[str, list[str], int]]] = [
    _shopping, _sharing, _travel, _wages, _savings, _baking, _reading, _garden]
TEMPLATES = tuple(t.__name__.lstrip("_") for t in _TEMPLATES)  # the names `Example.template` takes


def _generate(n: int, rng: random.Random, keep: Callable[[str], bool] = lambda q: True) -> list[Example]:
    out: list[Example] = []
    seen: set[str] = set()
    while len(out) < n:
        name, he = rng.choice(_NAMES)
        template = rng.choice(_TEMPLATES)
        question, steps, result = template(rng, name, he)
        if question in seen or not keep(question):
            continue
        seen.add(question)
        out.append(Example(question, "\n".join(steps) + f"\n#### {result}", template.__name__.lstrip("_")))
    return out


def synthetic_gsm8k(n: int, seed: int = 0) -> list[Example]:
    """`n` deterministic multi-step (2-4) arithmetic word problems with GSM8K-style worked answers."""
    return _generate(n, random.Random(seed))


def synthetic_split(n: int, seed: int, split: str) -> list[Example]:
    """`n` problems of `split`: "train" draws from 90% of the problem space (by question hash),
    every other split from the other 10% with a seed derived from (seed, split), so train and eval
    never overlap."""
    sub = int.from_bytes(hashlib.sha256(f"{seed}/{split}".encode()).digest()[:8], "little")
    is_train = split == "train"
    return _generate(n, random.Random(sub), keep=lambda q: (_split_bucket(q) != 0) == is_train)


def _split_bucket(question: str) -> int:
    return int.from_bytes(hashlib.blake2b(question.encode(), digest_size=4).digest(), "little") % 10

