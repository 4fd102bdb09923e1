"""Teacher plans, the logit rules, splits and seeds: what a job's student side consumes, without Ray.

`teacher_plans` builds a `TeacherPlan` per teacher from the geometries it reports (running actors, a KV cache,
or in process); the logit rules say which teachers train the student's logits and with how many top-k ids; the
split loaders give the train, validation and test splits with every aligned teacher's view. The Distiller, the
train worker, evaluation and the benches read these; `kava_ray.runtime.job` adds Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from huggingface_hub import constants

from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.common.files import default_cache_dir
from kava_ray.common.fingerprints import tokenizer_fingerprint
from kava_ray.core.align.layers import LayerMap, plan_teacher_layers
from kava_ray.core.align.vocab import cached_vocab_map
from kava_ray.core.logit_kd import LogitTeacher
from kava_ray.core.models import KVGeometry, _resolve, copied_from, kv_geometry, load_model_config, load_tokenizer
from kava_ray.data import BatchStream, TokenizedSplit, teacher_view, tokenize_split
from kava_ray.data.batching import ROUTE
from kava_ray.data.sources import load_records, source_fingerprint, source_path


@dataclass
class TeacherPlan:
    """One teacher as the student sees it: its geometry, the layer map and the layers it ships.

    `tokenizer`: None when it shares the student's tokenizer (positions one to one); else where the student side
    loads it from (its model, or the KV cache's copy) to align positions by characters (`data.alignment`),
    checked against `tokenizer_fingerprint`, what the teacher reports. `copied`: the student was copied from this
    teacher (`copied_from_teacher`), so `align.projector.kind: auto` may compare their KV directly (identity)."""

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


def logits_top_k(cfg: JobConfig) -> int:
    """The top-k every KVFeed of the job asks for: `loss.logit_top_k` when `loss.logit_weight` > 0, else 0."""
    weight = float(getattr(cfg.loss, "logit_weight", 0.0) or 0.0)
    return int(getattr(cfg.loss, "logit_top_k", 64)) if weight > 0 else 0


def wants_hidden(cfg: JobConfig) -> bool:
    """Whether the job's teachers serve their layers' hidden states too (`loss.hidden_weight` > 0)."""
    return float(getattr(cfg.loss, "hidden_weight", 0.0) or 0.0) > 0


def token_logprob_teachers(cfg: JobConfig, plans: dict[str, "TeacherPlan"]) -> list[str]:
    """Teachers that also serve each next token's log-prob: those of the student's tokenizer, when the student
    samples (`onpolicy`): the sampled reverse KL and its metric read them."""
    o = getattr(cfg, "onpolicy", None)
    if o is None or o.fraction == 0 or o.source != "student":
        return []
    return [n for n, p in plans.items() if not p.aligned]


def cross_vocab(cfg: JobConfig) -> str:
    """How teachers of another tokenizer train the student's logits: "hybrid", "uld" or "off"."""
    return getattr(cfg.loss, "logit_cross_vocab", "off")


def logit_teachers(cfg: JobConfig, plans: dict[str, "TeacherPlan"]) -> list[str]:
    """Teachers whose logits train the student: its tokenizer's, and the others' unless logit_cross_vocab=off."""
    across = cross_vocab(cfg) != "off"
    return [n for n, p in plans.items() if across or not p.aligned]


def check_vocab(cfg: JobConfig, plans: dict[str, "TeacherPlan"]) -> None:
    """When the job asks for teacher logits, at least one teacher must give them (a `logit_teachers` entry, its
    LM head of any size: docs/internals/core.md#plans); else one KavaError line."""
    if not logits_top_k(cfg):
        return
    usable = logit_teachers(cfg, plans)
    if not usable:
        raise KavaError(f"loss.logit_weight={cfg.loss.logit_weight} needs teacher logits, but no teacher shares the "
                        f"student's tokenizer and loss.logit_cross_vocab=off ({', '.join(plans)} are aligned by "
                        f"characters, KV only); set loss.logit_cross_vocab=hybrid (or uld), or loss.logit_weight=0")


def shares_tokenizer_here(cfg: JobConfig, teacher: str, student_fp: Optional[str] = None) -> Optional[bool]:
    """Whether `teacher` tokenizes as the student (the fingerprint its actor will report: `teacher_plans`), read in
    the driver before any teacher starts. None where its tokenizer is not at hand here without the network (a hub id
    while online, a path only another node has, a package not installed): the teachers' own report decides then."""
    spec = cfg.teacher(teacher).model
    try:
        source, gguf = _resolve(spec)
    except KavaError:
        return None
    if gguf is None and not os.path.isdir(source) and not constants.HF_HUB_OFFLINE:
        return None  # a hub id, online: the loader's (it may wait on the network for minutes)
    try:
        fp = tokenizer_fingerprint(load_tokenizer(spec))
    except (KavaError, OSError, ValueError):
        return None
    return fp == (student_fp or student_tokenizer(cfg)[1])


def onpolicy_writer(cfg: JobConfig) -> str:
    """The teacher that writes completions with `onpolicy.source: teacher`: `onpolicy.teacher`, else the first."""
    return cfg.onpolicy.teacher or cfg.teachers[0].name


def check_writer(cfg: JobConfig, shares_tokenizer: Optional[bool]) -> None:
    """`onpolicy.source: teacher` needs a writer of the student's tokenizer (its ids are the student's): one line
    when it is known to have another (the driver's `shares_tokenizer_here` before Ray, or its plan once it runs)."""
    if shares_tokenizer is False:
        raise KavaError(f"onpolicy.source: teacher needs a teacher of the student's tokenizer; "
                        f"'{onpolicy_writer(cfg)}' has another (set onpolicy.teacher to one that shares it)")


def check_routes(cfg: JobConfig, splits: dict[str, TokenizedSplit]) -> None:
    """Records that name their teacher (column `teacher`: `Batch.route`, read by the logit term) name one of the
    job's logit teachers (`logit_teachers`; the Distiller refuses any other mid-run): one line naming the split,
    row and name, before Ray starts. A teacher of another tokenizer counts as one unless loss.logit_cross_vocab=off,
    when it does only where its tokenizer is not at hand here (`shares_tokenizer_here`: None)."""
    if not logits_top_k(cfg):
        return  # no logit term: nothing reads the column
    names, across, student_fp = [t.name for t in cfg.teachers], cross_vocab(cfg) != "off", None
    logit_names = None
    for what, split in splits.items():
        if split.records is None or ROUTE not in split.records.column_names:
            continue
        if logit_names is None:
            if not across:
                student_fp = student_tokenizer(cfg)[1]
            logit_names = [n for n in names if across or shares_tokenizer_here(cfg, n, student_fp) is not False]
        for i, r in enumerate(split.records.select_columns([ROUTE])[ROUTE]):
            if r and r not in logit_names:
                why = (f" ('{r}' uses another tokenizer than the student's and loss.logit_cross_vocab=off)"
                       if r in names else "")
                raise KavaError(f"data.source {cfg.data.source}: row {i} of the {what} split names teacher {r!r} "
                                f"(column '{ROUTE}'), but the job's logit teachers are "
                                f"{', '.join(logit_names) or 'none'}{why}")


def teacher_logits_top_k(cfg: JobConfig, plans: dict[str, "TeacherPlan"]) -> dict[str, int]:
    """{teacher: top-k to ask it for}: `logits_top_k(cfg)` for the `logit_teachers`, 0 (no wasted work) else."""
    k, usable = logits_top_k(cfg), set(logit_teachers(cfg, plans))
    return {n: (k if n in usable else 0) for n in plans}


def vocab_maps(cfg: JobConfig, plans: dict[str, "TeacherPlan"], student_tok, teacher_toks: dict) -> dict:
    """{teacher: `align.vocab.VocabMap`} for the logit teachers of another tokenizer (none when the job takes no
    logits or `loss.logit_cross_vocab` is off). Read from beside the teacher's tokenizer (a KV cache keeps one
    there) or the kava-ray cache (`<cache>/vocab_maps/`), else built (1-4 s for 50k-150k vocabularies) and
    saved there."""
    if not logits_top_k(cfg) or cross_vocab(cfg) == "off":
        return {}
    s_fp, s_vocab = tokenizer_fingerprint(student_tok), student_geometry(cfg).vocab_size
    out = {}
    for n, tok in teacher_toks.items():
        p = plans[n]
        beside = (Path(p.tokenizer),) if _is_local_dir(p.tokenizer) else ()
        out[n] = cached_vocab_map(student_tok, tok, p.tokenizer_fingerprint or tokenizer_fingerprint(tok), s_fp,
                                  default_cache_dir() / "vocab_maps", beside, p.geometry.vocab_size, s_vocab)
    return out


def cross_vocab_lines(cfg: JobConfig, plans: dict[str, "TeacherPlan"]) -> list[str]:
    """One status line per teacher whose logits cross vocabularies: the loss, and its vocabulary map's coverage
    (built here once, so the workers of this node read it from the cache)."""
    if not logits_top_k(cfg) or cross_vocab(cfg) == "off" or not any(p.aligned for p in plans.values()):
        return []
    toks = teacher_tokenizers(plans)
    maps = vocab_maps(cfg, plans, student_tokenizer(cfg)[0], toks)
    return [f"logits: teacher '{n}' (another tokenizer) by {cross_vocab(cfg)} at the positions where both have read "
            f"the same text; {m.summary()}" for n, m in maps.items()]


def logit_specs(cfg: JobConfig, plans: dict[str, "TeacherPlan"], maps: Optional[dict] = None) -> dict:
    """{teacher: `logit_kd.LogitTeacher`} for the `logit_teachers`; `maps`: `vocab_maps` (needed for hybrid)."""
    out = {}
    for n in logit_teachers(cfg, plans):
        if not plans[n].aligned:
            v = plans[n].geometry.vocab_size
            out[n] = LogitTeacher(n, vocab_size=None if v is None else int(v))
        elif (maps or {}).get(n) is not None:
            out[n] = LogitTeacher.across(n, cross_vocab(cfg), maps[n], cfg.loss.logit_hybrid_matched_weight)
        elif cross_vocab(cfg) == "uld":  # needs no map (top-1 agreement then counts no match)
            out[n] = LogitTeacher(n, "uld")
        else:
            raise KavaError(f"teacher '{n}' uses another tokenizer: loss.logit_cross_vocab=hybrid needs its vocabulary "
                            f"map (plans.vocab_maps)")
    return out


def student_geometry(cfg: JobConfig) -> KVGeometry:
    return kv_geometry(load_model_config(cfg.student.model, keep=cfg.student.keep_layers))


def student_tokenizer(cfg: JobConfig):
    tok = load_tokenizer(cfg.student.model)
    return tok, tokenizer_fingerprint(tok)


def teacher_plans(cfg: JobConfig, teacher_geoms: dict[str, dict], s_geom: KVGeometry,
                  student_fp: Optional[str] = None, tokenizer_dirs: Optional[dict[str, str]] = None
                  ) -> dict[str, TeacherPlan]:
    """Layer map + shipped layers per teacher, from the geometries the teachers report, and how each one's
    positions meet the student's: one to one (same tokenizer fingerprint as `student_fp`, default the
    student's) or aligned by characters (its tokenizer loaded from `tokenizer_dirs[name]`, else its model)."""
    if student_fp is None:
        student_fp = student_tokenizer(cfg)[1]
    plans = {}
    for t in cfg.teachers:
        geom = teacher_geoms[t.name]
        g = KVGeometry.from_dict(geom)
        layer_map, shipped = layer_plan(cfg, t.name, g.num_layers, s_geom.num_layers)
        fp = geom.get("tokenizer_fingerprint")
        tokenizer = None
        if fp is not None and fp != student_fp:
            tokenizer = (tokenizer_dirs or {}).get(t.name) or t.model
        plans[t.name] = TeacherPlan(t.name, g, layer_map, shipped, tokenizer, fp, copied_from_teacher(cfg, t.name))
    return plans


def layer_plan(cfg: JobConfig, teacher: str, n_teacher: int, n_student: int) -> tuple[LayerMap, list[int]]:
    """(layer map, teacher layers to ship) of one teacher: `align.layer_map`, where `auto` is identity for a
    student copied from this teacher by keep_layers (`copied_layers`) and ratio otherwise."""
    a = cfg.align
    kind, sources = a.layer_map, copied_layers(cfg, teacher)
    if kind == "auto":
        kind = "identity" if sources is not None else "ratio"
    return plan_teacher_layers(kind, n_teacher, n_student, mode=a.mode, selected=cfg.teacher(teacher).layers,
                               explicit=a.explicit_map, cka_path=a.cka_path, teacher=teacher,
                               sources=sources)


def copied_layers(cfg: JobConfig, teacher: str) -> Optional[list[int]]:
    """The teacher layers the student's were copied from (`student.keep_layers` of this teacher's model, or a saved
    student's `models.copied_from`), else None. Such a pair shares its per-layer geometry: `align.layer_map: auto`
    is then identity, and KV compares without a projector (`core.probe`)."""
    keep, source = cfg.student.keep_layers, cfg.student.model
    if not keep:
        prov = copied_from(load_model_config(cfg.student.model)) if _is_local_dir(source) else None
        if prov is None:
            return None
        keep, source = prov["layers"], prov["model"]
    return list(keep) if cfg.teacher(teacher).model == source else None


def copied_from_teacher(cfg: JobConfig, teacher: str) -> bool:
    """Whether the student starts as this teacher's own weights: layers copied from its model (`copied_layers`:
    `student.keep_layers`, or a saved copy's provenance) or that very model. Only then do the two share a KV basis,
    so `align.projector.kind: auto` makes the teacher's own KV the target (identity, `projectors.resolve_kind`); a
    student of the same geometry trained apart from the teacher (Qwen3's sizes, Qwen2.5-1.5B/3B) has its own."""
    return copied_layers(cfg, teacher) is not None or cfg.student.model == cfg.teacher(teacher).model


def _is_local_dir(spec: str) -> bool:
    return "://" not in spec and Path(spec).expanduser().is_dir()


def in_process_plans(cfg: JobConfig, models: dict) -> dict[str, TeacherPlan]:
    """Plans for teachers loaded in this process ({teacher: model}, e.g. `testing.InProcessSource`'s): the
    geometry and tokenizer fingerprint each would report as an actor."""
    geoms = {t.name: dict(kv_geometry(models[t.name]).to_dict(),
                          tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer(t.model)))
             for t in cfg.teachers}
    return teacher_plans(cfg, geoms, student_geometry(cfg))


