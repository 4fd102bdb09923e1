"""KV losses (all masked), the CE anchor, the logit KD loss (top-k forward KL, `topk_kl_loss`) and its
top-1 agreement metric, the contrast-gap metric and the shared-prefix token mask.

Every KV loss takes `(student, target, mask=None, center=False, **kw)` with student/target
`[L, B, H, T, D]` and mask `[B, T]` (nonzero = token that counts) and returns
`(loss: scalar tensor, metrics: dict)`. Masked-out positions are replaced by a
constant before any arithmetic, so their values (huge, inf or NaN) reach neither
the loss, the metrics nor the gradients (which are exactly 0 there).

Centred cosine. A target that is one constant vector per (layer, head) already scores a high raw
cosine on real keys (SmolLM2-135M: K ≈ 0.88), so a projector that ignores its input looks aligned.
The centred cosine subtracts, from student and target separately, the mask-weighted mean of each
(layer, head) slice over the batch's counted tokens (B and T) before the per-token cosine: a
constant (per head or per layer) then scores 0, an identical student 1, another sample's target ~0.
A centred vector shorter than `CENTER_TOL` x the slice's RMS raw norm is treated as (near) zero
(its cosine shrinks toward 0): without that floor the float rounding left after subtracting the
mean of a constant would get a direction of its own. Centring is done in float32 at least.

Metrics (detached tensors): `cos_sim` (masked mean centred cosine), `cos_raw` (masked mean raw
cosine), `cos_per_layer` / `cos_raw_per_layer` (lists of L), `n_tokens`, `loss`, and the loss
components (`cos_term`, `mag_term`, `mse`, `smooth_l1`, `mercator`). With `center=True` the
cosine term of mercator/hybrid uses the centred cosine (the magnitude term is unchanged: raw norms).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kava_ray.common.errors import KavaError

COS_EPS = 1e-8
NORM_EPS = 1e-6
CENTER_TOL = 1e-3  # centred vectors shorter than this x the (layer, head) RMS norm count as ~zero


def _bool_mask(mask: torch.Tensor | None, B: int, T: int, device, what: str) -> torch.Tensor:
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
    m = _bool_mask(mask, B, T, student.device, "KV loss")[None, :, None, :]  # [1, B, 1, T]
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
    """Mean of x [L, B, H, T, D] over the tokens where m [1, B, 1, T] is True (B and T): [L, 1, H, 1, D].
    Masked positions are zeroed first (their values, NaN included, never count)."""
    keep = m[..., None]  # [1, B, 1, T, 1]
    n = keep.sum(dim=(1, 3), keepdim=True).clamp_min(1).to(x.dtype)
    return torch.where(keep, x, 0.0).sum(dim=(1, 3), keepdim=True) / n


def _centre(x: torch.Tensor, m: torch.Tensor):
    """x [L, B, H, T, D] (masked positions already constant) minus the mean of each (layer, head) over
    the tokens where m [1, B, 1, T] is True; and the norm floor [L, 1, H, 1] (detached)."""
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
    tokens where m [1, B, 1, T] is True (see the module docstring). Inputs as from `_prepare`."""
    sc, ns = _centred_side(s, m)
    tc, nt = _centred_side(t, m)
    return (sc * tc).sum(-1) / (ns * nt)


