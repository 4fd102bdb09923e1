"""What the Distiller's loss terms share: the micro-batch as they read it (`StepView`), the
interface each implements (`Term`), what one is built from (`TermParts`) and the map of a teacher's
positions onto the student's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

from kava_ray.common.config import LossConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.align.tokens import aligned_mask, apply_alignment
from kava_ray.core.kv import KVBatch
from kava_ray.core.vocab_chunks import VocabReader

if TYPE_CHECKING:  # the batch type is the data layer's; core does not import it at run time
    from kava_ray.data import Batch


@dataclass
class StepView:
    """One micro-batch after the student's forward and the projectors, as every term reads it. Masks
    are [B, T]; projected / native: {teacher: (keys, values)} in the student's layout [L_s, B, H_s,
    T, D_s] / the teacher's own [L_t, B, H_t, T, D_t]; masks: {teacher: its KV mask on the student's
    positions}. Terms write their figures into `metrics`; the KV term narrows `kv_mask` to the
    positions a fused target covers and leaves its weighted loss in `kv_term`, the vocabulary term
    its CE in `ce`."""

    batch: "Batch"
    teacher_kv: dict[str, KVBatch]
    out: Any
    skv: KVBatch
    reader: VocabReader
    kv_mask: torch.Tensor
    next_mask: torch.Tensor
    projected: dict
    masks: dict
    native: dict
    training: bool
    metrics: dict = field(default_factory=dict)
    kv_term: Optional[torch.Tensor] = None
    ce: Optional[torch.Tensor] = None


class Term(Protocol):
    """A loss term: what it adds to the loss (weighted; None: metrics only), its figures into `view.metrics`."""

    name: str

    def __call__(self, view: StepView) -> Optional[torch.Tensor]: ...


class PriorWeighted:
    """A term summed over the teachers, each weighted by the normalised fusion prior (the relation
    and hidden terms): a subclass names its weight in the `loss` section (`weight_key`), its figure
    (`metric`) and one teacher's loss (`per_teacher`); it is built only when that weight is > 0."""

    weight_key: str
    metric: str

    def __init__(self, parts: "TermParts"):
        self.weight, self.names, self.fusion = getattr(parts.loss, self.weight_key), parts.names, parts.fusion

    @classmethod
    def build(cls, parts: "TermParts", *args):
        return cls(parts, *args) if getattr(parts.loss, cls.weight_key) > 0 else None

    def per_teacher(self, v: StepView, n: str) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, v: StepView) -> torch.Tensor:
        total = 0
        for wi, n in zip(self.fusion.prior.tolist(), self.names):
            total = total + wi * self.per_teacher(v, n)
        v.metrics[self.metric] = total.detach()
        return self.weight * total


@dataclass
class TermParts:
    """What a term is built from: the job's `loss` section and the Distiller's parts it reads (the
    fusion, the projectors, the teachers' plans and logit specs); `build_terms` hands the same parts
    to every term."""

    loss: LossConfig
    names: list[str]
    plans: dict
    fusion: Any
    projectors: Any
    positions: "TeacherPositions"
    ships_kv: bool
    logit_specs: dict
    scored: list[str]
    onpolicy: bool


@dataclass
class TeacherPositions:
    """A teacher's tensors on the student's positions: as sent for one of the student's tokenizer;
    for one of another tokenizer (`aligned`) mapped from T_t to T_s by
    `align.tokens.apply_alignment` (`batch.teachers[n]`'s align_lo / align_hi, `token_align`),
    student positions no teacher token overlaps leaving the mask."""

    aligned: list[str]
    token_align: str

    def __call__(self, n: str, xs: tuple, batch: "Batch", mask: torch.Tensor) -> tuple[tuple, torch.Tensor]:
        """(tensors, mask): teacher `n`'s tensors [L_t, B, H_t, T, D_t] on the student's positions, and `mask`."""
        if n not in self.aligned:
            return xs, mask
        view = batch.teachers.get(n)
        if view is None:
            raise KavaError(f"teacher '{n}' uses another tokenizer than the student, but the batch carries no token "
                            f"alignment for it (splits must be built with job.teacher_tokenizers)")
        lo, hi = view.align_lo.to(xs[0].device), view.align_hi.to(xs[0].device)
        return (tuple(apply_alignment(x, lo, hi, self.token_align) for x in xs),
                mask * aligned_mask(lo, hi).to(mask.device, mask.dtype))
