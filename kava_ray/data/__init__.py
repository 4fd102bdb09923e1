"""GSM8K-style data: sources (synthetic, local file, HF hub), answer parsing, tokenization with
label masking, length-bucketed deterministic batching, DDP sharding, and a resumable batch stream.

Pure Python/torch/HF (no Ray). Labels follow the HF convention: unshifted, -100 where no loss.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from kava_ray.errors import KavaError

IGNORE_INDEX = -100
PLAIN_PROMPT = "Question: {q}\nAnswer: "
_LOCAL_EXTS = (".jsonl", ".json", ".parquet")
_FILE_LIKE_EXTS = _LOCAL_EXTS + (".csv", ".tsv", ".txt", ".arrow", ".gz", ".zip", ".xlsx")


@dataclass(frozen=True)
class Example:
    """One problem: `answer` holds worked steps ending in `#### <number>` (GSM8K format)."""

    question: str
    answer: str


# ----------------------------------------------------------------------------------------------
# Synthetic GSM8K-like generator
# ----------------------------------------------------------------------------------------------

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


def _generate(n: int, rng: random.Random, keep: Callable[[str], bool] = lambda q: True) -> list[Example]:
    out: list[Example] = []
    seen: set[str] = set()
    while len(out) < n:
        name, he = rng.choice(_NAMES)
        question, steps, result = rng.choice(_TEMPLATES)(rng, name, he)
        if question in seen or not keep(question):
            continue
        seen.add(question)
        out.append(Example(question, "\n".join(steps) + f"\n#### {result}"))
    return out


def synthetic_gsm8k(n: int, seed: int = 0) -> list[Example]:
    """`n` deterministic multi-step (2-4) arithmetic word problems with GSM8K-style worked answers."""
    return _generate(n, random.Random(seed))


def _split_bucket(question: str) -> int:
    return int.from_bytes(hashlib.blake2b(question.encode(), digest_size=4).digest(), "little") % 10


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def load_examples(source: str, split: str, n: Optional[int] = None, seed: int = 0,
                  hub_config: Optional[str] = "main") -> list[Example]:
    """Examples of `split` from "synthetic", a local .jsonl/.json/.parquet file, or a hub dataset id.

    Synthetic: `split == "train"` draws from 90% of the problem space (by question hash), every other
    split from the other 10% with a seed derived from (seed, split), so train and eval never overlap.
    A local path may contain `{split}` (e.g. `data/{split}.jsonl`). Real data is capped to its first `n` rows.
    """
    if source == "synthetic":
        if n is None:
            raise KavaError("data.source=synthetic needs a number of examples (data.num_train / data.num_eval)")
        sub = int.from_bytes(hashlib.sha256(f"{seed}/{split}".encode()).digest()[:8], "little")
        is_train = split == "train"
        return _generate(n, random.Random(sub), keep=lambda q: (_split_bucket(q) != 0) == is_train)
    path = os.path.expanduser(source.replace("{split}", split))
    ext = os.path.splitext(path)[1].lower()
    if os.path.exists(path) or ext in _FILE_LIKE_EXTS or source.startswith(("/", "./", "../", "~")):
        rows = _read_local(path, ext)
    else:
        rows = _read_hub(source, split, hub_config, n)
    if n is not None:
        rows = rows[:n]
    if not rows:
        raise KavaError(f"data source '{source}' (split {split}) has no examples")
    out = []
    for i, row in enumerate(rows):
        for key in ("question", "answer"):
            if not isinstance(row, dict) or row.get(key) is None:
                raise KavaError(f"data source '{source}': row {i} has no '{key}' field")
        out.append(Example(str(row["question"]), str(row["answer"])))
    return out


def _read_local(path: str, ext: str) -> list[dict]:
    if not os.path.isfile(path):
        raise KavaError(f"data file not found: {path}")
    if ext in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if text.lstrip().startswith("["):  # a .json array is accepted too
            try:
                return list(json.loads(text))
            except json.JSONDecodeError as e:
                raise KavaError(f"data file {path}: invalid JSON ({e.msg} at line {e.lineno})") from None
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise KavaError(f"data file {path}: line {lineno} is not valid JSON ({e.msg})") from None
        return rows
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - any pyarrow failure is a bad file
            raise KavaError(f"data file {path}: cannot read parquet ({_first_line(e)})") from None
        for key in ("question", "answer"):
            if key not in table.column_names:
                raise KavaError(f"data file {path}: row 0 has no '{key}' field (columns: {table.column_names})")
        return table.select(["question", "answer"]).to_pylist()
    raise KavaError(f"data file {path}: unknown extension '{ext}' (use .jsonl, .json or .parquet)")


def _read_hub(source: str, split: str, hub_config: Optional[str], n: Optional[int]) -> list[dict]:
    try:
        import datasets

        ds = datasets.load_dataset(source, hub_config, split=split)
        if n is not None:
            ds = ds.select(range(min(n, len(ds))))
        return ds.to_list()
    except Exception as e:  # noqa: BLE001 - wrapped into one user-facing line
        raise KavaError(
            f"cannot load dataset '{source}' (config {hub_config}, split {split}): {_first_line(e)}; "
            "offline, use data.source=synthetic or a local .jsonl/.parquet file"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# Answers
# ----------------------------------------------------------------------------------------------

_NUM = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+")


def normalize_number(s: Optional[str]) -> Optional[str]:
    """First number in `s` in canonical form: "1,000" / "1000.0" -> "1000", "$5" -> "5", "-3.50" -> "-3.5"."""
    m = _NUM.search(s or "")
    if not m:
        return None
    try:
        d = Decimal(m.group().replace("$", "").replace(",", "")).normalize()
    except InvalidOperation:
        return None
    out = format(d, "f")
    return "0" if out in ("-0", "0") else out


def final_answer(text: Optional[str]) -> Optional[str]:
    """The normalised answer of a solution: the number after the last `####`, else the last number."""
    text = text or ""
    if "####" in text:
        return normalize_number(text.rsplit("####", 1)[1])
    nums = _NUM.findall(text)
    return normalize_number(nums[-1]) if nums else None


# ----------------------------------------------------------------------------------------------
# Tokenization
# ----------------------------------------------------------------------------------------------


def _sha(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\x00")
    return h.hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable short hash of what decides token ids: vocab, bos/eos/pad, and the ids of a probe text.

    The probe catches pre-tokenizer/normaliser differences; the tokenizer class and an unused unk
    token do not count (transformers may load one tokenizer file as different classes).
    """
    vocab = sorted(tokenizer.get_vocab().items())
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")}
    probe = tokenizer("Tom buys 12 apples at $3.50 each; naïve 東京 costs\n  1,000 -> 3*4=12", add_special_tokens=True)
    return _sha(vocab, specials, list(probe["input_ids"]))


