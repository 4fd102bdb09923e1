"""Fusion of several projected teachers into one KV target [L, B, H, T, D].

Kinds: `fixed` (constant normalised weights, default equal), `gate` (a learned softmax over
teachers, one per layer with `per_layer`), `router` (a per-token softmax from Linear(feature_dim ->
n_teachers) on a student feature [B, T, F]), each starting at `weights`; `sum` fuses nothing (one
loss per teacher, `combine_losses`). Teachers are fused by direction with a separately fused
log-norm magnitude, so a projector's output scale cannot buy weight; with `center` (`loss.center`),
on their centred projections. Why and how: docs/internals/core.md#fusion.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from kava_ray.common.errors import KavaError
from kava_ray.core.losses import token_mean

FUSION_KINDS = ("fixed", "gate", "router", "sum")
DIR_EPS = 1e-8  # a projected vector shorter than this has no direction (its unit vector is ~0)
NORM_EPS = 1e-6  # added to norms before the log, as in the Mercator magnitude term


def fuse_by_direction(stacked: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Fuse teachers by direction: `stacked` [..., D, n] (n teachers on the last dim), `w` teacher
    weights summing to 1, broadcastable to [..., 1, n]. Returns [..., D] in `stacked`'s dtype:
    unit(sum_i w_i unit(x_i)) * exp(sum_i w_i log(|x_i| + 1e-6)). Computed in float32 at least."""
    dtype = stacked.dtype
    x = stacked.float() if dtype in (torch.float16, torch.bfloat16) else stacked
    w = w.to(x.dtype)
    norm = torch.linalg.vector_norm(x, dim=-2, keepdim=True)  # [..., 1, n]
    direction = (x / norm.clamp_min(DIR_EPS) * w).sum(dim=-1)  # [..., D]
    direction = direction / torch.linalg.vector_norm(direction, dim=-1, keepdim=True).clamp_min(DIR_EPS)
    log_mag = (torch.log(norm + NORM_EPS) * w).sum(dim=-1)  # [..., 1]
    return (direction * log_mag.exp()).to(dtype)


