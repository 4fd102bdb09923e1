"""`kava-ray eval RUN --tasks ...`: lm-evaluation-harness tasks on a run's student, beside each of
its teachers (and a baseline student), one model at a time on one device; the table and
`RUN_DIR/eval/tasks-*.json`.

Teachers load through the job's own loading code (`core.models.load_model` with their dtype and
quantization: NF4 included; a `.gguf` converted once), the student from the checkpoint. The share of
a teacher's score is student / teacher for a higher-is-better metric and teacher / student for a
lower-is-better one (a perplexity): 1.0 is the teacher's figure either way. With a baseline, the gap
recovered is (student - baseline) / (teacher - baseline), the figure distillation papers report: 0
where training changed nothing, 1 at the teacher; on metrics on a log scale or bounded only
(`has_gap`), never on a perplexity.
"""

from __future__ import annotations

import gc
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from kava_ray.common.config import derive
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_write, format_table
from kava_ray.core.checkpoint import check_whole_student, checkpoint_config, held_checkpoint
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.data.corpus import pydoc_test_records, uniform_bits_per_byte
from kava_ray.data.tasks import PPL_TASK as PPL
from kava_ray.data.tasks import resolve_tasks
from kava_ray.recipes.harness import run_tasks

EVAL_DIR = "eval"  # RUN_DIR/eval/tasks-<checkpoint>-<time>.json
PREFIX = "tasks-"
STUDENT, BASELINE, TEACHER = "student", "baseline", "teacher "  # a model's label: TEACHER + its name


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _baseline_dir(baseline: str, run_dir: Path) -> Path:
    """`--baseline PATH`: a run or checkpoint dir, as given or inside the run's dir (`checkpoint_...`)."""
    p = Path(baseline).expanduser()
    return p if p.exists() or not (run_dir / baseline).exists() else run_dir / baseline


def _loaders(ckpt: Path, cfg, baseline: Optional[str], teachers: bool, runs: Path) -> list:
    """[(label, load(device) -> (model, tokenizer), its Ray resources)] in the order they run; a baseline checkpoint
    (a name is looked up in `runs`, the run's dir) is checked here, before any model loads (the teachers' paths:
    `check_teachers`). A teacher's resources are its own (`teachers[].num_gpus`, `num_cpus`, `label_selector`: where
    the job runs it); a student's one CPU, and a GPU where the cluster has them (`--address`)."""
    dtype = "auto"  # as stored (a run saves fp32 master weights): lm-eval's `dtype=auto`, and what training scores
    mine = {"num_cpus": 1, "num_gpus": None}  # None: one GPU where the cluster has any (`_resources`)

    def student(path):
        return lambda device: (load_model(path, dtype=dtype).to(device), load_tokenizer(path))

    out = [(STUDENT, student(ckpt / "student"), mine)]
    if baseline == "init":  # the student before training: the job's own student, as step 0 built it
        s = cfg.student
        out.append((BASELINE, lambda device: (load_student(s.model, dtype=dtype, keep=s.keep_layers,
                                                           device=device).eval(), load_tokenizer(s.model)), mine))
    elif baseline is not None:
        b_ckpt, _, _ = checkpoint_config(_baseline_dir(baseline, runs))
        check_whole_student(b_ckpt, "evaluate")
        out.append((BASELINE, student(b_ckpt / "student"), mine))
    for t in [t for t in cfg.teachers if t.engine != "openai"] if teachers else []:  # (a URL: no weights here)
        def teacher(device, t=t):
            model = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
            if t.quantization == "none":  # bitsandbytes places a quantized model itself
                model.to(device)
            return model, load_tokenizer(t.model)
        out.append((TEACHER + t.name, teacher, {"num_cpus": t.num_cpus, "num_gpus": t.num_gpus,
                                                "label_selector": t.label_selector}))
    return out


