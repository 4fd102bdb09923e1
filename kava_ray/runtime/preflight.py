"""Preflight: every input a command reads, checked in the driver before Ray starts.

`preflight(cfg, command, ...)` is the first call of every command that starts Ray; each problem is
one `KavaError` line naming the key or file, in well under 5 s. What it checks, in which order, and
why: docs/internals/runtime.md#preflight. `prepare_data` (train's driver, before its workers start)
then tokenizes the splits once, with the checks only the whole data decides: rows shared between
splits, records naming a teacher.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from huggingface_hub import constants

from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError, NothingToDo
from kava_ray.common.files import name_problem
from kava_ray.core.align.layers import load_layer_map
from kava_ray.core.checkpoint import STATE, check_compatible, check_files, find_checkpoint, finished, read_state
from kava_ray.core.models import PYPI_SCHEME, load_model_config, load_tokenizer, resolve_model, resolve_packaged_file
from kava_ray.core.plans import (
    check_writer,
    cross_vocab,
    logits_top_k,
    onpolicy_writer,
    shares_tokenizer_here,
    student_tokenizer,
)
from kava_ray.data.batching import ROUTE
from kava_ray.data.sources import check_source
from kava_ray.data.splits import carved, check_overlap, load_splits, load_test_split
from kava_ray.data.tasks import resolve_tasks
from kava_ray.data.tokenize import TokenizedSplit
from kava_ray.rollout.vllm_engine import check_tensor_parallel, require_vllm

COMMANDS = ("train", "tune", "eval", "teachers precompute", "align cka", "demo")


def preflight(cfg: JobConfig, command: str, resume=None, space: Optional[str] = None, *,
              resume_override: bool = False, address: Optional[str] = None, out=None,
              name: Optional[str] = None) -> None:
    """Check everything `command` will read or write before anything starts; one KavaError line for
    the first problem, None when all is well.

    resume: train -- a run or checkpoint dir (`--resume`); eval -- the checkpoint being evaluated;
    tune -- a sweep dir or name. space: tune's search space. resume_override: train's
    `--resume-override`. address: the command's `--address` (teacher paths are checked only for an
    embedded Ray). out: the output dir of `teachers precompute` / `align cka` (default for the
    latter: under `ray.storage_path`). name: `--name`, a run's or sweep's directory under
    `ray.storage_path`.
    """
    if command not in COMMANDS:
        raise ValueError(f"preflight: unknown command {command!r}; expected one of {COMMANDS}")
    if name is not None:
        check_name(name)
    if command == "tune":
        check_space(cfg, space)  # first: the cheapest, and what `kava-ray tune` most often gets wrong
    if resume is not None:
        if command == "tune":
            check_sweep(cfg, resume)
        elif command == "eval":
            check_files(resume)
        else:
            check_resume(cfg, resume, resume_override)
    for split in data_splits(cfg, command):
        check_data(cfg, split)
    check_kv_cache(cfg, command)
    check_layer_map(cfg, command)
    if command == "demo":
        check_model_files(cfg)  # the demo's pypi:// models: the pip command, on a cluster too
    check_student(cfg, command, resume)
    check_teachers(cfg, command, address)
    check_onpolicy_writer(cfg, command)
    check_engines(cfg, command)
    if command in ("train", "tune", "demo") and cfg.train.eval_tasks:
        resolve_tasks(cfg.train.eval_tasks)  # each task's data loaded once here: a name that cannot is one line
    check_context(cfg, command, resume, address)
    if command in ("train", "tune", "demo"):
        check_memory(cfg, address)
    for key, path in output_dirs(cfg, command, out):
        check_writable(path, key)


@contextlib.contextmanager
def about(key: str):
    """Prefix a KavaError raised inside with the config key (or option) it is about, once."""
    try:
        yield
    except KavaError as e:
        msg = str(e)
        raise KavaError(msg if msg.startswith(key) else f"{key}: {msg}") from None


def check_name(name: str) -> None:
    """`--name` is one directory under `ray.storage_path` (`files.name_problem`, the rule the config's `name` has)."""
    why = name_problem(name)
    if why:
        raise KavaError(f"--name {name!r}: {why}")


# ------------------------------------------------------------------------------------------- tune


def check_space(cfg: JobConfig, space: Optional[str]) -> None:
    """The search space parses and every searched key exists in the job config (`load_space` says which)."""
    from kava_ray.runtime.tune_space import load_space  # Ray: recipes.evaluate imports this module, without Ray

    if not space:
        raise KavaError("tune: --space is required (a search-space YAML or a name in tune_spaces/)")
    load_space(space, base=cfg)


def sweep_dir(cfg: JobConfig, resume: str) -> Path:
    """The sweep `--resume` names: a directory, or a sweep name under `ray.storage_path` (the rule
    of `kava_ray.recipes.tune.experiment_dir`)."""
    given = Path(resume).expanduser()
    if given.is_dir() or given.parent != Path("."):
        return given.resolve()
    return Path(cfg.ray.storage_path).expanduser().resolve() / resume


def check_sweep(cfg: JobConfig, resume: str, limit: int = 256) -> None:
    """A sweep to resume exists, and its trials' checkpoints (which restored trials' workers read)
    are readable: a corrupt one is named here rather than in a worker traceback."""
    exp = sweep_dir(cfg, resume)
    if not exp.is_dir():
        raise KavaError(f"tune --resume {resume}: nothing to resume at {exp} (pass the directory of an earlier sweep)")
    for i, state in enumerate(sorted(exp.glob(f"*/run/*/{STATE}"))):
        if i >= limit:
            break
        read_state(state.parent, verify=False)


# ------------------------------------------------------------------------------------- checkpoints


def check_resume(cfg: JobConfig, resume, resume_override: bool = False) -> None:
    """`--resume`: a readable, complete checkpoint this config can continue
    (`checkpoint.check_compatible`: the keys that differ, in one line). A run complete at
    `train.steps` (its final/ written, `checkpoint.finished`), or a checkpoint past it, has nothing
    left to do: NothingToDo (its one line, exit 0) rather than Ray, the teachers and a test split
    evaluated again for nothing. One at `train.steps` without final/ (cut off in the run's end)
    resumes to evaluate the test split and write final/."""
    ckpt = find_checkpoint(resume, for_resume=True)
    check_files(ckpt)
    step = check_compatible(ckpt, cfg, allow_run_changes=resume_override)["step"]
    if step > cfg.train.steps or (step == cfg.train.steps and finished(ckpt, step)):
        at = f"step {step} of {cfg.train.steps}" if step == cfg.train.steps else \
            f"step {step}, past train.steps={cfg.train.steps}"
        raise NothingToDo(f"{resume} is complete ({at}): nothing to resume (to train on, raise train.steps and pass "
                          f"--resume-override)")


# -------------------------------------------------------------------------------------------- data


def data_splits(cfg: JobConfig, command: str) -> list[str]:
    """The splits `command` reads: training data (train and validation) and the test split read at
    the end of a run -- a bad test split found after hours of training is the worst case this
    prevents."""
    d = cfg.data
    if command == "eval":
        return [d.test_split]
    if command == "align cka":
        return [d.train_split]
    return list(dict.fromkeys([d.train_split, *([d.val_split] if d.val_split else []), d.test_split]))


def check_data(cfg: JobConfig, split: str) -> None:
    """`data.source` for `split`: synthetic, a local file whose first records parse and are valid
    records of one format (`data.format`, `data.columns`), or something shaped like a hub id
    (`check_source`)."""
    with about("data.source"):
        fmt = check_source(cfg.data.source, split, fmt=cfg.data.format, columns=cfg.data.columns)
    check_prompts(cfg, fmt if cfg.data.format == "auto" else cfg.data.format)


def check_prompts(cfg: JobConfig, fmt: Optional[str]) -> None:
    """On-policy distillation (`onpolicy.fraction` > 0) samples a completion for each record's
    prompt: text records have none. `fmt`: the records' format, the one place this is decided --
    `data.format`, else as read from the data (`check_data`: a local file, synthetic;
    `recipes.train` once a hub dataset of format auto is tokenized)."""
    if fmt == "text" and cfg.onpolicy.fraction > 0:
        raise KavaError(f"onpolicy.fraction={cfg.onpolicy.fraction}: data.source {cfg.data.source} holds text "
                        f"records, which have no prompt to sample a completion for (on-policy distillation needs "
                        f"prompt_completion, messages or gsm8k records)")


def prepare_data(cfg: JobConfig) -> dict:
    """Tokenize (and pack) the job's splits once in the driver, before any worker starts: a bad
    record deep in the data is one line before Ray starts, and workers load the cached Arrow files.
    Returns row counts (and the records' format)."""
    overlap = check_overlap(cfg.data)  # the same rows in a held-out split: refused (one line) unless allowed
    tok = load_tokenizer(cfg.student.model)
    train, val = load_splits(cfg.data, cfg.train, tok)
    test = load_test_split(cfg.data, cfg.train, tok)
    check_routes(cfg, {"training": train, "validation": val, "test": test})
    return {"train": len(train), "validation": len(val), "test": len(test), "carved": carved(cfg.data),
            "warning": overlap, "format": train.format}


def check_routes(cfg: JobConfig, splits: dict[str, TokenizedSplit]) -> None:
    """Records that name their teacher (column `teacher`: `Batch.route`, read by the logit term)
    name one of the job's logit teachers (`plans.logit_teachers`; the Distiller refuses any other
    mid-run): one line naming the split, row and name, before Ray starts. A teacher of another
    tokenizer counts as one unless loss.logit_cross_vocab=off, when it does only where its tokenizer
    is not at hand here (`shares_tokenizer_here`: None)."""
    if not logits_top_k(cfg.loss):
        return  # no logit term: nothing reads the column
    names, across, student_fp = [t.name for t in cfg.teachers], cross_vocab(cfg.loss) != "off", None
    logit_names = None
    for what, split in splits.items():
        if split.records is None or ROUTE not in split.records.column_names:
            continue
        if logit_names is None:
            if not across:
                student_fp = student_tokenizer(cfg.student)[1]
            logit_names = [n for n in names if across or shares_tokenizer_here(cfg.student, cfg.teacher(n),
                                                                               student_fp) is not False]
        for i, r in enumerate(split.records.select_columns([ROUTE])[ROUTE]):
            if r and r not in logit_names:
                why = (f" ('{r}' uses another tokenizer than the student's and loss.logit_cross_vocab=off)"
                       if r in names else "")
                raise KavaError(f"data.source {cfg.data.source}: row {i} of the {what} split names teacher {r!r} "
                                f"(column '{ROUTE}'), but the job's logit teachers are "
                                f"{', '.join(logit_names) or 'none'}{why}")


def check_kv_cache(cfg: JobConfig, command: str) -> None:
    """`data.kv_source=cache` reads teacher KV from `data.kv_cache_dir`: its manifest must be there
    and parse (`actors.kv_cache.KVCache` reads it; precompute writes it, so it is not checked
    there)."""
    from actors.kv_cache import KVCache  # Ray: see check_space

    if cfg.data.kv_source != "cache" or command == "teachers precompute":
        return
    with about("data.kv_cache_dir"):
        KVCache(Path(cfg.data.kv_cache_dir).expanduser())


def check_layer_map(cfg: JobConfig, command: str) -> None:
    """`align.layer_map=cka`: `align.cka_path` exists and holds a map for every teacher (`align cka`
    itself measures that map, so it is not checked there)."""
    if cfg.align.layer_map != "cka" or command == "align cka":
        return
    with about("align.cka_path"):
        for t in cfg.teachers:
            load_layer_map(Path(cfg.align.cka_path).expanduser(), t.name)


# ------------------------------------------------------------------------------------------ models


def check_model_files(cfg: JobConfig) -> None:
    """Every pypi:// model file of the job must be installed (KavaError names the pip command)."""
    for key, spec in [(f"teachers[{t.name}].model", t.model) for t in cfg.teachers] + [("student.model",
                                                                                         cfg.student.model)]:
        if spec.startswith(PYPI_SCHEME):
            with about(key):
                resolve_packaged_file(spec)


def check_student(cfg: JobConfig, command: str, ckpt=None) -> None:
    """The student resolves (a local dir has config.json, a .gguf exists, a pypi:// package is
    installed) and its tokenizer loads -- the driver tokenizes with it. A hub id is loaded only with
    HF_HUB_OFFLINE (from the cache: instant); online, huggingface_hub retries a missing network for
    minutes, so it stays the loader's. `eval` loads the checkpoint's student instead."""
    if command == "eval" and ckpt is not None:
        with about(f"checkpoint {ckpt}"):
            load_tokenizer(Path(ckpt) / "student")
        return
    with about("student.model"):
        source, gguf = resolve_model(cfg.student.model)
        if gguf is None and not os.path.isdir(source) and not _hub_offline():
            return  # a hub id, online: fetching it is the loader's business (and may take minutes offline)
        load_tokenizer(cfg.student.model)
        if os.path.isdir(source) and gguf is None:
            check_weights(source)
    if os.path.isdir(source) or gguf is not None:  # (a .gguf: its config from the cached conversion the run uses)
        with about("student.keep_layers"):
            load_model_config(cfg.student.model, keep=cfg.student.keep_layers)  # indices within the model's depth


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE: a hub id then loads from the local cache only, so trying it costs no network waits."""
    return bool(constants.HF_HUB_OFFLINE)


def _embedded(cfg: JobConfig, address: Optional[str]) -> bool:
    """True when the command starts its own Ray on this machine (teachers then load here)."""
    return not (address or cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def check_teachers(cfg: JobConfig, command: str, address: Optional[str] = None) -> None:
    """Teachers given as local paths exist (a dir with config.json, an existing .gguf, an installed
    pypi:// package) when they load on this machine; a hub id is the loader's business. Not checked
    when the KV cache serves the teachers, nor on a cluster (a path there is resolved on the
    teacher's node)."""
    if cfg.data.kv_source == "cache" and command != "teachers precompute":
        return
    if not _embedded(cfg, address):
        return
    for t in cfg.teachers:
        if t.engine == "openai":
            check_server(t)
            continue
        with about(f"teachers[{t.name}].model"):
            source, gguf = resolve_model(t.model)
            if not os.path.isdir(source) and gguf is None:
                continue  # a hub id: the loader's
            if gguf is None:
                check_weights(source)
                load_tokenizer(t.model)
            depth = load_model_config(t.model).num_hidden_layers  # (a .gguf: the cached conversion the run uses)
        bad = [i for i in t.layers or [] if i >= depth]
        if bad:
            raise KavaError(f"teachers[{t.name}].layers: layer {bad[0]} is out of range (the model has {depth} "
                            f"layers: 0..{depth - 1})")


def check_server(t) -> None:
    """A teacher behind a URL (`engine: openai`): its tokenizer and config load here (`tokenizer`,
    else the served model's name as a local path or hub id), its key's variable is set, and the
    server answers, serves the model and tokenizes as that tokenizer (`OpenAIServer.check`): one
    line each, before Ray starts."""
    from kava_ray.rollout.openai_server import OpenAIServer

    key = f"teachers[{t.name}].tokenizer" if t.tokenizer else f"teachers[{t.name}].model"
    with about(key):
        tok = load_tokenizer(t.served_from())
        load_model_config(t.served_from())
    OpenAIServer(t.url, t.model, t.name, t.api_key_env, min(t.timeout_s, 30.0), 0, 1).check(tok)


def check_onpolicy_writer(cfg: JobConfig, command: str) -> None:
    """`onpolicy.source: teacher`: the teacher that writes the completions shares the student's
    tokenizer (`plans.check_writer`), read from its tokenizer here where it is at hand
    (`plans.shares_tokenizer_here`), not from its report once Ray and the teachers have started."""
    o = cfg.onpolicy
    if command not in ("train", "tune", "demo") or o.fraction == 0 or o.source != "teacher":
        return
    writer = cfg.teacher(onpolicy_writer(cfg.onpolicy, cfg.teachers))
    check_writer(cfg.onpolicy, cfg.teachers, shares_tokenizer_here(cfg.student, writer))


def check_engines(cfg: JobConfig, command: str) -> None:
    """`onpolicy.engine: vllm` and `teachers[].engine: vllm` need vLLM installed where the driver
    runs (its workers and actors load it too): the pip command in one line, before anything
    starts."""
    if command in ("train", "tune", "demo") and cfg.onpolicy.fraction > 0 and cfg.onpolicy.engine == "vllm":
        require_vllm("onpolicy.engine: vllm")
    for t in cfg.teachers:  # (the actor loads it on its node; one install for driver and nodes here)
        if t.engine == "vllm":
            check_tensor_parallel(t)  # (the actor checks the heads too, from the model's config)
            require_vllm(f"teachers[{t.name}].engine: vllm")


def check_context(cfg: JobConfig, command: str, ckpt=None, address: Optional[str] = None) -> None:
    """train.max_length within the context of every model that reads the rows
    (`max_position_embeddings`): the student, and the teachers that run on this machine, whose
    configs are read where `check_student` / `check_teachers` read them (a hub id online, or a
    teacher on a cluster, is not looked at). Before the memory check, whose figure for such a length
    would name RAM rather than the cause."""
    models = [("student.model", Path(ckpt) / "student" if command == "eval" and ckpt is not None
               else cfg.student.model)]
    if _embedded(cfg, address) and (cfg.data.kv_source == "live" or command == "teachers precompute"):
        models += [(f"teachers[{t.name}].model", t.served_from()) for t in cfg.teachers]
    n = cfg.train.max_length
    for key, spec in models:
        source, gguf = resolve_model(str(spec))
        if gguf is None and not os.path.isdir(source) and (key != "student.model" or not _hub_offline()):
            continue  # a hub id: the student's is read offline only (from the cache), a teacher's not at all
        with about(key):
            config = load_model_config(spec)
        field = next((f for f in ("max_position_embeddings", "n_positions") if getattr(config, f, None)), None)
        limit = getattr(config, field) if field else None
        if isinstance(limit, int) and n > limit:
            raise KavaError(f"train.max_length={n} is past the context of {key} ({spec}: {limit} positions, its "
                            f"{field}): set train.max_length to {limit} or less")


def check_weights(model_dir) -> None:
    """A model dir holds its weights and each safetensors file is whole: its header parses and the
    file is as long as the header says (a download cut short, or a file that is not safetensors, is
    one line here rather than a loader's traceback in a teacher or worker after Ray started). Reads
    the headers only."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files and not any(d.glob("pytorch_model*.bin")) and not any(d.glob("*.pt")):
        raise KavaError(f"{d}: no weights (no *.safetensors or pytorch_model*.bin)")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError):
            raise KavaError(f"{index}: not a safetensors index (no weight_map)") from None
        missing = sorted(w for w in wanted if not (d / w).is_file())
        if missing:
            raise KavaError(f"{d}: {missing[0]} is missing ({len(missing)} of the {len(wanted)} weight files the "
                            f"index names)")
    for f in files:
        _check_safetensors(f)


def _check_safetensors(path: Path) -> None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= min(size - 8, 100 * 2**20):
                raise ValueError("bad header length")
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, OSError):
        raise KavaError(f"{path}: not a readable safetensors file (its header does not parse)") from None
    if 8 + n + end > size:
        raise KavaError(f"{path}: cut short ({size} bytes, its header describes {8 + n + end}): download it again")


def check_memory(cfg: JobConfig, address: Optional[str] = None) -> None:
    """An embedded run's memory, as `kava-ray plan` estimates it, against this machine: its GPU's
    memory when it has one (`planner.check_fits`, the check a cluster run makes once Ray is up),
    else the RAM available now (teachers, the student's step and every worker share it). Skipped
    where a model is a hub id not in the local cache (reading its config would go to the network) or
    the planner cannot read a model (its loader says why)."""
    import psutil
    import torch

    from kava_ray.runtime.console import silenced  # Ray: see check_space (check_memory runs for Ray commands)
    from kava_ray.runtime.planner import GiB, check_fits, plan

    if not _embedded(cfg, address):
        return
    specs = [cfg.student.model, *(t.served_from() for t in cfg.teachers)] if cfg.data.kv_source == "live" else \
        [cfg.student.model]
    if not _hub_offline() and any(resolve_model(m)[1] is None and not os.path.isdir(resolve_model(m)[0])
                                  for m in specs):
        return
    if torch.cuda.is_available():
        with silenced():
            check_fits(cfg, torch.cuda.get_device_properties(0).total_memory)
        return
    try:
        with silenced():  # (the planner's meta models: transformers, torchao and torch write to fds 1 and 2)
            need = plan(cfg)["devices"]["cpu"]["total"]
    except (KavaError, OSError, ValueError, KeyError):
        return
    have = psutil.virtual_memory().available
    if need > have:
        raise KavaError(f"{cfg.name}: one step needs about {need / GiB:.1f} GiB of RAM (teachers, student, "
                        f"optimizer and activations; `kava-ray plan --config ...` itemizes it), this machine has "
                        f"{have / GiB:.1f} GiB available: lower train.batch_size or train.max_length, quantize the "
                        f"teachers (teachers.N.quantization: 4bit), or run on a GPU or a cluster (--address)")


# ------------------------------------------------------------------------------------------ output


def output_dirs(cfg: JobConfig, command: str, out=None) -> list[tuple[str, Path]]:
    """(key, dir) of what `command` writes: run / sweep dirs under `ray.storage_path`, the KV cache
    of `teachers precompute`, the CKA map's directory. `eval` writes nothing."""
    storage = Path(cfg.ray.storage_path).expanduser()
    if command in ("train", "tune", "demo"):
        return [("ray.storage_path", storage)]
    if command == "teachers precompute":
        return [("--out", Path(out).expanduser())] if out is not None else []
    if command == "align cka":
        return [("--out", Path(out).expanduser().parent)] if out is not None else [("ray.storage_path", storage)]
    return []


def check_writable(path, key: str) -> None:
    """`path` can be created (with its parents) and a file written in it: an unwritable storage path
    would otherwise fail in Ray Train after the teachers have loaded."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KavaError(f"{key}={path}: cannot create the directory ({e.strerror or type(e).__name__})") from None
    try:
        with tempfile.NamedTemporaryFile(dir=p, prefix=".kava-preflight-"):
            pass
    except OSError as e:
        raise KavaError(f"{key}={path}: not writable ({e.strerror or type(e).__name__})") from None
