"""lm-evaluation-harness tasks on a model in memory: `run_tasks` (the student during training,
`train.eval_tasks`; a checkpoint's student, its baseline and its teachers, `kava-ray eval RUN
--tasks`), and the table of them.

The harness computes every figure (`lm_eval.simple_evaluate` on `lm_eval.models.huggingface.HFLM`
built around the loaded model): the numbers are the ones `lm_eval --model hf` reports for the same
weights, tasks and limit. Tasks are resolved (and their data loaded) beforehand by
`kava_ray.data.tasks.resolve_tasks`. No Ray here: the training worker and `kava-ray eval` call it
alike.
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.metric_names import TASK_PREFIX
from kava_ray.data.records import use_chat
from kava_ray.data.tasks import HarnessTask, lm_eval_quiet, task_manager

# where lm-eval makes its bars; those of its requests ("Running generate_until requests", ...) are the progress shown
BAR_MODULES = ("lm_eval.models.huggingface", "lm_eval.api.model", "lm_eval.api.task")


PIP_NAMES = {"sklearn": "scikit-learn"}  # a module lm-eval imports for a metric -> its package


def _chat(tokenizer, prompt_format: str) -> bool:
    """Whether a model's prompts go through its chat template: the job's `data.prompt_format` as the
    student's training records used it (`records.use_chat`); `chat` for a tokenizer without one (a
    teacher's) reads plain."""
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        return False
    return use_chat(tokenizer, prompt_format)


@contextlib.contextmanager
def _bars(make_bar: Optional[Callable]):
    """lm-eval's request bars made by `make_bar(iterable, total=, desc=)` (the console's one bar);
    its other bars (building contexts, rolling windows) and, without `make_bar`, all of them:
    none."""
    import importlib

    mods = [importlib.import_module(m) for m in BAR_MODULES]
    saved = [m.tqdm for m in mods]

    def bar(iterable=None, *, total=None, desc="", disable=False, **_):
        if make_bar is None or disable or not str(desc).startswith("Running"):
            from tqdm import tqdm

            return tqdm(iterable, total=total, disable=True)
        return make_bar(iterable, total=total if total is not None else _len(iterable), desc=desc)

    for m in mods:
        m.tqdm = bar
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            m.tqdm = t


def _len(iterable):
    try:
        return len(iterable)
    except TypeError:
        return None


@contextlib.contextmanager
def _rng_kept():
    """The harness seeds Python's, NumPy's and torch's generators (its defaults, for its
    reproducibility): the caller's streams (a training run's dropout, data order) continue
    afterwards as if it had not run."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def run_tasks(model, tokenizer, tasks: Sequence[HarnessTask], prompt_format: str = "auto",
              limit: Optional[int] = None, batch_size: int = 8, make_bar: Optional[Callable] = None,
              responses: bool = False, max_length: Optional[int] = None) -> dict:
    """{task name: {"metrics": {metric: value}, "n": documents evaluated, "higher_is_better":
    {metric: bool}}}; `responses`: also "responses", the model's raw output per document in document
    order.

    One `simple_evaluate` per task as named: a task or a group with an aggregate is reported under
    its name; a tag, a group without one or a YAML path under each of the tasks lm-eval ran for it
    (a name that yields no figure is one KavaError). A shipped task with a chat variant runs that
    variant, through the chat template, for a model that `_chat` says uses it (reported under the
    task's own name). Greedy where the task says so, zero-shot unless it sets shots, `limit`: the
    first N documents of each task; `max_length`: the context HFLM reads (None: lm-eval's default,
    the model's). `bootstrap_iters=0` (no stderr: 100,000 resamples a metric otherwise). The model's
    train/eval mode and the caller's random streams are as they were afterwards."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm_eval_quiet()
    chat = _chat(tokenizer, prompt_format)
    was_training, out = model.training, {}
    try:
        with _rng_kept(), _bars(make_bar):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
            for t in tasks:
                templated = chat and t.chat_spec is not None
                spec = t.chat_spec if templated else t.spec
                try:
                    res = simple_evaluate(model=lm, tasks=[spec], task_manager=task_manager(t.builtin), limit=limit,
                                          bootstrap_iters=0, log_samples=responses, apply_chat_template=templated)
                except ModuleNotFoundError as e:  # a metric's package (scikit-learn for f1 / mcc: the Makefile's)
                    pkg = PIP_NAMES.get(e.name, e.name)
                    raise KavaError(f"eval task {t.name!r}: lm-eval needs {e.name} for it: pip install {pkg}") from None
                out.update(_named_results(res, t.name, spec if isinstance(spec, str) else spec["task"], responses))
    finally:
        model.train(was_training)
    return out


def _named_results(res: dict, name: str, key: str, responses: bool) -> dict:
    """{reported name: result} of one task as named: its own row (`key`: the task, group or chat
    variant lm-eval ran) as `name`, else every row lm-eval reports for it under the row's name."""
    rows = [key] if key in res["results"] or key in res.get("groups", {}) else list(res["results"])
    out = {}
    for row in rows:
        r = _task_result(res, row)
        if r["metrics"]:
            if responses:
                docs = sorted(res.get("samples", {}).get(row, []), key=lambda d: d["doc_id"])
                r["responses"] = [d["resps"][0][0] for d in docs]
            out[name if row == key else row] = r
    if not out:
        raise KavaError(f"eval task {name!r}: lm-eval reported no figure for it")
    return out


def _task_result(res: dict, key: str) -> dict:
    """A task's (or group's) metrics from `simple_evaluate`'s result: `<metric>,<filter>` -> `metric` (filter
    `none`) or `metric/filter`; the stderr entries left out (none are computed). A direction lm-eval leaves
    undecided (a group whose members disagree: None) reads as higher is better."""
    row = res["results"].get(key) or res.get("groups", {}).get(key) or {}
    metrics, better = {}, res.get("higher_is_better", {}).get(key, {})
    for k, v in row.items():
        if "," not in k or "_stderr" in k or not isinstance(v, (int, float)):
            continue
        metric, filt = k.split(",", 1)
        metrics[metric if filt == "none" else f"{metric}/{filt}"] = float(v)
    n = res.get("n-samples", {}).get(key, {}).get("effective")
    return {"metrics": metrics, "n": n,
            "higher_is_better": {m: better.get(m.split("/")[0]) is not False for m in metrics}}


def task_metrics(results: dict) -> dict[str, float]:
    """`run_tasks`' result as flat `eval/task/<task>/<metric>` figures (metrics.jsonl, the trackers)."""
    return {f"{TASK_PREFIX}{t}/{m}": v for t, r in results.items() for m, v in r["metrics"].items()}
