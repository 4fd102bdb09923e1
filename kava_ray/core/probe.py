"""Projector-free KV alignment: how close the student's own keys and values are to a teacher's, with
no learned part between them -- the same figure for every recipe, where the projector's `cos_sim` is
~0 for a `ce` run by construction.

Layers the student copied from the teacher compare directly; any other pair goes through a ridge
linear probe fit on one split and scored on another. Both score the centred cosine, the mean of K
and V: 1 for a student equal to its teacher on those layers, ~0 for a random one. Pure PyTorch.
Details: docs/internals/core.md#probe.
"""

from __future__ import annotations

from typing import Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.losses import cos_metrics
from kava_ray.core.projectors import affine_per_layer


def source_layers(keep_layers: Optional[list[int]], student_layers: int, teacher_layers: int) -> list[int]:
    """The teacher layer each student layer was copied from (`student.keep_layers`; all layers when None)."""
    keep = list(range(student_layers)) if keep_layers is None else [int(i) for i in keep_layers]
    if len(keep) != student_layers or max(keep) >= teacher_layers or min(keep) < 0:
        raise KavaError(f"keep_layers {keep} do not name {student_layers} layers of a {teacher_layers}-layer teacher")
    return keep


def _tokens(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[L, B, H, T, D] -> the real tokens' features [L, N, H * D] (float64, for the normal equations)."""
    L, B, H, T, D = x.shape
    flat = x.permute(0, 1, 3, 2, 4).reshape(L, B * T, H * D)
    return flat[:, mask.reshape(-1).bool()].double()


class KVAlignment:
    """Accumulates the projector-free centred cosine of student vs teacher K and V over batches.

    pairs[i] = the teacher layer (an index into the teacher KV's layer axis) student layer i is
    compared with. probe=False: direct comparison (identical geometry, `source_layers`). probe=True:
    `fit` on batches first (a linear map per student layer and per K / V, ridge `ridge` x mean
    feature variance), then `score`.
    """

    def __init__(self, pairs: list[int], probe: bool = False, ridge: float = 1e-3, exclude: tuple = ()):
        self.pairs, self.probe, self.ridge = list(pairs), probe, ridge
        self.exclude = sorted(set(int(i) for i in exclude))  # student layers left out of the mean (a copy: ~1)
        if len(self.exclude) >= len(self.pairs):
            self.exclude = []
        self._stats: dict[str, list] = {}  # K / V -> per student layer [n, sum x, sum y, X'X, X'Y]
        self.maps: dict[str, list] = {}  # K / V -> per student layer (W, b)
        self._per = {"k": [0.0] * len(self.pairs), "v": [0.0] * len(self.pairs)}  # per layer, token-weighted
        self.tokens = 0

    def _check(self, student: torch.Tensor, teacher: torch.Tensor) -> None:
        if student.shape[0] != len(self.pairs):
            raise KavaError(f"KV alignment: {student.shape[0]} student layers for {len(self.pairs)} pairs")
        if max(self.pairs) >= teacher.shape[0]:
            raise KavaError(f"KV alignment: teacher layer {max(self.pairs)} not in its {teacher.shape[0]} layers")
        if not self.probe and student.shape[1:] != teacher.shape[1:]:
            raise KavaError(f"KV alignment without a probe needs one geometry, got student {tuple(student.shape)} "
                            f"and teacher {tuple(teacher.shape)} (a student not built by keep_layers: probe=True)")

    @torch.no_grad()
    def fit_batch(self, skv: tuple, tkv: tuple, mask: torch.Tensor) -> None:
        """Add one batch's real tokens to the normal equations: skv / tkv = (keys, values) [L, B, H, T, D]."""
        for name, s, t in (("k", skv[0], tkv[0]), ("v", skv[1], tkv[1])):
            self._check(s, t)
            xs, ys = _tokens(s, mask), _tokens(t[self.pairs], mask)  # [L_s, N, F_s], [L_s, N, F_t]
            stats = self._stats.setdefault(name, [[0, 0.0, 0.0, 0.0, 0.0] for _ in self.pairs])
            for i, (x, y) in enumerate(zip(xs, ys)):
                st = stats[i]
                st[0] += x.shape[0]
                st[1] = st[1] + x.sum(0)
                st[2] = st[2] + y.sum(0)
                st[3] = st[3] + x.T @ x
                st[4] = st[4] + x.T @ y

    def fit(self) -> None:
        """Solve each layer's ridge regression (intercept included, features centred)."""
        if not self._stats:
            raise KavaError("KV alignment probe: fit_batch saw no tokens")
        for name, stats in self._stats.items():
            self.maps[name] = []
            for n, sx, sy, xx, xy in stats:
                mx, my = sx / n, sy / n
                cxx = xx / n - torch.outer(mx, mx)
                cxy = xy / n - torch.outer(mx, my)
                lam = self.ridge * float(torch.diagonal(cxx).mean().clamp_min(1e-12))
                w = torch.linalg.solve(cxx + lam * torch.eye(cxx.shape[0], dtype=cxx.dtype, device=cxx.device), cxy)
                self.maps[name].append((w, my - mx @ w))

    def _predict(self, name: str, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Student [L_s, B, H_s, T, D_s] -> its probe's prediction of teacher layers `pairs` [L_s, B, H_t, T, D_t]."""
        w = torch.stack([w for w, _ in self.maps[name]])  # [L, F_s, F_t] float64
        b = torch.stack([b for _, b in self.maps[name]])  # [L, F_t]
        return affine_per_layer(s.double(), w, b, t.shape[2], t.shape[4]).to(t.dtype)

    @torch.no_grad()
    def score_batch(self, skv: tuple, tkv: tuple, mask: torch.Tensor) -> None:
        """Add one batch's centred cosine (K and V) between the student (or its probe's output) and the teacher."""
        if self.probe and not self.maps:
            raise KavaError("KV alignment probe: call fit() before scoring")
        n = int(mask.bool().sum())
        for name, s, t in (("k", skv[0], tkv[0]), ("v", skv[1], tkv[1])):
            self._check(s, t)
            target = t[self.pairs]
            pred = self._predict(name, s, target) if self.probe else s.to(target.dtype)
            per = cos_metrics(pred, target, mask)["cos_per_layer"]  # centred, one per student layer
            self._per[name] = [acc + float(c) * n for acc, c in zip(self._per[name], per)]
        self.tokens += n

    def result(self) -> dict:
        """{"kv_cos_free": mean of K and V over the layers not excluded, "kv_cos_free_k",
        "kv_cos_free_v", "per_layer": [mean of K and V per student layer], "excluded", "tokens",
        "method"}."""
        n = max(self.tokens, 1)
        keep = [i for i in range(len(self.pairs)) if i not in self.exclude]
        k, v = ([self._per[x][i] / n for i in keep] for x in ("k", "v"))
        k, v = sum(k) / len(keep), sum(v) / len(keep)
        per_layer = [(a + b) / (2 * n) for a, b in zip(self._per["k"], self._per["v"])]
        return {"kv_cos_free": (k + v) / 2, "kv_cos_free_k": k, "kv_cos_free_v": v, "per_layer": per_layer,
                "excluded": self.exclude, "tokens": self.tokens,
                "method": "linear probe" if self.probe else "direct (source layers)"}
