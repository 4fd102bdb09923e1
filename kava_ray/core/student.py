"""The job's student, as its `student` section builds it: whole, layer-dropped, or a frozen base with
LoRA adapters (`core.lora`), from the model or a checkpoint."""

from __future__ import annotations

import torch

from kava_ray.core.lora import add_lora, load_adapter
from kava_ray.core.models import load_student


def job_student(s, dtype, seed: int, saved=None):
    """The job's student (its `student` section) in `dtype`: `s.model`, layer-dropped by
    `s.keep_layers`, or a checkpoint's `saved` student directory; with `s.lora`, the base with its
    adapters (`core.lora`: drawn under `seed`, the same on every rank; a checkpoint's adapter
    loaded into them)."""
    if s.lora is None:
        return load_student(saved or s.model, dtype=dtype, keep=None if saved else s.keep_layers,
                            gradient_checkpointing=s.gradient_checkpointing)
    base = load_student(s.model, dtype=dtype, gradient_checkpointing=s.gradient_checkpointing,
                        quantization=s.lora.quantize_base)
    torch.manual_seed(seed)  # (FSDP2 does not broadcast: each rank's shard of A is its own draw)
    student = add_lora(base, s.lora)
    if saved:
        load_adapter(student, saved)
    return student