def _cos_metrics(cos_c: torch.Tensor, cos_r: torch.Tensor, m: torch.Tensor) -> dict:
    """Centred and raw cosines [L, B, H, T] -> their masked means, per layer and overall (detached)."""
    cos_c, cos_r = cos_c.detach(), cos_r.detach()
    return {
        "cos_sim": _masked_mean(cos_c, m),
        "cos_raw": _masked_mean(cos_r, m),
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
    """alpha * (1 - masked mean cos) + beta * masked MSE(log||s||, log||t||).

    Cosine over head_dim per (layer, batch, head, token) — of the centred vectors with `center`
    (see the module docstring); norms (raw, also with `center`) get +1e-6 before the log. Without
    `center`, parallel vectors of any lengths give 0 (beta=0), opposite ones 2.
    """
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
    """mean cos(student, own target) - mean cos(student, target of the previous sample).

    The other sample is `target.roll(1, dims=1)`; both means use the positions real
    in both the sample and the rolled sample (mask & mask.roll(1, 0)). ~0 means the
    student matches targets no better than another sample's: nothing
    sample-specific was learned (the collapse trap). With B == 1 there is no other
    sample to compare with, so it returns 0.0; also 0.0 if no position is real in both
    (both masked means are then 0). A detached 0-d tensor, like every metric here.

    Centred by default (the same per-(layer, head) centring as `cos_sim`): the raw cosines of own
    and other target both carry the large per-head constant every sample shares (raw K cos of a
    constant ≈ 0.88 on real keys), which compresses the gap toward 0 even for a student that did
    learn something sample-specific and puts it on a different scale from `cos_sim`. Centred, the
    shared constant is removed from both terms alike, the other-sample term is ~0 for unrelated
    samples, and the gap reads on the scale of `cos_sim` (a constant student still scores 0, so the
    collapse trap still shows as a gap of 0). `centered=False` gives the raw gap.
    """
    if student.shape != target.shape or student.dim() != 5:
        raise KavaError(f"contrast_gap needs [L, B, H, T, D] of one shape, "
                        f"got {tuple(student.shape)} and {tuple(target.shape)}")
    B, T = student.shape[1], student.shape[3]
    if B < 2:
        return torch.zeros((), device=student.device)
    m = torch.ones(B, T, dtype=torch.bool, device=student.device) if mask is None else mask.to(student.device) != 0
    both = m & m.roll(1, dims=0)
    # = cos_metrics(student, t, both)[cos_sim or cos_raw] for t = target and its roll, computing only that
    # cosine and preparing (and centring) the student once: this runs on K and V every step
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
    leading positions whose token id is the same, and real, in every sample of the batch (a chat
    template's system prompt, BOS). Vectorised; no host sync.

    Nothing is dropped when the batch cannot tell a template from content: B == 1 (every position of
    a lone sample is trivially "shared"), or when dropping would leave no token in the batch (all
    samples identical). Left padding leaves no shared prefix at position 0, so nothing is dropped.
    """
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
    """[B, T] bool: the positions whose logits CE counts, i.e. t where labels[t + 1] != -100 (the last
    position never counts). Logit KD counts exactly these: logits at t predict token t + 1."""
    return F.pad(labels[:, 1:] != -100, (0, 1), value=False)


def position_masks(batch: dict, loss_tokens: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """(KV mask, next-token mask), both [B, T] bool, from one batch: the one rule every loss follows.

    KV losses count token positions (a token's key and value describe the token itself): `loss_tokens`
    all = the real tokens, answer = `answer_mask`, no_shared_prefix = the real tokens minus the leading
    positions every sample shares (`drop_shared_prefix`). CE and logit KD count next-token positions: t
    where labels[t + 1] carries a loss (`next_token_mask`), under every `loss_tokens` -- so with `answer`,
    KD scores the position before the first answer token and stops at the one before the last."""
    if loss_tokens == "answer":
        kv = batch["answer_mask"] != 0
    elif loss_tokens == "no_shared_prefix":
        kv = drop_shared_prefix(batch["input_ids"], batch["attention_mask"])
    elif loss_tokens == "all":
        kv = batch["attention_mask"] != 0
    else:
        raise KavaError(f"loss_tokens must be all, answer or no_shared_prefix, not {loss_tokens!r}")
    return kv, next_token_mask(batch["labels"])


def _at_least_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def log_normalizer(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log sum_v exp(logits[..., v] / T) in float32 at least, [B, T]: the one logsumexp over the vocabulary per
    position that CE and (at T = 1) logit KD share."""
    z = _at_least_f32(logits)
    return torch.logsumexp(z if temperature == 1.0 else z / temperature, dim=-1)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _tail_of(logp: torch.Tensor) -> torch.Tensor:
    """log of the mass outside the ids of `logp` [..., k] (log-probs normalised over the full vocabulary),
    floored at TAIL_FLOOR."""
    total = torch.logsumexp(logp, dim=-1).clamp(max=math.log1p(-TAIL_FLOOR))
    return _log1mexp(total)


def topk_tail(topk_logp: torch.Tensor, served_tail: torch.Tensor | None, k: int) -> torch.Tensor:
    """The teacher's log mass outside its first `k` ids [B, T]: the served tail (what was outside all the ids
    it sent) plus the mass of the ids past k; without a served tail, 1 - sum p over the k (a bf16 wire's
    rounding then limits it to ~1e-3)."""
    lp = topk_logp.float()
    if served_tail is None:
        return _tail_of(lp[..., :k])
    tail = served_tail.float()
    if k < lp.shape[-1]:
        tail = torch.logaddexp(tail, torch.logsumexp(lp[..., k:], dim=-1))
    return tail


def _topk_prepare(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                  mask: torch.Tensor | None):
    """Check shapes; return ids [B, T, k] (0 at masked positions) and m [B, T] bool."""
    if student_logits.dim() != 3 or topk_ids.dim() != 3 or tuple(topk_ids.shape) != tuple(topk_logp.shape):
        raise KavaError(f"top-k KL needs student logits [B, T, V] and top-k ids / log-probs [B, T, k] of one shape, "
                        f"got {tuple(student_logits.shape)}, {tuple(topk_ids.shape)} and {tuple(topk_logp.shape)}")
    B, T = student_logits.shape[:2]
    if tuple(topk_ids.shape[:2]) != (B, T):
        raise KavaError(f"top-k KL: teacher top-k is [B, T]={tuple(topk_ids.shape[:2])}, student logits ({B}, {T})")
    m = _bool_mask(mask, B, T, student_logits.device, "top-k KL")
    ids = torch.where(m[..., None], topk_ids.to(student_logits.device).long(), 0)  # garbage ids never gathered
    return ids, m


def topk_kl_loss(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor,
                 mask: torch.Tensor | None = None, temperature: float = 1.0, tail: str = "bucket",
                 teacher_tail: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                 valid: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k forward KL(p_t || p_s), the student normalised over its FULL vocabulary, T^2-scaled, masked mean.

    student_logits [B, T, V]; topk_ids [B, T, k] and topk_logp [B, T, k]: the teacher's top-k ids and their
    log-probs at temperature 1, normalised over the teacher's full vocabulary (what a teacher serves);
    teacher_tail [B, T]: log of the teacher's mass outside those ids (served with them; else 1 - sum p);
    mask [B, T]: the positions that count (`next_token_mask`: logits at t predict t + 1); lse [B, T]: the
    student's `log_normalizer(logits, temperature)` when the caller has it (CE's, at T = 1).

    Matches DistillKit (`distillkit/lossfuncs/kl.py`, `sparse_kl_div`, with `get_logprobs` in
    `lossfuncs/common.py`): the student's log-probs are `logits[ids] / T - logsumexp(logits / T)` over the
    whole vocabulary, so its mass outside the teacher's ids stays visible to the loss and its gradient.
    - tail "bucket" (DistillKit's `MissingProbabilityHandling.SYMMETRIC_UNIFORM`): a (k+1)-th entry holds the
      mass outside the ids, the teacher's tail against the student's 1 - sum_k p_s; the teacher at temperature
      T is (p_i^(1/T), tail^(1/T)) renormalised over the k + 1 entries (DistillKit's `get_target_logprobs`).
      The loss is exactly 0 (and its gradient 0) when the student's distribution equals the teacher's at T = 1,
      and a student whose mass sits off the teacher's support pays log(tail_t / tail_s)-weighted terms whose
      gradient moves that mass onto the support.
    - tail "none" (DistillKit's `ZERO`): the teacher renormalised over its k ids, no tail term; the student
      still normalised over its full vocabulary (sum_k q_t (log q_t - log p_s) >= KL over the k ids).
    Tail masses are floored at TAIL_FLOOR on both sides (fp32 noise). Computed in float32 at least (only the k
    gathered logits and the [B, T] normaliser are cast); masked positions (their logits, ids and log-probs
    may be anything, inf or NaN) change neither the loss nor its gradient. Returns 0 (with grad) if no
    position counts.
    valid [B, T, k] bool: the entries that count as ids (the hybrid cross-vocabulary loss: teacher ids without a
    student token of their string; `logit_kd`: ids past the student's LM head). With tail "bucket" the others'
    mass joins the tail bucket on both sides; with "none" they leave the k the teacher is renormalised over, and
    a position with none left does not count.
    """
    if not temperature > 0:
        raise KavaError(f"top-k KL temperature must be > 0, got {temperature}")
    if tail not in LOGIT_TAILS:
        raise KavaError(f"top-k KL tail must be one of {', '.join(LOGIT_TAILS)}, not {tail!r}")
    ids, m = _topk_prepare(student_logits, topk_ids, topk_logp, mask)
    if valid is not None and tail == "none":
        m = m & valid.to(m.device).any(-1)
        ids = torch.where(m[..., None], ids, 0)
    keep = m[..., None]
    if lse is None:
        lse = log_normalizer(student_logits, temperature)
    z = student_logits.gather(-1, ids)  # [B, T, k], before the cast: V-sized tensors stay in their dtype
    log_s = torch.where(keep, _at_least_f32(z) / temperature - lse[..., None], -1.0)  # student, full vocabulary
    t = torch.where(keep, topk_logp.to(student_logits.device, log_s.dtype), -1.0)  # teacher, T = 1
    if valid is not None:  # entries left out: no mass of their own (bucket: the teacher's served tail gains it)
        out = keep & ~valid.to(t.device)
        if tail == "bucket" and teacher_tail is not None:
            teacher_tail = torch.logaddexp(teacher_tail.to(t.device, t.dtype),
                                           torch.logsumexp(torch.where(out, t, -math.inf), dim=-1))
        t, log_s = torch.where(out, OFF, t), torch.where(out, OFF, log_s)
    if tail == "bucket":
        t_tail = _tail_of(t) if teacher_tail is None else teacher_tail.to(t.device, t.dtype)
        t_tail = torch.where(m, t_tail.clamp(min=math.log(TAIL_FLOOR)), -1.0)
        t = torch.cat([t, t_tail[..., None]], dim=-1)  # [B, T, k + 1]
        log_s = torch.cat([log_s, _tail_of(log_s)[..., None]], dim=-1)
    a = t / temperature
    log_p = a - torch.logsumexp(a, dim=-1, keepdim=True)  # the teacher at T, over its k (+ 1) entries
    per = (log_p.exp() * (log_p - log_s)).sum(-1)  # [B, T]; an entry left out: exp(OFF) = 0 times a finite term
    w = m.float()
    return (temperature ** 2) * (per * w).sum() / w.sum().clamp_min(1.0)


def uld_loss(student_logits: torch.Tensor, topk_logp: torch.Tensor, mask: torch.Tensor | None = None,
             teacher_tail: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Universal Logit Distillation distance, for a teacher of another vocabulary: no map between the two
    vocabularies, only the shapes of the two next-token distributions. Masked mean over positions of
    sum_i |t_i - s_i|, t the teacher's top-k probabilities sorted descending and s the student's top-k (over its
    full vocabulary) sorted descending, each followed by its mass outside those k as one bucket.

    student_logits [B, T, V_s]; topk_logp [B, T, k]: the teacher's top-k log-probs over its full vocabulary (any
    order); teacher_tail [B, T]: log of its mass outside them (else 1 - sum p); mask [B, T]; lse: the student's
    `log_normalizer` at T = 1 when the caller has it.

    Matches TRL's GOLD trainer (`trl/experimental/gold/gold_trainer.py`, `ULDLoss`, non-hybrid): both sides'
    probabilities sorted descending, the shorter zero-padded, L1 summed over the vocabulary, divided by the
    number of positions. With k = the teacher's whole vocabulary its tail is 0 and so is the student's bucket
    past k = min(k, V_s) ids plus zero padding: GOLD's value. Invariant to permuting either vocabulary, 0 for
    equal shapes. Float32 at least; masked positions (the teacher's rows there may be anything, NaN included)
change neither the loss nor its gradient.
    """
    m = _bool_mask(mask, *student_logits.shape[:2], student_logits.device, "ULD")
    k = topk_logp.shape[-1]
    if lse is None:
        lse = log_normalizer(student_logits, 1.0)
    keep = m[..., None]
    z = student_logits.topk(min(k, student_logits.shape[-1]), dim=-1).values  # [B, T, k'] sorted descending
    s = torch.where(keep, _at_least_f32(z) - lse[..., None], -1.0).exp()  # masked: anything, never NaN
    t = torch.where(keep, topk_logp.to(s.device, s.dtype), -1.0).exp()
    t_tail = (1.0 - t.sum(-1)).clamp(min=0.0) if teacher_tail is None else \
        torch.where(m, teacher_tail.to(s.device, s.dtype), -1.0).exp()
    s_tail = (1.0 - s.sum(-1)).clamp(min=0.0)
    w = m.float()
    return _sorted_l1(t, s, m) + ((t_tail - s_tail).abs() * w).sum() / w.sum().clamp_min(1.0)


def _sorted_l1(t: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Masked mean over positions of sum_i |t_i - s_i|, t [B, T, k] and s [B, T, k'] sorted descending inside,
    the shorter zero-padded (the ULD distance between two probability vectors)."""
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
    """The hybrid cross-vocabulary logit loss (as TRL's GOLD trainer, `ULDLoss._compute_hybrid_uld_loss`):
    teacher ids whose string the student also has (`t2s`, `align.vocab.VocabMap`) are compared id by id, the
    rest by the sorted distance. Returns (loss, {"kl": matched part, "uld": unmatched part}).

    student_logits [B, T, V_s]; topk_ids / topk_logp [B, T, k]: the teacher's top-k in ITS vocabulary (already at
    the student's positions); t2s [V_t] long: student id of each teacher id or -1; student_unmatched [U] long:
    the student ids no teacher id maps to; teacher_tail [B, T]: log of its mass outside the k ids.
    - matched: `topk_kl_loss` on the mapped ids (forward KL, the student over its full vocabulary, the tail
      bucket holding the teacher's mass outside its matched top-k ids against the student's outside their
      images): with one tokenizer (t2s = identity) it IS the same-tokenizer KD loss.
    - unmatched: the L1 distance between the teacher's unmatched top-k probabilities and the student's top-k over
      its unmatched ids, both sorted descending (`uld_loss` on the remainders, no buckets: their tail mass is
      the matched part's).
    - weights: `matched_weight` and 1 - it; default (as GOLD) the share of the teacher's vocabulary that maps,
      len(matched) / V_t -- 1 for one tokenizer, so the loss equals the full-vocabulary KD.
    Where this differs from GOLD: GOLD compares matched tokens by a generalized JSD on full distributions;
    here forward KL on the teacher's top-k (what it serves), as the same-tokenizer loss.
    """
    m = _bool_mask(mask, *student_logits.shape[:2], student_logits.device, "hybrid logit loss")
    t2s = t2s.to(student_logits.device)
    ids = torch.where(m[..., None], topk_ids.to(student_logits.device).long(), 0)
    inside = ids < len(t2s)  # an id past the map (a padded LM-head row) has no string
    sid = torch.where(inside, t2s[ids.clamp(max=len(t2s) - 1)], -1)  # [B, T, k] student ids, -1: unmatched
    matched = sid >= 0
    if teacher_tail is None:
        teacher_tail = _tail_of(topk_logp.float())
    kl = topk_kl_loss(student_logits, sid.clamp(min=0), topk_logp, m, temperature=temperature, tail="bucket",
                      teacher_tail=teacher_tail, lse=lse, valid=matched)
    keep = m[..., None]
    t_rest = torch.where(keep & ~matched, topk_logp.to(student_logits.device).float(), -math.inf).exp()
    k, n_un = topk_logp.shape[-1], len(student_unmatched)
    if n_un:
        lse1 = log_normalizer(student_logits) if lse is None or temperature != 1.0 else lse
        z = student_logits.index_select(-1, student_unmatched.to(student_logits.device))  # [B, T, U]
        z = z.topk(min(k, n_un), dim=-1).values
        s_rest = torch.where(keep, _at_least_f32(z) - lse1[..., None], -1.0).exp()
    else:
        s_rest = t_rest.new_zeros(*t_rest.shape[:2], 0)
    uld = _sorted_l1(t_rest, s_rest, m)
    w = float(matched_weight) if matched_weight is not None else float((t2s >= 0).sum()) / max(len(t2s), 1)
    return w * kl + (1.0 - w) * uld, {"kl": kl.detach(), "uld": uld.detach()}


@torch.no_grad()
def top1_agreement(student_logits: torch.Tensor, topk_ids: torch.Tensor, mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Masked mean of (student argmax over the full vocab == teacher's top-1 id, `topk_ids[..., 0]`):
    a detached 0-d float32 tensor (0 if no position counts)."""
    ids, m = _topk_prepare(student_logits, topk_ids, topk_ids, mask)
    agree = (student_logits.argmax(-1) == ids[..., 0]) & m
    return agree.float().sum() / m.float().sum().clamp_min(1.0)


def masked_ce(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True,
              lse: torch.Tensor | None = None) -> torch.Tensor:
    """Causal-LM cross entropy: logits [B, T, V], labels [B, T] with -100 ignored.

    With `shift`, position t predicts label t+1 (the positions `next_token_mask` names). Returns 0 (with
    grad) if no label counts. The labels are shifted, not the logits (the last position gets -100): slicing
    [B, T, V] logits would copy them, and its backward fill and copy a second [B, T, V] gradient (~20 ms of a
    ~700 ms CPU step, `kava-ray bench step`); Hugging Face's causal-LM loss does the same.
    lse [B, T]: the logits' `log_normalizer` when the caller computed it for logit KD too; CE is then
    lse - logits[label] (one logsumexp per position for both losses) instead of `F.cross_entropy`.
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
    if not (flat_labels != -100).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=-100)
