"""The distillation step as one nn.Module: student + a projector per teacher + fusion -> loss.

`Distiller.forward(batch, teacher_kv)` is one micro-batch: student forward (CE on answer tokens and
the student's own K, V), project every teacher into the student layout, fuse (or keep one loss per
teacher for `sum`), Mercator/hybrid/MSE KV loss, plus the metrics a researcher watches. Wrapping the
whole module in DDP syncs the student, the projectors and the fusion together. Pure PyTorch.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.profiler import record_function

from kava_ray.common.config import JobConfig, OptimConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.align.tokens import aligned_mask, apply_alignment
from kava_ray.core.fusion import Fusion
from kava_ray.core.kv import KVBatch, student_forward_kv
from kava_ray.core.logit_kd import logit_term
from kava_ray.core.losses import (
    contrast_gap,
    cos_metrics,
    kv_loss,
    log_normalizer,
    masked_ce,
    position_masks,
)
from kava_ray.core.models import KVGeometry
from kava_ray.core.plans import TeacherPlan, logit_specs
from kava_ray.core.projectors import TeacherProjector


class Distiller(nn.Module):
    """Student, projector bank {teacher: TeacherProjector} and Fusion, trained together."""

    def __init__(self, student: nn.Module, plans: dict[str, TeacherPlan], s_geom: KVGeometry, cfg: JobConfig,
                 vocab_maps: dict | None = None):
        super().__init__()
        a, p = cfg.align, cfg.align.projector
        self.student = student
        self.names = list(plans)
        self.layers = {n: list(plans[n].layers) for n in self.names}
        self.projectors = nn.ModuleDict({
            n: TeacherProjector(plan.layers, plan.geometry.num_kv_heads, plan.geometry.head_dim,
                                s_geom.num_layers, s_geom.num_kv_heads, s_geom.head_dim, plan.layer_map,
                                mode=a.mode, aggregation=a.aggregation, kind=p.kind, mlp_ratio=p.mlp_ratio,
                                dropout=p.dropout, head_proj=p.head_proj)
            for n, plan in plans.items()})
        self.fusion = Fusion(cfg.fusion.kind, len(self.names), n_layers=s_geom.num_layers,
                             weights=cfg.fusion.weights, per_layer=cfg.fusion.per_layer,
                             feature_dim=s_geom.hidden_size, names=self.names, center=cfg.loss.center)
        self.loss_cfg = cfg.loss
        self.key_space = a.key_space
        # teachers of another tokenizer: their KV is mapped to student positions by characters
        # (`align.token_align`); their logits, unless loss.logit_cross_vocab is off, at paired positions through
        # `vocab_maps` (`plans.vocab_maps`: needed for hybrid), see `kava_ray.core.logit_kd`
        self.aligned = [n for n in self.names if plans[n].aligned]
        self.token_align = a.token_align
        self.logit_specs = logit_specs(cfg, plans, vocab_maps) if cfg.loss.logit_weight > 0 else {}
        self.logit_names = list(self.logit_specs)

    def _kv_loss(self, s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor):
        c = self.loss_cfg
        return kv_loss(c.kind, s, t, mask, alpha=c.alpha, beta=c.beta, hybrid_weight=c.hybrid_weight,
                       center=c.center)

    @staticmethod
    def _kv_means(mk: dict, mv: dict) -> dict:
        """cos_sim (centred), cos_raw and cos_per_layer (centred), each the mean of K and V."""
        per_layer = [(a + b) / 2 for a, b in zip(mk["cos_per_layer"], mv["cos_per_layer"])]
        return {"cos_sim": (mk["cos_sim"] + mv["cos_sim"]) / 2, "cos_raw": (mk["cos_raw"] + mv["cos_raw"]) / 2,
                "cos_per_layer": per_layer}

    def _kv_pair_loss(self, skv: KVBatch, tk: torch.Tensor, tv: torch.Tensor, mask: torch.Tensor):
        """The KV loss -- mean of the K and V losses, or one of them (`loss.kv_parts`); metrics averaged over K and V
        either way."""
        lk, mk = self._kv_loss(skv.keys, tk, mask)
        lv, mv = self._kv_loss(skv.values, tv, mask)
        parts = self.loss_cfg.kv_parts
        loss = lk if parts == "keys" else lv if parts == "values" else (lk + lv) / 2
        return loss, self._kv_means(mk, mv)

    def _logit_weights(self) -> list:
        """The teachers' shares of the logit KD loss, detached (the logit loss never trains the fusion):
        fixed / sum: the normalised `fusion.weights` (the prior); gate: the current softmax (mean over
        layers with per_layer); router: the mean router weight over this batch's counted tokens (its
        last forward) -- i.e. `Fusion.current_weights()`, which for `sum` is the normalised prior too."""
        w = self.fusion.current_weights()
        total = sum(w[n] for n in self.logit_names)  # renormalised over the teachers whose logits count
        return [w[n] / total for n in self.logit_names]

    def _logit_loss(self, logits: torch.Tensor, teacher_kv: dict[str, KVBatch], batch: dict, mask: torch.Tensor,
                    lse: torch.Tensor | None = None):
        """Every logit teacher's term (`logit_kd.logit_term`: top-k forward KL for the student's tokenizer, hybrid
        or ULD at paired positions for another), weighted with the fusion weights, on the next-token positions
        `mask`; metrics `logit_kl` (the weighted loss), `logit_kl/<t>`, `logit_uld/<t>`, `logit_aligned/<t>`,
        `top1_agree/<t>`."""
        c = self.loss_cfg
        # the student's tokenizer: ids past its vocabulary? one host sync for all (a gather past the vocab would be a
        # device-side assert on CUDA); a teacher that sent no top-k is named by `logit_term`
        # (a teacher whose head is wider than the student's may: `logit_term` counts those ids as tail mass)
        vocab = logits.shape[-1]
        same = [n for n in self.logit_names if self.logit_specs[n].cross is None and teacher_kv[n].topk_ids is not None
                and not self.logit_specs[n].wider_than(vocab)]
        if same:
            keep = mask.to(logits.device)[..., None] != 0
            ids = [teacher_kv[n].topk_ids for n in same]
            top = torch.stack([torch.where(keep, i[..., :c.logit_top_k].to(logits.device), 0).max() for i in ids])
            if int(top.max()) >= vocab:
                worst = same[int(top.argmax())]
                raise KavaError(f"teacher '{worst}' sent top-k token id {int(top.max())}, the student's vocab has "
                                f"{vocab} (logit KD needs one tokenizer: loss.logit_weight={c.logit_weight})")
        metrics, total = {}, 0
        for n, w in zip(self.logit_names, self._logit_weights()):
            spec = self.logit_specs[n].to(logits.device)  # its map's tensors (a no-op once there)
            loss_n, m = logit_term(spec, logits, teacher_kv[n], batch, mask, c, lse)
            total = total + w.to(loss_n.device) * loss_n
            metrics.update({f"{'top1_agree' if k == 'top1_agree' else 'logit_' + k}/{n}": v for k, v in m.items()})
        metrics["logit_kl"] = total.detach()
        return total, metrics

    def _to_student_time(self, n: str, t: KVBatch, batch: dict, kv_mask: torch.Tensor):
        """(keys, values, mask) of teacher `n` on the student's positions.

        Same tokenizer: its KV as sent and the KV mask. Another tokenizer: `align.tokens.apply_alignment`
        maps [L_t, B, H_t, T_t, D_t] to [L_t, B, H_t, T_s, D_t] (the batch's `align_lo/<n>`, `align_hi/<n>`),
        and student positions no teacher token overlaps leave the mask (counted as `aligned/<n>`)."""
        if n not in self.aligned:
            return t.keys, t.values, kv_mask
        if f"align_lo/{n}" not in batch:
            raise KavaError(f"teacher '{n}' uses another tokenizer than the student, but the batch carries no token "
                            f"alignment for it (splits must be built with job.teacher_tokenizers)")
        lo, hi = batch[f"align_lo/{n}"].to(t.keys.device), batch[f"align_hi/{n}"].to(t.keys.device)
        keys = apply_alignment(t.keys, lo, hi, self.token_align)
        values = apply_alignment(t.values, lo, hi, self.token_align)
        return keys, values, kv_mask * aligned_mask(lo, hi).to(kv_mask.device, kv_mask.dtype)

    def forward(self, batch: dict, teacher_kv: dict[str, KVBatch]):
        """batch: input_ids / attention_mask / labels / answer_mask [B, T]; teacher_kv: {teacher: KVBatch}.

        Returns (loss, metrics); metrics are detached 0-d tensors on the loss's device (no GPU sync here:
        the worker converts them once per log step). KV metrics: `cos_sim` / `cos/<teacher>` (cosine
        centred per (layer, head) over the batch's counted tokens: a constant target scores 0),
        `cos_raw` / `cos_raw/<teacher>` (plain cosine), `cos_layer/{first,middle,last}` (centred),
        `contrast_gap` (centred, see `losses.contrast_gap`); all the mean of K and V. With
        `loss.logit_weight` > 0 also the logit KD loss (top-k forward KL, every teacher's KVBatch must carry
        `topk_ids` / `topk_logp`): `logit_kl` (weighted over teachers), `logit_kl/<teacher>`,
        `top1_agree/<teacher>` (student argmax == teacher's top-1), on the positions CE counts
        (`losses.position_masks`: logits at t predict t + 1); KV losses count token positions.
        Teachers of another tokenizer are first mapped to the student's positions (`_to_student_time`):
        with a fused target the KV loss counts the positions every teacher covers, per-teacher metrics (and
        `fusion.kind: sum`'s losses) each teacher's own; `aligned/<teacher>` is the share it covers.
        """
        mask = batch["attention_mask"]
        kv_mask, next_mask = position_masks(batch, self.loss_cfg.loss_tokens)  # [B, T] each: KV / CE + KD
        router = self.fusion.kind == "router"
        with record_function("kava/student_forward"):  # incl. the KV capture (scopes for `bench step`)
            out, skv = student_forward_kv(self.student, batch["input_ids"], mask, key_space=self.key_space,
                                          output_hidden_states=router)
        with record_function("kava/projectors"):
            projected, masks, metrics = {}, {}, {}
            for n in self.names:
                t = teacher_kv[n]
                if t.key_space != self.key_space:  # rotated keys against de-rotated ones would align nothing
                    raise KavaError(f"teacher '{n}' sent {t.key_space} keys, the student aligns {self.key_space} keys "
                                    f"(align.key_space)")
                if t.layer_ids != self.layers[n]:
                    raise KavaError(f"teacher '{n}' sent layers {t.layer_ids}, its projector expects {self.layers[n]}")
                keys, values, masks[n] = self._to_student_time(n, t, batch, kv_mask)  # [L_t, B, H_t, T, D_t]
                projected[n] = self.projectors[n](keys, values)  # each [L_s, B, H_s, T, D_s]
        with record_function("kava/fusion_loss"):  # CE, fusion, KV (+ logit) loss, metrics
            c = self.loss_cfg
            kd = c.logit_weight > 0
            # one logsumexp over the vocabulary per position for CE and (at T = 1) the KD's full-vocab normaliser
            lse = log_normalizer(out.logits) if kd and c.logit_temperature == 1.0 else None
            ce = masked_ce(out.logits, batch["labels"], lse=lse)
            if self.aligned:  # a fused target exists where every teacher has one
                for n in self.aligned:
                    metrics[f"aligned/{n}"] = (masks[n] != 0).sum() / (kv_mask != 0).sum().clamp(min=1)
                if self.fusion.fuses_targets:
                    kv_mask = torch.stack([masks[n] for n in self.names]).amin(0)
            if self.fusion.fuses_targets:
                feat = out.hidden_states[-1].detach() if router else None  # [B, T, hidden]
                tk = self.fusion([projected[n][0] for n in self.names], feat, kv_mask)
                tv = self.fusion([projected[n][1] for n in self.names], feat, kv_mask)
                kvl, m = self._kv_pair_loss(skv, tk, tv, kv_mask)
                for n in self.names:
                    if tk is projected[n][0] and tv is projected[n][1]:  # one teacher, fixed: it is the target
                        m_n = m
                    else:
                        m_n = self._kv_means(cos_metrics(skv.keys, projected[n][0], masks[n]),
                                             cos_metrics(skv.values, projected[n][1], masks[n]))
                    metrics[f"cos/{n}"], metrics[f"cos_raw/{n}"] = m_n["cos_sim"], m_n["cos_raw"]
                gap = (contrast_gap(skv.keys, tk, kv_mask) + contrast_gap(skv.values, tv, kv_mask)) / 2
            else:
                losses, ms = [], []
                for n in self.names:
                    loss_n, m_n = self._kv_pair_loss(skv, *projected[n], masks[n])
                    losses.append(loss_n)
                    ms.append(m_n)
                    metrics[f"cos/{n}"], metrics[f"cos_raw/{n}"] = m_n["cos_sim"], m_n["cos_raw"]
                kvl = self.fusion.combine_losses(losses)
                w = self.fusion.prior.tolist()
                m = {"cos_sim": sum(wi * mi["cos_sim"] for wi, mi in zip(w, ms)),
                     "cos_raw": sum(wi * mi["cos_raw"] for wi, mi in zip(w, ms)),
                     "cos_per_layer": [sum(wi * mi["cos_per_layer"][i] for wi, mi in zip(w, ms))
                                       for i in range(len(ms[0]["cos_per_layer"]))]}
                # one loss per teacher, so the gap is the weighted mean of the per-teacher gaps
                gap = sum(wi * (contrast_gap(skv.keys, projected[n][0], masks[n])
                                + contrast_gap(skv.values, projected[n][1], masks[n])) / 2
                          for wi, n in zip(w, self.names))
            loss = c.ce_weight * ce + c.kv_weight * kvl
            if kd:
                kl, m_logit = self._logit_loss(out.logits, teacher_kv, batch, next_mask, lse)
                loss = loss + c.logit_weight * kl
                metrics.update(m_logit)
            layers = m["cos_per_layer"]
            metrics.update(
                loss=loss.detach(), ce=ce.detach(), kv_loss=kvl.detach(), cos_sim=m["cos_sim"], cos_raw=m["cos_raw"],
                **{"cos_layer/first": layers[0], "cos_layer/middle": layers[len(layers) // 2],
                   "cos_layer/last": layers[-1]},
                contrast_gap=gap,
                tokens=mask.sum(),
                kv_tokens=(kv_mask != 0).sum(),  # what the KV loss and KV metrics average over (loss_tokens)
                label_tokens=next_mask.sum(),  # what CE and logit KD average over
            )
            metrics.update({f"fusion/{n}": w for n, w in self.fusion.current_weights().items()})
            return loss, metrics


# ------------------------------------------------------------------------------------ optimisation


def param_groups(distiller: Distiller, optim: OptimConfig) -> list[dict]:
    """Two groups: the student at lr_student; projectors and fusion at lr_projector."""
    student = [p for p in distiller.student.parameters() if p.requires_grad]
    heads = [p for m in (distiller.projectors, distiller.fusion) for p in m.parameters() if p.requires_grad]
    groups = [{"params": student, "lr": optim.lr_student, "name": "student"}]
    if heads:
        groups.append({"params": heads, "lr": optim.lr_projector, "name": "projector"})
    return groups


def build_optimizer(distiller: Distiller, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (torch) or AdamW8bit (bitsandbytes) for fp32 student weights (student.precision fp32 or
    bf16-mixed); for bf16 weights (bf16-sr) torchao's AdamW / AdamW8bit with stochastic rounding, because a
    round-to-nearest optimizer loses bf16 updates below half an ulp. fp16 weights are refused."""
    groups = param_groups(distiller, optim)
    low = {p.dtype for g in groups for p in g["params"] if p.dtype in (torch.float16, torch.bfloat16)}
    if torch.float16 in low:
        raise KavaError("student weights are float16: refused (AdamW overflows them to inf without loss scaling); "
                        "use student.precision: bf16-mixed or fp32")
    if low:
        from kava_ray.core.precision import sr_adamw

        return sr_adamw(groups, optim)
    if optim.optimizer == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, weight_decay=optim.weight_decay)
    return torch.optim.AdamW(groups, weight_decay=optim.weight_decay)


def lr_lambda(optim: OptimConfig, total_steps: int):
    """Linear warmup over warmup_steps, then cosine / linear decay to 0 or constant."""
    warm = optim.warmup_steps

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if optim.schedule == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        if optim.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def build_scheduler(opt: torch.optim.Optimizer, optim: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))

