"""A loss that is not finite stops the run, naming the first bad step and its term, before a checkpoint saves it.

`FirstBad` watches every step without a host sync: the gradient norms (after DDP/FSDP's all-reduce,
so every rank sees the same ones and every rank stops at the same step) decide; the rank's own loss
terms say which one. `check()` reads it at the loop's log steps, which every save step is: weights
that went NaN are never saved, and the last good checkpoint stays the latest.
"""

from __future__ import annotations

from typing import Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.metric_names import CE, HIDDEN, KV_LOSS, LOGIT_KL, LOSS, RELATION

# the terms a step's loss is built of, as a message names them
TERMS = {CE: "CE", KV_LOSS: "KV", LOGIT_KL: "logits", HIDDEN: "hidden", RELATION: "relation", LOSS: "loss"}
NORMS = ("grad_norm", "grad_norm_projector")


class FirstBad:
    """The first step whose gradient norm is not finite, and which loss terms were not (device tensors)."""

    def __init__(self):
        self.step: Optional[torch.Tensor] = None  # float64 scalar: 0 = none yet
        self.terms: Optional[torch.Tensor] = None  # bool [len(keys)]
        self.keys: list[str] = []

    def update(self, values: dict[str, torch.Tensor], step: int) -> None:
        """After a step (`values`: its metrics, device tensors); no sync."""
        norms = [values[k].reshape(()) for k in NORMS if k in values]
        if self.step is None:
            self.keys = [k for k in TERMS if k in values]
            self.step = torch.zeros((), dtype=torch.float64, device=norms[0].device)
            self.terms = torch.zeros(len(self.keys), dtype=torch.bool, device=norms[0].device)
        bad = ~torch.isfinite(torch.stack(norms)).all()
        new = bad & (self.step == 0)
        self.step = torch.where(new, torch.full_like(self.step, float(step)), self.step)
        terms = torch.stack([~torch.isfinite(values[k].reshape(())) for k in self.keys]) if self.keys else self.terms
        self.terms = torch.where(new, terms, self.terms)

    def check(self, last_saved: Optional[int] = None) -> None:
        """One KavaError line when a step went bad (one host sync; call it where the loop syncs anyway)."""
        if self.step is None or int(self.step.item()) == 0:
            return
        terms = [TERMS[k] for k, b in zip(self.keys, self.terms.tolist()) if b and k != LOSS]
        what = (f"the {' and '.join(terms)} term{'s' if len(terms) > 1 else ''}" if terms else
                "the gradient (this rank's loss terms were finite: another rank's batch, or an overflow in backward)")
        kept = (f"the checkpoint of step {last_saved} stays the latest" if last_saved else
                "nothing was saved")
        raise KavaError(f"step {int(self.step.item())}: the loss is not finite ({what}); training stopped and "
                        f"{kept} (lower the learning rates or the loss weights)")