def teacher_tokenizers(plans: dict[str, TeacherPlan]) -> dict:
    """{teacher: its tokenizer} for the teachers aligned by characters, loaded where the student tokenizes. One
    that differs from what the teacher reported (another revision) is refused: its positions would not index the KV."""
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


def data_cache_dir(cfg: JobConfig) -> Path:
    """Where tokenized splits are cached (Arrow): `data.cache_dir`, else $KAVA_RAY_CACHE or ~/.cache/kava-ray, /data."""
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir() / "data"


def split_records(cfg: JobConfig, split: str, n: Optional[int]):
    """The records of one split (`data.source`, `data.columns` applied): a `datasets.Dataset`."""
    d = cfg.data
    return load_records(d.source, split, n, d.seed, d.hub_config, d.columns)


def tokenize_records(cfg: JobConfig, tokenizer, records, source_id: str, with_text: bool, what: str) -> TokenizedSplit:
    """`tokenize_split` with the job's data settings; cached on disk unless the records live in memory."""
    d = cfg.data
    on_disk = bool(getattr(records, "cache_files", None))
    return tokenize_split(tokenizer, records, cfg.train.max_length, d.prompt_format, d.overlength, source_id,
                          fmt=d.format, packing=d.packing, with_text=with_text,
                          cache_dir=data_cache_dir(cfg) if on_disk else None, where=f"data source '{d.source}' {what}")


