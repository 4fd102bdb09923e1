"""Checkpoints of a distillation run, written through `_io.atomic_dir` (a temp dir renamed into place).

  student/                 save_pretrained (safetensors) + tokenizer
  projectors.safetensors   every teacher's projector, keys `<teacher>.<param>`
  fusion.safetensors       fusion parameters and buffers
  optimizer.pt             optimizer + LR scheduler state (loaded with weights_only=True)
  state.json               step, data-stream position, RNG scheme, config hash and the full config
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from kava_ray._io import atomic_dir
from kava_ray.config import JobConfig, config_hash, diff_keys, validate_config
from kava_ray.errors import KavaError

STATE = "state.json"


def save_checkpoint(path, distiller, tokenizer, optimizer, scheduler, step: int, stream_state: dict,
                    cfg: JobConfig, extra: Optional[dict] = None) -> Path:
    """Write a complete checkpoint to `path`: a half-written one never appears, and an existing one is
    replaced only once the new one is complete."""
    path = Path(path)
    with atomic_dir(path) as tmp:
        distiller.student.save_pretrained(tmp / "student", safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / "student")
        save_file(_contiguous(distiller.projectors.state_dict()), tmp / "projectors.safetensors")
        save_file(_contiguous(distiller.fusion.state_dict()) or {"_empty": torch.zeros(0)},
                  tmp / "fusion.safetensors")
        if optimizer is not None:
            torch.save({"optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict() if scheduler is not None else None},
                       tmp / "optimizer.pt")
        state = {"step": step, "stream": stream_state, "config_hash": config_hash(cfg), "config": cfg.to_dict(),
                 "rng": {"scheme": "reseeded every step from (train.seed, step, rank)", "seed": cfg.train.seed},
                 **(extra or {})}
        (tmp / STATE).write_text(json.dumps(state, indent=1))
    return path


def _contiguous(sd: dict) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def read_state(path) -> dict:
    p = Path(path) / STATE
    if not p.is_file():
        raise KavaError(f"checkpoint {path}: no {STATE} (not a kava-ray checkpoint)")
    return json.loads(p.read_text())


RUN_SECTIONS = ("optim", "train", "data")  # what a resumed run would otherwise silently keep from the checkpoint


def _saved_config(path, state: dict) -> JobConfig:
    try:
        return validate_config(state["config"])
    except KavaError as e:  # e.g. a key this version no longer has
        raise KavaError(f"checkpoint {path} was written with a config this version cannot read ({e})") from None


def check_compatible(path, cfg: JobConfig, allow_run_changes: bool = False) -> dict:
    """The checkpoint's state, if `cfg` can continue it; else one KavaError line naming the keys that differ.

    Shapes (teachers, student, align, fusion) must match. Optimizer, schedule and data settings
    (optim.*, train.*, data.*) may change only with `allow_run_changes` (`--resume-override`): the
    checkpoint's optimizer state and schedule would otherwise quietly win over the new values.
    """
    state = read_state(path)
    if state["config_hash"] != config_hash(cfg):
        keys = diff_keys(_saved_config(path, state), cfg)
        raise KavaError(f"checkpoint {path} was trained with a different config: {', '.join(keys) or 'unknown keys'}"
                        f" differ")
    if not allow_run_changes:
        changed = diff_keys(_saved_config(path, state), cfg, RUN_SECTIONS)
        if changed:
            raise KavaError(f"checkpoint {path} was trained with other {', '.join(changed)}; pass --resume-override "
                            f"to continue with the new values")
    return state


def load_into(path, distiller, optimizer=None, scheduler=None) -> None:
    """Load projectors, fusion (and optimizer/scheduler) from `path` into already-built objects.

    The student itself is loaded by the caller with from_pretrained(path / "student").
    """
    path = Path(path)
    distiller.projectors.load_state_dict(load_file(path / "projectors.safetensors"))
    fusion = {k: v for k, v in load_file(path / "fusion.safetensors").items() if k != "_empty"}
    distiller.fusion.load_state_dict(fusion)
    if optimizer is not None and (path / "optimizer.pt").is_file():
        blob = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(blob["optimizer"])
        if scheduler is not None and blob.get("scheduler") is not None:
            scheduler.load_state_dict(blob["scheduler"])
