"""The distillation step as one nn.Module: student + a projector per teacher + fusion -> loss.

`Distiller.forward(batch, teacher_kv)` is one micro-batch: student forward (CE on answer tokens and
the student's own K, V), project every teacher into the student layout, fuse (or keep one loss per
teacher for `sum`), Mercator/hybrid/MSE KV loss, plus the metrics a researcher watches. Wrapping the
whole module in DDP syncs the student, the projectors and the fusion together. Pure PyTorch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
from torch.profiler import record_function

from kava_ray.common.config import JobConfig, OptimConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import heaviest_sources
from kava_ray.core.align.tokens import aligned_mask, apply_alignment
from kava_ray.core.fusion import Fusion
from kava_ray.core.kv import KVBatch, student_forward_kv
from kava_ray.core.logit_kd import TEACHER_LOSS, VocabTerms, logit_targets, loss_key, next_labels
from kava_ray.core.losses import (
    contrast_gap,
    cos_metrics,
    hidden_cosine_loss,
    kv_loss,
    position_masks,
    relation_loss,
)
from kava_ray.core.metric_names import (
    ALIGNED,
    CE,
    CONTRAST_GAP,
    COS,
    COS_LAYERS,
    COS_RAW,
    COS_SIM,
    FUSION,
    HIDDEN,
    KV_LOSS,
    KV_TOKENS,
    LABEL_TOKENS,
    LOGIT_KL,
    LOSS,
    RELATION,
    RKL_SUM,
    SAMPLED_TOKENS,
    TOKENS,
    TOP1_AGREE,
    of,
)
from kava_ray.core.models import KVGeometry
from kava_ray.core.plans import TeacherPlan, logit_specs, token_logprob_teachers
from kava_ray.core.precision import sr_adamw
from kava_ray.core.projectors import StudentMap, TeacherProjector, job_kind
from kava_ray.core.vocab_chunks import VocabReader

if TYPE_CHECKING:  # the batch type is the data layer's; core does not import it at run time
    from kava_ray.data import Batch


@dataclass
class DistillOutput:
    """What `Distiller.forward` returns (the shape of Hugging Face's `ModelOutput`, TRL's
    `compute_loss(return_outputs=True)`): `loss` (0-d, with its graph) and `metrics` ({`metric_names`: detached 0-d
    tensor}); when asked, `kv_term` (kv_weight * the KV loss, with its graph: `recipes.distill`'s grad/kv_share) and
    `student_kv` (the student's own K, V: evaluation's projector-free cosine). Under DDP the wrapper's forward returns
    it as is (it finds the tensors of a dataclass's fields)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    kv_term: Optional[torch.Tensor] = None
    student_kv: Optional[KVBatch] = None


class Distiller(nn.Module):
    """Student, projector bank {teacher: TeacherProjector} and Fusion, trained together."""

    def __init__(self, student: nn.Module, plans: dict[str, TeacherPlan], s_geom: KVGeometry, cfg: JobConfig,
                 vocab_maps: dict | None = None, *, sharded: bool = False):
        """sharded: FSDP2 shards this module over the job's workers (`RayConfig.sharded`), which rules out the
        projector kind fit (`projectors.job_kind`); the Distiller reads no other part of the job's `ray` section."""
        super().__init__()
        a, p = cfg.align, cfg.align.projector
        self.student = student
        self.names = list(plans)
        self.layers = {n: list(plans[n].layers) for n in self.names}
        # a job whose teachers ship no KV (`JobConfig.ships_kv`: a teacher on vLLM) has no KV terms, projectors or
        # KV metrics: its teachers serve log-probs only
        self.kv = cfg.ships_kv
        self.projectors = nn.ModuleDict({} if not self.kv else {
            n: TeacherProjector(plan.layers, plan.geometry.num_kv_heads, plan.geometry.head_dim,
                                s_geom.num_layers, s_geom.num_kv_heads, s_geom.head_dim, plan.layer_map,
                                mode=a.mode, aggregation=a.aggregation,
                                kind=job_kind(cfg, plan.geometry, s_geom, copied=plan.copied, sharded=sharded,
                                              aligned=plan.aligned),
                                mlp_ratio=p.mlp_ratio, dropout=p.dropout, head_proj=p.head_proj,
                                train_map=p.train_map)
            for n, plan in plans.items()})
        self.fusion = Fusion(cfg.fusion.kind, len(self.names), n_layers=s_geom.num_layers,
                             weights=cfg.fusion.weights, per_layer=cfg.fusion.per_layer,
                             feature_dim=s_geom.hidden_size, names=self.names, center=cfg.loss.center)
        self.loss_cfg = cfg.loss
        if self.fusion.fuses_targets and len(self.names) > 1 and any(pr.student_side for pr in self.projectors.values()):
            raise KavaError(f"align.projector.kind: fit compares the student with each teacher in that teacher's own "
                            f"space, so there is no fused target: use fusion.kind: sum with {len(self.names)} teachers")
        self.key_space = a.key_space
        # teachers of another tokenizer: their KV is mapped to student positions by characters
        # (`align.token_align`); their logits, unless loss.logit_cross_vocab is off, at paired positions through
        # `vocab_maps` (`plans.vocab_maps`: needed for hybrid), see `kava_ray.core.logit_kd`
        self.aligned = [n for n in self.names if plans[n].aligned]
        self.token_align = a.token_align
        # relation loss: each student layer against its heaviest mapped teacher layer (an index into the shipped ones)
        self.relation_pairs = {n: [self.layers[n].index(t) for t in heaviest_sources(plan.layer_map)]
                               for n, plan in plans.items() if self.kv}
        self.relation_heads = {n: math.gcd(s_geom.num_kv_heads, plan.geometry.num_kv_heads) for n, plan in plans.items()}
        # hidden-state loss: the same pairs; a learned map where the widths differ (ModelOpt's ProjectionLayer:
        # Linear with bias, weights N(0, 0.02) as Megatron's init_method, bias 0), else none
        self.hidden_proj = nn.ModuleDict(
            {n: _hidden_projection(s_geom.hidden_size, plan.geometry.hidden_size) for n, plan in plans.items()}
            if cfg.loss.hidden_weight > 0 else {})
        self.logit_specs = logit_specs(cfg, plans, vocab_maps) if cfg.loss.logit_weight > 0 else {}
        self.logit_names = list(self.logit_specs)
        self.scored = token_logprob_teachers(cfg, plans)  # on-policy: their reverse KL of the student's samples
        self.onpolicy = cfg.onpolicy.fraction > 0

    def forward(self, batch: Batch, teacher_kv: dict[str, KVBatch], *, output_kv_term: bool = False,
                output_student_kv: bool = False) -> DistillOutput:
        """One micro-batch: batch a `kava_ray.data.Batch` (input_ids / attention_mask / labels / answer_mask
        [B, T], `teachers` for those of another tokenizer), teacher_kv {teacher: KVBatch}.

        Returns a `DistillOutput`: loss = ce_weight * CE + kv_weight * KV (+ logit_weight * logit KD); metrics
        (`kava_ray.core.metric_names`) are detached 0-d tensors on the loss's device, converted once per log step;
        with output_kv_term its kv_term, with output_student_kv the student's KVBatch (as Hugging Face's
        `output_hidden_states`: asked for, else None). Nothing is kept on the module.
        KV terms count token positions, CE and logit KD next-token positions (`losses.position_masks`).
        """
        kv_mask, next_mask = position_masks(batch, self.loss_cfg.loss_tokens)  # [B, T] each: KV / CE + KD
        reader = VocabReader(self.student, self.loss_cfg.vocab_chunk, batch.input_ids.numel())  # whole, or chunks
        with record_function("kava/student_forward"), reader.capture():  # incl. the KV capture (scopes: `bench step`)
            out, skv = student_forward_kv(self.student, batch.input_ids, batch.attention_mask,
                                          layers=None if self.kv else [],
                                          key_space=self.key_space, hidden=len(self.hidden_proj) > 0,
                                          output_hidden_states=self.fusion.kind == "router", **reader.forward_kwargs())
        with record_function("kava/projectors"):
            projected, masks, native = self._project(batch, teacher_kv, kv_mask) if self.kv else ({}, {}, {})
        with record_function("kava/fusion_loss"):  # CE, fusion, KV (+ logit) loss, metrics
            c = self.loss_cfg
            metrics, kvl, kv_m = {}, skv.keys.new_zeros(()), None  # (no KV: a job whose teachers ship none)
            if self.kv:
                metrics = {of(ALIGNED, n): (masks[n] != 0).sum() / (kv_mask != 0).sum().clamp(min=1)
                           for n in self.aligned}  # the share of KV positions each teacher of another tokenizer covers
                if self.aligned and self.fusion.fuses_targets:  # a fused target exists where every teacher has one
                    kv_mask = torch.stack([masks[n] for n in self.names]).amin(0)
                views = {n: self._student_view(n, skv) for n in self.names}  # the student as each teacher's loss sees it
                kvl, kv_m, per_teacher = self._kv_term(out, views, projected, masks, kv_mask)
                metrics.update(per_teacher)
            kv_term = c.kv_weight * kvl
            # CE (off on the student's own samples: it would teach it what it already says; on a teacher's samples
            # it is sequence-level KD) and the logit terms, which read the vocabulary; after the KV term, whose
            # fusion forward sets the router weights the logit teachers are weighted with
            head_loss, ce, m_logit = self._vocab_terms(reader, out, teacher_kv, batch, next_mask)
            loss = head_loss + kv_term
            if c.relation_weight > 0:
                rel = self._relation_term(skv, native, masks)
                loss = loss + c.relation_weight * rel
                metrics[RELATION] = rel.detach()
            if c.hidden_weight > 0:
                hid = self._hidden_term(skv, teacher_kv, batch, next_mask)
                loss = loss + c.hidden_weight * hid
                metrics[HIDDEN] = hid.detach()
            metrics.update(m_logit)
            metrics.update(self._metrics(loss, ce, kvl, kv_m, batch, kv_mask, next_mask))
            if self.onpolicy:
                metrics.update(self._sampled_metrics(teacher_kv, batch, next_mask))
            return DistillOutput(loss, metrics, kv_term if output_kv_term else None,
                                 skv if output_student_kv else None)

    # ---------------------------------------------------------------------------------- teachers -> student

    def _project(self, batch: Batch, teacher_kv: dict[str, KVBatch], kv_mask: torch.Tensor):
        """Every teacher's KV in the student's layout and positions: ({t: (keys, values)}, each
        [L_s, B, H_s, T, D_s]; {t: its KV mask [B, T]}; {t: (keys, values) unprojected, [L_t, B, H_t, T, D_t]})."""
        projected, masks, native = {}, {}, {}
        for n in self.names:
            t = teacher_kv[n]
            if t.key_space != self.key_space:  # rotated keys against de-rotated ones would align nothing
                raise KavaError(f"teacher '{n}' sent {t.key_space} keys, the student aligns {self.key_space} keys "
                                f"(align.key_space)")
            if t.layer_ids != self.layers[n]:
                raise KavaError(f"teacher '{n}' sent layers {t.layer_ids}, its projector expects {self.layers[n]}")
            keys, values, masks[n] = self._to_student_time(n, t, batch, kv_mask)  # [L_t, B, H_t, T, D_t]
            native[n] = (keys, values)
            projected[n] = self.projectors[n](keys, values)
        return projected, masks, native

    def _to_student_time(self, n: str, t: KVBatch, batch: Batch, kv_mask: torch.Tensor):
        """(keys, values, mask) of teacher `n` on the student's positions (`_in_student_time`)."""
        (keys, values), mask = self._in_student_time(n, (t.keys, t.values), batch, kv_mask)
        return keys, values, mask

    def _in_student_time(self, n: str, xs: tuple, batch: Batch, mask: torch.Tensor):
        """(tensors, mask): teacher `n`'s tensors [L_t, B, H_t, T, D_t] on the student's positions, and `mask`.

        Same tokenizer: as sent. Another tokenizer: `align.tokens.apply_alignment` maps T_t to T_s
        (`batch.teachers[n]`'s align_lo / align_hi), and student positions no teacher token overlaps leave the mask."""
        if n not in self.aligned:
            return xs, mask
        view = batch.teachers.get(n)
        if view is None:
            raise KavaError(f"teacher '{n}' uses another tokenizer than the student, but the batch carries no token "
                            f"alignment for it (splits must be built with job.teacher_tokenizers)")
        lo, hi = view.align_lo.to(xs[0].device), view.align_hi.to(xs[0].device)
        return (tuple(apply_alignment(x, lo, hi, self.token_align) for x in xs),
                mask * aligned_mask(lo, hi).to(mask.device, mask.dtype))

    def _student_view(self, n: str, skv: KVBatch) -> tuple:
        """The student's (keys, values) as teacher `n`'s KV loss sees them: its own, or (kind fit) mapped into the
        teacher's space; a fit map that was never fitted (`recipes.fit_maps.fit_maps`) would train nothing: refused."""
        pr = self.projectors[n]
        if not pr.student_side:
            return skv.keys, skv.values
        if self.training and not bool(pr.k_map.fitted):
            raise KavaError(f"teacher '{n}': align.projector.kind fit, but its student-side map was never fitted "
                            f"(fit it before training: kava_ray.recipes.fit_maps.fit_maps)")
        return pr.map_student(skv.keys, skv.values)

    # ------------------------------------------------------------------------------------------ the terms

    def _kv_term(self, out, views: dict, projected: dict, masks: dict, kv_mask: torch.Tensor):
        """(KV loss, its summary {cos_sim, cos_raw, cos_per_layer, contrast_gap}, {cos/<t>, cos_raw/<t>}).

        views: {t: the student's (keys, values) as t's loss sees them} (the student's own; kind fit: mapped into t's
        space). A fused target (fixed, gate, router): one loss against the fusion of the projected teachers, on the
        positions every teacher covers; per-teacher metrics against each teacher's own. `sum`: one loss per
        teacher (`Fusion.combine_losses`), the summary the prior-weighted mean of the teachers'."""
        if not self.fusion.fuses_targets:
            return self._summed_kv(views, projected, masks)
        sk, sv = views[self.names[0]]  # one teacher, or none of kind fit (Distiller refuses the rest)
        feat = out.hidden_states[-1].detach() if self.fusion.kind == "router" else None  # [B, T, hidden]
        tk = self.fusion([projected[n][0] for n in self.names], feat, kv_mask)  # [L_s, B, H_s, T, D_s]
        tv = self.fusion([projected[n][1] for n in self.names], feat, kv_mask)
        kvl, m = self._kv_pair_loss(sk, sv, tk, tv, kv_mask)
        per_teacher = {}
        for n in self.names:
            if tk is projected[n][0] and tv is projected[n][1]:  # one teacher, fixed: it is the target
                m_n = m
            else:
                m_n = self._kv_means(cos_metrics(sk, projected[n][0], masks[n]),
                                     cos_metrics(sv, projected[n][1], masks[n]))
            per_teacher[of(COS, n)], per_teacher[of(COS_RAW, n)] = m_n[COS_SIM], m_n[COS_RAW]
        m[CONTRAST_GAP] = (contrast_gap(sk, tk, kv_mask) + contrast_gap(sv, tv, kv_mask)) / 2
        return kvl, m, per_teacher

    def _summed_kv(self, views: dict, projected: dict, masks: dict):
        """`fusion.kind: sum`'s KV term: one loss per teacher on its own positions, as `_kv_term` returns it."""
        losses, ms, per_teacher = [], [], {}
        for n in self.names:
            loss_n, m_n = self._kv_pair_loss(*views[n], *projected[n], masks[n])
            losses.append(loss_n)
            ms.append(m_n)
            per_teacher[of(COS, n)], per_teacher[of(COS_RAW, n)] = m_n[COS_SIM], m_n[COS_RAW]
        kvl = self.fusion.combine_losses(losses)
        w = self.fusion.prior.tolist()
        m = {COS_SIM: sum(wi * mi[COS_SIM] for wi, mi in zip(w, ms)),
             COS_RAW: sum(wi * mi[COS_RAW] for wi, mi in zip(w, ms)),
             "cos_per_layer": [sum(wi * mi["cos_per_layer"][i] for wi, mi in zip(w, ms))
                               for i in range(len(ms[0]["cos_per_layer"]))]}
        # one loss per teacher, so the gap is the weighted mean of the per-teacher gaps
        m[CONTRAST_GAP] = sum(wi * (contrast_gap(views[n][0], projected[n][0], masks[n])
                                    + contrast_gap(views[n][1], projected[n][1], masks[n])) / 2
                              for wi, n in zip(w, self.names))
        return kvl, m, per_teacher

    def _kv_pair_loss(self, sk: torch.Tensor, sv: torch.Tensor, tk: torch.Tensor, tv: torch.Tensor,
                      mask: torch.Tensor):
        """The KV loss of student (sk, sv) against (tk, tv) -- mean of the K and V losses, or one of them
        (`loss.kv_parts`); metrics averaged over K and V either way."""
        c = self.loss_cfg
        kw = dict(alpha=c.alpha, beta=c.beta, hybrid_weight=c.hybrid_weight, center=c.center)
        lk, mk = kv_loss(c.kind, sk, tk, mask, **kw)
        lv, mv = kv_loss(c.kind, sv, tv, mask, **kw)
        loss = lk if c.kv_parts == "keys" else lv if c.kv_parts == "values" else (lk + lv) / 2
        return loss, self._kv_means(mk, mv)

    @staticmethod
    def _kv_means(mk: dict, mv: dict) -> dict:
        """cos_sim (centred), cos_raw and cos_per_layer (centred), each the mean of K and V."""
        per_layer = [(a + b) / 2 for a, b in zip(mk["cos_per_layer"], mv["cos_per_layer"])]
        return {COS_SIM: (mk[COS_SIM] + mv[COS_SIM]) / 2, COS_RAW: (mk[COS_RAW] + mv[COS_RAW]) / 2,
                "cos_per_layer": per_layer}

    def _vocab_terms(self, reader: VocabReader, out, teacher_kv: dict[str, KVBatch], batch: Batch,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(ce_weight * CE + logit_weight * the logit teachers' terms, CE, the logit metrics), from the student's logits
        whole or in chunks of positions (`core.vocab_chunks`, `loss.vocab_chunk`): CE on the next-token positions
        whose label carries loss; every logit teacher's term (`logit_kd.targets_term`) weighted by the fusion
        weights (`_logit_weights`, or per record: `_routed`) on the next-token positions `mask`. One logsumexp per
        position serves CE and (at temperature 1) the logit terms. Metrics: logit_kl (the weighted loss),
        logit_kl/<t>, logit_uld/<t>, logit_aligned/<t>, top1_agree/<t>."""
        c, dev, vocab = self.loss_cfg, reader.device(out), reader.vocab(out)
        terms = VocabTerms(next_labels(batch.labels, dev), c, c.logit_weight > 0 and c.logit_temperature == 1.0,
                           ce_coef=0.0 if batch.source == "student" else c.ce_weight)
        shares, metrics = [], {}  # shares: (share of the logit loss, its term's key)
        # a teacher no record of the batch is routed to teaches nothing in it: its figures are not measured (absent,
        # not 0: `DistillRecipe.step` averages each over the micro-batches that measured it)
        absent = set() if batch.route is None else {n for n in self.logit_names
                                                    if not any(not r or r == n for r in batch.route)}
        if c.logit_weight > 0:
            self._check_top_k_ids(vocab, dev, teacher_kv, mask)
            for n, parts in self._routed(batch, mask).items():
                spec = self.logit_specs[n].to(dev)  # its map's tensors (a no-op once there)
                whole = parts[0][1] if len(parts) == 1 else torch.stack([m for _, m, _ in parts]).any(0)
                tg, fixed = logit_targets(spec, teacher_kv[n], batch, whole, c, vocab, dev)
                if n not in absent:
                    metrics.update({of("logit_" + k, n): v for k, v in fixed.items()})
                if len(parts) == 1:
                    terms.add(n, spec, tg, coef=c.logit_weight * parts[0][0].to(dev))
                else:  # its figures over every position it teaches; its loss in parts of their own weight
                    terms.add(n, spec, tg)
                    for w, m, part in parts:
                        terms.add(n, spec, logit_targets(spec, teacher_kv[n], batch, m, c, vocab, dev)[0],
                                  coef=c.logit_weight * w.to(dev), part=part)
                shares += [(w.to(dev), of(loss_key(part if len(parts) > 1 else ""), n)) for w, _, part in parts]
        loss, read = reader.terms(out, terms)
        if shares:
            metrics.update({of(TOP1_AGREE if t.name == TOP1_AGREE else "logit_" + t.name, t.teacher): t.value
                            for t in read.values() if t.coef is None and t.teacher not in (None, *absent)
                            and not t.name.startswith(TEACHER_LOSS)})
            metrics[LOGIT_KL] = sum(w * read[key].value for w, key in shares).detach()
        return loss, read[CE].value, metrics

    def _routed(self, batch: Batch, mask: torch.Tensor) -> dict[str, list]:
        """{teacher: [(share of the logit loss, the positions [B, T] it teaches at that weight, the part's name)]}
        over the logit teachers, so that the logit loss is the mean over the positions `mask` of each position's
        teachers' terms, each at its weight there: every position with the fusion weights (`_logit_weights`); with
        records that name their teacher (`batch.route`, NeMo-RL's MOPD), a named row's positions are its teacher's
        alone (weight 1) and an unnamed row's split by the fusion weights. A term is a mean over its positions, so
        a teacher that teaches named rows (weight 1) and unnamed ones (its fusion weight) has a part for each
        (`named`, `free`), each with the share of the positions it holds times that weight."""
        weights = self._logit_weights()
        if batch.route is None:
            return {n: [(w, mask, "")] for n, w in zip(self.logit_names, weights)}
        unknown = sorted({r for r in batch.route if r and r not in self.logit_names})
        if unknown:
            raise KavaError(f"a record names teacher {unknown[0]!r} (column 'teacher'), but the job's logit teachers "
                            f"are {', '.join(self.logit_names)}")
        m = mask.to(torch.bool)
        total = m.sum().to(torch.float32).clamp(min=1)  # every named row names a logit teacher; free rows' weights sum to 1
        free = torch.tensor([not r for r in batch.route], device=m.device)[:, None] & m
        out = {}
        for n, w in zip(self.logit_names, weights):
            mine = torch.tensor([r == n for r in batch.route], device=m.device)[:, None] & m
            parts = [(mine.sum() / total, mine, "named")] if n in batch.route else []
            if not all(batch.route):
                parts.append((w.to(m.device) * free.sum() / total, free, "free"))
            if len(parts) < 2:  # one part (none: a teacher no row is routed to, its share 0 and its figures absent)
                parts = [(parts[0][0], parts[0][1], "")] if parts else [(total * 0, mine, "")]
            out[n] = parts
        return out

    def _check_top_k_ids(self, vocab: int, device, teacher_kv: dict[str, KVBatch], mask: torch.Tensor) -> None:
        """Refuse top-k ids past the student's vocabulary from a teacher of its tokenizer, in one host sync (a
        gather past the vocab would be a device-side assert on CUDA). A teacher that sent no top-k is named by
        `targets_term`; one whose head is wider than the student's may (`targets_term` counts those as tail mass)."""
        c = self.loss_cfg
        same = [n for n in self.logit_names if self.logit_specs[n].cross is None and teacher_kv[n].topk_ids is not None
                and not self.logit_specs[n].wider_than(vocab)]
        if not same:
            return
        keep = mask.to(device)[..., None] != 0
        ids = [teacher_kv[n].topk_ids for n in same]
        top = torch.stack([torch.where(keep, i[..., :c.logit_top_k].to(device), 0).max() for i in ids])
        if int(top.max()) >= vocab:
            worst = same[int(top.argmax())]
            raise KavaError(f"teacher '{worst}' sent top-k token id {int(top.max())}, the student's vocab has "
                            f"{vocab} (logit KD needs one tokenizer: loss.logit_weight={c.logit_weight})")

    def _logit_weights(self) -> list:
        """The teachers' shares of the logit KD loss, detached (the logit loss never trains the fusion):
        `Fusion.current_weights()` (fixed / sum: the normalised prior; gate: the softmax, mean over layers;
        router: the mean router weight of its last forward), renormalised over the logit teachers."""
        w = self.fusion.current_weights()
        total = sum(w[n] for n in self.logit_names)
        return [w[n] / total for n in self.logit_names]

    def _relation_term(self, skv: KVBatch, native: dict, masks: dict) -> torch.Tensor:
        """MiniLMv2's K-K and V-V relation KL (`losses.relation_loss`, the mean of the two) to every teacher's matched
        layers, weighted with the normalised fusion prior: no projector between student and teacher."""
        w = self.fusion.prior.tolist()
        total = 0
        for wi, n in zip(w, self.names):
            keys, values = native[n]
            pick, heads = self.relation_pairs[n], self.relation_heads[n]
            total = total + wi * (relation_loss(skv.keys, keys[pick], masks[n], heads)
                                  + relation_loss(skv.values, values[pick], masks[n], heads)) / 2
        return total

    def _hidden_term(self, skv: KVBatch, teacher_kv: dict[str, KVBatch], batch: Batch, mask: torch.Tensor):
        """Minitron's hidden-state cosine loss (`losses.hidden_cosine_loss`) to every teacher's matched layers on the
        CE positions `mask`, weighted with the normalised fusion prior; a teacher of another tokenizer's states are
        first moved to student positions as its KV is (`_to_student_time`)."""
        w = self.fusion.prior.tolist()
        total = 0
        for wi, n in zip(w, self.names):
            t = teacher_kv[n]
            if t.hidden is None:
                raise KavaError(f"teacher '{n}' sent no hidden states (loss.hidden_weight > 0 needs them; a KV cache "
                                f"must be precomputed with it)")
            (th,), m = self._in_student_time(n, (t.hidden.unsqueeze(2),), batch, mask)  # [L, B, 1, T, h], as the KV
            th = th.squeeze(2)  # [L_t, B, T_s, h_t]
            s = self.hidden_proj[n](skv.hidden)  # [L_s, B, T, h_t]
            total = total + wi * hidden_cosine_loss(s, th[self.relation_pairs[n]], m)
        return total

    def _sampled_metrics(self, teacher_kv: dict[str, KVBatch], batch: Batch, next_mask: torch.Tensor) -> dict:
        """On-policy runs, every batch: the tokens the student sampled (0 for a batch of the data), and per teacher
        of its tokenizer the sum over them of log q - log pi_T (`RKL_SUM/<t>`; the step record divides by the tokens:
        the teacher-scored reverse KL of the samples, absent from a step that sampled none)."""
        sampled = batch.source == "student" and batch.sample_logp is not None
        m = next_mask.to(batch.input_ids.device) if sampled else torch.zeros_like(next_mask, dtype=torch.bool)
        out = {SAMPLED_TOKENS: m.sum()}
        for n in self.scored:
            t = teacher_kv[n].token_logp
            if sampled and t is None:
                raise KavaError(f"teacher '{n}' sent no token log-probs for the student's samples")
            diff = (batch.sample_logp.to(m.device) - t.to(m.device)) if sampled else torch.zeros(m.shape)
            out[of(RKL_SUM, n)] = torch.where(m, diff.to(m.device), 0.0).sum()
        return out

    def _metrics(self, loss, ce, kvl, kv_m: dict, batch: Batch, kv_mask: torch.Tensor, next_mask: torch.Tensor) -> dict:
        """The step's summary metrics: losses, the KV cosines and gap (mean of K and V), the token counts and the
        fusion weights."""
        out = {LOSS: loss.detach(), CE: ce.detach(), KV_LOSS: kvl.detach(),
               TOKENS: batch.attention_mask.sum(),
               KV_TOKENS: (kv_mask != 0).sum(),  # what the KV loss and KV metrics average over (loss_tokens)
               LABEL_TOKENS: next_mask.sum()}  # what CE and logit KD average over
        if kv_m is not None:  # (a job whose teachers ship no KV has none)
            layers = kv_m["cos_per_layer"]
            first, middle, last = COS_LAYERS
            out.update({COS_SIM: kv_m[COS_SIM], COS_RAW: kv_m[COS_RAW], first: layers[0],
                        middle: layers[len(layers) // 2], last: layers[-1], CONTRAST_GAP: kv_m[CONTRAST_GAP]})
        out.update({of(FUSION, n): w for n, w in self.fusion.current_weights().items()})
        return out


def _hidden_projection(s_hidden: int, t_hidden: int) -> nn.Module:
    """The student-side map of the hidden-state loss: none for one width, else ModelOpt's ProjectionLayer."""
    if int(s_hidden) == int(t_hidden):
        return nn.Identity()
    proj = nn.Linear(int(s_hidden), int(t_hidden))
    nn.init.normal_(proj.weight, std=0.02)
    nn.init.zeros_(proj.bias)
    return proj


# ------------------------------------------------------------------------------------ optimisation


def param_groups(distiller: Distiller, optim: OptimConfig) -> list[dict]:
    """The student at lr_student; projectors and fusion at lr_projector; a trained student-side map (kind fit,
    align.projector.train_map) at lr_student -- it must not learn faster than the student it maps."""
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
    bf16-mixed); for bf16 weights (bf16-sr) torchao's AdamW / AdamW8bit with stochastic rounding, because a
    round-to-nearest optimizer loses bf16 updates below half an ulp. fp16 weights are refused."""
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
    """Linear warmup over warmup_steps, then cosine / linear decay to 0 or constant. `warmup_from_zero`: the warm-up
    of transformers' `get_constant_schedule_with_warmup` / `get_cosine_schedule_with_warmup` (step / warmup_steps:
    the first step at lr 0), which TRL's trainers use; the decay is theirs either way."""
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