def one_source(cfg: JobConfig) -> bool:
    """True when the test split would read the training split's rows: one local file or directory with no
    `{split}` in its path (every split names it), or a hub dataset whose `test_split` is its `train_split`."""
    d = cfg.data
    if d.source == "synthetic":
        return False  # synthetic_split keeps train apart from the others by construction
    path = source_path(d.source, d.train_split)
    return path == source_path(d.source, d.test_split) if path is not None else d.train_split == d.test_split


CARVED_SHARE = 0.05  # a carved split whose data.num_val / num_test is null: this share of the source's records


def carved(cfg: JobConfig) -> bool:
    """Validation and test are cut from the training records: one source (`one_source`) without
    `data.allow_overlap`. Rows: the first `num_train` + `num_val` + `num_test` records (all of them when
    `num_train` is null); test = the last `num_test`, validation = the `num_val` before them, train = the rest.
    A null `num_val` / `num_test` (every record of a split's own file) is `CARVED_SHARE` here (`carved_counts`):
    "every record" of one file would leave nothing to train on."""
    return one_source(cfg) and not cfg.data.allow_overlap


def carved_counts(cfg: JobConfig, total: int) -> tuple[int, int]:
    """(validation, test) records carved from training records, `total` of them in the source: `data.num_val` /
    `data.num_test`, or where null `CARVED_SHARE` (at least one) of the records the job trains on: `num_train`
    when set (100 of a million-record file: 5 and 5, not 50,000 each), else `total`."""
    base = total if cfg.data.num_train is None else min(cfg.data.num_train, total)
    share = max(1, int(base * CARVED_SHARE))
    return tuple(share if n is None else n for n in (cfg.data.num_val, cfg.data.num_test))