def _use_chat(tokenizer, prompt_format: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "chat" and not has_template:
        raise KavaError("data.prompt_format=chat but the tokenizer has no chat template (use auto or plain)")
    if prompt_format not in ("auto", "chat", "plain"):
        raise KavaError(f"data.prompt_format must be auto, chat or plain, not '{prompt_format}'")
    return prompt_format == "chat" or (prompt_format == "auto" and has_template)


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def encode_prompt(tokenizer, question: str, prompt_format: str = "auto") -> list[int]:
    """Token ids of the prompt alone (what generation starts from in GSM8K evaluation)."""
    if _use_chat(tokenizer, prompt_format):
        msgs = [{"role": "user", "content": question}]
        return _ids(tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    ids = _ids(tokenizer, PLAIN_PROMPT.format(q=question), special=True)  # BOS if the tokenizer adds one
    if ids and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]  # some tokenizers append EOS; the prompt must stay open
    return ids


def encode_example(tokenizer, ex: Example, max_length: int, prompt_format: str = "auto",
                   overlength: str = "truncate", index: Optional[int] = None) -> dict:
    """Token ids + labels (-100 on the prompt) + answer_mask for one example; truncates or raises."""
    prompt = encode_prompt(tokenizer, ex.question, prompt_format)
    if _use_chat(tokenizer, prompt_format):
        msgs = [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.answer}]
        ids = _ids(tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False))
        n_prompt = 0  # the prompt is a token prefix of the full text; stop at the first difference
        while n_prompt < min(len(prompt), len(ids)) and prompt[n_prompt] == ids[n_prompt]:
            n_prompt += 1
    else:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids, n_prompt = prompt + _ids(tokenizer, ex.answer) + eos, len(prompt)
    truncated = len(ids) > max_length
    if truncated and overlength == "error":
        where = f"example {index}" if index is not None else "example"
        raise KavaError(f"{where} has {len(ids)} tokens > train.max_length={max_length} "
                        "(raise max_length or set data.overlength=truncate)")
    ids = ids[:max_length]
    labels = [IGNORE_INDEX] * min(n_prompt, len(ids)) + ids[n_prompt:]
    return {"input_ids": ids, "labels": labels, "answer_mask": [int(lab != IGNORE_INDEX) for lab in labels],
            "truncated": truncated}


