"""Teacher plans and the logit rules: what a job's student side consumes of its teachers, without Ray.

Each function takes the config sections it reads (`loss`, `student`, `teachers`, `align`,
`onpolicy`), as torchtune builds each component from its own section: the caller holds the
`JobConfig`.

`teacher_plans` builds a `TeacherPlan` per teacher from the geometries it reports (running actors, a
KV cache, or in process); the logit rules say which teachers train the student's logits and with how
many top-k ids. The Distiller, the train worker, evaluation and the benches read these;
`kava_ray.runtime.job` adds Ray. The job's data splits are `kava_ray.data.splits` (core and data
import nothing of each other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from huggingface_hub import constants

from kava_ray.common.config import AlignConfig, LossConfig, OnPolicyConfig, StudentConfig, TeacherConfig, ships_kv
from kava_ray.common.errors import KavaError
from kava_ray.common.files import default_cache_dir
from kava_ray.common.fingerprints import tokenizer_fingerprint
from kava_ray.core.align.layers import LayerMap, plan_teacher_layers
from kava_ray.core.align.vocab import cached_vocab_map
from kava_ray.core.logit_kd import LogitTeacher
from kava_ray.core.models import KVGeometry, copied_from, kv_geometry, load_model_config, load_tokenizer, resolve_model


@dataclass
class TeacherPlan:
    """One teacher as the student sees it: its geometry, the layer map and the layers it ships.

    `tokenizer`: None when it shares the student's tokenizer (positions one to one); else where the
    student side loads it from (its model, or the KV cache's copy) to align positions by characters
    (`data.alignment`), checked against `tokenizer_fingerprint`, what the teacher reports. `copied`:
    the student was copied from this teacher (`copied_from_teacher`), so `align.projector.kind:
    auto` may compare their KV directly (identity)."""

    name: str
    geometry: KVGeometry
    layer_map: LayerMap
    layers: list[int]
    tokenizer: Optional[str] = None
    tokenizer_fingerprint: Optional[str] = None
    copied: bool = False

    @property
    def aligned(self) -> bool:
        """True when this teacher's positions are mapped across tokenizers (not one to one)."""
        return self.tokenizer is not None


def logits_top_k(loss: LossConfig) -> int:
    """The top-k every KVFeed of the job asks for: `loss.logit_top_k` when `loss.logit_weight` > 0, else 0."""
    weight = float(getattr(loss, "logit_weight", 0.0) or 0.0)
    return int(getattr(loss, "logit_top_k", 64)) if weight > 0 else 0


def wants_hidden(loss: LossConfig) -> bool:
    """Whether the job's teachers serve their layers' hidden states too (`loss.hidden_weight` > 0)."""
    return float(getattr(loss, "hidden_weight", 0.0) or 0.0) > 0


def token_logprob_teachers(onpolicy: Optional[OnPolicyConfig], plans: dict[str, "TeacherPlan"]) -> list[str]:
    """Teachers that also serve each next token's log-prob: those of the student's tokenizer, when
    the student samples (`onpolicy`): the sampled reverse KL and its metric read them."""
    o = onpolicy
    if o is None or o.fraction == 0 or o.source != "student":
        return []
    return [n for n, p in plans.items() if not p.aligned]


def cross_vocab(loss: LossConfig) -> str:
    """How teachers of another tokenizer train the student's logits: "hybrid", "uld" or "off"."""
    return getattr(loss, "logit_cross_vocab", "off")


def logit_teachers(loss: LossConfig, plans: dict[str, "TeacherPlan"]) -> list[str]:
    """Teachers whose logits train the student: its tokenizer's, and the others' unless logit_cross_vocab=off."""
    across = cross_vocab(loss) != "off"
    return [n for n, p in plans.items() if across or not p.aligned]


def check_vocab(loss: LossConfig, plans: dict[str, "TeacherPlan"]) -> None:
    """When the job asks for teacher logits, at least one teacher must give them (a `logit_teachers`
    entry, its LM head of any size: docs/internals/core.md#plans); else one KavaError line."""
    if not logits_top_k(loss):
        return
    usable = logit_teachers(loss, plans)
    if not usable:
        raise KavaError(f"loss.logit_weight={loss.logit_weight} needs teacher logits, but no teacher shares "
                        f"the student's tokenizer and loss.logit_cross_vocab=off ({', '.join(plans)} are aligned by "
                        f"characters, KV only); set loss.logit_cross_vocab=hybrid (or uld), or loss.logit_weight=0")


def shares_tokenizer_here(student: StudentConfig, teacher: TeacherConfig,
                          student_fp: Optional[str] = None) -> Optional[bool]:
    """Whether `teacher` tokenizes as the student (the fingerprint its actor will report:
    `teacher_plans`), read in the driver before any teacher starts. None where its tokenizer is not
    at hand here without the network (a hub id while online, a path only another node has, a package
    not installed): the teachers' own report decides then."""
    spec = teacher.served_from()
    try:
        source, gguf = resolve_model(spec)
    except KavaError:
        return None
    if gguf is None and not os.path.isdir(source) and not constants.HF_HUB_OFFLINE:
        return None  # a hub id, online: the loader's (it may wait on the network for minutes)
    try:
        fp = tokenizer_fingerprint(load_tokenizer(spec))
    except (KavaError, OSError, ValueError):
        return None
    return fp == (student_fp or student_tokenizer(student)[1])


def onpolicy_writer(onpolicy: OnPolicyConfig, teachers: list[TeacherConfig]) -> str:
    """The teacher that writes completions with `onpolicy.source: teacher`: `onpolicy.teacher`, else the first."""
    return onpolicy.teacher or teachers[0].name


def check_writer(onpolicy: OnPolicyConfig, teachers: list[TeacherConfig], shares_tokenizer: Optional[bool]) -> None:
    """`onpolicy.source: teacher` needs a writer of the student's tokenizer (its ids are the
    student's): one line when it is known to have another (the driver's `shares_tokenizer_here`
    before Ray, or its plan once it runs)."""
    if shares_tokenizer is False:
        raise KavaError(f"onpolicy.source: teacher needs a teacher of the student's tokenizer; "
                        f"'{onpolicy_writer(onpolicy, teachers)}' has another (set onpolicy.teacher to one that "
                        f"shares it)")


def teacher_logits_top_k(loss: LossConfig, plans: dict[str, "TeacherPlan"]) -> dict[str, int]:
    """{teacher: top-k to ask it for}: `logits_top_k(loss)` for the `logit_teachers`, 0 (no wasted work) else."""
    k, usable = logits_top_k(loss), set(logit_teachers(loss, plans))
    return {n: (k if n in usable else 0) for n in plans}


def vocab_maps(loss: LossConfig, student: StudentConfig, plans: dict[str, "TeacherPlan"], student_tok,
               teacher_toks: dict) -> dict:
    """{teacher: `align.vocab.VocabMap`} for the logit teachers of another tokenizer (none when the
    job takes no logits or `loss.logit_cross_vocab` is off). Read from beside the teacher's
    tokenizer (a KV cache keeps one there) or the kava-ray cache (`<cache>/vocab_maps/`), else built
    (1-4 s for 50k-150k vocabularies) and saved there."""
    if not logits_top_k(loss) or cross_vocab(loss) == "off":
        return {}
    s_fp, s_vocab = tokenizer_fingerprint(student_tok), student_geometry(student).vocab_size
    out = {}
    for n, tok in teacher_toks.items():
        p = plans[n]
        beside = (Path(p.tokenizer),) if _is_local_dir(p.tokenizer) else ()
        out[n] = cached_vocab_map(student_tok, tok, p.tokenizer_fingerprint or tokenizer_fingerprint(tok), s_fp,
                                  default_cache_dir() / "vocab_maps", beside, p.geometry.vocab_size, s_vocab)
    return out


def cross_vocab_lines(loss: LossConfig, student: StudentConfig, plans: dict[str, "TeacherPlan"]) -> list[str]:
    """One status line per teacher whose logits cross vocabularies: the loss, and its vocabulary
    map's coverage (built here once, so the workers of this node read it from the cache)."""
    if not logits_top_k(loss) or cross_vocab(loss) == "off" or not any(p.aligned for p in plans.values()):
        return []
    toks = teacher_tokenizers(plans)
    maps = vocab_maps(loss, student, plans, student_tokenizer(student)[0], toks)
    return [f"logits: teacher '{n}' (another tokenizer) by {cross_vocab(loss)} at the positions where both have read "
            f"the same text; {m.summary()}" for n, m in maps.items()]


def logit_specs(loss: LossConfig, plans: dict[str, "TeacherPlan"], maps: Optional[dict] = None) -> dict:
    """{teacher: `logit_kd.LogitTeacher`} for the `logit_teachers`; `maps`: `vocab_maps` (needed for hybrid)."""
    out = {}
    for n in logit_teachers(loss, plans):
        if not plans[n].aligned:
            v = plans[n].geometry.vocab_size
            out[n] = LogitTeacher(n, vocab_size=None if v is None else int(v))
        elif (maps or {}).get(n) is not None:
            out[n] = LogitTeacher.across(n, cross_vocab(loss), maps[n], loss.logit_hybrid_matched_weight)
        elif cross_vocab(loss) == "uld":  # needs no map (top-1 agreement then counts no match)
            out[n] = LogitTeacher(n, "uld")
        else:
            raise KavaError(f"teacher '{n}' uses another tokenizer: loss.logit_cross_vocab=hybrid needs its vocabulary "
                            f"map (plans.vocab_maps)")
    return out


def student_geometry(student: StudentConfig) -> KVGeometry:
    return kv_geometry(load_model_config(student.model, keep=student.keep_layers))


def student_tokenizer(student: StudentConfig):
    tok = load_tokenizer(student.model)
    return tok, tokenizer_fingerprint(tok)


def teacher_plans(student: StudentConfig, teachers: list[TeacherConfig], align: AlignConfig,
                  teacher_geoms: dict[str, dict], s_geom: KVGeometry, student_fp: Optional[str] = None,
                  tokenizer_dirs: Optional[dict[str, str]] = None) -> dict[str, TeacherPlan]:
    """Layer map + shipped layers per teacher, from the geometries the teachers report, and how each
    one's positions meet the student's: one to one (same tokenizer fingerprint as `student_fp`,
    default the student's) or aligned by characters (its tokenizer loaded from
    `tokenizer_dirs[name]`, else its model)."""
    if student_fp is None:
        student_fp = student_tokenizer(student)[1]
    ships = ships_kv(teachers)
    plans = {}
    for t in teachers:
        geom = teacher_geoms[t.name]
        g = KVGeometry.from_dict(geom)
        layer_map, shipped = layer_plan(align, student, t, g.num_layers, s_geom.num_layers) if ships else ([], [])
        fp = geom.get("tokenizer_fingerprint")
        tokenizer = None
        if fp is not None and fp != student_fp:
            tokenizer = (tokenizer_dirs or {}).get(t.name) or t.served_from()
        plans[t.name] = TeacherPlan(t.name, g, layer_map, shipped, tokenizer, fp, copied_from_teacher(student, t))
    return plans


def layer_plan(align: AlignConfig, student: StudentConfig, teacher: TeacherConfig, n_teacher: int, n_student: int
               ) -> tuple[LayerMap, list[int]]:
    """(layer map, teacher layers to ship) of one teacher: `align.layer_map`, where `auto` is
    identity for a student copied from this teacher by keep_layers (`copied_layers`) and ratio
    otherwise. Only for a job whose teachers ship KV (`ships_kv`; none does beside a teacher on
    vLLM)."""
    kind, sources = align.layer_map, copied_layers(student, teacher)
    if kind == "auto":
        kind = "identity" if sources is not None else "ratio"
    return plan_teacher_layers(kind, n_teacher, n_student, mode=align.mode, selected=teacher.layers,
                               explicit=align.explicit_map, cka_path=align.cka_path, teacher=teacher.name,
                               sources=sources)


def copied_layers(student: StudentConfig, teacher: TeacherConfig) -> Optional[list[int]]:
    """The teacher layers the student's were copied from (`student.keep_layers` of this teacher's
    model, or a saved student's `models.copied_from`), else None. Such a pair shares its per-layer
    geometry: `align.layer_map: auto` is then identity, and KV compares without a projector
    (`core.probe`)."""
    keep, source = student.keep_layers, student.model
    if not keep:
        prov = copied_from(load_model_config(student.model)) if _is_local_dir(source) else None
        if prov is None:
            return None
        keep, source = prov["layers"], prov["model"]
    return list(keep) if teacher.model == source else None


def copied_from_teacher(student: StudentConfig, teacher: TeacherConfig) -> bool:
    """Whether the student starts as this teacher's own weights: layers copied from its model
    (`copied_layers`: `student.keep_layers`, or a saved copy's provenance) or that very model. Only
    then do the two share a KV basis, so `align.projector.kind: auto` makes the teacher's own KV the
    target (identity, `projectors.resolve_kind`); a student of the same geometry trained apart from
    the teacher (Qwen3's sizes, Qwen2.5-1.5B/3B) has its own."""
    return copied_layers(student, teacher) is not None or student.model == teacher.model


def _is_local_dir(spec: str) -> bool:
    return "://" not in spec and Path(spec).expanduser().is_dir()


def teacher_tokenizers(plans: dict[str, TeacherPlan]) -> dict:
    """{teacher: its tokenizer} for the teachers aligned by characters, loaded where the student
    tokenizes. One that differs from what the teacher reported (another revision) is refused: its
    positions would not index the KV."""
    out = {}
    for n, p in plans.items():
        if not p.aligned:
            continue
        tok = load_tokenizer(p.tokenizer)
        if p.tokenizer_fingerprint is not None and tokenizer_fingerprint(tok) != p.tokenizer_fingerprint:
            raise KavaError(f"teacher '{n}': the tokenizer loaded from {p.tokenizer} differs from the one the teacher "
                            f"uses (another revision?); its token positions would not match its KV")
        out[n] = tok
    return out


def plans_payload(plans: dict[str, TeacherPlan]) -> dict:
    """TeacherPlans as plain data (for a Train loop config or a Tune setup)."""
    return {n: {"geometry": p.geometry.to_dict(), "layer_map": p.layer_map, "layers": p.layers,
                "tokenizer": p.tokenizer, "tokenizer_fingerprint": p.tokenizer_fingerprint, "copied": p.copied}
            for n, p in plans.items()}


def plans_from_payload(payload: dict) -> dict[str, TeacherPlan]:
    return {n: TeacherPlan(n, KVGeometry.from_dict(p["geometry"]),
                           [(s, [tuple(x) for x in pairs]) for s, pairs in p["layer_map"]], p["layers"],
                           p.get("tokenizer"), p.get("tokenizer_fingerprint"), bool(p.get("copied", False)))
            for n, p in payload.items()}
