"""The student's precision policy (`student.precision`): the dtype its weights are stored in, the
dtype its forward computes in, and an optimizer that does not round small updates away. Pure
PyTorch.

`auto` (bf16-mixed on a CUDA device with bf16, else fp32), `fp32`, `bf16-mixed` (fp32 master
weights, grads and states; bf16 autocast) or `bf16-sr` (bf16 weights; torchao AdamW / AdamW8bit with
stochastic rounding; needs `pip install 'kava-ray[sr]'`). No policy trains bf16 weights with a
round-to-nearest optimizer: it loses small updates. Projectors and fusion stay fp32. Measurements
and the `student.dtype` rules: docs/internals/core.md#precision.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from kava_ray.common.config import PRECISION_WEIGHT_DTYPE
from kava_ray.common.errors import KavaError

POLICIES = tuple(PRECISION_WEIGHT_DTYPE)  # auto, fp32, bf16-mixed, bf16-sr
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SR_INSTALL = "pip install 'kava-ray[sr]'  (or: pip install torchao)"


@dataclass(frozen=True)
class Precision:
    """A resolved policy on one device type: `fp32`, `bf16-mixed` or `bf16-sr`."""

    policy: str
    device_type: str
    weight_dtype: torch.dtype  # what the student is loaded in (load_student(dtype=...))
    autocast_dtype: Optional[torch.dtype]  # None: no autocast

    def autocast(self):
        """A fresh autocast context for one forward (a factory: call it once per `with`)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forwards compute in: the autocast's, else the weights'."""
        return self.autocast_dtype or self.weight_dtype

    @property
    def stochastic_rounding(self) -> bool:
        return self.policy == "bf16-sr"


def resolve_precision(policy: str, device_type: str, bf16_supported: bool = True) -> Precision:
    """The policy `policy` on a `device_type` ('cuda', 'cpu', ...) device.

    `auto` is bf16-mixed on CUDA when `bf16_supported`, else fp32. An explicit policy is taken as
    asked (CPU autocast supports bf16), except that a bf16 policy on a CUDA device without bf16
    fails.
    """
    if policy not in POLICIES:
        raise KavaError(f"student.precision {policy!r}: expected one of {', '.join(POLICIES)}")
    if policy == "auto":
        policy = "bf16-mixed" if device_type == "cuda" and bf16_supported else "fp32"
    elif policy != "fp32" and device_type == "cuda" and not bf16_supported:
        raise KavaError(f"student.precision {policy}: this GPU has no bf16 support; use student.precision: fp32")
    weights = _TORCH_DTYPES[PRECISION_WEIGHT_DTYPE[policy]]
    return Precision(policy, device_type, weights, None if policy == "fp32" else torch.bfloat16)


def student_precision(student_cfg, device) -> Precision:
    """The config's `student.precision` on `device` (a torch.device or string), bf16 support checked."""
    device = torch.device(device)
    bf16 = device.type != "cuda" or torch.cuda.is_bf16_supported()
    return resolve_precision(student_cfg.precision, device.type, bf16)


def planned_policy(policy: str, on_gpu: bool) -> str:
    """What `policy` resolves to for the planner (which assumes a GPU with bf16 support)."""
    return resolve_precision(policy, "cuda" if on_gpu else "cpu").policy


def student_bytes_per_param(policy: str, optimizer: str) -> dict:
    """Bytes per student parameter of a resolved policy: weights, grads, optimizer states, and the
    bf16 copy autocast makes of every weight a matmul reads (counted per such param by the
    planner)."""
    if policy == "bf16-sr":  # torchao: bf16 states for adamw, 8-bit blockwise for adamw8bit
        return {"weights": 2, "grads": 2, "optimizer": 2 if optimizer == "adamw8bit" else 4, "autocast_copy": 0}
    states = 2 if optimizer == "adamw8bit" else 8  # bitsandbytes 8-bit, or torch's fp32 exp_avg + exp_avg_sq
    return {"weights": 4, "grads": 4, "optimizer": states, "autocast_copy": 2 if policy == "bf16-mixed" else 0}


# ------------------------------------------------------------------------------------ the optimizer


def _torchao_optim():
    try:
        import torchao.optim as tao  # optional: the `sr` extra
    except ImportError:
        raise KavaError(f"student.precision bf16-sr needs torchao: {SR_INSTALL}") from None
    return tao


def sr_adamw(groups: list[dict], optim) -> torch.optim.Optimizer:
    """torchao AdamW (`adamw`) or AdamW8bit (`adamw8bit`) with bf16 stochastic rounding over
    `groups`; the lr stays a float between steps (`_float_lr`)."""
    tao = _torchao_optim()
    base = tao.AdamW8bit if optim.optimizer == "adamw8bit" else tao._AdamW
    return _float_lr(base)(groups, lr=groups[0]["lr"], weight_decay=optim.weight_decay, bf16_stochastic_round=True)


_FLOAT_LR: dict = {}


# torchao keeps each group's lr as a tensor (its compiled step then does not recompile when the lr
# changes); the LR scheduler, metrics and checkpoints expect a float, so the subclass makes it a
# tensor only inside `step`
def _float_lr(base):
    if base not in _FLOAT_LR:
        class FloatLR(base):
            def add_param_group(self, param_group: dict) -> None:
                torch.optim.Optimizer.add_param_group(self, param_group)  # keep a float lr

            @torch.no_grad()
            def step(self, closure=None):
                lrs = [g["lr"] for g in self.param_groups]
                for g, lr in zip(self.param_groups, lrs):
                    g["lr"] = torch.tensor(float(lr), dtype=torch.float32)
                try:
                    return super().step(closure)
                finally:
                    for g, lr in zip(self.param_groups, lrs):
                        g["lr"] = lr

        FloatLR.__name__ = FloatLR.__qualname__ = f"{base.__name__}SR"
        _FLOAT_LR[base] = FloatLR
    return _FLOAT_LR[base]