@dataclass
class TokenizedSplit:
    """The encoded examples of one split, identified by `fingerprint` (content + settings hash)."""

    items: list[dict]  # encode_example outputs, in example order
    examples: list[Example]  # the source texts (teachers with other tokenizers, evaluation)
    fingerprint: str
    num_truncated: int
    pad_id: int
    lengths: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.lengths = [len(it["input_ids"]) for it in self.items]

    def __len__(self) -> int:
        return len(self.items)


def tokenize_split(tokenizer, examples: Sequence[Example], max_length: int, prompt_format: str = "auto",
                   overlength: str = "truncate", source_id: str = "") -> TokenizedSplit:
    """Encode every example; `source_id` names the data (e.g. "synthetic/train/n=512/seed=0")."""
    items = [encode_example(tokenizer, ex, max_length, prompt_format, overlength, index=i)
             for i, ex in enumerate(examples)]
    n_trunc = sum(it["truncated"] for it in items)
    if n_trunc:
        warnings.warn(f"{n_trunc} of {len(items)} examples ({source_id}) exceed max_length={max_length} "
                      "tokens and were truncated", stacklevel=2)
    content = b"".join(np.asarray(it["input_ids"] + [-1, it["answer_mask"].count(0)], np.int64).tobytes()
                       for it in items)
    fp = _sha(source_id, tokenizer_fingerprint(tokenizer), max_length, prompt_format, content)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TokenizedSplit(items, list(examples), fp, n_trunc, pad if pad is not None else 0)


def load_split(data_cfg, tokenizer, split: str, n: int, max_length: int) -> TokenizedSplit:
    """load_examples + tokenize_split from a `DataConfig` (the glue train/eval use)."""
    c = data_cfg
    examples = load_examples(c.source, split, n, c.seed, c.hub_config)
    source_id = f"{c.source}|{c.hub_config}|{split}|n={n}|seed={c.seed}"
    return tokenize_split(tokenizer, examples, max_length, c.prompt_format, c.overlength, source_id)


# ----------------------------------------------------------------------------------------------
# Batching
# ----------------------------------------------------------------------------------------------


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(int(_sha(*parts), 16))


