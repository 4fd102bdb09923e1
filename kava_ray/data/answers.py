"""Whether an answer is right: GSM8K's final number in one canonical form (`number`), or the whole
completion (`exact`). The one checker every generate-and-score route uses: `kava-ray eval`
(`evaluate.score_answers`), the shipped harness tasks (`kava_gsm8k`, a user's `file:PATH`) and the
task benches."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

CHECKERS = ("number", "exact")

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


def answers_match(pred: Optional[str], gold: Optional[str]) -> bool:
    """GSM8K's correctness: both final answers (`final_answer`) exist and are equal
    (`evaluate.score_answers`, the shipped harness task `kava_gsm8k`)."""
    p = final_answer(pred)
    return p is not None and p == final_answer(gold)


def same_completion(pred: str, gold: str) -> bool:
    """A completion equal to the gold one, surrounding whitespace aside (`bench task --checker
    exact`, the harness tasks of a user's file, `kava-ray eval --tasks file:PATH`)."""
    return pred.strip() == gold.strip()


def correct(checker: str, pred: Optional[str], gold: Optional[str]) -> bool:
    """Whether `pred` answers as `gold` does: `number` (`answers_match`) or `exact` (`same_completion`)."""
    return same_completion(pred or "", gold or "") if checker == "exact" else answers_match(pred, gold)