def _carved_records(cfg: JobConfig):
    """(train, val, test) records of a carved source (`carved`); a source too small for the three is one line."""
    d = cfg.data
    # only the records the carve uses (a synthetic source needs a number; a short file gives what it has)
    want = None if d.num_train is None else d.num_train + sum(carved_counts(cfg, d.num_train))
    records = split_records(cfg, d.train_split, want)
    n_val, n_test = carved_counts(cfg, len(records))
    n = len(records) - n_val - n_test
    if n < 1:
        raise KavaError(f"data.source {d.source} has {len(records)} records: too few to carve {n_val} validation "
                        f"(data.num_val) and {n_test} test records (data.num_test) from one file and keep any for "
                        f"training (lower them, or give each split its own file with {{split}} in the path)")
    return (records.select(range(n)), records.select(range(n, n + n_val)),
            records.select(range(n + n_val, len(records))))


def load_splits(cfg: JobConfig, tokenizer, teacher_toks: Optional[dict] = None
                ) -> tuple[TokenizedSplit, TokenizedSplit]:
    """(train, val): validation is `data.val_split` when set, else the last `data.num_val` training records
    (`carved`: the records before the test rows).

    Validation drives evaluation, `train.checkpoint_score` and Tune (the test split is read only after training).
    `teacher_toks` (`teacher_tokenizers`): each split also carries those teachers' views (`TokenizedSplit.views`).
    """
    d = cfg.data
    base = source_fingerprint(d.source, d.train_split, d.num_train, d.seed, d.hub_config, d.columns)
    if carved(cfg):
        train, val, test = _carved_records(cfg)
        val_id = f"{base}|carved-val|n={len(val)}|test={len(test)}"
    elif d.val_split is not None:
        train = split_records(cfg, d.train_split, d.num_train)
        val = split_records(cfg, d.val_split, d.num_val)
        val_id = source_fingerprint(d.source, d.val_split, d.num_val, d.seed, d.hub_config, d.columns)
    else:  # validation: the last training records (a null num_val: `carved_counts`' share of them)
        if d.num_train is None:
            records = split_records(cfg, d.train_split, None)
            n_val = carved_counts(cfg, len(records))[0]
        else:
            n_val = carved_counts(cfg, d.num_train)[0]
            records = split_records(cfg, d.train_split, d.num_train + n_val)
        if len(records) <= n_val:
            raise KavaError(f"data '{d.source}' split {d.train_split!r} has {len(records)} examples: too few to carve "
                            f"{n_val} for validation (data.num_val) and keep any for training")
        n = len(records) - n_val
        train, val = records.select(range(n)), records.select(range(n, len(records)))
        val_id = f"{base}|val|n={n_val}"

    def split(records, source_id, what):
        out = tokenize_records(cfg, tokenizer, records, source_id, bool(teacher_toks), what)
        return with_views(out, cfg, teacher_toks)

    return (split(train, f"{base}|train|n={len(train)}", f"split {d.train_split!r}"),
            split(val, val_id, "(validation)"))


