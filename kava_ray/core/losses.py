"""KV losses (all masked), the CE anchor, the logit KD losses (top-k forward KL, ULD, hybrid) with
the top-1 agreement metric, the contrast-gap metric and the token masks every loss follows.

Every KV loss takes `(student, target, mask=None, center=False, **kw)` with student/target `[L, B,
H, T, D]` and mask `[B, T]` (nonzero = token that counts) and returns `(loss, metrics)`. Masked-out
positions are replaced by a constant before any arithmetic, so their values (huge, inf or NaN) reach
neither the loss, the metrics nor the gradients. Metrics (detached): `cos_sim` (masked mean centred
cosine: a constant target scores 0), `cos_raw`, `cos_per_layer` / `cos_raw_per_layer`, `n_tokens`
and the loss components. Why centred, and the other derivations: docs/internals/step.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kava_ray.common.errors import KavaError
from kava_ray.core.metric_names import COS_RAW, COS_SIM

if TYPE_CHECKING:  # the batch type is the data layer's; core does not import it at run time
    from kava_ray.data import Batch

COS_EPS = 1e-8
NORM_EPS = 1e-6
CENTER_TOL = 1e-3  # centred vectors shorter than this x the (layer, head) RMS norm count as ~zero


def bool_mask(mask: torch.Tensor | None, B: int, T: int, device, what: str) -> torch.Tensor:
    """[B, T] bool on `device`: True where a position counts (every position when `mask` is None)."""
    if mask is None:
        return torch.ones(B, T, dtype=torch.bool, device=device)
    if tuple(mask.shape) != (B, T):
        raise KavaError(f"{what} mask must be [B, T]=({B}, {T}), got {tuple(mask.shape)}")
    return mask.to(device) != 0


def _prepare(student: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None):
    """Check shapes; return student, target with masked positions set to 1, and m [1, B, 1, T] bool."""
    if student.shape != target.shape or student.dim() != 5:
        raise KavaError(f"KV loss needs student and target [L, B, H, T, D] of one shape, "
                        f"got {tuple(student.shape)} and {tuple(target.shape)}")
    L, B, H, T, D = student.shape
    m = bool_mask(mask, B, T, student.device, "KV loss")[None, :, None, :]  # [1, B, 1, T]
    # cosines and norms in fp32 at least: under bf16 autocast both sides arrive in bf16
    dtype = torch.promote_types(student.dtype, torch.float32)
    return _fill_masked(student, m, dtype), _fill_masked(target, m, dtype), m


def _fill_masked(x: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [L, B, H, T, D] in `dtype`, 1 wherever m [1, B, 1, T] is False."""
    return torch.where(m[..., None], x.to(dtype), torch.ones((), dtype=dtype, device=x.device))


def _f(x) -> torch.Tensor:
    """A metric as a detached 0-d tensor: converting to a Python float would sync a GPU every call,
    so callers convert once, on log steps."""
    return x.detach() if isinstance(x, torch.Tensor) else torch.tensor(float(x))


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of x [L, B, H, T] over positions where m [1, B, 1, T] is True (0 if none)."""
    w = m.expand_as(x).to(x.dtype)
    return (x * w).sum() / w.sum().clamp_min(1.0)


def _per_layer(cos: torch.Tensor, m: torch.Tensor) -> list:
    w = m.expand_as(cos).to(cos.dtype)
    return list(((cos * w).sum(dim=(1, 2, 3)) / w.sum(dim=(1, 2, 3)).clamp_min(1.0)).unbind())


def _raw_cos(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(s, t, dim=-1, eps=COS_EPS)  # [L, B, H, T]


def token_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of x [L, B, H, T, D] over the tokens where m [1, B, 1, T] is True (B and T): [L, 1, H,
    1, D]. Masked positions are zeroed first (their values, NaN included, never count)."""
    keep = m[..., None]  # [1, B, 1, T, 1]
    n = keep.sum(dim=(1, 3), keepdim=True).clamp_min(1).to(x.dtype)
    return torch.where(keep, x, 0.0).sum(dim=(1, 3), keepdim=True) / n


