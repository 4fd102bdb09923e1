"""The Distiller built from the job's sections, as torchtune's recipes build their components: the
projectors from `align`, the fusion from `fusion`, the loss terms from `loss` (`core.terms`), the
logit teachers and the scored ones from the job's plans. The one place a `JobConfig` meets the
Distiller."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.distiller import Distiller
from kava_ray.core.fusion import Fusion
from kava_ray.core.models import KVGeometry
from kava_ray.core.plans import TeacherPlan, logit_specs, token_logprob_teachers
from kava_ray.core.projectors import TeacherProjector, job_kind
from kava_ray.core.terms import TeacherPositions, TermParts, build_terms


def build_distiller(student: nn.Module, plans: dict[str, TeacherPlan], s_geom: KVGeometry, cfg: JobConfig,
                    vocab_maps: Optional[dict] = None, *, sharded: bool = False) -> Distiller:
    """The job's Distiller over `student` (KV geometry `s_geom`). vocab_maps: `plans.vocab_maps`
    (the hybrid logit loss of a teacher of another tokenizer); sharded: FSDP2 shards it over the
    job's workers (`RayConfig.sharded`), which rules out the projector kind fit
    (`projectors.job_kind`). Parameters are created in the order projectors, fusion, hidden-state
    maps (the seed set before decides them)."""
    a, p = cfg.align, cfg.align.projector
    projectors = nn.ModuleDict({} if not cfg.ships_kv else {
        n: TeacherProjector(plan.layers, plan.geometry.num_kv_heads, plan.geometry.head_dim,
                            s_geom.num_layers, s_geom.num_kv_heads, s_geom.head_dim, plan.layer_map,
                            mode=a.mode, aggregation=a.aggregation,
                            kind=job_kind(cfg.align, cfg.fusion.kind, len(cfg.teachers), plan.geometry, s_geom,
                                          copied=plan.copied, sharded=sharded,
                                          aligned=plan.aligned),
                            mlp_ratio=p.mlp_ratio, dropout=p.dropout, head_proj=p.head_proj, train_map=p.train_map)
        for n, plan in plans.items()})
    fusion = Fusion(cfg.fusion.kind, len(plans), n_layers=s_geom.num_layers, weights=cfg.fusion.weights,
                    per_layer=cfg.fusion.per_layer, feature_dim=s_geom.hidden_size, names=list(plans),
                    center=cfg.loss.center)
    if fusion.fuses_targets and len(plans) > 1 and any(pr.student_side for pr in projectors.values()):
        raise KavaError(f"align.projector.kind: fit compares the student with each teacher in that teacher's own "
                        f"space, so there is no fused target: use fusion.kind: sum with {len(plans)} teachers")
    positions = TeacherPositions([n for n, plan in plans.items() if plan.aligned], a.token_align)
    parts = TermParts(loss=cfg.loss, names=list(plans), plans=plans, fusion=fusion, projectors=projectors,
                      positions=positions, ships_kv=cfg.ships_kv,
                      logit_specs=logit_specs(cfg.loss, plans, vocab_maps) if cfg.loss.logit_weight > 0 else {},
                      scored=token_logprob_teachers(cfg.onpolicy, plans), onpolicy=cfg.onpolicy.fraction > 0)
    return Distiller(student, plans, projectors, fusion, build_terms(parts, s_geom), cfg.loss, positions,
                     a.key_space)
