"""Checkpoints of a distillation run, written through `common.files.atomic_dir` (a temp dir renamed into place).

A checkpoint holds the student (save_pretrained + tokenizer), projectors and fusion (safetensors),
optimizer and LR scheduler state, the data side's state (`data_state.json`, and `data_state.pt` for
what JSON cannot hold), and `state.json`, written last. One that cannot be used (state.json not
JSON, a file missing or of another size than state.json records, a tensor file that does not parse)
is one KavaError line naming the file; a write that fails is one line too, and never replaces the
checkpoint that was there. The files: docs/internals/core.md#checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kava_ray.common.config import JobConfig, config_hash, diff_keys, resolve_paths, validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_dir, first_line, write_json
from kava_ray.common.metrics_file import METRICS
from kava_ray.common.run_lock import LOCK, describe_holder, holder
from kava_ray.core import fsdp
from kava_ray.core.lora import ADAPTER_CONFIG, has_lora, is_adapter_dir, save_adapter, save_final
from kava_ray.core.plans import copied_from_teacher

STATE = "state.json"
# the data side's state (`rollout.step_source.StepSource.state_dict`), opaque here: its entries JSON
# can hold, and (on-policy's batches in flight) the rest, pickled -- so a checkpoint without them is
# never unpickled
DATA, DATA_OBJECTS = "data_state.json", "data_state.pt"
# (checkpoints before `DATA`: on-policy's batches in flight; the stream in STATE)
LEGACY_PENDING = "onpolicy_pending.pt"


def save_checkpoint(path, distiller, tokenizer, optimizer, scheduler, step: int, data_state: dict,
                    cfg: JobConfig, extra: Optional[dict] = None, rank: int = 0) -> Path:
    """Write a complete checkpoint to `path`: a half-written one never appears, and an existing one
    is replaced only once the new one is complete. data_state: where the data side continues (the
    step source's `state_dict()`: the stream's position, the skips, on-policy's batches in flight),
    kept as it is (`load_data_state`).

    A Distiller sharded with FSDP2 (`core.fsdp`) is saved by every rank, each into its own `path`:
    with the optimizer, each its shard of both (`fsdp.save_sharded`; rank 0 adds everything else);
    without (final/), the whole model gathered, and rank 0 writes the usual layout (the student a
    Hugging Face directory)."""
    path = Path(path)
    try:
        return _save(path, distiller, tokenizer, optimizer, scheduler, step, data_state, cfg, extra, rank)
    except OSError as e:  # unwritable storage, disk full, file size limit: the previous checkpoint stays
        raise KavaError(f"cannot write checkpoint {path}: {e.strerror or first_line(e)}"
                        f"{f' ({e.filename})' if e.filename else ''}") from None
    except (SafetensorError, RuntimeError) as e:  # the same from safetensors' / torch.save's own writers
        raise KavaError(f"cannot write checkpoint {path}: {first_line(e)}") from None


def _parts(distiller) -> dict:
    """{"student": its state dict or None (save_pretrained's own), "projectors", "fusion",
    "hidden_proj"}: a sharded Distiller's gathered from every rank (rank 0 gets them, the others
    {}), else each module's own."""
    if not fsdp.is_sharded(distiller):
        hidden = getattr(distiller, "hidden_proj", None)
        return {"student": None, "projectors": distiller.projectors.state_dict(),
                "fusion": distiller.fusion.state_dict(), "hidden_proj": hidden.state_dict() if hidden else {}}
    full = fsdp.full_model_state(distiller)
    return {k: {n[len(k) + 1:]: v for n, v in full.items() if n.startswith(k + ".")}
            for k in ("student", "projectors", "fusion", "hidden_proj")}


def _save(path: Path, distiller, tokenizer, optimizer, scheduler, step, data_state, cfg, extra, rank: int) -> Path:
    sharded = fsdp.is_sharded(distiller) and optimizer is not None
    parts = None if sharded else _parts(distiller)  # (gathered by every rank)
    with atomic_dir(path) as tmp:
        shard_files = {}
        if sharded:  # every rank its shard of the model and optimizer; rank 0 records every rank's files
            fsdp.save_sharded(tmp, distiller, optimizer)
            shard_files = fsdp.gather_files(tmp, fsdp.SHARDED)
        if rank != 0:
            return path
        if sharded:  # the student's config and tokenizer; its weights are in the shards
            distiller.student.config.save_pretrained(tmp / "student")
        elif has_lora(distiller.student):  # `core.lora`: the adapter; final/ adds the merged model
            if optimizer is None:
                save_final(tmp, distiller.student, parts["student"])
            else:
                save_adapter(tmp / "student", distiller.student, parts["student"])
        else:
            distiller.student.save_pretrained(tmp / "student", safe_serialization=True, state_dict=parts["student"])
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "student")
        if not sharded:
            save_file(_contiguous(parts["projectors"]), tmp / "projectors.safetensors")
            save_file(_contiguous(parts["fusion"]) or {"_empty": torch.zeros(0)}, tmp / "fusion.safetensors")
            if len(parts["hidden_proj"]):  # the hidden-state loss's maps (loss.hidden_weight)
                save_file(_contiguous(parts["hidden_proj"]), tmp / "hidden_proj.safetensors")
        if optimizer is not None:
            torch.save({"optimizer": None if sharded else optimizer.state_dict(),
                        "scheduler": scheduler.state_dict() if scheduler is not None else None},
                       tmp / "optimizer.pt")
        plain, objects = _json_split(data_state)
        write_json(tmp / DATA, plain)
        if objects:
            torch.save(objects, tmp / DATA_OBJECTS)
        state = {"step": step, "config_hash": config_hash(cfg), "config": cfg.to_dict(),
                 "rng": {"scheme": "reseeded every step from (train.seed, step, rank)", "seed": cfg.train.seed},
                 **({"sharded": True} if sharded else {}), **(extra or {}),
                 "files": {**{f.relative_to(tmp).as_posix(): f.stat().st_size for f in sorted(tmp.rglob("*"))
                              if f.is_file() and not f.relative_to(tmp).as_posix().startswith(fsdp.SHARDED + "/")},
                           **shard_files}}
        write_json(tmp / STATE, state)
    return path