def _score(label: str, load: Callable, tasks: Sequence, prompt_format: str, limit: Optional[int], batch_size: int,
           say: Callable[[str], None], make_bar: Optional[Callable] = None) -> dict:
    """One model on every task, on this process's device: {"result": run_tasks', "uniform": the
    perplexity task's uniform guess (the student's), "device", "pid", "s"}; a line per task done
    (documents, seconds per document)."""
    t0 = time.perf_counter()
    device = _device()
    model, tok = load(device)
    say(f"eval: {label} loaded ({device.type}, {time.perf_counter() - t0:.0f} s)")
    result = {}
    for t in tasks:
        t1 = time.perf_counter()
        one = run_tasks(model, tok, [t], prompt_format, limit, batch_size=batch_size, make_bar=make_bar)
        result.update(one)
        n = sum(r["n"] or 0 for r in one.values())
        spent = time.perf_counter() - t1
        say(f"eval: {label}: {t.name} done, {n} documents ({spent / max(n, 1):.2f} s per document)")
    uniform = uniform_reference(tok, limit) if label == STUDENT and PPL in result else None
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"result": result, "uniform": uniform, "device": device.type, "pid": os.getpid(),
            "s": round(time.perf_counter() - t0, 1)}


def _on_cluster(cfg, address: str, loaders: list, args: tuple, names: str) -> dict:
    """Every model a Ray task of its own resources on the cluster at `address`, side by side (each
    where it can run: a teacher where the job would run it); a line as each one ends. Returns
    `_score`'s dict per label, with the node and the task's start and end."""
    import ray

    from kava_ray.runtime.connect import resolve_use_gpu
    from kava_ray.runtime.console import status
    from kava_ray.runtime.job import job_session

    with job_session(cfg, address, require_cluster=True):
        gpus = 1 if resolve_use_gpu(cfg.ray.use_gpu) else 0
        pending = {}
        for label, load, res in loaders:
            opts = {"num_cpus": res["num_cpus"], "num_gpus": gpus if res["num_gpus"] is None else res["num_gpus"]}
            if res.get("label_selector"):
                opts["label_selector"] = res["label_selector"]
            ref = ray.remote(_score_task).options(name=f"kava-eval {label}", **opts).remote(label, load, *args)
            pending[ref] = label
        status(f"eval: {len(pending)} models on {names}, side by side on the cluster ({address})")
        out = {}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            label = pending.pop(done[0])
            out[label] = ray.get(done[0])
            status(f"eval: {label} done on {out[label]['node']} ({out[label]['device']}, {out[label]['s']:.0f} s)")
    return out


def _score_task(label: str, load: Callable, *args) -> dict:
    """`_score` in a Ray task: its lines in the task's log, its node and times in the result."""
    import socket

    start = time.time()
    r = _score(label, load, *args, say=lambda line: print(line, flush=True))
    return {**r, "node": socket.gethostname(), "start": start, "end": time.time()}


def console_bar(label: str, every_s: float = 30.0) -> Callable:
    """lm-eval's request bars as the console's one bar, named by model; where the console is not a
    terminal (a log, CI), a line every `every_s` seconds instead: requests done / total and seconds
    per request."""
    from tqdm import tqdm

    from kava_ray.runtime.console import console  # Ray: the CLI's console (this module stays importable without)

    def make(iterable=None, total=None, desc=""):
        what = desc.replace("Running ", "").replace(" requests", "")
        out = console()
        if not getattr(out, "isatty", lambda: False)():
            return _Lines(iterable, total, f"eval: {label}: {what}", lambda line: print(line, file=out, flush=True),
                          every_s)
        return tqdm(iterable, total=total, desc=f"eval {label}: {what}", file=out, leave=False,
                    dynamic_ncols=True, unit="req")
    return make


class _Lines:
    """The tqdm calls lm-eval makes (iterate, update, close), as a progress line every `every_s` seconds."""

    def __init__(self, iterable, total: Optional[int], desc: str, say: Callable[[str], None], every_s: float):
        self.iterable, self.total, self.desc, self.say, self.every_s = iterable, total, desc, say, every_s
        self.n, self.t0 = 0, time.perf_counter()
        self.last = self.t0

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            self.say(f"{self.desc} {self.n}{of} requests ({(now - self.t0) / self.n:.2f} s each)")

    def close(self) -> None:
        pass

    def __getattr__(self, name):  # set_description, set_postfix, refresh, ...: nothing to show
        return lambda *a, **k: None


