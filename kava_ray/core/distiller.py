"""The distillation step as one nn.Module: student + a projector per teacher + fusion + the loss terms -> loss.

`Distiller.forward(batch, teacher_kv)` is one micro-batch: the student's forward (its logits and its
own K, V), every teacher's KV projected into the student's layout, then each enabled loss term
(`core.terms`: KV, CE and logit KD, relation, hidden states, on-policy's sampled figures) adds to
the loss and writes its figures. The recipe builds the parts from the job's sections
(`recipes.build.build_distiller`); the Distiller reads no config but the `loss` section's positions
and chunking. Wrapping the whole module in DDP syncs the student, the projectors, the fusion and the
hidden-state maps together. Pure PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
from torch.profiler import record_function

from kava_ray.common.config import LossConfig, OptimConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.fusion import Fusion
from kava_ray.core.kv import KVBatch, student_forward_kv
from kava_ray.core.losses import position_masks
from kava_ray.core.metric_names import FUSION, KV_LOSS, KV_TOKENS, LABEL_TOKENS, LOSS, TOKENS, of
from kava_ray.core.plans import TeacherPlan
from kava_ray.core.precision import sr_adamw
from kava_ray.core.projectors import StudentMap
from kava_ray.core.terms import StepView, TeacherPositions, Term
from kava_ray.core.vocab_chunks import VocabReader

if TYPE_CHECKING:  # the batch type is the data layer's; core does not import it at run time
    from kava_ray.data import Batch


@dataclass
class DistillOutput:
    """What `Distiller.forward` returns (the shape of Hugging Face's `ModelOutput`, TRL's
    `compute_loss(return_outputs=True)`): `loss` (0-d, with its graph) and `metrics`
    ({`metric_names`: detached 0-d tensor}); when asked, `kv_term` (kv_weight * the KV loss, with
    its graph: `recipes.distill`'s grad/kv_share; None without a KV term) and `student_kv` (the
    student's own K, V: evaluation's projector-free cosine). Under DDP the wrapper's forward returns
    it as is (it finds the tensors of a dataclass's fields)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    kv_term: Optional[torch.Tensor] = None
    student_kv: Optional[KVBatch] = None


class Distiller(nn.Module):
    """Student, projector bank {teacher: TeacherProjector}, Fusion and the terms' maps, trained together.

    terms: {name: `core.terms.Term`} in the order they run (`core.terms.build_terms`); positions: a
    teacher's tensors on the student's positions (`core.terms.TeacherPositions`); key_space: the
    keys the projectors align."""

    def __init__(self, student: nn.Module, plans: dict[str, TeacherPlan], projectors: nn.ModuleDict, fusion: Fusion,
                 terms: dict[str, Term], loss: LossConfig, positions: TeacherPositions, key_space: str):
        super().__init__()
        self.student, self.projectors, self.fusion = student, projectors, fusion
        hidden = terms.get("hidden")
        self.hidden_proj = hidden.proj if hidden is not None else nn.ModuleDict()  # (checkpoint name: hidden_proj)
        self.terms, self.loss_cfg, self.positions, self.key_space = terms, loss, positions, key_space
        self.names = list(plans)
        self.layers = {n: list(plans[n].layers) for n in self.names}
        self.kv = "kv" in terms  # a job whose teachers ship no KV (a teacher on vLLM) serves log-probs only
        vocab = terms["ce_logits"]
        self.logit_specs, self.logit_names = vocab.specs, vocab.names

    def forward(self, batch: Batch, teacher_kv: dict[str, KVBatch], *, output_kv_term: bool = False,
                output_student_kv: bool = False) -> DistillOutput:
        """One micro-batch: batch a `kava_ray.data.Batch` (input_ids / attention_mask / labels /
        answer_mask [B, T], `teachers` for those of another tokenizer), teacher_kv {teacher:
        KVBatch}.

        Returns a `DistillOutput`: loss = the sum of the terms' (ce_weight * CE + kv_weight * KV +
        logit_weight * logit KD + ...); metrics (`kava_ray.core.metric_names`) are detached 0-d
        tensors on the loss's device. KV terms count token positions, CE and logit KD next-token
        positions (`losses.position_masks`)."""
        kv_mask, next_mask = position_masks(batch, self.loss_cfg.loss_tokens)  # [B, T] each: KV / CE + KD
        reader = VocabReader(self.student, self.loss_cfg.vocab_chunk, batch.input_ids.numel())  # whole, or chunks
        with record_function("kava/student_forward"), reader.capture():  # incl. the KV capture (scopes: `bench step`)
            out, skv = student_forward_kv(self.student, batch.input_ids, batch.attention_mask,
                                          layers=None if self.kv else [],
                                          key_space=self.key_space, hidden=len(self.hidden_proj) > 0,
                                          output_hidden_states=self.fusion.kind == "router", **reader.forward_kwargs())
        with record_function("kava/projectors"):
            projected, masks, native = self._project(batch, teacher_kv, kv_mask) if self.kv else ({}, {}, {})
        with record_function("kava/fusion_loss"):  # the terms in order: KV, CE + logit KD, relation, hidden, sampled
            v = StepView(batch, teacher_kv, out, skv, reader, kv_mask, next_mask, projected, masks, native,
                         self.training)
            loss = None
            for term in self.terms.values():
                add = term(v)
                if add is not None:
                    loss = add if loss is None else loss + add
            v.metrics.update(self._summary(loss, v))
            return DistillOutput(loss, v.metrics, v.kv_term if output_kv_term else None,
                                 skv if output_student_kv else None)

    def _project(self, batch: Batch, teacher_kv: dict[str, KVBatch], kv_mask: torch.Tensor):
        """Every teacher's KV in the student's layout and positions: ({t: (keys, values)}, each
        [L_s, B, H_s, T, D_s]; {t: its KV mask [B, T]}; {t: (keys, values) unprojected, [L_t, B,
        H_t, T, D_t]})."""
        projected, masks, native = {}, {}, {}
        for n in self.names:
            t = teacher_kv[n]
            if t.key_space != self.key_space:  # rotated keys against de-rotated ones would align nothing
                raise KavaError(f"teacher '{n}' sent {t.key_space} keys, the student aligns {self.key_space} keys "
                                f"(align.key_space)")
            if t.layer_ids != self.layers[n]:
                raise KavaError(f"teacher '{n}' sent layers {t.layer_ids}, its projector expects {self.layers[n]}")
            (keys, values), masks[n] = self.positions(n, (t.keys, t.values), batch, kv_mask)  # [L_t, B, H_t, T, D_t]
            native[n] = (keys, values)
            projected[n] = self.projectors[n](keys, values)
        return projected, masks, native

    def _summary(self, loss: torch.Tensor, v: StepView) -> dict:
        """The step's loss, its token counts (what each term averages over) and the fusion weights."""
        out = {LOSS: loss.detach(), TOKENS: v.batch.attention_mask.sum(),
               KV_TOKENS: (v.kv_mask != 0).sum(),  # what the KV loss and KV metrics average over (loss_tokens)
               LABEL_TOKENS: v.next_mask.sum()}  # what CE and logit KD average over
        if KV_LOSS not in v.metrics:  # (a job whose teachers ship no KV: 0)
            out[KV_LOSS] = v.skv.keys.new_zeros(())
        out.update({of(FUSION, n): w for n, w in self.fusion.current_weights().items()})
        return out


# ------------------------------------------------------------------------------------ optimisation


def param_groups(distiller: Distiller, optim: OptimConfig) -> list[dict]:
    """The student at lr_student; projectors and fusion at lr_projector; a trained student-side map
    (kind fit, align.projector.train_map) at lr_student -- it must not learn faster than the student
    it maps."""
    student = [p for p in distiller.student.parameters() if p.requires_grad]
    maps = [p for m in distiller.projectors.modules() if isinstance(m, StudentMap) for p in m.parameters()
            if p.requires_grad]
    extra = getattr(distiller, "hidden_proj", None)  # (a stand-in with a student, projectors and fusion only)
    heads = [p for m in (distiller.projectors, distiller.fusion, *([extra] if extra is not None else []))
             for p in m.parameters()
             if p.requires_grad and not any(p is q for q in maps)]
    groups = [{"params": student, "lr": optim.lr_student, "name": "student"}]
    if heads:
        groups.append({"params": heads, "lr": optim.lr_projector, "name": "projector"})
    if maps:
        groups.append({"params": maps, "lr": optim.lr_student, "name": "map"})
    return groups


def build_optimizer(distiller: Distiller, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (torch) or AdamW8bit (bitsandbytes) for fp32 student weights (student.precision fp32 or
    bf16-mixed); for bf16 weights (bf16-sr) torchao's AdamW / AdamW8bit with stochastic rounding,
    because a round-to-nearest optimizer loses bf16 updates below half an ulp. fp16 weights are
    refused."""
    groups = param_groups(distiller, optim)
    low = {p.dtype for g in groups for p in g["params"] if p.dtype in (torch.float16, torch.bfloat16)}
    if torch.float16 in low:
        raise KavaError("student weights are float16: refused (AdamW overflows them to inf without loss scaling); "
                        "use student.precision: bf16-mixed or fp32")
    if low:
        return sr_adamw(groups, optim)
    if optim.optimizer == "adamw8bit":
        import bitsandbytes as bnb  # optional (CUDA only)

        return bnb.optim.AdamW8bit(groups, weight_decay=optim.weight_decay)
    return torch.optim.AdamW(groups, weight_decay=optim.weight_decay)


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Linear warmup over warmup_steps, then cosine / linear decay to 0 or constant.
    `warmup_from_zero`: the warm-up of transformers' `get_constant_schedule_with_warmup` /
    `get_cosine_schedule_with_warmup` (step / warmup_steps: the first step at lr 0), which TRL's
    trainers use; the decay is theirs either way."""
    warm = optim.warmup_steps
    first = 0 if optim.warmup_from_zero else 1

    def f(step: int) -> float:
        if step < warm:
            return (step + first) / warm
        if optim.schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        if optim.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def build_scheduler(opt: torch.optim.Optimizer, optim: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))

