"""Token (time) alignment across tokenizers, on tensors: teacher KV moved to student time.

Which teacher tokens lo[i]:hi[i] each student token i reads is decided when the data is tokenized,
from both tokenizers' character spans (`kava_ray.data.alignment`, carried by the batch);
`apply_alignment` then moves teacher KV [.., T_t, ..] to student time [.., T_s, ..]. Pure torch, no
Ray. Segments, the canonical coordinate and the causal rule: docs/internals/core.md#align-tokens.
"""

from __future__ import annotations

import torch

MODES = ("mean", "last", "first")


def apply_alignment(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """Teacher-time x [..., B, H, T_t, D] -> student time [..., B, H, T_s, D] (same dtype and device).

    lo, hi: LongTensor [B, T_s]. mean | last | first of x[..., lo:hi, :]; 0 where hi == lo. No grad
    by design (teacher KV carries none); O(T), on x's device.
    """
    if mode not in MODES:
        raise ValueError(f"token alignment mode must be one of {MODES}, not {mode!r}")
    if x.dim() < 4:
        raise ValueError(f"apply_alignment wants x [..., B, H, T, D], got shape {tuple(x.shape)}")
    *lead, B, H, T_t, D = x.shape
    if lo.shape != hi.shape or lo.dim() != 2 or lo.shape[0] != B:
        raise ValueError(f"lo/hi must both be [B={B}, T_s], got {tuple(lo.shape)} and {tuple(hi.shape)}")
    T_s = lo.shape[1]
    lo, hi = lo.to(x.device, torch.long), hi.to(x.device, torch.long)
    ok = hi > lo  # [B, T_s]
    if T_t == 0 or T_s == 0:
        return x.new_zeros(*lead, B, H, T_s, D)
    out_shape = (*lead, B, H, T_s, D)

    def index(pos: torch.Tensor) -> torch.Tensor:
        return pos.view(B, 1, T_s, 1).expand(out_shape)

    with torch.no_grad():
        if mode == "mean":
            # float32 prefix sums gathered at hi and lo: O(T), no [T_s, T_t] matrix
            cs = torch.cumsum(x.float(), dim=-2)
            cs = torch.cat([cs.new_zeros(*lead, B, H, 1, D), cs], dim=-2)  # cs[..., j, :] = sum x[..., :j, :]
            hi_c, lo_c = hi.clamp(0, T_t), lo.clamp(0, T_t)
            total = cs.gather(-2, index(hi_c)) - cs.gather(-2, index(lo_c))
            count = (hi_c - lo_c).clamp(min=1).to(total.dtype).view(B, 1, T_s, 1)
            out = total / count
        else:
            pos = (hi - 1) if mode == "last" else lo
            out = x.gather(-2, index(pos.clamp(0, T_t - 1)))
        out = out * ok.view(B, 1, T_s, 1).to(out.dtype)
    return out.to(x.dtype)


def aligned_mask(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """BoolTensor [B, T_s]: the student positions that use at least one teacher token (hi > lo)."""
    return hi > lo


def alignment_stats(lo: torch.Tensor, hi: torch.Tensor, student_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Alignment coverage over the real student tokens (student_mask [B, T_s], 1 = real token).

    Returns detached 0-d tensors on lo's device (metrics-style, no host sync):
      aligned_fraction     float32, aligned real tokens / real tokens (0 when there are none)
      teacher_per_student  float32, mean hi - lo over the aligned real tokens (0 when none)
      unaligned            int64, number of real student tokens with no teacher token
    """
    real = student_mask.to(lo.device).bool()
    ok = aligned_mask(lo, hi) & real
    n_real, n_ok = real.sum(), ok.sum()
    width = torch.where(ok, (hi - lo).float(), torch.zeros((), device=lo.device)).sum()
    return {
        "aligned_fraction": (n_ok.float() / n_real.clamp(min=1).float()).detach(),
        "teacher_per_student": (width / n_ok.clamp(min=1).float()).detach(),
        "unaligned": (n_real - n_ok).to(torch.int64).detach(),
    }