def uniform_reference(tokenizer, limit: Optional[int]) -> dict:
    """`kava_pydoc_ppl`'s bits_per_byte and byte_perplexity for a uniform guess over `tokenizer`'s
    vocabulary, on the documents the task read (its first `limit`): the figure a model must beat to
    have learned anything of the text (`corpus.uniform_bits_per_byte`)."""
    texts = [r["text"] for r in pydoc_test_records()[:limit]]
    bpb = uniform_bits_per_byte(tokenizer, texts)
    return {f"{PPL}/bits_per_byte": bpb, f"{PPL}/byte_perplexity": 2.0 ** bpb}


def _figure(result: dict, task: str, metric: str) -> Optional[float]:
    """One model's figure for a task's metric in a `run_tasks` result (None where it has none)."""
    return result.get(task, {}).get("metrics", {}).get(metric)


def _share(s: float, t: float, higher: bool) -> Optional[float]:
    num, den = (s, t) if higher else (t, s)
    return num / den if den else None


# lm-eval's perplexities: exponentials of a mean log-loss, unbounded, on which a linear gap reads a
# ratio as a distance (the demo's three models recover 0.945 of the gap in word perplexity, 0.336 in
# byte perplexity and 0.101 in bits per byte, the same models on the same documents)
PERPLEXITIES = frozenset({"perplexity", "word_perplexity", "byte_perplexity", "token_perplexity"})


def has_gap(metric: str) -> bool:
    """Whether the gap recovered is shown for `metric` (lm-eval's name, `metric/filter` too):
    metrics on a log scale or bounded (accuracy, exact match, f1, bits per byte, a log-perplexity),
    never a perplexity (`PERPLEXITIES`)."""
    return metric.split("/")[0] not in PERPLEXITIES


def _recovered(s: float, b: float, t: float, higher: bool) -> Optional[float]:
    """(s - b) / (t - b) where the teacher is better than the baseline; else None (the ratio would flip sign)."""
    return (s - b) / (t - b) if (t > b if higher else t < b) else None


def compare(models: dict) -> dict:
    """{"share": {teacher: {task/metric: share}}, "gap_recovered": {teacher: {...}}} of `models` (label ->
    `run_tasks` result); gap recovered only with a baseline, and only for the metrics `has_gap` allows."""
    student, base = models[STUDENT], models.get(BASELINE)
    share, rec = {}, {}
    for label, r in models.items():
        if not label.startswith(TEACHER):
            continue
        t = label[len(TEACHER):]
        share[t], rec[t] = {}, {}
        for task, sr in student.items():
            for m, s in sr["metrics"].items():
                tv, higher = _figure(r, task, m), sr["higher_is_better"].get(m, True)
                if tv is None:
                    continue
                share[t][f"{task}/{m}"] = _share(s, tv, higher)
                if base is not None and has_gap(m) and _figure(base, task, m) is not None:
                    rec[t][f"{task}/{m}"] = _recovered(s, _figure(base, task, m), tv, higher)
    return {"share": share, "gap_recovered": rec if base is not None else {}}


def evaluate_tasks(path, tasks: Sequence[str], limit: Optional[int] = None, teachers: bool = True,
                   baseline: Optional[str] = None, overrides: Optional[Sequence[str]] = None,
                   address: Optional[str] = None) -> dict:
    """The harness's `tasks` on a checkpoint's student (`path`: a run or checkpoint dir), then on
    `baseline` ("init": the student before training; a checkpoint) and each teacher, the first
    `limit` documents of each task; written to RUN_DIR/eval/. Every name, path and override is
    checked before any model loads."""
    from kava_ray.runtime.console import status  # Ray: see console_bar

    with held_checkpoint(path) as (ckpt, real, live):  # a live run's checkpoint stays while it is read
        if live:
            status(f"eval: {live}")
        return _evaluate_tasks(ckpt, real, tasks, limit, teachers, baseline, overrides, address)


