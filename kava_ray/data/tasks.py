"""lm-evaluation-harness tasks by name, each checked (its data loaded) before any model loads.

Three kinds of names (`kava-ray eval RUN --tasks ...`, `train.eval_tasks`):
- the tasks shipped in `lm_eval_tasks/` (package data, offline): `kava_gsm8k` (the synthetic GSM8K's held-out
  problems, scored as `evaluate.gsm8k_accuracy` scores them) and `kava_pydoc_ppl` (perplexity on the Python-docs
  corpus' test topics); `lm-eval --include_path <that dir>` runs them too;
- `file:PATH`: a user's JSONL of {"prompt", "completion"} strings, greedy, exact match of the completion
  (`answers.same_completion`), the prompt as kava-ray renders a prompt/completion record (plain, no template);
- any lm-eval task, group or tag (`lm-eval ls tasks`), its data from the Hugging Face Hub or the HF cache.

A name that cannot load is one KavaError line naming it and what to do. lm-eval is imported here,
not at the top: what only reads configs never pays for it.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line
from kava_ray.data.answers import correct

SHIPPED_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
PPL_TASK = "kava_pydoc_ppl"  # the shipped perplexity task (`kava-ray eval` sets a uniform guess beside it)
SHIPPED = ("kava_gsm8k", PPL_TASK)
CHAT_VARIANTS = {"kava_gsm8k": "kava_gsm8k_chat"}  # the same task through the chat template
FILE = "file:"
FILE_MAX_NEW_TOKENS = 128  # a file task's greedy completions (as the synthetic GSM8K's)


@dataclass(frozen=True)
class HarnessTask:
    """One task as a user named it: `name` (reported), `spec` (what lm-eval's `TaskManager.load` and
    `simple_evaluate(tasks=...)` take: a registered name or a config dict), `chat_spec` (the variant
    for a model whose prompts use its chat template; None: the template is never applied) and
    whether it needs lm-eval's own task index (`builtin`: ~5 s to build)."""

    name: str
    spec: Union[str, dict]
    chat_spec: Union[str, dict, None] = None
    builtin: bool = False


INSTALL = "pip install 'kava-ray[eval]' (make install does it)"


def require_lm_eval() -> None:
    """One line with the install when lm-evaluation-harness is missing (the `eval` extra)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise KavaError(f"eval tasks need lm-evaluation-harness: {INSTALL}")


def lm_eval_quiet() -> None:
    """lm-eval's chatter off (its INFO/WARNING lines; `git describe` in the working directory and
    the environment report it adds to a result)."""
    import lm_eval.evaluator

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    lm_eval.evaluator.add_env_info = lambda results: None  # torch's collect_env, shelling out: 0.3 s a call


@functools.cache
def task_manager(builtin: bool):
    """lm-eval's TaskManager over the shipped tasks, with its own ~15,000 task names only when asked."""
    from lm_eval.tasks import TaskManager

    lm_eval_quiet()
    return TaskManager(include_path=str(SHIPPED_DIR), include_defaults=builtin)


def _file_task(arg: str) -> HarnessTask:
    """`file:PATH` as a task config: the file read and every row checked here (one line for the first problem)."""
    path = Path(arg[len(FILE):]).expanduser()
    if not path.is_file():
        raise KavaError(f"eval task {arg}: no such file")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KavaError(f"eval task {arg}: cannot read it ({e})") from None
    n = 0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise KavaError(f"eval task {arg}: line {i} is not JSON ({e})") from None
        if not (isinstance(row, dict) and isinstance(row.get("prompt"), str)
                and isinstance(row.get("completion"), str)):
            raise KavaError(f"eval task {arg}: line {i} needs string fields prompt and completion")
        n += 1
    if n == 0:
        raise KavaError(f"eval task {arg}: the file has no records")
    name = "file_" + re.sub(r"\W", "_", path.stem)
    spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path.resolve())}},
            "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{completion}}",
            "generation_kwargs": {"until": [], "do_sample": False, "max_gen_toks": FILE_MAX_NEW_TOKENS},
            "process_results": _file_results,
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}
    return HarnessTask(name, spec)


def _file_results(doc: dict, results: list) -> dict:
    return {"exact_match": float(correct("exact", results[0], doc["completion"]))}


def parse_task(arg: str) -> HarnessTask:
    """One name as a `HarnessTask` (a file task's file is read and checked here; nothing is loaded yet)."""
    if arg.startswith(FILE):
        return _file_task(arg)
    if arg in SHIPPED:
        return HarnessTask(arg, arg, CHAT_VARIANTS.get(arg))
    return HarnessTask(arg, arg, builtin=True)


def _load(task: HarnessTask, spec) -> None:
    import datasets.utils as du

    tm = task_manager(task.builtin)
    was_off = du.are_progress_bars_disabled()
    du.disable_progress_bars()  # datasets' "Generating test split" bar: a check prints nothing
    try:
        tm.load([spec])
    except KeyError as e:
        if "not a registered" not in str(e):  # a KeyError of the task's own data processing: below
            raise _unloadable(task, e) from None
        close = difflib.get_close_matches(task.name, [*SHIPPED, *tm.all_tasks], n=1, cutoff=0.85)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise KavaError(f"unknown eval task {task.name!r}{hint}: not one of kava-ray's ({', '.join(SHIPPED)}, "
                        f"file:PATH) nor an lm-eval task, group or tag (`lm-eval ls tasks` lists them)") from None
    except Exception as e:  # noqa: BLE001 - whatever stops its data loading (offline, a missing file) is one line
        raise _unloadable(task, e) from None
    finally:
        if not was_off:
            du.enable_progress_bars()


def _unloadable(task: HarnessTask, e: BaseException) -> KavaError:
    return KavaError(f"eval task {task.name!r}: its data cannot be loaded ({first_line(e, with_type=True)}); a Hub "
                     f"dataset needs the network or its copy in the Hugging Face cache, or use kava-ray's offline "
                     f"tasks ({', '.join(SHIPPED)}) or file:PATH")


def resolve_tasks(names: Optional[Sequence[str]]) -> list[HarnessTask]:
    """Every named task parsed and loaded once (its data read, no model), in order; duplicates and
    empty names are one line. The first that fails is one KavaError line naming it."""
    names = [n.strip() for n in (names or [])]
    if not names or any(not n for n in names):
        raise KavaError("eval tasks: give one or more task names (e.g. kava_gsm8k,kava_pydoc_ppl or file:PATH)")
    require_lm_eval()
    tasks = [parse_task(n) for n in names]
    seen = [t.name for t in tasks]
    dup = next((n for n in seen if seen.count(n) > 1), None)
    if dup is not None:
        raise KavaError(f"eval tasks: {dup} is named twice")
    for t in tasks:
        for spec in (t.spec, t.chat_spec):
            if spec is not None:
                _load(t, spec)
    return tasks
