"""On-policy runs' figures of the student's samples: the tokens sampled and the teacher-scored reverse KL."""

from __future__ import annotations

from typing import Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.metric_names import RKL_SUM, SAMPLED_TOKENS, of
from kava_ray.core.terms.base import StepView, TermParts


class SampledTerm:
    """No loss: every batch of an on-policy run, the tokens the student sampled (0 for a batch of
    the data) and, per teacher of its tokenizer, the sum over them of log q - log pi_T
    (`RKL_SUM/<t>`; the step record divides by the tokens: the teacher-scored reverse KL of the
    samples, absent from a step that sampled none)."""

    name = "sampled"

    def __init__(self, parts: TermParts):
        self.scored = parts.scored

    @classmethod
    def build(cls, parts: TermParts) -> Optional["SampledTerm"]:
        return cls(parts) if parts.onpolicy else None

    def __call__(self, v: StepView) -> None:
        batch = v.batch
        sampled = batch.source == "student" and batch.sample_logp is not None
        m = v.next_mask.to(batch.input_ids.device) if sampled else torch.zeros_like(v.next_mask, dtype=torch.bool)
        v.metrics[SAMPLED_TOKENS] = m.sum()
        for n in self.scored:
            t = v.teacher_kv[n].token_logp
            if sampled and t is None:
                raise KavaError(f"teacher '{n}' sent no token log-probs for the student's samples")
            diff = (batch.sample_logp.to(m.device) - t.to(m.device)) if sampled else torch.zeros(m.shape)
            v.metrics[of(RKL_SUM, n)] = torch.where(m, diff.to(m.device), 0.0).sum()
        return None
