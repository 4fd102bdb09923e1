"""The hidden-state term: Minitron's cosine loss between the student's hidden states and each
teacher's matched layers, through a learned map where the widths differ."""

from __future__ import annotations

import torch
import torch.nn as nn

from kava_ray.common.errors import KavaError
from kava_ray.core.losses import hidden_cosine_loss
from kava_ray.core.metric_names import HIDDEN
from kava_ray.core.terms.base import PriorWeighted, StepView, TermParts
from kava_ray.core.terms.relation import layer_pairs


def hidden_projection(s_hidden: int, t_hidden: int) -> nn.Module:
    """The student-side map: none for one width, else ModelOpt's ProjectionLayer (Linear with bias,
    weights N(0, 0.02) as Megatron's init_method, bias 0)."""
    if int(s_hidden) == int(t_hidden):
        return nn.Identity()
    proj = nn.Linear(int(s_hidden), int(t_hidden))
    nn.init.normal_(proj.weight, std=0.02)
    nn.init.zeros_(proj.bias)
    return proj


class HiddenTerm(PriorWeighted):
    """hidden_weight * `losses.hidden_cosine_loss` to every teacher's matched layers on the CE
    positions, weighted with the normalised fusion prior; a teacher of another tokenizer's states
    first moved to student positions as its KV is. Its maps (`proj`, {teacher: module}) are the
    Distiller's `hidden_proj`, trained with the projectors."""

    name, weight_key, metric = "hidden", "hidden_weight", HIDDEN

    def __init__(self, parts: TermParts, s_hidden: int):
        super().__init__(parts)
        self.positions, self.pairs = parts.positions, layer_pairs(parts)
        self.proj = nn.ModuleDict({n: hidden_projection(s_hidden, p.geometry.hidden_size)
                                   for n, p in parts.plans.items()})

    def per_teacher(self, v: StepView, n: str) -> torch.Tensor:
        t = v.teacher_kv[n]
        if t.hidden is None:
            raise KavaError(f"teacher '{n}' sent no hidden states (loss.hidden_weight > 0 needs them; a KV cache "
                            f"must be precomputed with it)")
        (th,), m = self.positions(n, (t.hidden.unsqueeze(2),), v.batch, v.next_mask)  # [L, B, 1, T, h]: as KV
        th = th.squeeze(2)  # [L_t, B, T_s, h_t]
        s = self.proj[n](v.skv.hidden)  # [L_s, B, T, h_t]
        return hidden_cosine_loss(s, th[self.pairs[n]], m)
