"""lm-evaluation-harness tasks on a model in memory: `run_tasks` (the student during training, `train.eval_tasks`;
a checkpoint's student, its baseline and its teachers, `kava-ray eval RUN --tasks`), and the table of them.

The harness computes every figure (`lm_eval.simple_evaluate` on `lm_eval.models.huggingface.HFLM` built around the
loaded model): the numbers are the ones `lm_eval --model hf` reports for the same weights, tasks and limit. Tasks
are resolved (and their data loaded) beforehand by `kava_ray.data.tasks.resolve_tasks`. No Ray here: the training
worker and `kava-ray eval` call it alike.
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from kava_ray.core.metric_names import TASK_PREFIX
from kava_ray.data.records import use_chat
from kava_ray.data.tasks import HarnessTask, lm_eval_quiet, task_manager

# where lm-eval makes its bars; those of its requests ("Running generate_until requests", ...) are the progress shown
BAR_MODULES = ("lm_eval.models.huggingface", "lm_eval.api.model", "lm_eval.api.task")


def _chat(tokenizer, prompt_format: str) -> bool:
    """Whether a model's prompts go through its chat template: the job's `data.prompt_format` as the student's
    training records used it (`records.use_chat`); `chat` for a tokenizer without one (a teacher's) reads plain."""
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        return False
    return use_chat(tokenizer, prompt_format)


@contextlib.contextmanager
def _bars(make_bar: Optional[Callable]):
    """lm-eval's request bars made by `make_bar(iterable, total=, desc=)` (the console's one bar); its other bars
    (building contexts, rolling windows) and, without `make_bar`, all of them: none."""
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
    """The harness seeds Python's, NumPy's and torch's generators (its defaults, for its reproducibility): the
    caller's streams (a training run's dropout, data order) continue afterwards as if it had not run."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def run_tasks(model, tokenizer, tasks: Sequence[HarnessTask], prompt_format: str = "auto",
              limit: Optional[int] = None, batch_size: int = 8, make_bar: Optional[Callable] = None,
              responses: bool = False) -> dict:
    """{task name: {"metrics": {metric: value}, "n": documents evaluated, "higher_is_better": {metric: bool}}};
    `responses`: also "responses", the model's raw output per document in document order.

    One `simple_evaluate` for the tasks read plain and one for those read through the chat template (a shipped
    task's chat variant, for a model that `_chat` says uses it; reported under the task's own name). Greedy where
    the task says so, zero-shot unless the task sets shots, `limit`: the first N documents of each task.
    `bootstrap_iters=0` (no stderr: 100,000 resamples a metric otherwise). The model's train/eval mode and the
    caller's random streams are as they were afterwards."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm_eval_quiet()
    chat = _chat(tokenizer, prompt_format)
    groups: dict[bool, list[tuple[str, object]]] = {False: [], True: []}
    for t in tasks:
        use = chat and t.chat_spec is not None
        groups[use].append((t.name, t.chat_spec if use else t.spec))
    was_training, out = model.training, {}
    try:
        with _rng_kept(), _bars(make_bar):
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
            for templated, specs in groups.items():
                if not specs:
                    continue
                builtin = any(t.builtin for t in tasks if t.name in dict(specs))
                res = simple_evaluate(model=lm, tasks=[s for _, s in specs], task_manager=task_manager(builtin),
                                      limit=limit, bootstrap_iters=0, log_samples=responses,
                                      apply_chat_template=templated)
                for name, spec in specs:
                    key = spec if isinstance(spec, str) else spec["task"]
                    out[name] = _task_result(res, key)
                    if responses:
                        docs = sorted(res["samples"].get(key, []), key=lambda d: d["doc_id"])
                        out[name]["responses"] = [d["resps"][0][0] for d in docs]
    finally:
        model.train(was_training)
    return {t.name: out[t.name] for t in tasks}  # in the order asked


def _task_result(res: dict, key: str) -> dict:
    """A task's (or group's) metrics from `simple_evaluate`'s result: `<metric>,<filter>` -> `metric` (filter
    `none`) or `metric/filter`; the stderr entries left out (none are computed)."""
    row = res["results"].get(key) or res.get("groups", {}).get(key) or {}
    metrics, better = {}, res.get("higher_is_better", {}).get(key, {})
    for k, v in row.items():
        if "," not in k or "_stderr" in k or not isinstance(v, (int, float)):
            continue
        metric, filt = k.split(",", 1)
        metrics[metric if filt == "none" else f"{metric}/{filt}"] = float(v)
    n = res.get("n-samples", {}).get(key, {}).get("effective")
    return {"metrics": metrics, "n": n,
            "higher_is_better": {m: bool(better.get(m.split("/")[0], True)) for m in metrics}}


def task_metrics(results: dict) -> dict[str, float]:
    """`run_tasks`' result as flat `eval/task/<task>/<metric>` figures (metrics.jsonl, the trackers)."""
    return {f"{TASK_PREFIX}{t}/{m}": v for t, r in results.items() for m, v in r["metrics"].items()}