def is_sharded_checkpoint(path) -> bool:
    """Whether `path` holds FSDP2 shards (`ray.strategy: fsdp` mid-run) rather than a whole student."""
    return (Path(path) / fsdp.SHARDED).is_dir()


def check_whole_student(ckpt, command: str) -> None:
    """One line for `command` (eval, generate) on a sharded checkpoint: its student is in FSDP2
    shards, not a model directory; final/ (or the run dir, once it has one) holds the whole
    student."""
    if is_sharded_checkpoint(ckpt):
        raise KavaError(f"checkpoint {ckpt} is sharded: its student is in FSDP2 shards (ray.strategy: fsdp), not a "
                        f"whole model to {command}; use the run's final/ (or the run dir once it has one), or resume "
                        f"the run from it")


def _load_tensors(f: Path) -> dict:
    if not f.is_file():
        raise KavaError(f"checkpoint {f.parent}: {f} is missing (an incomplete checkpoint)")
    try:
        return load_file(f)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a truncated header/data
        raise KavaError(f"checkpoint {f.parent}: {f} is corrupt ({first_line(e, with_type=True)})") from None


def _recorded_files(path: Path) -> Optional[dict]:
    try:
        return json.loads((path / STATE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None


def _contiguous(sd: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def read_state(path, verify: bool = True) -> dict:
    """The checkpoint's state.json; with `verify`, every file it records is there with its recorded
    size. Not a checkpoint, a state.json that is not JSON (truncated, overwritten) or lacks the keys
    a resume reads, a missing or truncated file: one KavaError line naming the file."""
    p = Path(path) / STATE
    if not p.is_file():
        raise KavaError(f"checkpoint {path}: no {STATE} (not a kava-ray checkpoint)")
    try:
        state = json.loads(p.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else type(e).__name__
        raise KavaError(f"checkpoint {p} is not valid JSON ({why}): corrupt or truncated") from None
    missing = [k for k in ("step", "config_hash", "config") if not isinstance(state, dict) or k not in state]
    if missing:
        raise KavaError(f"checkpoint {p} has no {missing[0]!r} (not a complete kava-ray checkpoint)")
    if verify:
        problem = incomplete(path, state)
        if problem:
            raise KavaError(f"checkpoint {path}: {problem}")
    return state


def find_checkpoint(path, for_resume: bool = False) -> Path:
    """A checkpoint dir from a checkpoint path or a run dir.

    For evaluation a run dir means its final/ (else its latest checkpoint); for resuming, its latest
    checkpoint (which carries the optimizer state final/ leaves out). A run dir's partial checkpoint
    (Ray Train's copy into storage cut off) is passed over.
    """
    p = Path(path).expanduser()
    latest = sorted(p.glob("checkpoint_2*"), reverse=True)
    order = (p, *latest, p / "final") if for_resume else (p, p / "final", *latest)
    passed_over = []
    for candidate in order:
        if (candidate / STATE).is_file():
            problem = None if candidate == p else incomplete(candidate)
            if problem is None:
                return candidate
            passed_over.append(problem)
    if passed_over:  # only unusable ones: name why the newest is (e.g. its state.json is corrupt)
        raise KavaError(f"{path}: no complete checkpoint ({passed_over[0]})")
    if not p.exists():
        raise KavaError(f"{path}: no such run dir or checkpoint")
    if (p / METRICS).is_file() or (p / LOCK).is_file():  # a run that has not saved one
        live = holder(p)
        raise KavaError(f"{path}: no checkpoint yet" + (f" (its run is live: {describe_holder(live)})" if live else ""))
    raise KavaError(f"{path}: not a kava-ray run dir or checkpoint (no {STATE})")


@contextlib.contextmanager
def held_checkpoint(path, tries: int = 3) -> Iterator[tuple[Path, Path, Optional[str]]]:
    """(the dir to read, the checkpoint it stands for, a line saying the run is live, else None) for the block.

    A live run (`common.run_lock`) deletes old checkpoints as it saves new ones
    (`train.num_to_keep`), so a reader pins the one it picked: hard links into a hidden sibling dir
    of the run (a copy where links fail), removed on the way out. The files stay whole while the run
    goes on; a checkpoint deleted mid-pin is picked anew.
    """
    ckpt = find_checkpoint(path)
    live = holder(ckpt.parent)
    if not live:
        yield ckpt, ckpt, None
        return
    for attempt in range(tries):
        tmp = Path(tempfile.mkdtemp(prefix=f".{ckpt.parent.name}-read-", dir=ckpt.parent.parent))
        try:
            try:
                shutil.copytree(ckpt, tmp / ckpt.name, copy_function=_link_or_copy)
            except (FileNotFoundError, shutil.Error):
                if attempt == tries - 1:
                    raise KavaError(f"{path}: its live run deleted checkpoint {ckpt.name} while it was pinned, "
                                    f"{tries} times: try again") from None
                ckpt = find_checkpoint(path)
                continue
            step = read_state(tmp / ckpt.name, verify=False)["step"]
            yield tmp / ckpt.name, ckpt, (f"{ckpt.parent.name} is live ({describe_holder(live)}): reading its "
                                          f"checkpoint of step {step}, pinned until this command ends")
            return
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        shutil.copy2(src, dst)


def finished(ckpt, step: int) -> bool:
    """Whether the run `ckpt` (a checkpoint dir) belongs to is complete at `step`: the run dir's
    final/ as a run's end (`recipes.distill.finish`) writes it -- complete (every file state.json
    records), at `step`, with the test split's figures. A run cut off after its last checkpoint, in
    the test evaluation or writing final/, is not."""
    final = Path(ckpt).parent / "final"
    try:
        state = json.loads((final / STATE).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(state, dict) and state.get("step") == step and "test" in state
            and incomplete(final, state) is None)


def checkpoint_config(path) -> tuple[Path, dict, JobConfig]:
    """(checkpoint dir, its state, its job config) of a run or checkpoint dir, every problem in one line."""
    ckpt = find_checkpoint(path)
    state = read_state(ckpt)
    return ckpt, state, _saved_config(ckpt, state)


def check_files(ckpt) -> None:
    """A readable state.json and the files loading a checkpoint reads (the student, projectors, fusion)."""
    ckpt = Path(ckpt)
    read_state(ckpt)
    student = "student/" + (ADAPTER_CONFIG if is_adapter_dir(ckpt / "student") else "config.json")  # LoRA: the adapter
    needed = (student, f"{fsdp.SHARDED}/.metadata") if is_sharded_checkpoint(ckpt) else \
        (student, "projectors.safetensors", "fusion.safetensors")
    for rel in needed:
        if not (ckpt / rel).is_file():
            raise KavaError(f"checkpoint {ckpt}: {rel} is missing (an incomplete checkpoint)")


def incomplete(path, state: Optional[dict] = None) -> Optional[str]:
    """What makes `path` an incomplete checkpoint (a file missing or of another size than state.json
    records), or None. Checkpoints written before state.json recorded its files are not checked."""
    path = Path(path)
    if state is None:
        try:
            state = json.loads((path / STATE).read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return f"{path / STATE} is missing or corrupt"
    for rel, size in (state.get("files") or {}).items():
        f = path / rel
        if not f.is_file():
            return f"{f} is missing (an incomplete checkpoint)"
        if f.stat().st_size != size:
            return f"{f} is truncated or corrupt ({f.stat().st_size} bytes, state.json records {size})"
    return None


# what a resumed run would otherwise take from the checkpoint (optim, train: its optimizer state and
# schedule) or change without a word (data, loss, onpolicy: what it trains on and towards, and how
# its samples are drawn)
RUN_SECTIONS = ("optim", "train", "data", "loss", "onpolicy")
# keys of those sections that change memory only, not the curve: free to differ on resume (the
# chunked vocabulary loss equals whole logits, `core.vocab_chunks`)
MEMORY_ONLY = ("loss.vocab_chunk",)


def _saved_config(path, state: dict) -> JobConfig:
    try:
        return validate_config(state["config"])
    except KavaError as e:  # e.g. a key this version no longer has
        raise KavaError(f"checkpoint {path} was written with a config this version cannot read ({e})") from None


def check_compatible(path, cfg: JobConfig, allow_run_changes: bool = False) -> dict:
    """The checkpoint's state, if `cfg` can continue it; else one KavaError line naming the keys that differ.

    Shapes (teachers, student, align, fusion) must match. Optimizer, schedule, data, loss and
    sampling settings (optim.*, train.*, data.*, loss.*, onpolicy.*; not the memory-only
    `MEMORY_ONLY`) may change only with `allow_run_changes` (`--resume-override`): the checkpoint's
    optimizer state and schedule would otherwise quietly win over the new values, and a new loss,
    data or on-policy sampling would change the curve without a word.
    """
    state = read_state(path)
    sharded, shards = is_sharded_checkpoint(path), cfg.ray.sharded
    if sharded != shards:  # (a whole state into FSDP2 shards, or shards into DDP: not supported)
        raise KavaError(f"checkpoint {path} holds {'FSDP2 shards' if sharded else 'a whole student'}: continue it with "
                        f"ray.strategy={'fsdp' if sharded else 'ddp'}" + (" and several workers" if sharded else ""))
    # a config saved before load_config made its paths absolute: its relative paths match ours
    saved = _as_trained(path, resolve_paths(_saved_config(path, state), like=cfg), cfg)
    if state["config_hash"] != config_hash(cfg) and (keys := diff_keys(saved, cfg)):
        raise KavaError(f"checkpoint {path} was trained with a different config: {', '.join(keys)}"
                        f" differ")
    _check_identity_projectors(path, saved, cfg)
    # the hidden-state maps and their optimizer state
    if (saved.loss.hidden_weight > 0) != (cfg.loss.hidden_weight > 0):
        raise KavaError(f"checkpoint {path} was trained with loss.hidden_weight={saved.loss.hidden_weight:g}: it "
                        f"cannot continue with loss.hidden_weight={cfg.loss.hidden_weight:g} (on / off changes what "
                        f"the checkpoint holds)")
    if not allow_run_changes:
        changed = [k for k in diff_keys(saved, cfg, RUN_SECTIONS) if k not in MEMORY_ONLY]
        if changed:
            raise KavaError(f"checkpoint {path} was trained with other {', '.join(changed)}; pass --resume-override "
                            f"to continue with the new values")
    return state


def _json_split(state: dict) -> tuple[dict, dict]:
    """({entry: value} of the entries JSON can hold, {entry: value} of the rest)."""
    plain, objects = {}, {}
    for k, v in state.items():
        try:
            json.dumps(v)
            plain[k] = v
        except (TypeError, ValueError):
            objects[k] = v
    return plain, objects


def load_data_state(path) -> dict:
    """The data side's state a checkpoint kept (`save_checkpoint`'s `data_state`): its JSON entries,
    and those only pickle held (on-policy's batches in flight: unpickled only where the checkpoint
    has them, like a run's own files). A checkpoint written before it had one keeps the stream's
    position in its state.json (and on-policy's batches in flight in their own file)."""
    path = Path(path)
    if (path / DATA).is_file():
        state = json.loads((path / DATA).read_text())
        if (path / DATA_OBJECTS).is_file():
            state.update(torch.load(path / DATA_OBJECTS, weights_only=False))
        return state
    legacy = path / LEGACY_PENDING
    return {"stream": read_state(path, verify=False)["stream"],
            "in_flight": torch.load(legacy, weights_only=False) if legacy.is_file() else []}


def _identity_only(keys) -> bool:
    """Whether a teacher's saved projector tensors (`keys`) are an identity projector's: its layer weights only."""
    return bool(keys) and all("_layer_weights." in k.split(".", 1)[1] for k in keys)


def _projector_keys(path) -> list[str]:
    """The names of the tensors in a checkpoint's projectors.safetensors ([] without one: sharded,
    or corrupt, which is load_into's line)."""
    try:
        with safe_open(Path(path) / "projectors.safetensors", "pt") as h:
            return list(h.keys())
    except Exception:  # noqa: BLE001 - missing or unreadable: nothing to compare here
        return []


def _identity_refusal(path, teacher: str, kind: str) -> str:
    return (f"checkpoint {path}: its projector for teacher '{teacher}' is identity (no parameters), but this job "
            f"builds kind {kind} for it (align.projector.kind auto gives identity only to a student copied from its "
            f"teacher): set align.projector.kind: identity to resume it")


def _check_identity_projectors(path, saved: JobConfig, cfg: JobConfig) -> None:
    """Before Ray starts: a checkpoint whose projector `auto` gave identity by KV geometry alone,
    for a teacher this version's `auto` gives another kind (`projectors.resolve_kind`: the student
    was not copied from it) -- the line loading it would give (`_load_projectors`)."""
    if (saved.align.projector.kind, cfg.align.projector.kind, cfg.align.mode) != ("auto", "auto", "structured"):
        return
    keys = _projector_keys(path)
    for t in cfg.teachers:
        own = [k for k in keys if k.startswith(t.name + ".")]
        if _identity_only(own) and not copied_from_teacher(cfg.student, t):
            raise KavaError(_identity_refusal(path, t.name, "fit or linear"))


def _as_trained(path, saved: JobConfig, cfg: JobConfig) -> JobConfig:
    """The saved config with `align.projector.kind: auto` read as identity where every teacher's
    saved projector is identity and `cfg` names identity: how a checkpoint trained when auto gave
    identity by KV geometry alone (this version: only to a student copied from its teacher)
    continues with the kind it holds."""
    if saved.align.projector.kind != "auto" or cfg.align.projector.kind != "identity":
        return saved
    keys = _projector_keys(path)
    if not all(_identity_only([k for k in keys if k.startswith(t.name + ".")]) for t in saved.teachers):
        return saved
    d = saved.to_dict()
    d["align"]["projector"]["kind"] = "identity"
    return validate_config(d)


def _load_projectors(path: Path, distiller) -> None:
    """The checkpoint's projectors into the Distiller's, teacher by teacher; a teacher whose saved
    tensors are not those its projector here holds is one line naming it (not load_state_dict's list
    of keys). The case met: a checkpoint trained when `align.projector.kind: auto` gave identity to
    a student of the teacher's KV geometry, which this version gives `fit` unless the student was
    copied from that teacher (`projectors.resolve_kind`)."""
    saved = _load_tensors(path / "projectors.safetensors")
    for name, proj in distiller.projectors.items():
        theirs = {k for k in saved if k.startswith(name + ".")}
        if theirs == {name + "." + k for k in proj.state_dict()}:
            continue
        if _identity_only(theirs) and proj.kind != "identity":
            raise KavaError(_identity_refusal(path, name, proj.kind))
        raise KavaError(f"checkpoint {path}: its projector for teacher '{name}' holds other tensors than the kind "
                        f"{proj.kind} this job builds for it")
    distiller.projectors.load_state_dict(saved)


def load_into(path, distiller, optimizer=None, scheduler=None) -> None:
    """Load projectors, fusion (and optimizer/scheduler) from `path` into already-built objects.

    The student itself is loaded by the caller with from_pretrained(path / "student").
    """
    path = Path(path)
    if is_sharded_checkpoint(path):  # FSDP2 shards: the model and optimizer together (every rank)
        fsdp.load_sharded(path, distiller, optimizer)
        blob = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True) \
            if (path / "optimizer.pt").is_file() else {}
        if scheduler is not None and blob.get("scheduler") is not None:
            scheduler.load_state_dict(blob["scheduler"])
        return
    _load_projectors(path, distiller)
    fusion = {k: v for k, v in _load_tensors(path / "fusion.safetensors").items() if k != "_empty"}
    distiller.fusion.load_state_dict(fusion)
    hidden = getattr(distiller, "hidden_proj", None)
    if hidden is not None and len(hidden.state_dict()):
        hidden.load_state_dict(_load_tensors(path / "hidden_proj.safetensors"))
    opt_file = path / "optimizer.pt"
    if optimizer is not None and not opt_file.is_file() and "optimizer.pt" in (_recorded_files(path) or {}):
        raise KavaError(f"checkpoint {path}: {opt_file} is missing (an incomplete checkpoint)")
    if optimizer is not None and opt_file.is_file():
        try:
            blob = torch.load(opt_file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file: one line naming it
            raise KavaError(f"checkpoint {path}: {opt_file} is corrupt ({first_line(e, with_type=True)})") from None
        optimizer.load_state_dict(blob["optimizer"])
        if scheduler is not None and blob.get("scheduler") is not None:
            scheduler.load_state_dict(blob["scheduler"])
