"""The Distiller's loss terms, one module each, behind one interface (`base.Term`): a term reads the
micro-batch's `StepView`, returns what it adds to the loss and writes its figures. `build_terms`
builds the enabled ones in the order they run: the KV term first (its fusion forward sets the router
weights the logit teachers are weighted with), then the vocabulary (CE and logit KD), relation and
hidden-state terms, and on-policy's sampled figures. A new term: a module here with a `build(parts,
...)` and a line in `build_terms`."""

from __future__ import annotations

from kava_ray.core.models import KVGeometry
from kava_ray.core.terms.base import StepView, TeacherPositions, Term, TermParts
from kava_ray.core.terms.ce_logits import CELogitsTerm
from kava_ray.core.terms.hidden import HiddenTerm, hidden_projection
from kava_ray.core.terms.kv import KVTerm
from kava_ray.core.terms.relation import RelationTerm
from kava_ray.core.terms.sampled import SampledTerm

__all__ = ["HiddenTerm", "KVTerm", "RelationTerm", "SampledTerm", "StepView", "TeacherPositions", "Term",
           "TermParts", "CELogitsTerm", "build_terms", "hidden_projection"]


def build_terms(parts: TermParts, s_geom: KVGeometry) -> dict[str, Term]:
    """{name: term} of the enabled terms, in the order they run and add to the loss."""
    built = (KVTerm.build(parts), CELogitsTerm.build(parts), RelationTerm.build(parts, s_geom.num_kv_heads),
             HiddenTerm.build(parts, s_geom.hidden_size), SampledTerm.build(parts))
    return {t.name: t for t in built if t is not None}