def _centre(x: torch.Tensor, m: torch.Tensor):
    """x [L, B, H, T, D] (masked positions already constant) minus the mean of each (layer, head)
    over the tokens where m [1, B, 1, T] is True; and the norm floor [L, 1, H, 1] (detached)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    mu = token_mean(x, m)  # [L, 1, H, 1, D]
    with torch.no_grad():
        ms = token_mean((x.detach() ** 2).sum(-1, keepdim=True), m)  # mean squared norm [L, 1, H, 1, 1]
        floor = (CENTER_TOL * ms.sqrt() + COS_EPS)[..., 0]  # [L, 1, H, 1]
    return x - mu, floor


def _centred_side(x: torch.Tensor, m: torch.Tensor):
    """(x centred as `_centre` does, its norm over head_dim raised to the floor): one side of a centred cosine."""
    xc, floor = _centre(x, m)
    return xc, torch.maximum(torch.linalg.vector_norm(xc, dim=-1), floor)


def centred_cos(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-token cosine [L, B, H, T] of student and target, each centred per (layer, head) over the
    tokens where m [1, B, 1, T] is True (docs/internals/step.md). Inputs as from `_prepare`."""
    sc, ns = _centred_side(s, m)
    tc, nt = _centred_side(t, m)
    return (sc * tc).sum(-1) / (ns * nt)


def _cos_metrics(cos_c: torch.Tensor, cos_r: torch.Tensor, m: torch.Tensor) -> dict:
    """Centred and raw cosines [L, B, H, T] -> their masked means, per layer and overall (detached)."""
    cos_c, cos_r = cos_c.detach(), cos_r.detach()
    return {
        COS_SIM: _masked_mean(cos_c, m),
        COS_RAW: _masked_mean(cos_r, m),
        "cos_per_layer": _per_layer(cos_c, m),
        "cos_raw_per_layer": _per_layer(cos_r, m),
        "n_tokens": m.sum(),
    }


def _both_cos(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor, center: bool):
    """(cosine the loss uses, centred cos, raw cos): only the one the loss uses keeps its graph."""
    if center:
        cos_c = centred_cos(s, t, m)
        with torch.no_grad():
            cos_r = _raw_cos(s, t)
        return cos_c, cos_c, cos_r
    cos_r = _raw_cos(s, t)
    with torch.no_grad():
        cos_c = centred_cos(s, t, m)
    return cos_r, cos_c, cos_r


