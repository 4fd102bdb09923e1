"""Layer maps: which teacher layers feed which student layer, and with what weight.

A `LayerMap` lists every student layer 0..L_s-1 in order, each with a list of
(teacher_layer, weight) pairs whose weights sum to 1:

    [(0, [(0, 1.0)]), (1, [(2, 0.5), (3, 0.5)]), ...]

Kinds: `ratio` (one teacher layer per student layer, spread evenly, first and last
teacher layer included), `uniform` (contiguous groups, every teacher layer used),
`explicit` (user spec), `cka` (measured with linear CKA and stored as JSON).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kava_ray.errors import KavaError

LayerMap = list[tuple[int, list[tuple[int, float]]]]

KINDS = ("ratio", "uniform", "explicit", "cka")


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


def cka_map(teacher_feats: list[torch.Tensor], student_feats: list[torch.Tensor], top_k: int = 1) -> LayerMap:
    """For each student layer, its top-k teacher layers by linear CKA.

    Features are per-layer [N, d] (e.g. flattened K of N tokens). Weights are the
    CKA values normalised to sum to 1 (equal if all are 0); the pairs are listed
    best first.
    """
    if not teacher_feats or not student_feats:
        raise KavaError("cka_map needs features for at least one teacher and one student layer")
    if not 1 <= top_k <= len(teacher_feats):
        raise KavaError(f"cka_map: top_k={top_k} must be in [1, {len(teacher_feats)}]")
    scores = cka_matrix(teacher_feats, student_feats)  # [L_s, L_t]
    out: LayerMap = []
    for s in range(len(student_feats)):
        vals, idx = scores[s].topk(top_k)
        total = float(vals.sum())
        ws = [float(v) / total for v in vals] if total > 0 else [1.0 / top_k] * top_k
        out.append((s, [(int(t), w) for t, w in zip(idx.tolist(), ws)]))
    return out


def save_layer_map(layer_map: LayerMap, path: str | Path) -> None:
    """Write a map as JSON: {"layer_map": [[student, [[teacher, weight], ...]], ...]}."""
    data = {"layer_map": [[int(s), [[int(t), float(w)] for t, w in pairs]] for s, pairs in layer_map]}
    Path(path).write_text(json.dumps(data, indent=1))


def load_layer_map(path: str | Path) -> LayerMap:
    """Read a map written by `save_layer_map`."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        return [(int(s), [(int(t), float(w)) for t, w in pairs]) for s, pairs in data["layer_map"]]
    except FileNotFoundError:
        raise KavaError(f"layer map file not found: {p}") from None
    except (ValueError, KeyError, TypeError):
        raise KavaError(f"layer map file {p} is not a saved layer map") from None


def build_layer_map(
    kind: str, n_teacher: int, n_student: int, explicit: dict | None = None, cka_path: str | Path | None = None
) -> LayerMap:
    """Dispatch on `kind` in ratio | uniform | explicit | cka (the latter loads `cka_path`)."""
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
            raise KavaError("layer map kind 'cka' needs cka_path (a JSON file from save_layer_map)")
        return validate_layer_map(load_layer_map(cka_path), n_teacher, n_student)
    raise KavaError(f"unknown layer map kind {kind!r} (expected one of {', '.join(KINDS)})")


def teacher_layers_used(layer_map: LayerMap) -> list[int]:
    """Sorted teacher layers that appear in the map (the ones a teacher must ship)."""
    return sorted({int(t) for _, pairs in layer_map for t, _w in pairs})


def plan_teacher_layers(
    kind: str, n_teacher: int, n_student: int, mode: str = "structured", selected: list[int] | None = None,
    explicit: dict | None = None, cka_path: str | Path | None = None,
) -> tuple[LayerMap, list[int]]:
    """(layer map in real teacher layer ids, the teacher layers to ship) for one teacher.

    `selected` (the teacher config's `layers`) restricts which teacher layers may be used — the way
    to bound KV volume for a large teacher; ratio/uniform maps are then built over the selected
    layers. Explicit and CKA maps name real layer ids and must stay inside the selection.
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
        layer_map = build_layer_map(kind, n_teacher, n_student, explicit=explicit, cka_path=cka_path)
        outside = sorted(set(teacher_layers_used(layer_map)) - set(candidates))
        if outside:
            raise KavaError(f"layer map uses teacher layers {outside} outside the selected layers {candidates}")
    shipped = candidates if mode == "flat" else teacher_layers_used(layer_map)
    return layer_map, shipped