def with_views(split: TokenizedSplit, cfg: JobConfig, teacher_toks: Optional[dict]) -> TokenizedSplit:
    """Attach every character-aligned teacher's view of `split` (its token ids + the alignment)."""
    for name, tok in (teacher_toks or {}).items():
        split.views[name] = teacher_view(split, tok, cfg.data.prompt_format, cfg.train.max_length)
    return split


def test_records(cfg: JobConfig):
    """The test split's records (`data.test_split`, `data.num_test`; `carved`: the last rows of the one source)."""
    d = cfg.data
    return _carved_records(cfg)[2] if carved(cfg) else split_records(cfg, d.test_split, d.num_test)


def load_test_split(cfg: JobConfig, tokenizer, teacher_toks: Optional[dict] = None) -> TokenizedSplit:
    """The test split (`test_records`): for the end of a run and `kava-ray eval`."""
    d = cfg.data
    if carved(cfg):
        _, val, records = _carved_records(cfg)
        source_id = f"{source_fingerprint(d.source, d.train_split, d.num_train, d.seed, d.hub_config, d.columns)}" \
                    f"|carved-test|val={len(val)}|n={len(records)}"
        where = "(test)"
    else:
        records = test_records(cfg)
        source_id = source_fingerprint(d.source, d.test_split, d.num_test, d.seed, d.hub_config, d.columns)
        where = f"split {d.test_split!r}"
    split = tokenize_records(cfg, tokenizer, records, source_id, bool(teacher_toks), where)
    return with_views(split, cfg, teacher_toks)


