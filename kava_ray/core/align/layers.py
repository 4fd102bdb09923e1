"""Layer maps: which teacher layers feed which student layer, and with what weight.

A `LayerMap` lists every student layer 0..L_s-1 in order, each with a list of (teacher_layer,
weight) pairs whose weights sum to 1. Kinds: `identity`, `ratio`, `uniform`, `explicit` (user spec)
and `cka` (measured by `kava-ray align cka`, stored as JSON, one map per teacher). What each kind
picks, with an example: docs/internals/core.md#align-layers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kava_ray.common.errors import KavaError
from kava_ray.common.files import write_json

LayerMap = list[tuple[int, list[tuple[int, float]]]]

KINDS = ("identity", "ratio", "uniform", "explicit", "cka")


def _check_counts(n_teacher: int, n_student: int) -> None:
    if int(n_teacher) < 1:
        raise KavaError(f"n_teacher must be >= 1, got {n_teacher}")
    if int(n_student) < 1:
        raise KavaError(f"n_student must be >= 1, got {n_student}")


def ratio_map(n_teacher: int, n_student: int) -> LayerMap:
    """Student layer s <- teacher layer round(s * (n_t - 1) / (n_s - 1)), rounding half up.

    Student layer 0 takes teacher layer 0 and the last student layer the last
    teacher layer; a one-layer student takes the last teacher layer.
    """
    _check_counts(n_teacher, n_student)
    if n_student == 1:
        return [(0, [(n_teacher - 1, 1.0)])]
    den = n_student - 1
    # exact integer round-half-up of s*(n_t-1)/den (Python's round() is banker's rounding)
    return [(s, [((2 * s * (n_teacher - 1) + den) // (2 * den), 1.0)]) for s in range(n_student)]


def identity_map(n_teacher: int, n_student: int, sources: list[int] | None = None) -> LayerMap:
    """Student layer s <- teacher layer sources[s] (the layer it was copied from:
    `student.keep_layers`), or layer s itself without `sources`."""
    _check_counts(n_teacher, n_student)
    src = list(range(n_student)) if sources is None else [int(t) for t in sources]
    if len(src) != n_student:
        raise KavaError(f"layer map identity: {len(src)} source layers for a {n_student}-layer student")
    bad = [t for t in src if not 0 <= t < n_teacher]
    if bad:
        raise KavaError(f"layer map identity: teacher layer {bad[0]} out of range [0, {n_teacher}) "
                        f"(the student has {n_student} layers{'' if sources is None else f', copied from {src}'})")
    return [(s, [(t, 1.0)]) for s, t in enumerate(src)]


def uniform_map(n_teacher: int, n_student: int) -> LayerMap:
    """Split the teacher layers into n_s contiguous groups of (nearly) equal size, equal weights.

    Every teacher layer is used exactly once. If the teacher has fewer layers than
    the student, student layer s takes teacher layer floor(s * n_t / n_s): groups
    then repeat, and every teacher layer is still used.
    """
    _check_counts(n_teacher, n_student)
    if n_teacher < n_student:
        return [(s, [(s * n_teacher // n_student, 1.0)]) for s in range(n_student)]
    bounds = [round(i * n_teacher / n_student) for i in range(n_student + 1)]
    out: LayerMap = []
    for s in range(n_student):
        group = list(range(bounds[s], bounds[s + 1]))
        out.append((s, [(t, 1.0 / len(group)) for t in group]))
    return out


def _as_layer(value, what: str) -> int:
    try:
        layer = int(value)
    except (TypeError, ValueError):
        raise KavaError(f"layer map: {what} {value!r} is not an integer") from None
    if isinstance(value, float) and value != layer:
        raise KavaError(f"layer map: {what} {value!r} is not an integer")
    return layer


def explicit_map(spec: dict, n_teacher: int, n_student: int) -> LayerMap:
    """Build a map from `{student_layer: [teacher, ...] | {teacher: weight}}`.

    Keys may be strings (YAML/JSON). A list means equal weights; a dict's weights
    are normalised to sum to 1. Every student layer must appear.
    """
    _check_counts(n_teacher, n_student)
    if not isinstance(spec, dict) or not spec:
        raise KavaError("layer map: explicit spec must be a non-empty mapping {student_layer: teacher_layers}")
    entries: dict[int, list[tuple[int, float]]] = {}
    for key, value in spec.items():
        s = _as_layer(key, "student layer")
        if not 0 <= s < n_student:
            raise KavaError(f"layer map: student layer {s} out of range [0, {n_student})")
        if s in entries:
            raise KavaError(f"layer map: student layer {s} given twice")
        if isinstance(value, dict):
            pairs = [(_as_layer(t, "teacher layer"), float(w)) for t, w in value.items()]
        elif isinstance(value, (list, tuple)):
            pairs = [(_as_layer(t, "teacher layer"), 1.0) for t in value]
        else:
            pairs = [(_as_layer(value, "teacher layer"), 1.0)]
        entries[s] = _normalise(pairs, s, n_teacher)
    missing = [s for s in range(n_student) if s not in entries]
    if missing:
        raise KavaError(f"layer map: student layer {missing[0]} has no teacher layers")
    return [(s, entries[s]) for s in range(n_student)]


def _normalise(pairs: list[tuple[int, float]], s: int, n_teacher: int) -> list[tuple[int, float]]:
    if not pairs:
        raise KavaError(f"layer map: student layer {s} has no teacher layers")
    seen = set()
    for t, w in pairs:
        if not 0 <= t < n_teacher:
            raise KavaError(f"layer map: teacher layer {t} (student layer {s}) out of range [0, {n_teacher})")
        if t in seen:
            raise KavaError(f"layer map: teacher layer {t} listed twice for student layer {s}")
        seen.add(t)
        if not math.isfinite(w) or w < 0:
            raise KavaError(f"layer map: weight {w} of teacher layer {t} (student layer {s}) must be >= 0")
    total = sum(w for _, w in pairs)
    if total <= 0:
        raise KavaError(f"layer map: weights of student layer {s} sum to 0")
    return [(t, w / total) for t, w in pairs]


def validate_layer_map(layer_map: LayerMap, n_teacher: int, n_student: int) -> LayerMap:
    """Check a map covers student layers 0..n_s-1 in order with in-range teacher layers; renormalise."""
    _check_counts(n_teacher, n_student)
    if len(layer_map) != n_student:
        raise KavaError(f"layer map has {len(layer_map)} student layers, the student has {n_student}")
    out: LayerMap = []
    for i, (s, pairs) in enumerate(layer_map):
        if int(s) != i:
            raise KavaError(f"layer map: entry {i} is student layer {s}, expected {i}")
        out.append((i, _normalise([(int(t), float(w)) for t, w in pairs], i, n_teacher)))
    return out


def linear_cka(X: torch.Tensor, Y: torch.Tensor) -> float:
    """Linear CKA between X [N, d1] and Y [N, d2] (same N samples), in [0, 1].

    CKA = HSIC(X, Y) / sqrt(HSIC(X, X) HSIC(Y, Y)) with column-centred features,
    computed as ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F) in float64.
    Invariant to orthogonal transforms and isotropic scaling of either side.
    """
    if X.dim() != 2 or Y.dim() != 2 or X.shape[0] != Y.shape[0]:
        raise KavaError(f"linear_cka needs [N, d1] and [N, d2], got {tuple(X.shape)} and {tuple(Y.shape)}")
    X = X.detach().double()
    Y = Y.detach().double()
    X = X - X.mean(0, keepdim=True)
    Y = Y - Y.mean(0, keepdim=True)
    hsic_xy = (Y.T @ X).pow(2).sum()
    den = torch.linalg.matrix_norm(X.T @ X) * torch.linalg.matrix_norm(Y.T @ Y)
    if den <= 0:
        return 0.0
    return float((hsic_xy / den).clamp(0.0, 1.0))


def cka_matrix(teacher_feats: list[torch.Tensor], student_feats: list[torch.Tensor]) -> torch.Tensor:
    """[L_s, L_t] matrix of linear CKA between every student and teacher layer."""
    return torch.tensor([[linear_cka(t, s) for t in teacher_feats] for s in student_feats], dtype=torch.float64)


def top_k_map(scores: torch.Tensor, top_k: int = 1, teacher_layers: list[int] | None = None) -> LayerMap:
    """For each student layer (row of `scores` [L_s, L_t]), its top-k teacher layers (columns).

    Weights are the scores normalised to sum to 1 (equal if all are 0); pairs are listed best first.
    `teacher_layers` names the real teacher layer id of each column (default: the column index).
    """
    n_t = scores.shape[1]
    if not 1 <= top_k <= n_t:
        raise KavaError(f"cka_map: top_k={top_k} must be in [1, {n_t}]")
    ids = list(range(n_t)) if teacher_layers is None else [int(t) for t in teacher_layers]
    if len(ids) != n_t:
        raise KavaError(f"top_k_map: {len(ids)} teacher layer ids for {n_t} columns")
    out: LayerMap = []
    for s in range(scores.shape[0]):
        vals, idx = scores[s].double().topk(top_k)
        total = float(vals.clamp(min=0).sum())
        ws = [max(float(v), 0.0) / total for v in vals] if total > 0 else [1.0 / top_k] * top_k
        out.append((s, [(ids[int(t)], w) for t, w in zip(idx.tolist(), ws)]))
    return out


def cka_map(teacher_feats: list[torch.Tensor], student_feats: list[torch.Tensor], top_k: int = 1) -> LayerMap:
    """For each student layer, its top-k teacher layers by linear CKA, best first. Features:
    per-layer [N, d] (e.g. flattened K of N tokens); weights: the CKA values normalised to sum to 1
    (equal if all are 0)."""
    if not teacher_feats or not student_feats:
        raise KavaError("cka_map needs features for at least one teacher and one student layer")
    if not 1 <= top_k <= len(teacher_feats):
        raise KavaError(f"cka_map: top_k={top_k} must be in [1, {len(teacher_feats)}]")
    return top_k_map(cka_matrix(teacher_feats, student_feats), top_k)


class CKAStats:
    """Streaming linear CKA between every teacher and every student layer, without keeping features.

    Linear CKA needs only second moments: with column-centred X [N, d_t] and Y [N, d_s], CKA =
    ||Xc^T Yc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F), and Xc^T Yc = X^T Y - N mx my^T. `update` adds
    one chunk of tokens to float64 sums of X^T Y (all layer pairs in one matrix product), X^T X, Y^T
    Y and the column sums; memory is O(L_t d_t * L_s d_s) whatever the number of tokens, and the
    result equals `cka_matrix` on the concatenated features. Features are shifted by the first
    chunk's mean before they are multiplied (covariances do not change), so large common offsets
    (biased K projections) do not cancel catastrophically.
    """

    def __init__(self):
        self.n = 0
        self._shift: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, teacher: torch.Tensor, student: torch.Tensor) -> None:
        """teacher [L_t, n, d_t], student [L_s, n, d_s]: the same n tokens, every layer."""
        if teacher.dim() != 3 or student.dim() != 3 or teacher.shape[1] != student.shape[1]:
            raise KavaError(f"CKAStats.update needs [L_t, n, d_t] and [L_s, n, d_s], got {tuple(teacher.shape)} "
                            f"and {tuple(student.shape)}")
        n = teacher.shape[1]
        if n == 0:
            return
        X, Y = teacher.detach().float().cpu(), student.detach().float().cpu()
        if self._shift is None:
            self._shift = (X.mean(1, keepdim=True), Y.mean(1, keepdim=True))
            (Lt, _, dt), (Ls, _, ds) = X.shape, Y.shape
            self.shape = (Lt, dt, Ls, ds)
            self.sx = torch.zeros(Lt, dt, dtype=torch.float64)
            self.sy = torch.zeros(Ls, ds, dtype=torch.float64)
            self.xx = torch.zeros(Lt, dt, dt, dtype=torch.float64)
            self.yy = torch.zeros(Ls, ds, ds, dtype=torch.float64)
            self.xy = torch.zeros(Lt * dt, Ls * ds, dtype=torch.float64)
        elif (X.shape[0], X.shape[2], Y.shape[0], Y.shape[2]) != self.shape:
            raise KavaError(f"CKAStats.update: layer/feature sizes changed from {self.shape}")
        X, Y = X - self._shift[0], Y - self._shift[1]
        self.sx += X.sum(1).double()
        self.sy += Y.sum(1).double()
        self.xx += torch.bmm(X.transpose(1, 2), X).double()
        self.yy += torch.bmm(Y.transpose(1, 2), Y).double()
        Xf = X.permute(1, 0, 2).reshape(n, -1)  # [n, L_t * d_t]
        Yf = Y.permute(1, 0, 2).reshape(n, -1)
        self.xy += (Xf.T @ Yf).double()
        self.n += n

    def matrix(self) -> torch.Tensor:
        """[L_s, L_t] linear CKA of every student layer (rows) with every teacher layer (columns)."""
        if self.n < 2:
            raise KavaError(f"CKAStats: {self.n} token(s) seen; CKA needs at least 2")
        Lt, dt, Ls, ds = self.shape
        mx, my = self.sx / self.n, self.sy / self.n
        cxx = self.xx - self.n * mx[:, :, None] * mx[:, None, :]
        cyy = self.yy - self.n * my[:, :, None] * my[:, None, :]
        cxy = self.xy.view(Lt, dt, Ls, ds) - self.n * mx[:, :, None, None] * my[None, None, :, :]
        num = cxy.pow(2).sum((1, 3))  # [L_t, L_s]
        den = torch.linalg.matrix_norm(cxx)[:, None] * torch.linalg.matrix_norm(cyy)[None, :]
        cka = torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num)).clamp(0.0, 1.0)
        return cka.T.contiguous()


def layer_map_json(layer_map: LayerMap) -> list:
    """A map as plain JSON data: [[student, [[teacher, weight], ...]], ...]."""
    return [[int(s), [[int(t), float(w)] for t, w in pairs]] for s, pairs in layer_map]


def save_layer_map(layer_map: LayerMap, path: str | Path) -> None:
    """Write a map as JSON: {"layer_map": [[student, [[teacher, weight], ...]], ...]}."""
    write_json(path, {"layer_map": layer_map_json(layer_map)})


def _parse_map(entries) -> LayerMap:
    return [(int(s), [(int(t), float(w)) for t, w in pairs]) for s, pairs in entries]


def load_layer_map(path: str | Path, teacher: str | None = None) -> LayerMap:
    """Read a map: a single map `{"layer_map": ...}` (`save_layer_map`; any teacher may use it) or
    one map per teacher `{"teachers": {name: {"layer_map": ...}}}` (`kava-ray align cka`), read by
    `teacher`.

    A per-teacher file read without a teacher name is accepted only when it holds exactly one teacher.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise KavaError(f"layer map file not found: {p}") from None
    except (OSError, ValueError):
        raise KavaError(f"layer map file {p} is not a saved layer map") from None
    try:
        if isinstance(data, dict) and "teachers" in data and "layer_map" not in data:
            maps = data["teachers"]
            if not isinstance(maps, dict) or not maps:
                raise TypeError
            if teacher is None:
                if len(maps) != 1:
                    raise KavaError(f"layer map file {p} holds maps for teachers {', '.join(sorted(maps))}: "
                                    f"say which teacher reads it")
                teacher = next(iter(maps))
            if teacher not in maps:
                raise KavaError(f"layer map file {p} has no map for teacher {teacher!r} "
                                f"(it has {', '.join(sorted(maps))}); measure one with kava-ray align cka")
            return _parse_map(maps[teacher]["layer_map"])
        return _parse_map(data["layer_map"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise KavaError(f"layer map file {p} is not a saved layer map") from None


def build_layer_map(
    kind: str, n_teacher: int, n_student: int, explicit: dict | None = None, cka_path: str | Path | None = None,
    teacher: str | None = None, sources: list[int] | None = None,
) -> LayerMap:
    """Dispatch on `kind` in identity | ratio | uniform | explicit | cka (identity reads `sources`,
    the student's `keep_layers`; cka loads `teacher`'s map from `cka_path`)."""
    if kind == "identity":
        return identity_map(n_teacher, n_student, sources)
    if kind == "ratio":
        return ratio_map(n_teacher, n_student)
    if kind == "uniform":
        return uniform_map(n_teacher, n_student)
    if kind == "explicit":
        if explicit is None:
            raise KavaError("layer map kind 'explicit' needs an explicit spec")
        return explicit_map(explicit, n_teacher, n_student)
    if kind == "cka":
        if cka_path is None:
            raise KavaError("layer map kind 'cka' needs cka_path (a JSON file from kava-ray align cka)")
        layer_map = load_layer_map(cka_path, teacher)
        try:
            return validate_layer_map(layer_map, n_teacher, n_student)
        except KavaError as e:
            who = f" (teacher {teacher!r})" if teacher else ""
            raise KavaError(f"layer map file {cka_path}{who}: {e}") from None
    raise KavaError(f"unknown layer map kind {kind!r} (expected one of {', '.join(KINDS)})")


def heaviest_sources(layer_map: LayerMap) -> list[int]:
    """Per student layer, the mapped teacher layer of the largest weight (what a one-to-one comparison uses)."""
    return [max(pairs, key=lambda tw: tw[1])[0] for _, pairs in layer_map]


def teacher_layers_used(layer_map: LayerMap) -> list[int]:
    """Sorted teacher layers that appear in the map (the ones a teacher must ship)."""
    return sorted({int(t) for _, pairs in layer_map for t, _w in pairs})


def plan_teacher_layers(
    kind: str, n_teacher: int, n_student: int, mode: str = "structured", selected: list[int] | None = None,
    explicit: dict | None = None, cka_path: str | Path | None = None, teacher: str | None = None,
    sources: list[int] | None = None,
) -> tuple[LayerMap, list[int]]:
    """(layer map in real teacher layer ids, the teacher layers to ship) for one teacher.

    `selected` (the teacher config's `layers`) restricts which teacher layers may be used — the way
    to bound KV volume for a large teacher; ratio/uniform maps are then built over the selected
    layers. Identity, explicit and CKA maps name real layer ids and must stay inside the selection
    (identity: `sources`, the layers a `keep_layers` student was copied from).
    `teacher` names the teacher whose map a per-teacher CKA file holds.
    Structured mode ships exactly the layers its map uses; flat mode aggregates whole stacks, so it
    ships every selected layer (all layers when nothing is selected).
    """
    candidates = sorted(set(selected)) if selected else list(range(n_teacher))
    if candidates[-1] >= n_teacher:
        raise KavaError(f"teacher layers {candidates}: the teacher has only {n_teacher} layers")
    if kind in ("ratio", "uniform"):
        virtual = build_layer_map(kind, len(candidates), n_student)
        layer_map = [(s, [(candidates[t], w) for t, w in pairs]) for s, pairs in virtual]
    else:
        layer_map = build_layer_map(kind, n_teacher, n_student, explicit=explicit, cka_path=cka_path,
                                    teacher=teacher, sources=sources)
        outside = sorted(set(teacher_layers_used(layer_map)) - set(candidates))
        if outside:
            raise KavaError(f"layer map uses teacher layers {outside} outside the selected layers {candidates}")
    shipped = candidates if mode == "flat" else teacher_layers_used(layer_map)
    return layer_map, shipped
