"""The KV term: the student's K, V against its teachers' projected K, V (Mercator, hybrid, MSE or
smooth L1: `losses.kv_loss`), against their fusion or (`fusion.kind: sum`) one loss per teacher, at
`loss.kv_weight`."""

from __future__ import annotations

from typing import Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.losses import contrast_gap, cos_metrics, kv_loss
from kava_ray.core.metric_names import ALIGNED, CONTRAST_GAP, COS, COS_LAYERS, COS_RAW, COS_SIM, KV_LOSS, of
from kava_ray.core.terms.base import StepView, TermParts


class KVTerm:
    """kv_weight * the KV loss; figures: kv_loss, cos_sim / cos_raw / the first, middle and last
    layer's cosine / contrast_gap (the mean of K and V), cos/<t>, cos_raw/<t>, and aligned/<t> (the
    share of KV positions a teacher of another tokenizer covers)."""

    name = "kv"

    def __init__(self, parts: TermParts):
        self.c, self.names, self.fusion, self.projectors = parts.loss, parts.names, parts.fusion, parts.projectors
        self.aligned = parts.positions.aligned

    @classmethod
    def build(cls, parts: TermParts) -> Optional["KVTerm"]:
        return cls(parts) if parts.ships_kv else None  # a teacher on vLLM ships no KV: no KV term, no KV figures

    def __call__(self, v: StepView) -> torch.Tensor:
        v.metrics.update({of(ALIGNED, n): (v.masks[n] != 0).sum() / (v.kv_mask != 0).sum().clamp(min=1)
                          for n in self.aligned})
        if self.aligned and self.fusion.fuses_targets:  # a fused target exists where every teacher has one
            v.kv_mask = torch.stack([v.masks[n] for n in self.names]).amin(0)
        views = {n: self._student_view(n, v) for n in self.names}  # the student as each teacher's loss sees it
        fused = self._fused if self.fusion.fuses_targets else self._summed
        kvl, m, per_teacher = fused(v, views)
        layers, (first, middle, last) = m["cos_per_layer"], COS_LAYERS
        v.metrics.update(per_teacher)
        v.metrics.update({KV_LOSS: kvl.detach(), COS_SIM: m[COS_SIM], COS_RAW: m[COS_RAW], first: layers[0],
                          middle: layers[len(layers) // 2], last: layers[-1], CONTRAST_GAP: m[CONTRAST_GAP]})
        v.kv_term = self.c.kv_weight * kvl
        return v.kv_term

    def _student_view(self, n: str, v: StepView) -> tuple:
        """The student's (keys, values) as teacher `n`'s KV loss sees them: its own, or (kind fit)
        mapped into the teacher's space; a fit map that was never fitted
        (`recipes.fit_maps.fit_maps`) would train nothing: refused."""
        pr = self.projectors[n]
        if not pr.student_side:
            return v.skv.keys, v.skv.values
        if v.training and not bool(pr.k_map.fitted):
            raise KavaError(f"teacher '{n}': align.projector.kind fit, but its student-side map was never fitted "
                            f"(fit it before training: kava_ray.recipes.fit_maps.fit_maps)")
        return pr.map_student(v.skv.keys, v.skv.values)

    def _fused(self, v: StepView, views: dict):
        """One loss against the fusion of the projected teachers (fixed, gate, router), on the
        positions every teacher covers; per-teacher figures against each teacher's own."""
        sk, sv = views[self.names[0]]  # one teacher, or none of kind fit (the Distiller refuses the rest)
        feat = v.out.hidden_states[-1].detach() if self.fusion.kind == "router" else None  # [B, T, hidden]
        projected = v.projected
        tk = self.fusion([projected[n][0] for n in self.names], feat, v.kv_mask)  # [L_s, B, H_s, T, D_s]
        tv = self.fusion([projected[n][1] for n in self.names], feat, v.kv_mask)
        kvl, m = self._pair_loss(sk, sv, tk, tv, v.kv_mask)
        per_teacher = {}
        for n in self.names:
            if tk is projected[n][0] and tv is projected[n][1]:  # one teacher, fixed: it is the target
                m_n = m
            else:
                m_n = _kv_means(cos_metrics(sk, projected[n][0], v.masks[n]),
                                cos_metrics(sv, projected[n][1], v.masks[n]))
            per_teacher[of(COS, n)], per_teacher[of(COS_RAW, n)] = m_n[COS_SIM], m_n[COS_RAW]
        m[CONTRAST_GAP] = (contrast_gap(sk, tk, v.kv_mask) + contrast_gap(sv, tv, v.kv_mask)) / 2
        return kvl, m, per_teacher

    def _summed(self, v: StepView, views: dict):
        """`fusion.kind: sum`: one loss per teacher on its own positions (`Fusion.combine_losses`),
        the figures the prior-weighted mean of the teachers'."""
        losses, ms, per_teacher = [], [], {}
        for n in self.names:
            loss_n, m_n = self._pair_loss(*views[n], *v.projected[n], v.masks[n])
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
        m[CONTRAST_GAP] = sum(wi * (contrast_gap(views[n][0], v.projected[n][0], v.masks[n])
                                    + contrast_gap(views[n][1], v.projected[n][1], v.masks[n])) / 2
                              for wi, n in zip(w, self.names))
        return kvl, m, per_teacher

    def _pair_loss(self, sk, sv, tk, tv, mask: torch.Tensor):
        """Student (sk, sv) against (tk, tv): the mean of the K and V losses, or one of them
        (`loss.kv_parts`); figures the mean of K and V either way."""
        c = self.c
        kw = dict(alpha=c.alpha, beta=c.beta, hybrid_weight=c.hybrid_weight, center=c.center)
        lk, mk = kv_loss(c.kind, sk, tk, mask, **kw)
        lv, mv = kv_loss(c.kind, sv, tv, mask, **kw)
        loss = lk if c.kv_parts == "keys" else lv if c.kv_parts == "values" else (lk + lv) / 2
        return loss, _kv_means(mk, mv)


def _kv_means(mk: dict, mv: dict) -> dict:
    """cos_sim (centred), cos_raw and cos_per_layer (centred), each the mean of K and V."""
    per_layer = [(a + b) / 2 for a, b in zip(mk["cos_per_layer"], mv["cos_per_layer"])]
    return {COS_SIM: (mk[COS_SIM] + mv[COS_SIM]) / 2, COS_RAW: (mk[COS_RAW] + mv[COS_RAW]) / 2,
            "cos_per_layer": per_layer}