class Fusion(nn.Module):
    """Weights over `n_teachers` teachers; `forward` fuses `[L, B, H, T, D]` targets."""

    def __init__(
        self,
        kind: str,
        n_teachers: int,
        n_layers: int = 1,
        weights: list[float] | None = None,
        per_layer: bool = False,
        feature_dim: int | None = None,
        names: list[str] | None = None,
        center: bool = False,
    ):
        super().__init__()
        if kind not in FUSION_KINDS:
            raise KavaError(f"unknown fusion kind {kind!r} (expected one of {', '.join(FUSION_KINDS)})")
        if int(n_teachers) < 1:
            raise KavaError(f"fusion n_teachers must be >= 1, got {n_teachers}")
        if int(n_layers) < 1:
            raise KavaError(f"fusion n_layers must be >= 1, got {n_layers}")
        self.kind, self.n_teachers, self.n_layers, self.per_layer = kind, int(n_teachers), int(n_layers), per_layer
        self.center = center
        self.names = list(names) if names is not None else [f"teacher_{i}" for i in range(self.n_teachers)]
        if len(self.names) != self.n_teachers:
            raise KavaError(f"fusion names has {len(self.names)} entries for {n_teachers} teachers")
        prior = self._prior(weights)  # [n]
        self.register_buffer("prior", prior)
        self.last_router_weights: torch.Tensor | None = None
        if kind == "gate":
            rows = self.n_layers if per_layer else 1
            self.logits = nn.Parameter(prior.log().expand(rows, -1).clone())  # [rows, n]
        elif kind == "router":
            if feature_dim is None or int(feature_dim) < 1:
                raise KavaError(f"fusion kind 'router' needs feature_dim >= 1, got {feature_dim}")
            self.router = nn.Linear(int(feature_dim), self.n_teachers)
            nn.init.zeros_(self.router.weight)
            with torch.no_grad():
                self.router.bias.copy_(prior.log())

    def _prior(self, weights: list[float] | None) -> torch.Tensor:
        if weights is None:
            return torch.full((self.n_teachers,), 1.0 / self.n_teachers)
        weights = [float(w) for w in weights]
        if len(weights) != self.n_teachers:
            raise KavaError(f"fusion weights has {len(weights)} entries for {self.n_teachers} teachers")
        for i, w in enumerate(weights):
            if not math.isfinite(w) or w < 0:
                raise KavaError(f"fusion weight {i} ({self.names[i]}) must be >= 0, got {w}")
        total = sum(weights)
        if total <= 0:
            raise KavaError("fusion weights sum to 0")
        if self.kind in ("gate", "router") and min(weights) == 0:
            raise KavaError(f"fusion kind {self.kind!r} needs positive weights (softmax init), got {weights}")
        return torch.tensor([w / total for w in weights])

    @property
    def fuses_targets(self) -> bool:
        """False for `sum`: use one loss per teacher and `combine_losses` instead of `forward`."""
        return self.kind != "sum"

    def weights(self, feature: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher weights, summing to 1 over the last dim.

        fixed/sum: [n]; gate: [n_layers or 1, n]; router: [B, T, n] from feature [B, T, F].
        """
        if self.kind in ("fixed", "sum"):
            return self.prior
        if self.kind == "gate":
            return torch.softmax(self.logits, dim=-1)
        if feature is None:
            raise KavaError("fusion kind 'router' needs the student feature [B, T, F]")
        return torch.softmax(self.router(feature.to(self.router.weight.dtype)), dim=-1)

    def forward(
        self, projected: list[torch.Tensor], feature: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Fuse per-teacher `[L, B, H, T, D]` targets into one by direction (`fuse_by_direction`);
        None for `sum`. `feature` [B, T, F] drives the router; `mask` [B, T]: the tokens that count
        for the logged router weights and, with `center`, for each teacher's mean."""
        if len(projected) != self.n_teachers:
            raise KavaError(f"fusion got {len(projected)} teacher targets, expected {self.n_teachers}")
        shape = projected[0].shape
        for i, p in enumerate(projected):
            if p.shape != shape or p.dim() != 5:
                raise KavaError(f"fusion: target {i} has shape {tuple(p.shape)}, expected 5-D {tuple(shape)}")
        if not self.fuses_targets:
            return None
        if self.kind == "fixed" and self.n_teachers == 1:
            # one teacher's target as projected: what fuse_by_direction gives up to its 1e-6 norm
            # eps, without the ~10 ms (K and V) a 1-teacher fusion costs a small CPU step (`kava-ray
            # bench step`). Gate and router keep their one-entry softmax: a parameter outside the
            # graph would fail DDP
            return projected[0]
        stacked = torch.stack(projected, dim=-1)  # [L, B, H, T, D, n]
        w = self.weights(feature)
        if self.kind == "fixed":
            w = w.to(stacked.dtype)  # broadcast [n]
        elif self.kind == "gate":
            if self.per_layer and w.shape[0] != shape[0]:
                raise KavaError(f"fusion gate has {w.shape[0]} layers, targets have {shape[0]}")
            w = w[:, None, None, None, None, :]  # [L or 1, 1, 1, 1, 1, n]
        else:
            if w.shape[:2] != (shape[1], shape[3]):
                raise KavaError(f"router feature is [B, T]={tuple(w.shape[:2])}, "
                                f"targets have B, T={shape[1]}, {shape[3]}")
            self._log_router(w, mask)
            w = w[None, :, None, :, None, :]  # [1, B, 1, T, 1, n]
        if not self.center:
            return fuse_by_direction(stacked, w)
        B, T = shape[1], shape[3]
        m = (torch.ones(B, T, dtype=torch.bool, device=stacked.device) if mask is None
             else mask.to(stacked.device) != 0)[None, :, None, :]  # [1, B, 1, T]
        x = stacked.float() if stacked.dtype in (torch.float16, torch.bfloat16) else stacked
        mus = torch.stack([token_mean(x[..., i], m) for i in range(self.n_teachers)], dim=-1)  # [L, 1, H, 1, D, n]
        fused = fuse_by_direction(x - mus, w) + (mus * w.to(mus.dtype)).sum(-1)
        return fused.to(stacked.dtype)

    def _log_router(self, w: torch.Tensor, mask: torch.Tensor | None) -> None:
        w = w.detach().reshape(-1, self.n_teachers)
        if mask is not None:
            keep = mask.reshape(-1) != 0
            w = w[keep] if keep.any() else w
        self.last_router_weights = w.mean(0)

    def combine_losses(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """Weighted sum of per-teacher losses (kind `sum`; the weights are normalised)."""
        if self.kind != "sum":
            raise KavaError(f"combine_losses is for fusion kind 'sum', this fusion is {self.kind!r}")
        if len(losses) != self.n_teachers:
            raise KavaError(f"fusion got {len(losses)} losses, expected {self.n_teachers}")
        return sum(float(w) * loss for w, loss in zip(self.prior.tolist(), losses))

    @torch.no_grad()
    def current_weights(self) -> dict[str, torch.Tensor]:
        """Per-teacher mean weight for logging (router: over the last forward's tokens, else its
        prior), as 0-d tensors: the caller converts them on log steps only (no GPU sync per
        step)."""
        if self.kind == "router":
            w = self.last_router_weights
            if w is None:
                w = torch.softmax(self.router.bias, dim=-1)
        else:
            w = self.weights().reshape(-1, self.n_teachers).mean(0)
        return dict(zip(self.names, w.unbind()))
