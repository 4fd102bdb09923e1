"""`bench task`'s records: prompt/completion pairs with a verifiable final answer, three splits, and their checker.

A built-in task (`TASKS`: `arith`, two-step arithmetic worked in one line, by default — short enough
for a 2-core box to fine-tune a competent teacher and run every arm; `gsm8k`, the synthetic GSM8K
word problems), each record routed by a `teacher` column to the specialist of its half of the
problem templates, or any prompt/completion JSONL (`--records FILE.jsonl`; an optional `teacher`
column with two values routes its records the same way), split by a seeded shuffle into train /
validation / test (a prompt written twice is refused: it could sit in two splits). Written as the
product's gsm8k records ({question, answer[, teacher]}), so the students, the teachers and the
greedy exact match read a prompt the same way (`recipes.evaluate.generate_answers` renders it as
training does).

Checkers: `number` (the final number after the last `####`, else the last number:
`data.final_answer`) or `exact` (the whole completion, stripped).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_write
from kava_ray.data import final_answer
from kava_ray.data.batching import ROUTE
from kava_ray.data.synthetic import TEMPLATES, synthetic_split
from kava_ray.recipes.evaluate import answer_accuracy

SPLITS = ("train", "validation", "test")
SPECIALISTS = ("spec-a", "spec-b")  # the synthetic records' two halves of the templates, in TEMPLATES' order
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ArmSizes:
    """The sizes of a records bench (`bench task`, `bench scarce`), what their shared stages read.
    counts: records per split; keep: the student's layers (of the job's student model); steps,
    batch_size, max_length: a student's run; max_new: new tokens a greedy answer or a sample may
    have; eval_batch: prompts per generation; ft_*: a teacher's fine-tune (at most ft_max steps,
    evaluated every ft_every on the validation prompts, plateau past ft_min steps: the best of the
    last ft_patience evaluations within ft_delta of the best before) at lr_teacher; lr_warm,
    warm_steps: the student's SFT warm start; lr, lr_grid, grid_extend: the rate and its multiples
    tried on the selection seed (at most grid_extend extensions past an edge); temperature: of the
    samples; quick: tiny models."""

    counts: dict
    keep: list
    steps: int
    batch_size: int
    max_length: int
    max_new: int
    eval_batch: int
    lr_teacher: float
    ft_max: int
    ft_every: int
    ft_min: int
    ft_patience: int
    ft_delta: float
    lr_warm: float
    warm_steps: int
    lr: float
    lr_grid: tuple
    grid_extend: int
    temperature: float
    quick: bool


@dataclass(frozen=True)
class TaskRecords:
    """The bench's records on disk: `routed` ({split}.jsonl with the teacher column, the MOPD
    arm's), `plain` (the same without it: every other arm's), `halves` ({specialist: dir} of its own
    records, its fine-tune's); `specialists`: the teacher column's two values (empty: the records
    name none); `fingerprint`: of the content."""
    routed: Path
    plain: Path
    halves: dict
    specialists: tuple
    checker: str
    counts: dict
    fingerprint: str

    def rows(self, split: str, root: Optional[Path] = None) -> list[dict]:
        return [json.loads(x) for x in ((root or self.plain) / f"{split}.jsonl").read_text().splitlines() if x]


def synthetic_rows(counts: dict, seed: int = 0) -> dict:
    """{split: rows} of the synthetic generator (train never overlaps the others), each routed to
    the specialist of its template's half (the first half of TEMPLATES: spec-a)."""
    half = {t: SPECIALISTS[i >= len(TEMPLATES) // 2] for i, t in enumerate(TEMPLATES)}
    return {s: [{"question": e.question, "answer": e.answer, ROUTE: half[e.template]}
                for e in synthetic_split(counts[s], seed, s)] for s in SPLITS}


# arith's templates: (the operators of its two steps, its specialist): additions and subtractions to
# spec-a, products to spec-b (each half a skill of its own, as MOPD's specialists)
ARITH = (("+", "+", "spec-a"), ("+", "-", "spec-a"), ("*", "+", "spec-b"), ("*", "-", "spec-b"))


def _arith(r: random.Random) -> dict:
    """One two-step problem `a o1 b o2 c` (left to right, every value positive; sums of numbers up
    to 50, the times tables up to 12: school arithmetic a 135M model learns in a few hundred steps)
    with its worked answer."""
    o1, o2, spec = r.choice(ARITH)
    a, b = (r.randint(2, 50), r.randint(2, 50)) if o1 == "+" else (r.randint(2, 12), r.randint(2, 12))
    x = a + b if o1 == "+" else a * b
    c = r.randint(1, 30) if o2 == "+" else r.randint(1, x - 1)
    y = x + c if o2 == "+" else x - c
    return {"question": f"What is {a} {o1} {b} {o2} {c}?",
            "answer": f"{a} {o1} {b} = {x}. {x} {o2} {c} = {y}. #### {y}", ROUTE: spec}


def arith_rows(counts: dict, seed: int = 0) -> dict:
    """{split: rows} of distinct `arith` problems (no question in two splits), drawn by one seeded generator."""
    r, seen, rows = random.Random(f"arith-{seed}"), set(), {}
    for s in ("test", "validation", "train"):
        rows[s] = []
        while len(rows[s]) < counts[s]:
            row = _arith(r)
            if row["question"] not in seen:
                seen.add(row["question"])
                rows[s].append(row)
    return rows




def file_rows(path: str, checker: str, counts: dict, seed: int = 0) -> dict:
    """{split: rows} of a prompt/completion JSONL: test and validation records drawn first by a
    seeded shuffle, the rest (at most counts["train"]) train. One line naming what is wrong for a
    bad file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise KavaError(f"bench task: --records {path}: no such file")
    rows = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise KavaError(f"bench task: {path} line {i} is not JSON ({e.msg})") from None
        if not isinstance(r, dict) or not all(isinstance(r.get(k), str) and r[k].strip() for k in ("prompt",
                                                                                                   "completion")):
            raise KavaError(f"bench task: {path} line {i} needs a non-empty string \"prompt\" and \"completion\"")
        if checker == "number" and final_answer(r["completion"]) is None:
            raise KavaError(f"bench task: {path} line {i}: the completion has no final number for --checker number "
                            f"(end it with '#### <number>', or use --checker exact)")
        row = {"question": r["prompt"], "answer": r["completion"]}
        if r.get(ROUTE) is not None:
            row[ROUTE] = str(r[ROUTE])
        rows.append(row)
    names = sorted({r[ROUTE] for r in rows if ROUTE in r})
    if names and (len(names) != 2 or any(ROUTE not in r for r in rows) or not all(_NAME.match(n) for n in names)):
        raise KavaError(f"bench task: {path}: a \"{ROUTE}\" column must name one of two teachers (letters, digits, "
                        f"-_.) on every record; got {names[:5]}")
    need = counts["validation"] + counts["test"] + 1
    if len(rows) < need:
        raise KavaError(f"bench task: {path} has {len(rows)} records; needs at least {need} (test "
                        f"{counts['test']} + validation {counts['validation']} + training)")
    seen: dict = {}
    for i, r in enumerate(rows, 1):
        if seen.setdefault(r["question"], i) != i:
            raise KavaError(f"bench task: {path}: record {i}'s prompt is record {seen[r['question']]}'s too (a "
                            f"prompt in two splits would score what the student memorised): write each prompt once")
    return split_rows(rows, counts, seed)


def split_rows(rows: list, counts: dict, seed: int = 0) -> dict:
    """{split: rows}: a seeded shuffle, then test and validation first, the rest (at most counts["train"]) train."""
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_t, n_v = counts["test"], counts["validation"]
    return {"test": rows[:n_t], "validation": rows[n_t:n_t + n_v], "train": rows[n_t + n_v:][:counts["train"]]}


def sort_rows(counts: dict, seed: int = 0) -> dict:
    """{split: rows} of the README's `sort.jsonl` (1,200 prompts "Sort these numbers from smallest
    to largest: 59 63 15 43 75", the sorted list the completion: its snippet's generator, byte for
    byte), split as `file_rows` splits that file (checker exact)."""
    r = random.Random(0)
    rows = []
    for _ in range(1200):
        xs = r.sample(range(10, 100), 5)
        rows.append({"question": "Sort these numbers from smallest to largest: " + " ".join(map(str, xs)),
                     "answer": " ".join(map(str, sorted(xs)))})
    return split_rows(rows, counts, seed)


TASKS = {"arith": arith_rows, "gsm8k": synthetic_rows}


def write_records(rows: dict, root: Path, checker: str) -> TaskRecords:
    """The splits under root (routed/, plain/, and one dir per specialist with its half), written atomically."""
    names = tuple(sorted({r[ROUTE] for s in SPLITS for r in rows[s] if ROUTE in r}))
    routed, plain = root / "routed", root / "plain"

    def put(d: Path, split: str, rs: list) -> None:
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(d / f"{split}.jsonl", "".join(json.dumps(r, sort_keys=True) + "\n" for r in rs), keep_same=True)

    for s in SPLITS:
        put(routed, s, rows[s])
        put(plain, s, [{k: v for k, v in r.items() if k != ROUTE} for r in rows[s]])
        for n in names:
            put(root / n, s, [{k: v for k, v in r.items() if k != ROUTE} for r in rows[s] if r.get(ROUTE) == n])
    blob = json.dumps({"checker": checker, "rows": rows}, sort_keys=True).encode()
    return TaskRecords(routed, plain, {n: root / n for n in names}, names, checker,
                       {s: len(rows[s]) for s in SPLITS}, hashlib.sha1(blob).hexdigest()[:16])


def score(model, tok, rows: Sequence[dict], checker: str, p: ArmSizes) -> dict:
    """`exact_match` at the bench's sizes (p.max_new new tokens, p.eval_batch prompts a batch)."""
    return exact_match(model, tok, rows, checker, p.max_new, p.eval_batch)


def exact_match(model, tok, rows: Sequence[dict], checker: str, max_new_tokens: int, batch_size: int = 8) -> dict:
    """Greedy exact match of `model` on `rows` ({question, answer}): `evaluate.answer_accuracy`'s
    dict, its share also as "em"."""
    r = answer_accuracy(model, tok, [x["question"] for x in rows], [x["answer"] for x in rows], checker,
                        max_new_tokens=max_new_tokens, batch_size=batch_size)
    return {"em": r["accuracy"], **r}