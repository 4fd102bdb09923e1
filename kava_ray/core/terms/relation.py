"""The relation term: MiniLMv2's K-K and V-V relation KL to each teacher's matched layers, no projector between."""

from __future__ import annotations

import math

import torch

from kava_ray.core.align.layers import heaviest_sources
from kava_ray.core.losses import relation_loss
from kava_ray.core.metric_names import RELATION
from kava_ray.core.terms.base import PriorWeighted, StepView, TermParts


def layer_pairs(parts: TermParts) -> dict[str, list[int]]:
    """{teacher: per student layer, the index among its shipped layers of its heaviest mapped
    teacher layer}: the layer each student layer is held against by the relation and hidden-state
    terms."""
    return {n: [list(p.layers).index(t) for t in heaviest_sources(p.layer_map)] for n, p in parts.plans.items()}


class RelationTerm(PriorWeighted):
    """relation_weight * (`losses.relation_loss` of K and V, their mean) to every teacher, weighted
    with the normalised fusion prior; figure: relation."""

    name, weight_key, metric = "relation", "relation_weight", RELATION

    def __init__(self, parts: TermParts, s_heads: int):
        super().__init__(parts)
        self.pairs = layer_pairs(parts)
        self.heads = {n: math.gcd(s_heads, p.geometry.num_kv_heads) for n, p in parts.plans.items()}

    def per_teacher(self, v: StepView, n: str) -> torch.Tensor:
        keys, values = v.native[n]
        pick, heads = self.pairs[n], self.heads[n]
        return (relation_loss(v.skv.keys, keys[pick], v.masks[n], heads)
                + relation_loss(v.skv.values, values[pick], v.masks[n], heads)) / 2
