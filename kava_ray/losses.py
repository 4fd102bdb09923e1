"""KV losses (all masked), the CE anchor and the contrast-gap metric.

Every KV loss takes `(student, target, mask=None, **kw)` with student/target
`[L, B, H, T, D]` and mask `[B, T]` (nonzero = real token) and returns
`(loss: scalar tensor, metrics: dict)`. Masked-out positions are replaced by a
constant before any arithmetic, so their values (huge, inf or NaN) reach neither
the loss, the metrics nor the gradients (which are exactly 0 there).

Metrics: `cos_sim` (masked mean cosine), `cos_per_layer` (list of L floats),
`loss`, and the loss components (`cos_term`, `mag_term`, `mse`, `smooth_l1`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kava_ray.errors import KavaError

COS_EPS = 1e-8
NORM_EPS = 1e-6


def _prepare(student: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None):
    """Check shapes; return student, target with masked positions set to 1, and m [1, B, 1, T] bool."""
    if student.shape != target.shape or student.dim() != 5:
        raise KavaError(f"KV loss needs student and target [L, B, H, T, D] of one shape, "
                        f"got {tuple(student.shape)} and {tuple(target.shape)}")
    L, B, H, T, D = student.shape
    if mask is None:
        m = torch.ones(B, T, dtype=torch.bool, device=student.device)
    else:
        if tuple(mask.shape) != (B, T):
            raise KavaError(f"KV loss mask must be [B, T]=({B}, {T}), got {tuple(mask.shape)}")
        m = mask.to(student.device) != 0
    m = m[None, :, None, :]  # [1, B, 1, T]
    target = target.to(student.dtype)
    keep = m[..., None]
    student = torch.where(keep, student, torch.ones((), dtype=student.dtype, device=student.device))
    target = torch.where(keep, target, torch.ones((), dtype=student.dtype, device=student.device))
    return student, target, m


def _f(x) -> torch.Tensor:
    """A metric as a detached 0-d tensor: converting to a Python float would sync a GPU every call,
    so callers convert once, on log steps."""
    return x.detach() if isinstance(x, torch.Tensor) else torch.tensor(float(x))


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of x [L, B, H, T] over positions where m [1, B, 1, T] is True (0 if none)."""
    w = m.expand_as(x).to(x.dtype)
    return (x * w).sum() / w.sum().clamp_min(1.0)


def _cos_metrics(cos: torch.Tensor, m: torch.Tensor) -> dict:
    """cos [L, B, H, T] -> cos_sim and cos_per_layer (masked means)."""
    w = m.expand_as(cos).to(cos.dtype)
    per_layer = (cos * w).sum(dim=(1, 2, 3)) / w.sum(dim=(1, 2, 3)).clamp_min(1.0)
    return {
        "cos_sim": _masked_mean(cos, m),
        "cos_per_layer": list(per_layer.unbind()),
        "n_tokens": m.sum(),
    }


def _mercator_parts(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor):
    cos = F.cosine_similarity(s, t, dim=-1, eps=COS_EPS)  # [L, B, H, T]
    cos_term = _masked_mean(1.0 - cos, m)  # = 1 - masked mean cos; 0 if no real token
    log_s = torch.log(torch.linalg.vector_norm(s, dim=-1) + NORM_EPS)
    log_t = torch.log(torch.linalg.vector_norm(t, dim=-1) + NORM_EPS)
    mag_term = _masked_mean((log_s - log_t) ** 2, m)
    return cos, cos_term, mag_term