def _evaluate_tasks(ckpt: Path, real: Path, tasks: Sequence[str], limit: Optional[int], teachers: bool,
                    baseline: Optional[str], overrides: Optional[Sequence[str]], address: Optional[str]) -> dict:
    from kava_ray.recipes.evaluate import eval_config
    from kava_ray.runtime.console import status  # Ray: see console_bar
    from kava_ray.runtime.preflight import check_teachers

    t0 = time.perf_counter()
    ckpt, state, cfg = checkpoint_config(ckpt)
    cfg = eval_config(cfg, overrides)
    check_whole_student(ckpt, "evaluate")
    harness_tasks = resolve_tasks(tasks)  # unknown names, offline Hub data: one line, nothing loaded or written
    if teachers:  # their local paths (weights, tokenizers), as a job's preflight checks them
        check_teachers(derive(cfg, {"data.kv_source": "live"}), "eval")
    loaders = _loaders(ckpt, cfg, baseline, teachers, runs=real.parent)
    names = ", ".join(t.name for t in harness_tasks)
    args = (harness_tasks, cfg.data.prompt_format, limit, cfg.train.batch_size)
    if address is None:  # one model at a time, on this machine's device
        scored = {}
        for label, load, _ in loaders:
            status(f"eval: {label} on {names} ({_device().type})")
            scored[label] = _score(label, load, *args, say=status, make_bar=console_bar(label))
    else:
        scored = _on_cluster(cfg, address, loaders, args, names)
    models = {label: v["result"] for label, v in scored.items()}
    uniform = scored[STUDENT]["uniform"]
    device = "/".join(sorted({v["device"] for v in scored.values()}))
    out = {"checkpoint": str(real.resolve()), "step": state["step"], "tasks": [t.name for t in harness_tasks],
           "limit": limit, "baseline": baseline, "device": device, "models": models, **compare(models),
           "uniform": uniform, "ran": {label: {k: v[k] for k in ("device", "pid", "s", "node", "start", "end")
                                              if k in v} for label, v in scored.items()},
           "address": address, "wall_s": round(time.perf_counter() - t0, 1)}
    dest = real.resolve().parent / EVAL_DIR / f"{PREFIX}{real.name}-{datetime.now():%Y%m%d-%H%M%S}.json"
    atomic_write(dest, json.dumps(out, indent=1, default=float) + "\n")
    out["written"] = str(dest)
    return out


def _fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}" if abs(v) >= 1000 or 0 < abs(v) < 1e-3 else f"{v:.4f}"


def _fmt_n(n) -> str:
    return "—" if n is None else str(n)  # (a group's: lm-eval counts its tasks' documents, not its own)


def format_tasks(out: dict) -> str:
    """One row per task and metric: documents, each model's figure, each teacher's share (and gap recovered)."""
    models = out["models"]
    own = [m for m in models if not m.startswith(TEACHER)]  # the student (and the baseline)
    teachers = {m: m[len(TEACHER):] for m in models if m.startswith(TEACHER)}  # label -> name
    gaps = out.get("gap_recovered")
    header = ["task", "metric", "n", *own]
    for t, name in teachers.items():
        header += [t, f"share of {name}"] + ([f"gap recovered ({name})"] if gaps else [])
    rows = []
    for task, r in models[STUDENT].items():
        for m in r["metrics"]:
            key = f"{task}/{m}"
            row = [task, m + ("" if r["higher_is_better"].get(m, True) else " (lower better)"), _fmt_n(r["n"])]
            row += [_fmt(_figure(models[k], task, m)) for k in own]
            for t, name in teachers.items():
                row += [_fmt(_figure(models[t], task, m)), _fmt(out["share"][name].get(key))]
                if gaps:
                    row.append(_fmt(gaps[name].get(key)))
            rows.append(row)
    lines = [format_table(header, rows), ""]
    if out.get("uniform"):
        lines.append("a uniform guess over the student's vocabulary (above it: worse than guessing): " +
                     ", ".join(f"{k} {_fmt(v)}" for k, v in out["uniform"].items()))
    lines.append(f"step {out['step']} of {out['checkpoint']}; {out['device']}; {out['wall_s']:.0f} s")
    if out.get("written"):
        lines.append(f"results: {out['written']}")
    return "\n".join(lines)


def latest_tasks_result(run_dir) -> Optional[dict]:
    """The newest `RUN_DIR/eval/tasks-*.json` (`kava-ray report`), or None."""
    found = sorted(Path(run_dir, EVAL_DIR).glob(f"{PREFIX}*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        return None
    try:
        out = json.loads(found[-1].read_text())
    except (OSError, ValueError) as e:
        raise KavaError(f"{found[-1]}: not a readable eval result ({e})") from None
    out["written"] = str(found[-1])
    return out