def plan_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, bucket: bool = True,
                 drop_last: bool = True) -> list[list[int]]:
    """One epoch's batches (lists of example indices), deterministic for (seed, epoch).

    bucket: shuffle, sort by length within chunks of 50 * batch_size so each batch holds similar
    lengths (little padding), then shuffle the batch order.
    """
    rng = _rng("plan", seed, epoch)
    order = rng.permutation(len(lengths)).tolist()
    if bucket:
        chunk = 50 * batch_size
        lens = np.asarray(lengths)
        order = [i for s in range(0, len(order), chunk)
                 for i in sorted(order[s:s + chunk], key=lambda j: -lens[j])]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    if bucket:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def shard_batches(batches: Sequence[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """Every world_size-th batch from `rank`, cut to the same count on every rank (DDP steps in lockstep)."""
    per_rank = len(batches) // world_size
    return list(batches[rank::world_size][:per_rank])


def collate(items: Sequence[dict], pad_id: int, padding_side: str = "right") -> dict[str, torch.Tensor]:
    """Pad encoded examples to the longest: input_ids / attention_mask / labels / answer_mask, all [B, T]."""
    T = max(len(it["input_ids"]) for it in items)
    out = {k: torch.full((len(items), T), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX), ("answer_mask", 0))}
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        sl = slice(0, n) if padding_side == "right" else slice(T - n, T)
        out["input_ids"][b, sl] = torch.tensor(it["input_ids"])
        out["attention_mask"][b, sl] = 1
        out["labels"][b, sl] = torch.tensor(it["labels"])
        out["answer_mask"][b, sl] = torch.tensor(it["answer_mask"])
    return out


def batch_key(fingerprint: str, epoch: int, batch_index: int, layers: Optional[Iterable[int]] = None) -> str:
    """Key teachers de-duplicate a batch by: same data plan, epoch and batch (and layer set) -> same KV."""
    key = f"{fingerprint}/e{epoch}/b{batch_index}"
    return with_layers(key, layers) if layers is not None else key


def with_layers(key: str, layers: Iterable[int]) -> str:
    """Append a teacher's layer set to a batch key: `with_layers(batch_key(f, e, i), L) == batch_key(f, e, i, L)`."""
    return key + "/L" + ",".join(str(i) for i in sorted(set(layers)))


class BatchStream:
    """A worker's batches forever across epochs, resumable exactly from `state()`.

    Epoch e's batches are `shard_batches(plan_batches(lengths, batch_size, seed, e), rank, world_size)`;
    keys use the global batch index, so they do not depend on the rank. Each batch dict also carries
    `index` [B] (example indices, for teachers that tokenize the text themselves).
    """

    def __init__(self, split: TokenizedSplit, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, state: Optional[dict] = None, bucket: bool = True):
        self.split, self.batch_size, self.seed, self.bucket = split, batch_size, seed, bucket
        self.rank, self.world_size = rank, world_size
        self.plan_fingerprint = _sha(split.fingerprint, batch_size, seed, bucket)
        n_global = len(split) // batch_size
        self.steps_per_epoch = n_global // world_size
        if self.steps_per_epoch == 0:
            raise KavaError(f"{len(split)} examples are too few for batch_size={batch_size} x {world_size} workers")
        if state is not None:
            if state.get("fingerprint") not in (None, self.plan_fingerprint):
                warnings.warn("resuming a BatchStream whose data, batch size or seed changed", stacklevel=2)
            self.epoch, self.position, self.step = int(state["epoch"]), int(state["position"]), int(state["step"])
        else:
            self.epoch, self.position = divmod(start_step, self.steps_per_epoch)
            self.step = start_step
        self._cached: tuple[int, list] = (-1, [])

    def _epoch_batches(self, epoch: int) -> list[tuple[int, list[int]]]:
        """(global batch index, example indices) for this rank in `epoch`."""
        if self._cached[0] != epoch:
            plan = plan_batches(self.split.lengths, self.batch_size, self.seed, epoch, bucket=self.bucket)
            self._cached = (epoch, shard_batches(list(enumerate(plan)), self.rank, self.world_size))
        return self._cached[1]

    def next(self) -> tuple[str, int, int, dict[str, torch.Tensor]]:
        """(key, step, epoch, batch) for the next batch; advances the stream."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        global_index, idx = self._epoch_batches(self.epoch)[self.position]
        batch = collate([self.split.items[i] for i in idx], self.split.pad_id)
        batch["index"] = torch.tensor(idx, dtype=torch.long)
        out = (batch_key(self.plan_fingerprint, self.epoch, global_index), self.step, self.epoch, batch)
        self.position += 1
        self.step += 1
        return out

    __next__ = next

    def __iter__(self):
        return self

    def state(self) -> dict:
        """JSON-able position: `BatchStream(..., state=s)` continues with the identical batches."""
        return {"epoch": self.epoch, "position": self.position, "step": self.step,
                "fingerprint": self.plan_fingerprint}
