"""`kava-ray data ...`: the offline corpus, written and put on record.

`kava-ray data pydoc --out DIR` writes the Python-docs corpus (`kava_ray.data.corpus`) and prints,
under a job's student tokenizer (default the demo's SmolLM2), each split's topics, documents and
tokens, and the held-out CE on the packed test split of the job's first teacher and of its student
-- the gap distillation could close.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Optional

from kava_ray.common.config import load_config
from kava_ray.common.files import format_table
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.data.corpus import write_pydoc_corpus
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.recipes.evaluate import heldout_ce
from kava_ray.runtime.preflight import check_model_files


def corpus_job(config, out: Path, block: int, overrides: Optional[list[str]] = None):
    """The job `config` reading the corpus at `out`: text records packed into `block`-token rows,
    the validation split of its own, every record of every split."""
    return load_config(config, [f"data.source={out}/{{split}}.jsonl", "data.format=text", "data.val_split=validation",
                                "data.num_train=null", "data.num_val=null", "data.num_test=null",
                                f"train.max_length={block}", *(overrides or [])])


def pydoc_corpus(out, config: str = "demo_cpu", block: int = 128, overrides: Optional[list[str]] = None,
                 models: bool = True) -> dict:
    """Write the corpus to `out`; count its tokens under the job's student tokenizer; with `models`,
    the test split's CE (and perplexity) under the job's first teacher and its student as built
    (`keep_layers`)."""
    written = write_pydoc_corpus(out)
    root = Path(written["train"]["path"]).parent
    cfg = corpus_job(config, root, block, overrides)
    tok = load_tokenizer(cfg.student.model)
    train, val = load_splits(cfg.data, cfg.train, tok)
    test = load_test_split(cfg.data, cfg.train, tok)
    result = {"out": str(root), "config": str(config), "block": block, "tokenizer": cfg.student.model, "splits": {}}
    for name, split in (("train", train), ("validation", val), ("test", test)):
        result["splits"][name] = {**written[name], "blocks": len(split), "tokens": int(split.lengths.sum())}
    if models:
        check_model_files(cfg)
        t = cfg.teachers[0]
        t0 = time.time()
        teacher = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
        student = load_student(cfg.student.model, dtype="float32", keep=cfg.student.keep_layers).eval()
        ce = {"teacher": heldout_ce(teacher, test), "student": heldout_ce(student, test)}
        result.update(teacher=t.name, student_layers=cfg.student.keep_layers, test_ce=ce,
                      test_ppl={k: math.exp(min(v, 50.0)) for k, v in ce.items()}, gap=ce["student"] - ce["teacher"],
                      models_s=time.time() - t0)
    return result


def format_pydoc(r: dict) -> str:
    rows = [[n, s["topics"], s["chars"], s["tokens"], s["blocks"]] for n, s in r["splits"].items()]
    lines = [f"Python-docs corpus in {r['out']}: one record per topic, split by topic "
             f"(tokens under {r['tokenizer']}, packed into {r['block']}-token blocks)",
             format_table(["split", "topics", "characters", "tokens (packed)", "blocks"], rows)]
    if "test_ce" in r:
        ce, ppl = r["test_ce"], r["test_ppl"]
        lines += [f"test split CE: teacher {r['teacher']} {ce['teacher']:.3f} nats (ppl {ppl['teacher']:.1f}), "
                  f"student (layers {r['student_layers']}) {ce['student']:.3f} nats (ppl {ppl['student']:.0f}): "
                  f"a gap of {r['gap']:.2f} nats to close",
                  f"use it: kava-ray train --config {r['config']} data.source={r['out']}/{{split}}.jsonl "
                  f"data.val_split=validation data.num_train=null data.num_val=null data.num_test=null "
                  f"train.max_length={r['block']}"]
    return "\n".join(lines)
