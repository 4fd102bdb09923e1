"""The shipped lm-evaluation-harness tasks' Python side (`!function kava_utils.<name>` in the YAMLs
beside it): their data, built offline from kava-ray's own generators, and GSM8K's scoring,
kava-ray's own.

lm-eval imports this file by its path (the YAMLs' directory), so it imports kava-ray by name.
"""

from __future__ import annotations


def gsm8k_test(n: int = 200, seed: int = 0, **_) -> dict:
    """{"test": Dataset} of the synthetic GSM8K's held-out problems: `synthetic_split(n, seed,
    "test")`, the test split of a `data.source: synthetic` job with the same seed (the demo's first
    `data.num_test` of them), never a training problem of any seed. `**_`: lm-eval also passes the
    task's metadata."""
    import datasets

    from kava_ray.data.synthetic import synthetic_split

    rows = [{"question": e.question, "answer": e.answer} for e in synthetic_split(n, seed, "test")]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def pydoc_test(**_) -> dict:
    """{"test": Dataset} of the Python-docs corpus' test topics (`kava_ray.data.corpus`; `kava-ray
    data pydoc`'s test.jsonl): {"text", "topic"} rows, natural text every Python install has."""
    import datasets

    from kava_ray.data.corpus import pydoc_test_records

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(pydoc_test_records())})


def gsm8k_results(doc: dict, results: list) -> dict:
    """accuracy 1/0 of one greedy completion: `normalize_number(final_answer(.))` of it and of the
    gold answer equal, exactly as `kava_ray.recipes.evaluate.score_answers` (`gsm8k_accuracy`)
    scores it."""
    from kava_ray.data.answers import correct

    return {"accuracy": float(correct("number", results[0], doc["answer"]))}