def _mse(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _masked_mean(((s - t) ** 2).mean(dim=-1), m)


def mercator_loss(student, target, mask=None, alpha: float = 1.0, beta: float = 0.0, **kw):
    """alpha * (1 - masked mean cos) + beta * masked MSE(log||s||, log||t||).

    Cosine over head_dim per (layer, batch, head, token); norms get +1e-6 before
    the log. Parallel vectors of any lengths give 0 (beta=0), opposite ones 2.
    """
    s, t, m = _prepare(student, target, mask)
    cos, cos_term, mag_term = _mercator_parts(s, t, m)
    loss = alpha * cos_term + (beta * mag_term if beta else 0.0)
    metrics = _cos_metrics(cos.detach(), m)
    metrics.update(loss=_f(loss), cos_term=_f(cos_term), mag_term=_f(mag_term))
    return loss, metrics


def mse_loss(student, target, mask=None, **kw):
    """Masked mean squared error over all real positions and head_dim."""
    s, t, m = _prepare(student, target, mask)
    loss = _mse(s, t, m)
    metrics = _cos_metrics(F.cosine_similarity(s.detach(), t.detach(), dim=-1, eps=COS_EPS), m)
    metrics.update(loss=_f(loss), mse=_f(loss))
    return loss, metrics


def smooth_l1_loss(student, target, mask=None, delta: float = 1.0, **kw):
    """Masked smooth-L1 (Huber with threshold `delta`), mean over real positions and head_dim."""
    s, t, m = _prepare(student, target, mask)
    per = F.smooth_l1_loss(s, t, reduction="none", beta=delta).mean(dim=-1)  # [L, B, H, T]
    loss = _masked_mean(per, m)
    metrics = _cos_metrics(F.cosine_similarity(s.detach(), t.detach(), dim=-1, eps=COS_EPS), m)
    metrics.update(loss=_f(loss), smooth_l1=_f(loss))
    return loss, metrics


def hybrid_loss(student, target, mask=None, weight: float = 0.5, alpha: float = 1.0, beta: float = 0.0, **kw):
    """weight * mercator(alpha, beta) + (1 - weight) * mse."""
    if not 0 <= weight <= 1:
        raise KavaError(f"hybrid weight must be in [0, 1], got {weight}")
    s, t, m = _prepare(student, target, mask)
    cos, cos_term, mag_term = _mercator_parts(s, t, m)
    mercator = alpha * cos_term + (beta * mag_term if beta else 0.0)
    mse = _mse(s, t, m)
    loss = weight * mercator + (1 - weight) * mse
    metrics = _cos_metrics(cos.detach(), m)
    metrics.update(loss=_f(loss), mercator=_f(mercator), cos_term=_f(cos_term),
                   mag_term=_f(mag_term), mse=_f(mse))
    return loss, metrics


LOSSES = {"mercator": mercator_loss, "hybrid": hybrid_loss, "mse": mse_loss, "smooth_l1": smooth_l1_loss}


def kv_loss(kind: str, student, target, mask=None, alpha: float = 1.0, beta: float = 0.0, hybrid_weight: float = 0.5):
    """Dispatch to LOSSES[kind]; returns (loss, metrics)."""
    if kind not in LOSSES:
        raise KavaError(f"unknown KV loss {kind!r} (expected one of {', '.join(LOSSES)})")
    return LOSSES[kind](student, target, mask, alpha=alpha, beta=beta, weight=hybrid_weight)


@torch.no_grad()
def contrast_gap(student: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """mean cos(student, own target) - mean cos(student, target of the previous sample).

    The other sample is `target.roll(1, dims=1)`; both means use the positions real
    in both the sample and the rolled sample (mask & mask.roll(1, 0)). ~0 means the
    student matches targets no better than another sample's: nothing
    sample-specific was learned (the collapse trap). With B == 1 there is no other
    sample to compare with, so it returns 0.0; also 0.0 if no position is real in both
    (both masked means are then 0). A detached 0-d tensor, like every metric here.
    """
    if student.shape != target.shape or student.dim() != 5:
        raise KavaError(f"contrast_gap needs [L, B, H, T, D] of one shape, "
                        f"got {tuple(student.shape)} and {tuple(target.shape)}")
    B, T = student.shape[1], student.shape[3]
    if B < 2:
        return torch.zeros((), device=student.device)
    m = torch.ones(B, T, dtype=torch.bool, device=student.device) if mask is None else mask.to(student.device) != 0
    both = m & m.roll(1, dims=0)
    own, _ = mercator_loss(student, target, both)
    other, _ = mercator_loss(student, target.roll(1, dims=1), both)
    return _f(other - own)  # (1 - cos_other) - (1 - cos_own) = cos_own - cos_other


def masked_ce(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """Causal-LM cross entropy: logits [B, T, V], labels [B, T] with -100 ignored.

    With `shift`, position t predicts label t+1. Returns 0 (with grad) if no label counts.
    """
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    flat_labels = labels.reshape(-1).to(logits.device)
    if not (flat_labels != -100).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=-100)
