"""The logit divergences of on-policy distillation (`loss.logit_divergence`), each matched to the tool users compare:

- `generalized_jsd_loss`: TRL's `GKDTrainer.generalized_jsd_loss` (trl/trainer/gkd_trainer.py) on full logits:
  beta = 0 forward KL(T || S), beta = 1 reverse KL(S || T), else beta KL(T || M) + (1 - beta) KL(S || M) with the
  mixture M = (1 - beta) S + beta T; both sides at `temperature` (no T^2 factor, as TRL); per position the sum
  over the vocabulary, then the mean over the positions that count (TRL's "batchmean" with labels).
- `topk_divergence`: the same divergences on what the wire carries, the teacher's top-k ids plus one bucket for
  the mass outside them (the student normalised over its full vocabulary, its own mass outside those ids in the
  bucket): the full-vocabulary form when k = V (within the tail floor, 1e-6).
- `sampled_reverse_kl_loss`: on-policy distillation's per-token policy-gradient form (Thinking Machines'
  tinker-cookbook, `distillation/train_on_policy.py::incorporate_kl_penalty` with the `importance_sampling`
  loss): advantage A_t = log pi_T(x_t) - log pi_S(x_t) at the sampled token (no gradient through A), loss
  -exp(log pi_S(x_t) - log q(x_t)) * A_t, averaged over the sampled tokens (tinker sums them; a mean keeps the
  scale of kava-ray's other terms). tinker's A_t takes the sampler's log q; where q = pi_S (lag 0, temperature 1,
  top_p 1) the two are one. Per position the form is exact for any q that can draw every token: given the prefix,
  E_q[(pi_S / q) (log pi_T - log pi_S) grad log pi_S] = -grad KL(pi_S || pi_T). Per sequence (the sum over positions
  of that KL, the prefixes drawn from pi_S) it is exact only where the sampler draws them from pi_S, temperature 1
  and top_p 1: a tempered q draws the prefixes from itself, which the per-token weight does not correct (2-11 % of
  the expected gradient's norm at T 0.7, by exact enumeration: tests/test_divergences.py), and a top_p < 1 q never
  draws the tokens outside its nucleus; the config refuses both. Lag 1 draws the prefixes from the previous step's
  weights: per position exact, per sequence off by one step's change of pi_S (`loss.rkl_clip` bounds its ratio).

Every loss takes a [B, T] mask of the next-token positions that count (`losses.next_token_mask`);
masked positions change neither the loss nor its gradient. Pure PyTorch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kava_ray.common.errors import KavaError
from kava_ray.core.losses import OFF, TAIL_FLOOR, at_least_f32, bool_mask, log_normalizer, tail_of, topk_prepare

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "reverse_kl_sampled")


def divergence_beta(divergence: str, jsd_beta: float) -> float:
    """The generalized JSD's beta of a dense divergence: forward_kl 0, reverse_kl 1, jsd `jsd_beta`
    (reverse_kl_sampled's dense counterpart, for batches without samples: 1)."""
    if divergence not in DIVERGENCES:
        raise KavaError(f"loss.logit_divergence must be one of {', '.join(DIVERGENCES)}, not {divergence!r}")
    return {"forward_kl": 0.0, "reverse_kl": 1.0, "reverse_kl_sampled": 1.0}.get(divergence, float(jsd_beta))


def topk_divergence_warning(loss_cfg, vocab_size: int, fraction: float = 0.0) -> str | None:
    """The driver's one line when the job's logit term takes a divergence with beta > 0 (reverse_kl,
    jsd, and reverse_kl_sampled on the batches it does not sample: `onpolicy.fraction` < 1) by
    `topk_divergence` with `loss.logit_top_k` below the student's `vocab_size`: on the teachers'
    top-k and a tail bucket it is not that divergence over the vocabulary (DESIGN, the task bench's
    pair at top-64: reverse KL 0.67x its value, gradient cosine 0.90; JSD at beta 0.5 0.94x / 0.999;
    forward KL, exempt, 0.96x / 0.9999). None where it is exact or unused."""
    c = loss_cfg
    sampled = c.logit_divergence == "reverse_kl_sampled"
    beta = divergence_beta(c.logit_divergence, c.jsd_beta)
    if c.logit_weight <= 0 or beta == 0 or c.logit_top_k >= vocab_size or (sampled and fraction >= 1):
        return None
    what = f"{c.logit_divergence} (on the batches it does not sample)" if sampled else c.logit_divergence
    measured = ("0.67x its value, gradient cosine 0.90, down to -0.70 at a position" if beta == 1 else
                "0.94x its value, gradient cosine 0.999, measured at beta 0.5")
    return (f"warning: loss.logit_divergence {what} is taken on the teachers' top-{c.logit_top_k} ids and a tail "
            f"bucket, not over the student's {vocab_size}-token vocabulary (on the task bench's pair, top-64: "
            f"{measured}): set loss.logit_top_k={vocab_size} where the teachers can serve it")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position [...]: sum over the last dim of p (log p - log q), as
    `F.kl_div(log_q, log_p, log_target=True)` sums it (an entry of p with no mass adds 0)."""
    return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)


def jsd_per_position(log_s: torch.Tensor, log_t: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD between the student's and the teacher's log-probs [..., n] over their last dim: [...]."""
    if not 0.0 <= beta <= 1.0:
        raise KavaError(f"loss.jsd_beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return _kl(log_t, log_s)  # forward KL(T || S)
    if beta == 1.0:
        return _kl(log_s, log_t)  # reverse KL(S || T)
    log_m = torch.logsumexp(torch.stack([log_s + math.log(1.0 - beta), log_t + math.log(beta)]), dim=0)
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def _masked_mean(per: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    per = torch.where(m, per, 0.0)  # a masked position's NaN never reaches the sum or its gradient
    return per.sum() / m.sum().clamp(min=1)


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor | None = None,
                         beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """TRL `GKDTrainer.generalized_jsd_loss` (module docstring) on full logits [B, T, V] of one
    vocabulary; mask [B, T]: the positions that count (TRL: labels != -100 after the shift). Float32
    at least."""
    if student_logits.shape != teacher_logits.shape:
        raise KavaError(f"generalized JSD needs student and teacher logits of one shape, got "
                        f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    if not temperature > 0:
        raise KavaError(f"temperature must be > 0, got {temperature}")
    m = bool_mask(mask, *student_logits.shape[:2], student_logits.device, "generalized JSD")
    log_s = F.log_softmax(at_least_f32(student_logits) / temperature, dim=-1)
    log_t = F.log_softmax(at_least_f32(teacher_logits.detach()) / temperature, dim=-1)
    return _masked_mean(jsd_per_position(log_s, log_t, beta), m)


def topk_divergence(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                    mask: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                    teacher_tail: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                    valid: torch.Tensor | None = None) -> torch.Tensor:
    """The generalized JSD on the teacher's top-k support plus the tail bucket (module docstring).

    Args: student_logits [B, T, V]; topk_ids / topk_logp [B, T, k]: the teacher's top-k and their
    log-probs at T = 1 over its full vocabulary; teacher_tail [B, T]: log of its mass outside them
    (else 1 - sum p); mask [B, T]; lse [B, T]: the student's `log_normalizer` at `temperature` when
    the caller has it. The teacher at `temperature` is its k + 1 entries' log-probs divided by it
    and renormalised (as `losses.topk_kl_loss`); both buckets are floored at TAIL_FLOOR. valid [B,
    T, k]: the entries that count as ids (an id past the student's head, a padded teacher row: its
    mass joins the teacher's bucket, as `losses.topk_kl_loss` does). With k = V (every id sent:
    `loss.logit_top_k` >= the vocabulary) there is no bucket: `generalized_jsd_loss` on the whole
    vocabulary, TRL's GKD to float rounding.
    """
    if not temperature > 0:
        raise KavaError(f"temperature must be > 0, got {temperature}")
    ids, m = topk_prepare(student_logits, topk_ids, topk_logp, mask)
    keep = m[..., None]
    if lse is None:
        lse = log_normalizer(student_logits, temperature)
    z = student_logits.gather(-1, ids)  # [B, T, k]
    log_s = torch.where(keep, at_least_f32(z) / temperature - lse[..., None], -1.0)  # full-vocabulary student
    t = torch.where(keep, topk_logp.to(student_logits.device, log_s.dtype), -1.0)
    t_tail = tail_of(t) if teacher_tail is None else teacher_tail.to(t.device, t.dtype)
    if valid is not None:  # entries left out: no mass of their own on either side (exp(OFF) = 0)
        out = keep & ~valid.to(t.device)
        t_tail = torch.logaddexp(t_tail, torch.logsumexp(torch.where(out, t, -math.inf), dim=-1))
        t, log_s = torch.where(out, OFF, t), torch.where(out, OFF, log_s)
    if ids.shape[-1] >= student_logits.shape[-1]:  # every id sent: the whole vocabulary, no bucket (TRL's form)
        log_t = torch.log_softmax(t / temperature, dim=-1)
        return _masked_mean(jsd_per_position(log_s, log_t, beta), m)
    t_tail = torch.where(m, t_tail.clamp(min=math.log(TAIL_FLOOR)), -1.0)
    a = torch.cat([t, t_tail[..., None]], dim=-1) / temperature  # [B, T, k + 1]
    log_t = a - torch.logsumexp(a, dim=-1, keepdim=True)
    log_s = torch.cat([log_s, tail_of(log_s)[..., None]], dim=-1)
    return _masked_mean(jsd_per_position(log_s, log_t, beta), m)


def sampled_reverse_kl_loss(student_logp: torch.Tensor, sample_logp: torch.Tensor, teacher_logp: torch.Tensor,
                            mask: torch.Tensor, baseline: torch.Tensor | None = None, clip: float | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation's importance-sampled policy gradient (module docstring), all [B, T] at
    the next-token positions: student_logp (with grad) and sample_logp (the sampling policy's) of
    the sampled next token, teacher_logp the teacher's of the same token; mask the sampled
    positions. baseline [B, T]: subtracted from each advantage (`logit_kd.group_baseline`: RLOO's
    leave-one-out mean). clip eps: PPO's clipped ratio (verl `compute_policy_loss_vanilla`, without
    its dual clip): per token max(-A r, -A clip(r, 1 - eps, 1 + eps)). Returns (loss, the
    teacher-scored per-token reverse KL of the samples, mean of log q - log pi_T: tinker's
    `teacher_kl`, detached)."""
    m = mask.to(student_logp.device) != 0
    s = at_least_f32(student_logp)
    q = sample_logp.to(s.device, s.dtype)  # (float32 at least, float64 with a float64 student: exact enumeration)
    adv = (teacher_logp.to(q.device, s.dtype) - s).detach()  # A_t of the current student: no gradient through it
    if baseline is not None:
        adv = adv - baseline.to(adv.device, adv.dtype).detach()
    adv = torch.where(m, adv, 0.0)
    ratio = torch.exp(torch.where(m, s - q, 0.0))
    per = -ratio * adv
    if clip is not None:
        per = torch.maximum(per, -ratio.clamp(1.0 - clip, 1.0 + clip) * adv)
    loss = _masked_mean(per, m)
    return loss, _masked_mean(q - teacher_logp.to(q.device, q.dtype), m).detach()