def check_overlap(cfg: JobConfig) -> Optional[str]:
    """Refuse held-out splits that share records with the training split: the same rows read twice make the
    test CE a training figure. With `data.allow_overlap` the warning line instead; None when they share none.
    Records are compared whole (every field as loaded, `data.columns` applied): a carved source's repeated rows
    count too."""
    d = cfg.data
    if d.source == "synthetic":
        return None
    if carved(cfg):
        train, val, test = _carved_records(cfg)
        held = {"validation": val, "test": test}
    else:
        train = split_records(cfg, d.train_split, d.num_train)
        held = {"test": test_records(cfg)}
        if d.val_split is not None:
            held["validation"] = split_records(cfg, d.val_split, d.num_val)
    seen = {_row_hash(r) for r in train}
    shared = {k: (sum(_row_hash(r) in seen for r in rows), len(rows)) for k, rows in held.items()}
    what = " and ".join(f"{v} of {n} {k} records" for k, (v, n) in shared.items() if v)
    if not what:
        return None
    same = " (every split reads the same file)" if one_source(cfg) and not carved(cfg) else ""
    if d.allow_overlap:
        return f"warning: data.allow_overlap: {what} are also training records{same}: they are not held out"
    raise KavaError(f"data.source {d.source}: {what} are also training records{same}, so the held-out figures "
                    f"would be measured on training rows; remove them from the held-out split, or set "
                    f"data.allow_overlap: true to measure them anyway")


def _row_hash(row) -> str:
    return hashlib.sha1(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()


def prepare_data(cfg: JobConfig) -> dict:
    """Tokenize (and pack) the job's splits once in the driver, before any worker starts: a bad record deep in
    the data is one line before Ray starts, and workers load the cached Arrow files. Returns row counts (and the
    records' format)."""
    overlap = check_overlap(cfg)  # the same rows in a held-out split: refused (one line) unless allowed
    tok = load_tokenizer(cfg.student.model)
    train, val = load_splits(cfg, tok)
    test = load_test_split(cfg, tok)
    check_routes(cfg, {"training": train, "validation": val, "test": test})
    return {"train": len(train), "validation": len(val), "test": len(test), "carved": carved(cfg),
            "warning": overlap, "format": train.format}


def data_seed(cfg: JobConfig) -> int:
    """The seed every data stream is batched with: `train.data_seed`, else `train.seed`."""
    return cfg.train.seed if cfg.train.data_seed is None else cfg.train.data_seed


def eval_stream(split: TokenizedSplit, cfg: JobConfig, drop_last: bool = True):
    """The batches a held-out split is evaluated in (no bucketing: every run and the KV cache agree);
    drop_last=False: every row, the last batch short (`evaluate_heldout`: a figure over the whole split)."""
    return BatchStream(split, cfg.train.batch_size, data_seed(cfg), bucket=False, drop_last=drop_last)
