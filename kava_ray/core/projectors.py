"""Projectors from a teacher's KV cache (`[L, B, H, T, D]`: layers, batch, kv heads, time, head_dim)
into the student's layout `[L_s, B, H_s, T, D_s]`. A `TeacherProjector` holds one teacher's K and V
projectors: `flat` (the shipped layers aggregated per token, one projector for all student layers)
or `structured` (per student layer, a learned combination of its mapped teacher layers, then a
`HeadwiseProjector`). See docs/internals/core.md#projectors.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import LayerMap, heaviest_sources, validate_layer_map

PROJECTOR_KINDS = ("elastic", "linear", "identity", "fit")  # and "auto" (`resolve_kind`)
MODES = ("flat", "structured")
AGGREGATIONS = ("concat", "mean", "weighted")
HEAD_PROJS = ("shared", "per_head")


def resolve_kind(kind: str, mode: str, t_heads: int, t_head_dim: int, s_heads: int, s_head_dim: int,
                 fit_ok: bool = True, *, copied: bool) -> str:
    """`auto` -> `identity` where the student was copied from this teacher (`copied`: `plans.copied_from_teacher`,
    the provenance `layer_map: auto` reads) and so has its KV geometry and basis per layer (structured mode), so the
    target is the teacher's own KV; else, in structured mode, `fit` (the teacher's own KV as the target, a
    student-side map started as the ridge fit) where `fit_ok` (the teacher shares the student's tokenizer, and its
    loss is its own: one teacher or fusion `sum`); else `linear`. The geometry alone does not decide identity: a
    student of the same kv heads x head_dim trained apart from the teacher holds its KV in a basis of its own."""
    if kind != "auto":
        return kind
    if mode != "structured":
        return "linear"
    if copied and (int(t_heads), int(t_head_dim)) == (int(s_heads), int(s_head_dim)):
        return "identity"
    return "fit" if fit_ok else "linear"


def job_kind(align, fusion_kind: str, n_teachers: int, t_geom, s_geom, *, copied: bool, sharded: bool,
             aligned: bool = False) -> str:
    """The projector kind a job (its `align` section, `fusion.kind`, its number of teachers) trains
    for one teacher of KV geometry `t_geom`: `resolve_kind` with the job's arguments, the one rule
    the Distiller, the planner and Tune's inert-dimension check share. `fit` only where it can serve
    (`fit_allowed`) and not when FSDP2 shards the student (`sharded`, `RayConfig.sharded`: fit fills
    its maps on rank 0 and broadcasts them; FSDP2 shards them). copied: `plans.copied_from_teacher`;
    aligned: another tokenizer."""
    return resolve_kind(align.projector.kind, align.mode, t_geom.num_kv_heads, t_geom.head_dim,
                        s_geom.num_kv_heads, s_geom.head_dim,
                        fit_allowed(fusion_kind, n_teachers, aligned) and not sharded, copied=copied)


def fit_allowed(fusion_kind: str, n_teachers: int, aligned: bool = False) -> bool:
    """Whether kind `fit` can serve a teacher: its KV loss is its own (one teacher, or fusion `sum`:
    a fused target lives in one space, fit's in each teacher's) and it shares the student's
    tokenizer (the fit is token by token)."""
    return not aligned and (fusion_kind == "sum" or n_teachers == 1)


def _init_linear(layer: nn.Linear) -> None:
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)


def _check_dims(**dims: int) -> None:
    for name, value in dims.items():
        if int(value) < 1:
            raise KavaError(f"{name} must be >= 1, got {value}")


def _check_head_proj(head_proj: str) -> None:
    if head_proj not in HEAD_PROJS:
        raise KavaError(f"unknown head_proj {head_proj!r} (expected one of {', '.join(HEAD_PROJS)})")


class ElasticBottleneck(nn.Module):
    """LayerNorm(d_in) -> Linear(d_in, d_in*mlp_ratio) -> SiLU -> Dropout -> Linear(-> d_out).

    Xavier-uniform weights, zero biases. [..., d_in] -> [..., d_out].
    """

    def __init__(self, d_in: int, d_out: int, mlp_ratio: float = 1.0, dropout: float = 0.1):
        super().__init__()
        _check_dims(d_in=d_in, d_out=d_out)
        if not mlp_ratio > 0:
            raise KavaError(f"mlp_ratio must be > 0, got {mlp_ratio}")
        if not 0 <= dropout < 1:
            raise KavaError(f"dropout must be in [0, 1), got {dropout}")
        hidden = int(d_in * mlp_ratio)
        if hidden < 1:
            raise KavaError(f"mlp_ratio={mlp_ratio} gives an empty hidden layer for d_in={d_in}")
        self.net = nn.Sequential(
            nn.LayerNorm(d_in),
            nn.Linear(d_in, hidden),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, d_out),
        )
        _init_linear(self.net[1])
        _init_linear(self.net[4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LinearProjector(nn.Module):
    """One nn.Linear(d_in, d_out) with Xavier-uniform weight and zero bias."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        _check_dims(d_in=d_in, d_out=d_out)
        self.linear = nn.Linear(d_in, d_out)
        _init_linear(self.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def make_projector(kind: str, d_in: int, d_out: int, mlp_ratio: float = 1.0, dropout: float = 0.1) -> nn.Module:
    """`elastic` -> ElasticBottleneck, `linear` -> LinearProjector (mlp_ratio/dropout unused)."""
    if kind == "elastic":
        return ElasticBottleneck(d_in, d_out, mlp_ratio, dropout)
    if kind == "linear":
        return LinearProjector(d_in, d_out)
    raise KavaError(f"unknown projector kind {kind!r} (expected one of {', '.join(PROJECTOR_KINDS)})")


def num_parameters(module: nn.Module) -> int:
    """Number of trainable parameters (works for modules on the meta device too)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def block_head_mix(h_in: int, h_out: int) -> torch.Tensor:
    """[h_out, h_in] matrix, rows summing to 1: output head j averages its contiguous block of input
    heads (with h_out > h_in, copies input head floor(j * h_in / h_out))."""
    mix = torch.zeros(h_out, h_in)
    for j in range(h_out):
        lo = j * h_in // h_out
        hi = max((j + 1) * h_in // h_out, lo + 1)
        mix[j, lo:hi] = 1.0 / (hi - lo)
    return mix


class PerHeadLinear(nn.Module):
    """H independent Linear(d_in, d_out) maps, head h applied to head h: [..., H, T, d_in] -> [..., H, T, d_out].

    One batched weight [H, d_in, d_out] applied by one einsum; each head initialised like a LinearProjector."""

    def __init__(self, heads: int, d_in: int, d_out: int):
        super().__init__()
        _check_dims(heads=heads, d_in=d_in, d_out=d_out)
        self.weight = nn.Parameter(torch.empty(heads, d_in, d_out))  # [H, D_in, D_out]
        self.bias = nn.Parameter(torch.zeros(heads, d_out))  # [H, D_out]
        for w in self.weight:  # per head: fan_in d_in, fan_out d_out (a 3-D xavier would fold H in)
            nn.init.xavier_uniform_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.einsum("...htd,hde->...hte", x, self.weight)  # [..., H, T, D_out]
        return out + self.bias[:, None, :]  # bias [H, 1, D_out] broadcast over T


class PerHeadElastic(nn.Module):
    """H independent ElasticBottlenecks, head h applied to head h: [..., H, T, d_in] -> [..., H, T, d_out].

    A ModuleList looped over H, not batched weights: see docs/internals/core.md#projectors."""

    def __init__(self, heads: int, d_in: int, d_out: int, mlp_ratio: float = 1.0, dropout: float = 0.1):
        super().__init__()
        _check_dims(heads=heads, d_in=d_in, d_out=d_out)
        self.heads = nn.ModuleList(ElasticBottleneck(d_in, d_out, mlp_ratio, dropout) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # head h: [..., T, D_in] -> [..., T, D_out]; stacked back on the head axis -> [..., H, T, D_out]
        return torch.stack([proj(x[..., h, :, :]) for h, proj in enumerate(self.heads)], dim=-3)


def make_head_projector(kind: str, heads: int, d_in: int, d_out: int, mlp_ratio: float = 1.0,
                        dropout: float = 0.1) -> nn.Module:
    """One projector per head (H times `make_projector`'s parameters): `elastic` -> PerHeadElastic, `linear` ->
    PerHeadLinear."""
    if kind == "elastic":
        return PerHeadElastic(heads, d_in, d_out, mlp_ratio, dropout)
    if kind == "linear":
        return PerHeadLinear(heads, d_in, d_out)
    raise KavaError(f"unknown projector kind {kind!r} (expected one of {', '.join(PROJECTOR_KINDS)})")


def matmul_weights(module: nn.Module) -> list[nn.Parameter]:
    """The weights a module's matmuls read (nn.Linear and PerHeadLinear): the planner counts their autocast copies."""
    out = []
    for m in module.modules():
        if isinstance(m, (nn.Linear, PerHeadLinear)):
            out.append(m.weight)
    return out


class HeadwiseProjector(nn.Module):
    """Mix kv heads H_t -> H_s with a learnable [H_s, H_t] matrix (starts `block_head_mix`), then project head_dim
    D_t -> D_s: [..., H_t, T, D_t] -> [..., H_s, T, D_s].

    head_proj `shared`: one projector for every student head (older checkpoints' layout);
    `per_head`: one per student head, H_s times the parameters, with state_dict keys the shared
    layout never loads into.
    """

    def __init__(
        self,
        h_in: int,
        d_in: int,
        h_out: int,
        d_out: int,
        kind: str = "linear",
        mlp_ratio: float = 1.0,
        dropout: float = 0.1,
        head_proj: str = "shared",
    ):
        super().__init__()
        _check_dims(h_in=h_in, d_in=d_in, h_out=h_out, d_out=d_out)
        _check_head_proj(head_proj)
        self.head_proj = head_proj
        self.mix = nn.Parameter(block_head_mix(h_in, h_out))  # [H_s, H_t]
        if head_proj == "shared":
            self.proj = make_projector(kind, d_in, d_out, mlp_ratio, dropout)  # [..., D_t] -> [..., D_s]
        else:
            self.proj = make_head_projector(kind, h_out, d_in, d_out, mlp_ratio, dropout)  # one per head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("sh,...htd->...std", self.mix, x)  # [..., H_s, T, D_t]
        return self.proj(mixed)  # [..., H_s, T, D_s]


def affine_per_layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, heads: int,
                     head_dim: int) -> torch.Tensor:
    """[L, B, H, T, D] -> [L, B, heads, T, head_dim]: per layer i, each token's features (heads flattened, H*D)
    times weight[i] [H*D, heads*head_dim] plus bias[i] -- a `StudentMap`, and `probe.KVAlignment`'s probe."""
    L, B, H, T, D = x.shape
    flat = x.permute(0, 1, 3, 2, 4).reshape(L, B * T, H * D).to(weight.dtype)  # [L, N, F_in]
    out = torch.baddbmm(bias[:, None, :], flat, weight)  # [L, N, F_out]
    return out.reshape(L, B, T, heads, head_dim).permute(0, 1, 3, 2, 4)


class StudentMap(nn.Module):
    """The student-side map of projector kind `fit` (FitNets / TinyBERT / Minitron put the learned map on the
    student's side, against a fixed teacher target): per student layer, one affine map of its KV (heads flattened)
    into its teacher layer's, [L_s, B, H_s, T, D_s] -> [L_s, B, H_t, T, D_t].

    It starts as the ridge fit of `probe.KVAlignment.fit` (`load_fit`, before training: the best
    linear image of the student in the teacher's space, so the loss's gradient pulls the student
    toward its teacher from step 1), then stays frozen (`trainable` False) or trains at the
    student's learning rate. `fitted` (a buffer, saved with the checkpoint) is 0 until then: a
    resumed run is not fitted again."""

    def __init__(self, layers: int, s_heads: int, s_head_dim: int, t_heads: int, t_head_dim: int,
                 trainable: bool = False):
        super().__init__()
        _check_dims(layers=layers, s_heads=s_heads, s_head_dim=s_head_dim, t_heads=t_heads, t_head_dim=t_head_dim)
        self.t_heads, self.t_head_dim = int(t_heads), int(t_head_dim)
        f_s, f_t = s_heads * s_head_dim, t_heads * t_head_dim
        self.weight = nn.Parameter(torch.zeros(layers, f_s, f_t), requires_grad=trainable)  # [L_s, F_s, F_t]
        self.bias = nn.Parameter(torch.zeros(layers, f_t), requires_grad=trainable)  # [L_s, F_t]
        self.register_buffer("fitted", torch.zeros(()))

    @torch.no_grad()
    def load_fit(self, maps: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """maps: per student layer (W [F_s, F_t], b [F_t]), as `probe.KVAlignment.maps[k or v]` holds them."""
        if len(maps) != self.weight.shape[0]:
            raise KavaError(f"fit: {len(maps)} layer maps for {self.weight.shape[0]} student layers")
        for i, (w, b) in enumerate(maps):
            self.weight[i].copy_(w.to(self.weight.dtype))
            self.bias[i].copy_(b.to(self.bias.dtype))
        self.fitted.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [L_s, B, H_s, T, D_s] -> [L_s, B, H_t, T, D_t]
        return affine_per_layer(x, self.weight, self.bias, self.t_heads, self.t_head_dim)


def _check_identity(mode: str, t_heads: int, t_head_dim: int, s_heads: int, s_head_dim: int) -> None:
    if mode != "structured":
        raise KavaError("align.projector.kind: identity needs align.mode: structured (flat mixes every layer)")
    if (t_heads, t_head_dim) != (s_heads, s_head_dim):
        raise KavaError(f"align.projector.kind: identity needs the teacher's KV geometry per layer: teacher "
                        f"{t_heads} heads x {t_head_dim}, student {s_heads} x {s_head_dim} "
                        f"(use auto, linear or elastic)")


class TeacherProjector(nn.Module):
    """The K and V projectors of one teacher: keys, values [len(teacher_layers), B, H_t, T, D_t] (the shipped
    layers, in `teacher_layers` order) -> (k_s, v_s), each [L_s, B, H_s, T, D_s].

    mode `flat` (aggregation concat | mean | weighted; the layer map only picks the shipped layers)
    or `structured` (`head_proj` shared | per_head; flat ignores it). See
    docs/internals/core.md#projectors.
    """

    def __init__(
        self,
        teacher_layers: list[int],
        t_heads: int,
        t_head_dim: int,
        s_layers: int,
        s_heads: int,
        s_head_dim: int,
        layer_map: LayerMap,
        mode: str = "flat",
        aggregation: str = "concat",
        kind: str = "elastic",
        mlp_ratio: float = 1.0,
        dropout: float = 0.1,
        head_proj: str = "shared",
        train_map: bool = False,
    ):
        super().__init__()
        _check_dims(t_heads=t_heads, t_head_dim=t_head_dim, s_layers=s_layers, s_heads=s_heads, s_head_dim=s_head_dim)
        if mode not in MODES:
            raise KavaError(f"unknown projector mode {mode!r} (expected one of {', '.join(MODES)})")
        if kind == "auto":  # it depends on the job (the student's provenance, fusion, strategy): `job_kind`
            raise KavaError("TeacherProjector: kind auto must be resolved first (projectors.job_kind)")
        if kind == "identity":
            _check_identity(mode, t_heads, t_head_dim, s_heads, s_head_dim)
        if kind == "fit" and mode != "structured":
            raise KavaError("align.projector.kind: fit needs align.mode: structured (one map per student layer)")
        if kind not in PROJECTOR_KINDS:
            raise KavaError(f"unknown projector kind {kind!r} (expected one of {', '.join(PROJECTOR_KINDS)})")
        _check_head_proj(head_proj)
        self.teacher_layers = [int(t) for t in teacher_layers]
        if not self.teacher_layers:
            raise KavaError("teacher_layers is empty: the teacher ships no layers")
        if len(set(self.teacher_layers)) != len(self.teacher_layers):
            raise KavaError(f"teacher_layers has duplicates: {self.teacher_layers}")
        n_teacher = max(self.teacher_layers) + 1
        self.layer_map = validate_layer_map(layer_map, n_teacher, s_layers)
        pos = {t: i for i, t in enumerate(self.teacher_layers)}
        for s, pairs in self.layer_map:
            for t, _ in pairs:
                if t not in pos:
                    raise KavaError(f"layer map uses teacher layer {t} (student layer {s}) not in teacher_layers")
        self.mode, self.aggregation, self.kind = mode, aggregation, kind
        self.head_proj = head_proj if mode == "structured" else "shared"  # flat has no head axis to split
        self.t_heads, self.t_head_dim = int(t_heads), int(t_head_dim)
        self.s_layers, self.s_heads, self.s_head_dim = int(s_layers), int(s_heads), int(s_head_dim)
        n_sel = len(self.teacher_layers)

        if mode == "flat":
            if aggregation not in AGGREGATIONS:
                raise KavaError(f"unknown aggregation {aggregation!r} (expected one of {', '.join(AGGREGATIONS)})")
            per_layer = self.t_heads * self.t_head_dim
            d_in = n_sel * per_layer if aggregation == "concat" else per_layer
            d_out = self.s_layers * self.s_heads * self.s_head_dim
            self.k_proj = make_projector(kind, d_in, d_out, mlp_ratio, dropout)
            self.v_proj = make_projector(kind, d_in, d_out, mlp_ratio, dropout)
            if aggregation == "weighted":
                self.k_layer_logits = nn.Parameter(torch.zeros(n_sel))
                self.v_layer_logits = nn.Parameter(torch.zeros(n_sel))
        elif kind == "fit":
            # the target: each student layer's heaviest mapped teacher layer as the teacher computed it
            self.target_pos = [pos[t] for t in heaviest_sources(self.layer_map)]
            self.k_map = StudentMap(self.s_layers, s_heads, s_head_dim, t_heads, t_head_dim, train_map)
            self.v_map = StudentMap(self.s_layers, s_heads, s_head_dim, t_heads, t_head_dim, train_map)
        else:
            # positions (into the shipped layers) and initial weights of each student layer's sources
            self._sources = [[pos[t] for t, _ in pairs] for _, pairs in self.layer_map]
            init = [torch.tensor([w for _, w in pairs]) for _, pairs in self.layer_map]
            learned = kind != "identity"  # identity: the mapped teacher layers as they are, nothing trained
            self.k_layer_weights = nn.ParameterList([nn.Parameter(w.clone(), requires_grad=learned) for w in init])
            self.v_layer_weights = nn.ParameterList([nn.Parameter(w.clone(), requires_grad=learned) for w in init])

            def bank() -> nn.ModuleList:
                if not learned:
                    return nn.ModuleList(nn.Identity() for _ in range(self.s_layers))
                return nn.ModuleList(
                    HeadwiseProjector(t_heads, t_head_dim, s_heads, s_head_dim, kind, mlp_ratio, dropout, head_proj)
                    for _ in range(self.s_layers)
                )

            self.k_heads = bank()
            self.v_heads = bank()

    @property
    def student_layout(self) -> tuple[int, int, int]:
        """(L_s, H_s, D_s): outputs are [L_s, B, H_s, T, D_s] (kind fit: [L_s, B, H_t, T, D_t], the teacher's)."""
        return self.s_layers, self.s_heads, self.s_head_dim

    @property
    def student_side(self) -> bool:
        """Kind `fit`: `forward` returns the teacher's own KV and `map_student` moves the student's into its space."""
        return self.kind == "fit"

    def map_student(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kind fit: the student's (keys, values) [L_s, B, H_s, T, D_s] -> the teacher's space [L_s, B, H_t, T, D_t]."""
        return self.k_map(keys), self.v_map(values)

    def num_parameters(self) -> int:
        """Trainable parameters of the K and V projectors together."""
        return num_parameters(self)

    def _check_input(self, x: torch.Tensor, name: str) -> None:
        want = (len(self.teacher_layers), self.t_heads, self.t_head_dim)
        if x.dim() != 5 or (x.shape[0], x.shape[2], x.shape[4]) != want:
            raise KavaError(
                f"{name} must be [L={want[0]}, B, H={want[1]}, T, D={want[2]}] (shipped teacher layers), "
                f"got {tuple(x.shape)}"
            )

    def _flat(self, x: torch.Tensor, proj: nn.Module, logits: torch.Tensor | None) -> torch.Tensor:
        L, B, H, T, D = x.shape
        x = x.permute(1, 3, 0, 2, 4)  # [B, T, L_sel, H_t, D_t]
        if self.aggregation == "concat":
            feat = x.reshape(B, T, L * H * D)
        elif self.aggregation == "mean":
            feat = x.mean(dim=2).reshape(B, T, H * D)
        else:
            w = torch.softmax(logits, dim=0)  # [L_sel]
            feat = torch.einsum("l,btlhd->bthd", w, x).reshape(B, T, H * D)
        out = proj(feat).view(B, T, self.s_layers, self.s_heads, self.s_head_dim)
        return out.permute(2, 0, 3, 1, 4)  # [L_s, B, H_s, T, D_s]

    def _structured(self, x: torch.Tensor, weights: nn.ParameterList, heads: nn.ModuleList) -> torch.Tensor:
        outs = []
        for src, w, head in zip(self._sources, weights, heads):
            combined = torch.einsum("l,lbhtd->bhtd", w, x[src])  # [B, H_t, T, D_t]
            outs.append(head(combined))  # [B, H_s, T, D_s]
        return torch.stack(outs)  # [L_s, B, H_s, T, D_s]

    def forward(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_input(keys, "keys")
        self._check_input(values, "values")
        dtype = next(self.parameters()).dtype
        keys, values = keys.to(dtype), values.to(dtype)
        if self.kind == "fit":  # the target is the teacher's KV itself; the map is on the student's side
            return keys[self.target_pos], values[self.target_pos]  # [L_s, B, H_t, T, D_t]
        if self.mode == "flat":
            weighted = self.aggregation == "weighted"
            k = self._flat(keys, self.k_proj, self.k_layer_logits if weighted else None)
            v = self._flat(values, self.v_proj, self.v_layer_logits if weighted else None)
        else:
            k = self._structured(keys, self.k_layer_weights, self.k_heads)
            v = self._structured(values, self.v_layer_weights, self.v_heads)
        return k, v