@torch.no_grad()
def _detached_cos_metrics(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> dict:
    return _cos_metrics(centred_cos(s, t, m), _raw_cos(s, t), m)


@torch.no_grad()
def cos_metrics(student: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> dict:
    """The cosine metrics of a KV loss without the loss: cos_sim (centred), cos_raw, per layer, n_tokens."""
    s, t, m = _prepare(student, target, mask)
    return _detached_cos_metrics(s, t, m)


def _mercator_parts(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor, center: bool = False):
    cos, cos_c, cos_r = _both_cos(s, t, m, center)
    cos_term = _masked_mean(1.0 - cos, m)  # = 1 - masked mean cos; 0 if no real token
    log_s = torch.log(torch.linalg.vector_norm(s, dim=-1) + NORM_EPS)
    log_t = torch.log(torch.linalg.vector_norm(t, dim=-1) + NORM_EPS)
    mag_term = _masked_mean((log_s - log_t) ** 2, m)
    return cos_term, mag_term, _cos_metrics(cos_c, cos_r, m)


def _mse(s: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return _masked_mean(((s - t) ** 2).mean(dim=-1), m)


def mercator_loss(student, target, mask=None, alpha: float = 1.0, beta: float = 0.0, center: bool = False, **kw):
    """alpha * (1 - masked mean cos) + beta * masked MSE(log||s||, log||t||). Cosine over head_dim
    per (layer, batch, head, token), of the centred vectors with `center` (module docstring); norms
    (raw) get +1e-6 before the log. Without `center`, parallel vectors of any lengths give 0
    (beta=0), opposite ones 2."""
    s, t, m = _prepare(student, target, mask)
    cos_term, mag_term, metrics = _mercator_parts(s, t, m, center)
    loss = alpha * cos_term + (beta * mag_term if beta else 0.0)
    metrics.update(loss=_f(loss), cos_term=_f(cos_term), mag_term=_f(mag_term))
    return loss, metrics


def mse_loss(student, target, mask=None, **kw):
    """Masked mean squared error over all real positions and head_dim (`center` does not apply)."""
    s, t, m = _prepare(student, target, mask)
    loss = _mse(s, t, m)
    metrics = _detached_cos_metrics(s, t, m)
    metrics.update(loss=_f(loss), mse=_f(loss))
    return loss, metrics


def smooth_l1_loss(student, target, mask=None, delta: float = 1.0, **kw):
    """Masked smooth-L1 (Huber with threshold `delta`), mean over real positions and head_dim
    (`center` does not apply)."""
    s, t, m = _prepare(student, target, mask)
    per = F.smooth_l1_loss(s, t, reduction="none", beta=delta).mean(dim=-1)  # [L, B, H, T]
    loss = _masked_mean(per, m)
    metrics = _detached_cos_metrics(s, t, m)
    metrics.update(loss=_f(loss), smooth_l1=_f(loss))
    return loss, metrics


def hybrid_loss(student, target, mask=None, weight: float = 0.5, alpha: float = 1.0, beta: float = 0.0,
                center: bool = False, **kw):
    """weight * mercator(alpha, beta, center) + (1 - weight) * mse."""
    if not 0 <= weight <= 1:
        raise KavaError(f"hybrid weight must be in [0, 1], got {weight}")
    s, t, m = _prepare(student, target, mask)
    cos_term, mag_term, metrics = _mercator_parts(s, t, m, center)
    mercator = alpha * cos_term + (beta * mag_term if beta else 0.0)
    mse = _mse(s, t, m)
    loss = weight * mercator + (1 - weight) * mse
    metrics.update(loss=_f(loss), mercator=_f(mercator), cos_term=_f(cos_term),
                   mag_term=_f(mag_term), mse=_f(mse))
    return loss, metrics


LOSSES = {"mercator": mercator_loss, "hybrid": hybrid_loss, "mse": mse_loss, "smooth_l1": smooth_l1_loss}


def kv_loss(kind: str, student, target, mask=None, alpha: float = 1.0, beta: float = 0.0,
            hybrid_weight: float = 0.5, center: bool = False):
    """Dispatch to LOSSES[kind]; returns (loss, metrics). `center` applies to mercator and hybrid."""
    if kind not in LOSSES:
        raise KavaError(f"unknown KV loss {kind!r} (expected one of {', '.join(LOSSES)})")
    return LOSSES[kind](student, target, mask, alpha=alpha, beta=beta, weight=hybrid_weight, center=center)


@torch.no_grad()
def contrast_gap(student: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None,
                 centered: bool = True) -> torch.Tensor:
    """mean cos(student, own target) - mean cos(student, target of the previous sample,
    `target.roll(1, 1)`), over the positions real in both: ~0 means nothing sample-specific was
    learned (the collapse trap). A detached 0-d tensor; 0 with B == 1 or no shared position. Centred
    like `cos_sim` (why: docs/internals/step.md); `centered=False` gives the raw gap."""
    if student.shape != target.shape or student.dim() != 5:
        raise KavaError(f"contrast_gap needs [L, B, H, T, D] of one shape, "
                        f"got {tuple(student.shape)} and {tuple(target.shape)}")
    B, T = student.shape[1], student.shape[3]
    if B < 2:
        return torch.zeros((), device=student.device)
    m = torch.ones(B, T, dtype=torch.bool, device=student.device) if mask is None else mask.to(student.device) != 0
    both = m & m.roll(1, dims=0)
    # = cos_metrics(student, t, both)[cos_sim or cos_raw] for t = target and its roll, computing
    # only that cosine and preparing (and centring) the student once: this runs on K and V every
    # step
    s, t, mb = _prepare(student, target, both)
    t_other = _fill_masked(target.roll(1, dims=1), mb, s.dtype)
    if centered:
        sc, ns = _centred_side(s, mb)

        def cos(t_):
            tc, nt = _centred_side(t_, mb)
            return (sc * tc).sum(-1) / (ns * nt)
    else:
        def cos(t_):
            return _raw_cos(s, t_)
    return _f(_masked_mean(cos(t), mb) - _masked_mean(cos(t_other), mb))


def drop_shared_prefix(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The KV token mask [B, T] (bool) of `loss_tokens: no_shared_prefix`: the real tokens minus the
    leading positions whose id is the same, and real, in every sample (a chat template's system
    prompt, BOS); vectorised, no host sync. When nothing can be told apart, nothing is dropped:
    docs/internals/step.md#shared-prefix."""
    m = attention_mask.to(input_ids.device) != 0
    if input_ids.shape[0] < 2:
        return m
    same = ((input_ids == input_ids[:1]) & m).all(dim=0)  # [T]
    shared = torch.cumprod(same.to(torch.int32), dim=0).bool()  # the leading run of identical positions
    keep = m & ~shared[None, :]
    return torch.where(keep.any(), keep, m)


# ----------------------------------------------------------------------------- logit KD (top-k forward KL)

LOGIT_TAILS = ("bucket", "none")
TAIL_FLOOR = 1e-6  # a tail mass below this is float noise (fp32 log-probs): both sides are floored to it
OFF = -1e30  # the log-prob of an entry left out: exp() is exactly 0 and every difference stays finite


def next_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the positions whose logits CE counts, i.e. t where labels[t + 1] != -100 (the
    last position never counts). Logit KD counts exactly these: logits at t predict token t + 1."""
    return F.pad(labels[:, 1:] != -100, (0, 1), value=False)


def position_masks(batch: Batch, loss_tokens: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """(KV mask, next-token mask), both [B, T] bool, from one `kava_ray.data.Batch`: the one rule every loss follows.

    KV losses count token positions (a token's key and value describe the token itself):
    `loss_tokens` all = the real tokens, answer = `answer_mask`, no_shared_prefix = the real tokens
    minus the leading positions every sample shares (`drop_shared_prefix`). CE and logit KD count
    next-token positions: t where labels[t + 1] carries a loss (`next_token_mask`), under every
    `loss_tokens` -- so with `answer`, KD scores the position before the first answer token and
    stops at the one before the last."""
    if loss_tokens == "answer":
        kv = batch.answer_mask != 0
    elif loss_tokens == "no_shared_prefix":
        kv = drop_shared_prefix(batch.input_ids, batch.attention_mask)
    elif loss_tokens == "all":
        kv = batch.attention_mask != 0
    else:
        raise KavaError(f"loss_tokens must be all, answer or no_shared_prefix, not {loss_tokens!r}")
    return kv, next_token_mask(batch.labels)


def at_least_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def log_normalizer(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log sum_v exp(logits[..., v] / T) in float32 at least, [B, T]: the one logsumexp over the
    vocabulary per position that CE and (at T = 1) logit KD share."""
    z = at_least_f32(logits)
    return torch.logsumexp(z if temperature == 1.0 else z / temperature, dim=-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def tail_of(logp: torch.Tensor) -> torch.Tensor:
    """log of the mass outside the ids of `logp` [..., k] (log-probs normalised over the full
    vocabulary), floored at TAIL_FLOOR."""
    total = torch.logsumexp(logp, dim=-1).clamp(max=math.log1p(-TAIL_FLOOR))
    return _log1mexp(total)


def topk_tail(topk_logp: torch.Tensor, served_tail: torch.Tensor | None, k: int) -> torch.Tensor:
    """The teacher's log mass outside its first `k` ids [B, T]: the served tail (what was outside
    all the ids it sent) plus the mass of the ids past k; without a served tail, 1 - sum p over the
    k (a bf16 wire's rounding then limits it to ~1e-3)."""
    lp = topk_logp.float()
    if served_tail is None:
        return tail_of(lp[..., :k])
    tail = served_tail.float()
    if k < lp.shape[-1]:
        tail = torch.logaddexp(tail, torch.logsumexp(lp[..., k:], dim=-1))
    return tail


def topk_prepare(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                  mask: torch.Tensor | None):
    """Check shapes; return ids [B, T, k] (0 at masked positions) and m [B, T] bool."""
    if student_logits.dim() != 3 or topk_ids.dim() != 3 or tuple(topk_ids.shape) != tuple(topk_logp.shape):
        raise KavaError(f"top-k KL needs student logits [B, T, V] and top-k ids / log-probs [B, T, k] of one shape, "
                        f"got {tuple(student_logits.shape)}, {tuple(topk_ids.shape)} and {tuple(topk_logp.shape)}")
    B, T = student_logits.shape[:2]
    if tuple(topk_ids.shape[:2]) != (B, T):
        raise KavaError(f"top-k KL: teacher top-k is [B, T]={tuple(topk_ids.shape[:2])}, student logits ({B}, {T})")
    m = bool_mask(mask, B, T, student_logits.device, "top-k KL")
    ids = torch.where(m[..., None], topk_ids.to(student_logits.device).long(), 0)  # garbage ids never gathered
    return ids, m


def topk_kl_loss(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                 mask: torch.Tensor | None = None, temperature: float = 1.0, tail: str = "bucket",
                 teacher_tail: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k forward KL(p_t || p_s), the student normalised over its FULL vocabulary, T^2-scaled,
    masked mean (as DistillKit's `sparse_kl_div`; the tails and `valid`: docs/internals/step.md).

    Args: student_logits [B, T, V]; topk_ids / topk_logp [B, T, k]: the teacher's top-k and their
    log-probs at T = 1 over its full vocabulary; teacher_tail [B, T]: log of its mass outside them
    (else 1 - sum p); mask [B, T]: the positions that count (`next_token_mask`); tail: "bucket" (a
    (k+1)-th entry for the mass outside the ids) or "none" (renormalised over the k); lse [B, T]:
    the student's `log_normalizer` when the caller has it; valid [B, T, k]: the entries that count
    as ids. Returns the loss (0 with grad if no position counts); masked positions (anything, NaN
    included) change neither the loss nor its gradient.
    """
    if not temperature > 0:
        raise KavaError(f"top-k KL temperature must be > 0, got {temperature}")
    if tail not in LOGIT_TAILS:
        raise KavaError(f"top-k KL tail must be one of {', '.join(LOGIT_TAILS)}, not {tail!r}")
    ids, m = topk_prepare(student_logits, topk_ids, topk_logp, mask)
    if valid is not None and tail == "none":
        m = m & valid.to(m.device).any(-1)
        ids = torch.where(m[..., None], ids, 0)
    keep = m[..., None]
    if lse is None:
        lse = log_normalizer(student_logits, temperature)
    z = student_logits.gather(-1, ids)  # [B, T, k], before the cast: V-sized tensors stay in their dtype
    log_s = torch.where(keep, at_least_f32(z) / temperature - lse[..., None], -1.0)  # student, full vocabulary
    t = torch.where(keep, topk_logp.to(student_logits.device, log_s.dtype), -1.0)  # teacher, T = 1
    if valid is not None:  # entries left out: no mass of their own (bucket: the teacher's served tail gains it)
        out = keep & ~valid.to(t.device)
        if tail == "bucket" and teacher_tail is not None:
            teacher_tail = torch.logaddexp(teacher_tail.to(t.device, t.dtype),
                                           torch.logsumexp(torch.where(out, t, -math.inf), dim=-1))
        t, log_s = torch.where(out, OFF, t), torch.where(out, OFF, log_s)
    if tail == "bucket":
        t_tail = tail_of(t) if teacher_tail is None else teacher_tail.to(t.device, t.dtype)
        t_tail = torch.where(m, t_tail.clamp(min=math.log(TAIL_FLOOR)), -1.0)
        t = torch.cat([t, t_tail[..., None]], dim=-1)  # [B, T, k + 1]
        log_s = torch.cat([log_s, tail_of(log_s)[..., None]], dim=-1)
    a = t / temperature
    log_p = a - torch.logsumexp(a, dim=-1, keepdim=True)  # the teacher at T, over its k (+ 1) entries
    per = (log_p.exp() * (log_p - log_s)).sum(-1)  # [B, T]; an entry left out: exp(OFF) = 0 times a finite term
    w = m.float()
    return (temperature ** 2) * (per * w).sum() / w.sum().clamp_min(1.0)


def uld_loss(student_logits: torch.Tensor, topk_logp: torch.Tensor, mask: torch.Tensor | None = None,
             teacher_tail: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Universal Logit Distillation distance for a teacher of another vocabulary (as TRL GOLD's
    `ULDLoss`): the masked mean over positions of sum_i |t_i - s_i|, both sides' top-k probabilities
    sorted descending, each followed by its mass outside those k as one bucket
    (docs/internals/step.md).

    Args: student_logits [B, T, V_s]; topk_logp [B, T, k]: the teacher's top-k log-probs (any
    order); teacher_tail [B, T]: log of its mass outside them (else 1 - sum p); mask [B, T]; lse:
    the student's `log_normalizer` at T = 1 when the caller has it. Float32 at least; masked
    positions count for nothing.
    """
    m = bool_mask(mask, *student_logits.shape[:2], student_logits.device, "ULD")
    k = topk_logp.shape[-1]
    if lse is None:
        lse = log_normalizer(student_logits, 1.0)
    keep = m[..., None]
    z = student_logits.topk(min(k, student_logits.shape[-1]), dim=-1).values  # [B, T, k'] sorted descending
    s = torch.where(keep, at_least_f32(z) - lse[..., None], -1.0).exp()  # masked: anything, never NaN
    t = torch.where(keep, topk_logp.to(s.device, s.dtype), -1.0).exp()
    t_tail = (1.0 - t.sum(-1)).clamp(min=0.0) if teacher_tail is None else \
        torch.where(m, teacher_tail.to(s.device, s.dtype), -1.0).exp()
    s_tail = (1.0 - s.sum(-1)).clamp(min=0.0)
    w = m.float()
    return _sorted_l1(t, s, m) + ((t_tail - s_tail).abs() * w).sum() / w.sum().clamp_min(1.0)


def _sorted_l1(t: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Masked mean over positions of sum_i |t_i - s_i|, t [B, T, k] and s [B, T, k'] sorted
    descending inside, the shorter zero-padded (the ULD distance between two probability
    vectors)."""
    t = t.sort(dim=-1, descending=True).values
    width = max(t.shape[-1], s.shape[-1])
    t, s = F.pad(t, (0, width - t.shape[-1])), F.pad(s, (0, width - s.shape[-1]))
    per = (t - s).abs().sum(-1)  # [B, T]
    w = m.float()
    return (per * w).sum() / w.sum().clamp_min(1.0)


def hybrid_logit_loss(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                      t2s: torch.Tensor, student_unmatched: torch.Tensor, mask: torch.Tensor | None = None,
                      teacher_tail: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                      temperature: float = 1.0, matched_weight: float | None = None):
    """The hybrid cross-vocabulary logit loss (as TRL GOLD's hybrid ULD): teacher ids whose string
    the student has are compared id by id (`topk_kl_loss` on the mapped ids), the rest by the sorted
    distance (`uld_loss`), weighted `matched_weight` (default: the share of the teacher's vocabulary
    that maps) and 1 - it. Returns (loss, {"kl": matched part, "uld": unmatched part}); details:
    docs/internals/step.md.

    Args: student_logits [B, T, V_s]; topk_ids / topk_logp [B, T, k]: the teacher's top-k in ITS
    vocabulary (at the student's positions); t2s [V_t] long: student id of each teacher id or -1
    (`align.vocab.VocabMap`); student_unmatched [U] long: the student ids no teacher id maps to;
    teacher_tail [B, T]: log of its mass outside the k ids.
    """
    m = bool_mask(mask, *student_logits.shape[:2], student_logits.device, "hybrid logit loss")
    t2s = t2s.to(student_logits.device)
    ids = torch.where(m[..., None], topk_ids.to(student_logits.device).long(), 0)
    inside = ids < len(t2s)  # an id past the map (a padded LM-head row) has no string
    sid = torch.where(inside, t2s[ids.clamp(max=len(t2s) - 1)], -1)  # [B, T, k] student ids, -1: unmatched
    matched = sid >= 0
    if teacher_tail is None:
        teacher_tail = tail_of(topk_logp.float())
    kl = topk_kl_loss(student_logits, sid.clamp(min=0), topk_logp, m, temperature=temperature, tail="bucket",
                      teacher_tail=teacher_tail, lse=lse, valid=matched)
    keep = m[..., None]
    t_rest = torch.where(keep & ~matched, topk_logp.to(student_logits.device).float(), -math.inf).exp()
    k, n_un = topk_logp.shape[-1], len(student_unmatched)
    if n_un:
        lse1 = log_normalizer(student_logits) if lse is None or temperature != 1.0 else lse
        z = student_logits.index_select(-1, student_unmatched.to(student_logits.device))  # [B, T, U]
        z = z.topk(min(k, n_un), dim=-1).values
        s_rest = torch.where(keep, at_least_f32(z) - lse1[..., None], -1.0).exp()
    else:
        s_rest = t_rest.new_zeros(*t_rest.shape[:2], 0)
    uld = _sorted_l1(t_rest, s_rest, m)
    w = float(matched_weight) if matched_weight is not None else float((t2s >= 0).sum()) / max(len(t2s), 1)
    return w * kl + (1.0 - w) * uld, {"kl": kl.detach(), "uld": uld.detach()}


@torch.no_grad()
def top1_agreement(student_logits: torch.Tensor, topk_ids: torch.Tensor, mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Masked mean of (student argmax over the full vocab == teacher's top-1 id, `topk_ids[...,
    0]`): a detached 0-d float32 tensor (0 if no position counts)."""
    ids, m = topk_prepare(student_logits, topk_ids, topk_ids, mask)
    agree = (student_logits.argmax(-1) == ids[..., 0]) & m
    return agree.float().sum() / m.float().sum().clamp_min(1.0)


def masked_ce(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True,
              lse: torch.Tensor | None = None) -> torch.Tensor:
    """Causal-LM cross entropy: logits [B, T, V], labels [B, T] with -100 ignored.

    With `shift`, position t predicts label t+1 (the positions `next_token_mask` names); the labels
    are shifted, not the logits (a copy of [B, T, V] saved: docs/internals/step.md). Returns 0 (with
    grad) if no label counts. lse [B, T]: the logits' `log_normalizer` when the caller has it for
    logit KD too (CE = lse - logits[label]).
    """
    if shift:
        labels = F.pad(labels[:, 1:], (0, 1), value=-100)
    labels = labels.to(logits.device)
    if lse is not None:
        valid = labels != -100
        z = logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0].float()  # [B, T]
        nll = torch.where(valid, lse - z, 0.0)
        return nll.sum() / valid.sum().clamp_min(1)
    flat_labels = labels.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=-100,
                            reduction="sum")  # / the counted labels: no host sync, 0 (with grad) when none counts
    return total / (flat_labels != -100).sum().clamp(min=1)


def relation_loss(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, heads: int) -> torch.Tensor:
    """MiniLMv2's self-relation loss for one of K or V, no projector: s [L, B, H_s, T, D_s], t [L,
    B, H_t, T, D_t] (the teacher layer matched to each student layer), mask [B, T].

    Per layer the heads are concatenated and split into `heads` relation heads of d_r = H*D / heads
    on each side (how MiniLMv2 reconciles head counts); R = softmax(X Xᵀ / √d_r) over the keys;
    KL(R_T ‖ R_S) summed over the keys, averaged over relation heads and a sequence's valid query
    rows, then over sequences and layers -- bloomberg/minilmv2.bb `minilmv2.py`
    (`_get_relation_vectors`, `_get_kl_loss`). For a decoder the keys are causal (j <= i); padding
    is masked instead of sliced, so any padding side works.
    """
    def relations(x: torch.Tensor) -> torch.Tensor:  # [L, B, H, T, D] -> [L, B, heads, T, T]
        L, B, H, T, D = x.shape
        if (H * D) % heads:
            raise KavaError(f"relation loss: {H} heads x {D} do not split into {heads} relation heads")
        x = x.float().permute(0, 1, 3, 2, 4).reshape(L, B, T, heads, H * D // heads).transpose(2, 3)
        return x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1])

    m = mask.to(s.device).bool()  # [B, T]
    T = m.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=s.device).tril()
    allowed = (m[:, :, None] & m[:, None, :] & causal)[None, :, None]  # [1, B, 1, T, T]
    low = torch.finfo(torch.float32).min
    log_s = torch.log_softmax(relations(s).masked_fill(~allowed, low), -1)
    log_t = torch.log_softmax(relations(t.detach()).masked_fill(~allowed, low), -1)
    kl = (log_t.exp() * (log_t - log_s)).masked_fill(~allowed, 0.0).sum(-1)  # [L, B, heads, T]
    rows = m.sum(-1).clamp(min=1)  # [B] valid query rows per sequence
    return (kl.sum((2, 3)) / (heads * rows)).mean()  # per sequence, then over sequences and layers


def hidden_cosine_loss(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Minitron's intermediate-state loss: s [L, B, T, h] (the student's layers' output hidden
    states, projected to the teacher's width where it differs), t [L, B, T, h] (each one's matched
    teacher layer), mask [B, T] (the positions CE counts).

    Per layer pair, 1 - cos(s, t) per token with no reduction (NVIDIA ModelOpt
    `HiddenStateCosineLoss`: `F.cosine_embedding_loss(..., target 1, reduction="none")`, the teacher
    detached), the mean over the masked tokens (Megatron-LM
    `post_training/loss_func.py::_mask_loss`), then the mean over layer pairs
    (`LogitsAndIntermediatesLossBalancer`: sum / len). Its dynamic rescaling to the logit loss is
    not applied: `loss.hidden_weight` is a fixed weight, like kava-ray's other terms.
    """
    L, B, T, h = s.shape
    m = mask.to(s.device, torch.float32)  # [B, T]
    one = torch.ones(1, device=s.device)
    total = 0
    for i in range(L):  # one layer's fp32 copies at a time, not [L, B, T, h] of them
        per = F.cosine_embedding_loss(s[i].float().reshape(-1, h), t[i].detach().float().reshape(-1, h), one,
                                      reduction="none").view(B, T)
        total = total + (per * m).sum() / m.sum().clamp(min=1)
    return total / L
