"""`kava-ray bench heal`: does it distil? A pruned student healed on natural text, with a positive
control, paired seeds and a decision rule fixed before the run.

The teacher's outputs cached once (and an NF4 twin's, for the NF4 arm), a gate (the teacher must
beat the pruned student), a shared CE warm start run until its held-out curve flattens (past the
logit-scale recalibration), the KV weights set from the gradient they give at that start
(`grad/kv_ratio`), then every arm (`ARMS`): its learning rate chosen from a small grid on seed 0 by
validation CE, the other seeds at that rate, scored on the test split with paired intervals against
the base arm. Each finished run is kept under OUT/runs/, so an interrupted bench re-run with the
same --out goes on where it stopped (and an added arm runs alone). The method step by step:
docs/internals/runtime.md#bench-heal.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

from kava_ray.bench.heal_onpolicy import OP_ARMS, OP_BASE, run_onpolicy_arms
from kava_ray.bench.inprocess import run_key, train_in_process
from kava_ray.bench.recipes import Scorer, plot_curves
from kava_ray.bench.stats import bracketed, fmt_interval, mean_sd, paired
from kava_ray.common.config import JobConfig, derive, load_config, parse_override
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_write, format_table, write_json
from kava_ray.core.models import load_model, load_student, load_tokenizer
from kava_ray.data.corpus import write_pydoc_corpus
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.recipes.evaluate import heldout_ce
from kava_ray.runtime.console import status
from kava_ray.runtime.job import job_session, kv_source, precompute, setup_teachers
from kava_ray.runtime.preflight import check_model_files


@dataclass(frozen=True)
class Arm:
    """One arm's loss: CE (weight 1, or 0 for the KV-only control), logit KD at `logit`, the KV loss
    (projector kind auto: none where the geometry allows) at the weight whose gradient on the
    student is `kv_ratio` x CE's at the warm start, the MiniLMv2 relation loss at `relation`,
    Minitron's hidden-state loss (`hidden`) at the weight that makes it as large as the logit loss
    at the warm start (Minitron's α = L_logits / L_is, fixed there); `other_batch`: the KV target is
    the teacher's KV of other training blocks (teacher information vs mere regularisation); `nf4`:
    the teacher loaded in NF4. `grid`: the learning rate is chosen from the grid (else the base
    arm's chosen rate is used)."""
    logit: float = 0.0
    kv_ratio: float = 0.0
    relation: float = 0.0
    ce: float = 1.0
    other_batch: bool = False
    nf4: bool = False
    hidden: bool = False
    grid: bool = True
    projector: str = "auto"  # align.projector.kind of the KV term (Run 2's width-pruned student: linear, fit, elastic)

    @property
    def variant(self) -> str:
        """The teacher cache the arm reads: "" (the fp32 teacher's), "nf4" or "hidden" (with hidden states)."""
        return "nf4" if self.nf4 else "hidden" if self.hidden else ""


ARMS: dict[str, Arm] = {  # in the order they run (what a cut-short bench has first)
    "ce": Arm(), "ce+logits": Arm(logit=1.0), "ce+kv": Arm(kv_ratio=1.0),
    "ce+kv-otherbatch": Arm(kv_ratio=1.0, other_batch=True), "ce+logits+kv": Arm(logit=1.0, kv_ratio=1.0),
    "ce+logits+kv-otherbatch": Arm(logit=1.0, kv_ratio=1.0, other_batch=True),
    # a student whose KV geometry differs from its teacher's (`--width-kv`): the KV through a real projector
    "ce+logits+kv-linear": Arm(logit=1.0, kv_ratio=1.0, projector="linear"),
    "ce+logits+kv-fit": Arm(logit=1.0, kv_ratio=1.0, projector="fit"),
    "ce+logits+kv-elastic": Arm(logit=1.0, kv_ratio=1.0, projector="elastic"),
    "ce+logits-nf4": Arm(logit=1.0, nf4=True), "kv-only": Arm(ce=0.0, kv_ratio=1.0, grid=False),
    "ce+kv-0.3": Arm(kv_ratio=0.3), "ce+logits+relation": Arm(logit=1.0, relation=1.0),
    "ce+logits+hidden": Arm(logit=1.0, hidden=True)}
# the arms of a width-pruned student (`--width-kv`: Run 2's real projector), and every other arm by default
WIDTH_ARMS = ("ce+logits", "ce+logits+kv-linear", "ce+logits+kv-fit", "ce+logits+kv-elastic")
DEFAULT_ARMS = tuple(a for a in ARMS if a not in WIDTH_ARMS[1:])
BASE, CONTROL, KV_CONTROL = "ce", "ce+logits", "kv-only"
MIN_NATS, MIN_GR = 0.05, 0.05  # an arm helps: its CE interval excludes 0 and it gains >= 0.05 nats or 5 GR points
# Run 2 (docs/results.md): does the KV route add anything beyond logits? (`kv_decision`)
KV_ARM, KV_OTHER = "ce+logits+kv", "ce+logits+kv-otherbatch"


def decision_rule(base: str = BASE) -> str:
    return (f"an arm helps when its paired test-CE difference against {base} has a 95 % interval that excludes 0 "
            f"and its mean gain is at least {MIN_NATS} nats or {100 * MIN_GR:.0f} points of gap recovered (GR)")


def kv_rule() -> str:
    return (f"KV helps when the 95 % interval of test CE ({KV_ARM} - {CONTROL}) lies below 0 with a mean <= "
            f"-{MIN_NATS} nats AND its control does not match it (the interval of {KV_ARM} - {KV_OTHER} lies below "
            f"0); no measurable effect when that interval lies inside +-{MIN_NATS} nats; else unsettled, with the "
            f"seeds a t-interval of the same spread would need to decide")


def seeds_needed(d: dict, margin: float = MIN_NATS, level: float = 0.95, most: int = 1000) -> Optional[int]:
    """The seeds a paired t-interval with this spread (`d`: `stats.paired`) needs to decide the KV
    rule: to fit inside +-margin around a mean inside it, or to exclude 0 with a mean beyond it
    (None: more than `most`)."""
    import statistics

    from kava_ray.bench.stats import t_quantile

    sd = statistics.stdev(d["diffs"]) if len(d["diffs"]) > 1 else 0.0
    room = margin - abs(d["mean"]) if abs(d["mean"]) < margin else abs(d["mean"])
    if sd == 0 or room <= 0:
        return None if room <= 0 else d["n"]
    for n in range(2, most + 1):
        if t_quantile(0.5 + level / 2, n - 1) * sd / n ** 0.5 < room:
            return n
    return None


def _kv_verdict(d: dict, control: Optional[dict] = None) -> str:
    """The KV rule on `d` (a KV arm - ce+logits, `stats.paired`): "helps" when its interval lies
    below 0 with a mean <= -MIN_NATS (and, given a `control`, that one's interval below 0 too); "no
    measurable effect" inside +-MIN_NATS; else "unsettled"."""
    if d["lo"] is None:
        return "unsettled"
    if d["hi"] < 0 and d["mean"] <= -MIN_NATS and (control is None or (control["hi"] is not None and
                                                                       control["hi"] < 0)):
        return "helps"
    return "no measurable effect" if -MIN_NATS < d["lo"] and d["hi"] < MIN_NATS else "unsettled"


def kv_decision(runs: dict) -> Optional[dict]:
    """Run 2's decisions (`kv_rule`), paired over the test seeds. Part A: ce+logits+kv against
    ce+logits, with its other-batch control, where all three ran. Part B: each projector arm of a
    width-pruned student (`WIDTH_ARMS`) against ce+logits, with no control ("projectors"). None when
    neither ran."""
    ce = {a: [r["figures"]["test_ce"] for r in rs] for a, rs in runs.items()}
    out: dict = {}
    if all(a in runs for a in (CONTROL, KV_ARM, KV_OTHER)):
        d, c = paired(ce[KV_ARM], ce[CONTROL]), paired(ce[KV_ARM], ce[KV_OTHER])
        verdict = _kv_verdict(d, c)
        out.update({"kv_vs_logits": d, "kv_vs_control": c, "verdict": verdict,
                    "seeds_needed": seeds_needed(d) if verdict == "unsettled" and d["lo"] is not None else None})
    proj = {}
    for arm in (a for a in WIDTH_ARMS[1:] if a in runs and CONTROL in runs):
        d = paired(ce[arm], ce[CONTROL])
        verdict = _kv_verdict(d)
        worse = d["lo"] is not None and d["lo"] > 0  # unsettled by the rule's letter, and no seed count would help
        proj[arm] = {"vs_logits": d, "verdict": verdict, "worse": worse, "seeds_needed":
                     seeds_needed(d) if verdict == "unsettled" and d["lo"] is not None and not worse else None}
    if proj:
        out["projectors"] = proj
    return out or None


TOP_K = 64
# lr_grid: multiples of the job's optim.lr_student tried on seed 0 per arm (grid_extend: at most
# this many more past an edge the best sits on, `stats.bracketed`); the warm start trains CE until a
# `warm_every`-step stretch lowers the held-out CE by less than `warm_flat` nats (at most `warm_max`
# steps)
DEFAULTS = {"steps": 30, "seeds": 5, "lr_grid": (1.0, 2.0, 4.0), "grid_extend": 2, "warm_every": 20, "warm_max": 200,
            "warm_flat": 0.1, "eval_every": 10, "block": 128, "batch_size": 8, "eval_blocks": 24, "topics": None}
# --quick (the test): a few topics per split (train, validation, test), so the teacher runs over hundreds of
# blocks, not the whole corpus
QUICK = {"steps": 3, "seeds": 2, "lr_grid": (1.0, 2.0), "grid_extend": 0, "warm_every": 2, "warm_max": 4,
         "warm_flat": 0.0, "eval_every": 3, "block": 32, "batch_size": 4, "eval_blocks": 4, "topics": (4, 1, 4)}


def heal_job(base: JobConfig, corpus: Path, root: Path, block: int, batch_size: int,
             topics: Optional[tuple] = None) -> JobConfig:
    """The bench's job: the base job's first teacher and its student, the corpus packed into
    `block`-token rows, top-k logits cached, a constant learning rate after a short warm-up. topics:
    (train, validation, test) records kept per split (None: all)."""
    n_train, n_val, n_test = topics or (None, None, None)
    return derive(base, {
        "teachers": base.teachers[:1], "fusion.weights": None,
        "data.source": f"{corpus}/{{split}}.jsonl", "data.format": "text", "data.val_split": "validation",
        "data.num_train": n_train, "data.num_val": n_val, "data.num_test": n_test, "data.packing": True,
        "data.kv_cache_dir": str(root / "kv_cache"), "train.max_length": block, "train.batch_size": batch_size,
        "loss.logit_top_k": TOP_K, "loss.logit_tail": "bucket", "optim.schedule": "constant",
        "optim.warmup_steps": 2, "align.projector.kind": "auto", "ray.storage_path": str(root / "runs")})


def variant_jobs(job: JobConfig, root: Path, names: Sequence[str]) -> dict[str, JobConfig]:
    """{cache variant: its job} for the arms `names`: "" the bench's job; "nf4" the same teacher
    loaded in bitsandbytes NF4; "hidden" the teacher serving its hidden states too. Each has its own
    cache under root."""
    t = job.teachers[0]
    out = {"": job}
    wanted = {ARMS[a].variant for a in names if a in ARMS}
    if "nf4" in wanted:
        out["nf4"] = derive(job, {"teachers": [{**t.model_dump(), "name": f"{t.name}-nf4", "quantization": "4bit"}],
                                  "data.kv_cache_dir": str(root / "kv_cache_nf4")})
    if "hidden" in wanted:
        out["hidden"] = derive(job, {"loss.hidden_weight": 1.0, "data.kv_cache_dir": str(root / "kv_cache_hidden")})
    return out


def arm_config(job: JobConfig, arm: str, seed: int, student: str, steps: int, lr: Optional[float] = None,
               kv_unit: float = 1.0, variants: Optional[dict] = None, hidden_unit: float = 1.0) -> JobConfig:
    """One run's config: ARMS[arm]'s weights (KV at `kv_ratio` x `kv_unit`, the weight whose
    gradient equals CE's; the hidden-state loss at `hidden_unit`), from `student` (the warm start),
    at learning rate `lr` (None: the job's), on its cache variant's job (`variant_jobs`)."""
    a = ARMS[arm]
    cfg = derive((variants or {}).get(a.variant, job), {
        "loss.ce_weight": a.ce, "loss.kv_weight": a.kv_ratio * kv_unit, "loss.logit_weight": a.logit,
        "loss.relation_weight": a.relation, "loss.hidden_weight": hidden_unit if a.hidden else 0.0,
        "train.seed": seed, "train.data_seed": seed, "train.steps": steps, "align.projector.kind": a.projector,
        "student.model": student, "student.keep_layers": None, "data.kv_source": "cache"})
    return cfg if lr is None else derive(cfg, {"optim.lr_student": lr})


def gap_recovered(ce_start: float, ce: float, ce_teacher: float) -> float:
    return (ce_start - ce) / (ce_start - ce_teacher)


def run_heal_bench(config: str = "demo_cpu", overrides: Optional[list[str]] = None, steps: Optional[int] = None,
                   seeds: Optional[int] = None, arms: Optional[Sequence[str]] = None, quick: bool = False,
                   out: Optional[str] = None, min_gap: float = 1.0, arm_overrides: Optional[dict] = None,
                   address: Optional[str] = None, progress: bool = True, base_arm: Optional[str] = None,
                   onpolicy: bool = False, lr_scale: float = 4.0, width_kv: Optional[int] = None) -> dict:
    """The whole bench (see the module docstring); returns its JSON-able result. base_arm: the arm
    every other is paired against (default `ce`, with `width_kv` `ce+logits`; or a recipe such as
    `ce` at a tuned rate). onpolicy: after the warm start, the on-policy arms instead
    (`bench.heal_onpolicy`), at `lr_scale` x the job's student rate. width_kv: the student's
    attention width-pruned to this many KV groups per layer (`_width_pruned`)."""
    if onpolicy:
        onpolicy_arms, arms = _onpolicy_arms(arms), None
    base_arm = base_arm or (CONTROL if width_kv else BASE)
    if width_kv is not None and width_kv < 1:
        raise KavaError(f"bench heal: --width-kv {width_kv}: keep at least 1 KV group per layer")
    p, names = _bench_params(quick, steps, seeds, arms or (WIDTH_ARMS if width_kv else None), arm_overrides,
                             base_arm)
    base = _base_job(config, overrides, arm_overrides)
    root, t_start, say = _out_dir(base, out), time.time(), _reporter(progress)
    rule = decision_rule(base_arm)
    if not onpolicy:  # (the on-policy arms have a rule of their own, said before they run)
        say(f"decision rule, fixed before the run: {rule}")
    corpus = Path(write_pydoc_corpus(root / "corpus")["train"]["path"]).parent
    job = heal_job(base, corpus, root, p["block"], p["batch_size"], p["topics"])
    tok = load_tokenizer(job.student.model)
    width = None
    if width_kv:  # the student: the layer-dropped copy, its attention width-pruned (Minitron)
        job, width = _width_pruned(job, root, tok, width_kv, say)
    gate = _gate(job, tok, min_gap, say)  # 1. before anything starts
    variants, cache = _teacher_caches(job, root, names, (address, progress), say)  # 2.
    scorer = Scorer(derive(job, {"data.kv_source": "cache"}), 0, 0)
    warm_dir = root / "warm_start"  # 3. the shared warm start, and the job a Tune sweep continues from
    warm = _warm_start(scorer, tok, warm_dir, p, say)
    if onpolicy:
        op = run_onpolicy_arms(job, corpus, root, str(warm_dir), tok, p["steps"], p["seeds"],
                               lr_scale * job.optim.lr_student, quick, say, onpolicy_arms)
        result = {"config": str(config), "out": str(root), "quick": quick, "gate": gate, "ce_start": warm["ce"],
                  "warm_start": warm, "teacher": job.teachers[0].name, "batch_size": p["batch_size"],
                  "onpolicy": op, "wall_s": time.time() - t_start}
        write_json(root / "bench_heal_onpolicy.json", result)
        return result
    start = _figures(scorer.model(load_student(str(warm_dir), dtype="float32"), tok), warm["ce"],
                     gate["teacher_ce"], job.teachers[0].name)
    ctx, calib = _run_context(job, variants, scorer, tok, warm_dir, p, arm_overrides, names,
                              (warm["ce"], gate["teacher_ce"]), root, say)  # 4.
    runs, lrs = _run_arms(ctx, names, base_arm)  # 5.
    summary = summarize(runs, base_arm)  # 6. figures, paired differences, decisions
    passes = _control_passes(runs)
    plots = _plot(runs, summary, root, gate["teacher_ce"], base_arm)
    result = {"config": str(config), "out": str(root), "quick": quick, **p, "arms": names, "base": base_arm,
              "decision_rule": rule, "gate": gate, "ce_start": warm["ce"], "warm_start": warm, "start": start,
              "kv_calibration": calib, "lr": lrs, "teacher": job.teachers[0].name, "width": width,
              "teacher_ce": gate["teacher_ce"], "test_tokens": int(scorer.test.lengths.sum()),
              "train_blocks": len(scorer.train_split), **cache, "control_passes": passes,
              "kv_control": _kv_control(runs, start, summary), "summary": summary, "test_seeds": test_seeds(p),
              "kv_rule": kv_rule(), "kv_decision": kv_decision(runs), "runs": runs, "plots": plots,
              "arm_overrides": arm_overrides or {}, "job": str(root / "heal_job.yaml"),
              "runs_wall_s": sum(r["wall_s"] for rs in runs.values() for r in rs), "wall_s": time.time() - t_start}
    write_json(root / "bench_heal.json", result)
    return result


def _run_context(job, variants: dict, scorer, tok, warm_dir: Path, p: dict, arm_overrides: Optional[dict],
                 names: list, ends: tuple, root: Path, say) -> tuple["_RunContext", dict]:
    """(what every run shares, the calibrations): the cache variants' sources, the loss weights
    measured at the warm start (`_calibrations`), and OUT/heal_job.yaml, the job a Tune sweep
    continues from."""
    sources = _sources(scorer, variants)
    calib = _calibrations(job, scorer, variants, sources, names, warm_dir, root, say)
    _write_tune_job(job, warm_dir, p["steps"], calib["kv_unit"], root / "heal_job.yaml")
    ctx = _RunContext(job, variants, sources, scorer, tok, str(warm_dir), p, arm_overrides or {},
                      {"auto": calib["kv_unit"], **calib.get("units", {})}, calib.get("hidden_unit", 1.0), ends,
                      root / "runs_done", say)
    return ctx, calib


def _out_dir(base, out: Optional[str]) -> Path:
    """OUT (created): `--out`, else a dated dir under the job's storage path."""
    default = Path(base.ray.storage_path) / f"bench-heal-{datetime.now():%Y%m%d-%H%M%S}"
    root = Path(out or default).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _teacher_caches(job, root: Path, names: list, where: tuple, say) -> tuple[dict, dict]:
    """(the cache variants' jobs, {"cached_blocks", ..., variant: its figures}): the teacher's
    outputs computed once per cache variant the arms read (`variant_jobs`: the plain cache, NF4,
    hidden states)."""
    address, progress = where
    variants = variant_jobs(job, root, names)
    cache = _cache_teacher(job, root / "kv_cache", address, progress, say)
    for name, vjob in variants.items():
        if name:
            cache[name] = _cache_teacher(vjob, Path(vjob.data.kv_cache_dir), address, progress, say)
    return variants, cache


def _onpolicy_arms(arms: Optional[Sequence[str]]) -> list[str]:
    """`--onpolicy`'s arms: among `OP_ARMS` and with `OP_BASE` (default: all of them)."""
    bad = [a for a in (arms or []) if a not in OP_ARMS]
    if bad or (arms and OP_BASE not in arms):
        raise KavaError(f"bench heal --onpolicy: arms must be among {', '.join(OP_ARMS)} and include {OP_BASE} "
                        f"(got {list(arms)})")
    return list(arms or OP_ARMS)


def _calibrations(job, scorer, variants: dict, sources: dict, names: list, warm_dir: Path, root: Path, say) -> dict:
    """The loss weights the arms run at, each measured once at the warm start and kept in OUT
    (`_calibration`): the KV weight whose gradient equals CE's (`kv_unit`; per projector kind an arm
    uses, `units`) and the hidden-state loss's, as the logit loss (`hidden_unit`, with the
    hidden-state variant)."""
    calib = _calibration(root / "calibration.json", lambda: _calibrate_kv(job, scorer, str(warm_dir), say))
    for kind in sorted({ARMS[a].projector for a in names if a in ARMS and ARMS[a].kv_ratio} - {"auto"}):
        calib.setdefault("units", {}).update(_calibration(
            root / f"calibration_{kind}.json",
            lambda: {kind: _calibrate_kv(job, scorer, str(warm_dir), say, kind)["kv_unit"]}))
    if "hidden" in variants:
        calib.update(_calibration(root / "calibration_hidden.json",
                                  lambda: _calibrate_hidden(variants, sources["hidden"], str(warm_dir), say)))
    return calib


def _bench_params(quick: bool, steps: Optional[int], seeds: Optional[int], arms: Optional[Sequence[str]],
                  arm_overrides: Optional[dict], base_arm: str) -> tuple[dict, list[str]]:
    """The run's sizes (QUICK or DEFAULTS, then `steps` and `seeds`) and its arms (`arms`, then the
    recipes), checked before anything loads."""
    p = dict(QUICK if quick else DEFAULTS)
    p.update({k: v for k, v in (("steps", steps), ("seeds", seeds)) if v is not None})
    names = list(arms or DEFAULT_ARMS)
    names += [a for a in (arm_overrides or {}) if a not in names]
    unknown = [a for a in names if a not in ARMS and a not in (arm_overrides or {})]
    if unknown or base_arm not in names or p["seeds"] < 1 or p["steps"] < 1:
        raise KavaError(f"bench heal: arms must be among {', '.join(ARMS)} or --recipe names and include the base "
                        f"{base_arm} (got {names}); seeds and steps >= 1")
    return p, names
def _base_job(config: str, overrides: Optional[list[str]], arm_overrides: Optional[dict]) -> JobConfig:
    """The base job, checked before any output or model: every recipe applies to it, its model files
    exist and its student is pruned (`student.keep_layers`)."""
    base = load_config(config, overrides)
    for name, recipe in (arm_overrides or {}).items():  # a typo in a recipe: one line now, not after the cache
        try:
            derive(base, recipe)
        except KavaError as e:
            raise KavaError(f"bench heal: --recipe {name}: {e}") from None
    check_model_files(base)
    if not base.student.keep_layers:
        raise KavaError(f"bench heal needs a pruned student: {config} has no student.keep_layers")
    return base


def _reporter(progress: bool) -> Callable[[str], None]:
    """`say`: one progress line on the console (`[bench heal] ...`), or nothing without `progress`."""
    def say(msg):
        if progress:
            status(f"[bench heal] {msg}")
    return say


def _gate(job: JobConfig, tok, min_gap: float, say) -> dict:
    """The gate, before any teacher cache or training: the teacher must beat the pruned student on
    the test split by `min_gap` nats, or there is nothing to distil (a one-line error)."""
    teacher = job.teachers[0]
    test = load_test_split(job.data, job.train, tok)
    t_model = load_model(teacher.model, dtype=teacher.dtype, quantization=teacher.quantization)
    ce_teacher = heldout_ce(t_model, test)
    del t_model
    pruned = load_student(job.student.model, dtype="float32", keep=job.student.keep_layers)
    ce_pruned = heldout_ce(pruned, test)
    gate = {"teacher_ce": ce_teacher, "student_ce": ce_pruned, "gap": ce_pruned - ce_teacher, "min_gap": min_gap}
    say(f"gate: teacher {ce_teacher:.3f} nats, pruned student {ce_pruned:.3f} nats on the test split "
        f"({int(test.lengths.sum())} tokens)")
    if gate["gap"] < min_gap:
        raise KavaError(f"bench heal: the teacher ({ce_teacher:.2f} nats) is not {min_gap:g} nat(s) better than the "
                        f"student ({ce_pruned:.2f} nats) on the test split: nothing to distil")
    return gate


def _width_pruned(job: JobConfig, root: Path, tok, n: int, say) -> tuple[JobConfig, dict]:
    """The job with its student width-pruned (`core.prune`, Minitron): the layer-dropped copy of the
    job's student, its attention cut to the `n` most active KV groups per layer on the first
    training batch; saved once under root (written whole, then renamed), it keeps the layers'
    provenance, so the layer map stays identity while the KV geometry differs and the KV term needs
    a real projector."""
    from kava_ray.core.prune import kv_group_importance, prune_kv_groups
    from kava_ray.data.batching import collate_split

    out = root / f"student-kv{n}"
    meta_path = out / "width.json"
    if not meta_path.is_file():
        student = load_student(job.student.model, dtype="float32", keep=job.student.keep_layers)
        split = load_splits(job.data, job.train, tok)[0]
        batch = collate_split(split, range(min(job.train.batch_size, len(split))))
        kept = prune_kv_groups(student, n, kv_group_importance(student, batch.input_ids, batch.attention_mask))
        tmp = root / f".student-kv{n}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        student.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / "width.json", {"kv_groups": n, "kept": kept, "from": str(job.student.model),
                                        "layers": job.student.keep_layers})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    meta = json.loads(meta_path.read_text())
    say(f"width-pruned student: {n} KV group(s) per layer kept by their activations (Minitron), "
        f"per layer {meta['kept']} ({out})")
    return derive(job, {"student.model": str(out), "student.keep_layers": None}), meta


def _cache_teacher(job: JobConfig, out: Path, address: Optional[str], progress: bool, say) -> dict:
    """The teacher's outputs for every block, computed once (a Ray job) into `out` and read by every
    arm and seed (a re-run finds them there); returns the result's figures of the cache."""
    pre = derive(job, {"data.kv_source": "live", "loss.logit_weight": 1.0, "data.kv_cache_dir": str(out)})
    t0 = time.time()
    with job_session(pre, address):
        stats = precompute(pre, out, progress=progress)
    precompute_s = time.time() - t0
    say(f"teacher cache {pre.teachers[0].name}: {stats['written']} blocks in {stats['forwards']} teacher batches, "
        f"{stats['skipped']} already there ({precompute_s:.0f} s)")
    return {"teacher_forwards": stats["forwards"], "cached_blocks": stats["written"] + stats["skipped"],
            "teacher_forwards_per_sample": (stats["written"] + stats["skipped"]) / max(stats["total"], 1),
            "precompute_s": precompute_s}


def _warm_start(scorer: Scorer, tok, warm_dir: Path, p: dict, say) -> dict:
    """The shared warm start: CE steps (seed 0) on the cache until a `warm_every`-step stretch
    lowers the held-out CE (validation head) by less than `warm_flat` nats, at most `warm_max`
    steps; saved to warm_dir where every arm begins, with its curve and test CE (the point the gap
    recovered is measured from). Kept: a re-run with the same settings reads it back."""
    warm_cfg = derive(scorer.cfg, {"loss.ce_weight": 1.0, "loss.kv_weight": 0.0, "loss.logit_weight": 0.0,
                                   "train.steps": p["warm_max"], "train.seed": 0, "train.data_seed": 0})
    key = {k: p[k] for k in ("warm_every", "warm_max", "warm_flat", "eval_blocks")}
    job_key = run_key(warm_cfg.model_dump(mode="json", exclude_defaults=True))
    meta_path = warm_dir / "warm_start.json"
    if meta_path.is_file() and (warm_dir / "config.json").is_file():
        meta = json.loads(meta_path.read_text())
        # (a warm start written before its job was recorded is taken as this job's)
        if meta.get("key") == key and meta.get("job", job_key) == job_key:
            say(f"warm start: {meta['steps']} CE steps -> {meta['ce']:.3f} nats (kept from an earlier run)")
            return meta
    for stale in (warm_dir.parent / "runs_done", warm_dir.parent / "calibration.json"):  # they belong to the old one
        if stale.exists():
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    val_head = load_splits_head(scorer.cfg, tok, p["eval_blocks"])

    def flat(curve):
        return len(curve) > 1 and curve[-2][1] - curve[-1][1] < p["warm_flat"]

    warm = train_in_process(warm_cfg, scorer.plans, scorer.source, p["warm_max"], p["warm_every"],
                            lambda r: heldout_ce(r.distiller.student, val_head), stop=flat)
    warm["recipe"].distiller.student.save_pretrained(warm_dir)
    tok.save_pretrained(warm_dir)
    steps = warm["curve"][-1][0]
    meta = {"key": key, "job": job_key, "steps": steps, "curve": warm["curve"], "flattened": flat(warm["curve"]),
            "ce": heldout_ce(warm["recipe"].distiller.student, scorer.test)}
    write_json(meta_path, meta)
    say(f"warm start: {steps} CE steps -> {meta['ce']:.3f} nats ({warm_dir}; validation-head curve "
        + " ".join(f"{s}:{c:.3f}" for s, c in warm["curve"]) + ")")
    return meta


def _calibrate_kv(job: JobConfig, scorer: Scorer, warm: str, say, projector: str = "auto", steps: int = 3) -> dict:
    """The KV weight whose gradient on the student equals CE's at the warm start: `steps` CE + KV
    steps (weight 1, seed 0, through `projector`) measure grad/kv_ratio (|KV's gradient| / |CE's|,
    linear in the weight); kv_unit = 1 / its median."""
    cfg = derive(arm_config(job, "ce+kv", 0, warm, steps), {"align.projector.kind": projector})
    ratios = sorted(train_in_process(cfg, scorer.plans, scorer.source, steps, grad_share=True)["ratios"])
    ratio = ratios[len(ratios) // 2]
    if not ratio > 0:
        raise KavaError("bench heal: the KV loss has no gradient on the student at the warm start (grad/kv_ratio 0)")
    say(f"KV weight ({projector} projector): grad/kv_ratio at weight 1 is {ratio:.4f} (steps 1..{steps}: "
        + " ".join(f"{r:.4f}" for r in ratios) + f"), so KV's gradient equals CE's at weight {1 / ratio:.1f}")
    return {"ratio_at_1": ratio, "ratios": ratios, "kv_unit": 1 / ratio,
            "weights": {a: ARMS[a].kv_ratio / ratio for a in ARMS
                        if ARMS[a].kv_ratio and ARMS[a].projector == projector}}


def _calibration(path: Path, measure: Callable[[], dict]) -> dict:
    """A calibration measured once per warm start and kept beside it (the KV arms' weights are part
    of their configs: a re-run must find the same ones to read its finished runs back)."""
    if path.is_file():
        return json.loads(path.read_text())
    out = measure()
    write_json(path, out)
    return out


def _sources(scorer: Scorer, variants: dict) -> dict:
    """{cache variant: (teacher plans, KV source)}: the scorer's for the bench's own cache."""
    out = {"": (scorer.plans, scorer.source)}
    for name, vjob in variants.items():
        if name:
            cfg = derive(vjob, {"data.kv_source": "cache"})
            plans = setup_teachers(cfg)[1]
            out[name] = (plans, kv_source(cfg, plans))
    return out


def _calibrate_hidden(variants: dict, source: tuple, warm: str, say) -> dict:
    """Minitron's α, fixed at the warm start: the hidden-state weight that makes the term as large
    as the logit loss (one ce+logits+hidden step at weight 1, seed 0: logit_kl / hidden_loss)."""
    cfg = arm_config(variants[""], "ce+logits+hidden", 0, warm, 1, variants=variants)
    first = train_in_process(cfg, *source, 1)["first"]
    unit = first["logit_kl"] / max(first["hidden_loss"], 1e-12)
    say(f"hidden-state weight: logit KD {first['logit_kl']:.4f} / hidden-state loss {first['hidden_loss']:.4f} at the "
        f"warm start -> {unit:.2f}")
    return {"hidden_unit": unit, "hidden_loss_at_1": first["hidden_loss"], "logit_kl_at_start": first["logit_kl"]}


def _write_tune_job(job: JobConfig, warm_dir: Path, steps: int, kv_unit: float, path: Path) -> None:
    """The job a Tune sweep (or a user) continues from: the ce+kv arm of seed 0 from the warm start,
    evaluated at the end only."""
    tune_job = derive(arm_config(job, "ce+kv", 0, str(warm_dir), steps, kv_unit=kv_unit),
                      {"train.eval_steps": steps, "train.save_steps": steps})
    atomic_write(path, tune_job.to_yaml().encode())


@dataclass
class _RunContext:
    """What every run of the bench shares."""
    job: JobConfig
    variants: dict  # {cache variant: job}
    sources: dict  # {cache variant: (plans, source)}
    scorer: Scorer
    tok: object
    warm: str
    p: dict
    recipes: dict
    kv_units: dict  # {projector kind: the KV weight whose gradient equals CE's at the warm start}
    hidden_unit: float
    ends: tuple  # (warm start CE, teacher CE): the span of the gap recovered
    done: Path  # finished runs, one JSON each
    say: Callable[[str], None]


def test_seeds(p: dict) -> list[int]:
    """The seeds every arm is scored on: 1 .. p["seeds"]. Seed 0 chooses each arm's rate and is not
    among them (its validation-chosen rate would make its test figure a little optimistic)."""
    return list(range(1, p["seeds"] + 1))


def _run_arms(ctx: _RunContext, names: list[str], base_arm: str) -> tuple[dict, dict]:
    """Every arm: its learning rate from the grid on the selection seed 0 (by validation CE), then
    the test seeds (`test_seeds`) at that rate; a seed's arms train on the same blocks in the same
    order (paired). Returns ({arm: [run per seed]}, {arm: {"lr", "grid": {lr: validation CE}}})."""
    val_head = load_splits_head(ctx.scorer.cfg, ctx.tok, ctx.p["eval_blocks"])
    val = load_splits(ctx.scorer.cfg.data, ctx.scorer.cfg.train, ctx.tok)[1]
    sources = ctx.sources
    runs, lrs = {}, {}
    for arm in sorted(names, key=lambda x: x != BASE):  # the base first: the KV control trains at its rate
        a = ARMS.get(arm, Arm())
        base_lr = ctx.recipes.get(arm, {}).get("optim.lr_student", ctx.job.optim.lr_student)  # a recipe's own rate
        if a.grid:  # extended past an edge while the best sits on it (`stats.bracketed`)
            best, grid, on_edge = bracketed(lambda m: _run(ctx, arm, 0, base_lr * m, sources[a.variant], val_head,
                                                           val), ctx.p["lr_grid"], lambda r: -r["val_ce"],
                                            ctx.p["grid_extend"])
            lr = base_lr * best
            lrs[arm] = {"lr": lr, "grid": {str(base_lr * m): grid[m]["val_ce"] for m in sorted(grid)},
                        "on_edge": on_edge}
        else:  # the KV control: at the base arm's rate
            lr = lrs.get(BASE, {}).get("lr", base_lr)
            lrs[arm] = {"lr": lr, "grid": {}}
        runs[arm] = [_run(ctx, arm, seed, lr, sources[a.variant], val_head) for seed in test_seeds(ctx.p)]
    return runs, lrs


def _run(ctx: _RunContext, arm: str, seed: int, lr: float, source: tuple, val_head, val=None) -> dict:
    """One run from the warm start, its held-out CE curve on `val_head` every `eval_every` steps,
    scored on the test split (and on the whole validation split `val`, what the grid selects by);
    kept under ctx.done and read back by a re-run with the same config."""
    a = ARMS.get(arm, ARMS[BASE])
    cfg = arm_config(ctx.job, arm if arm in ARMS else BASE, seed, ctx.warm, ctx.p["steps"], None,
                     ctx.kv_units[a.projector], ctx.variants, ctx.hidden_unit)
    if arm in ctx.recipes:
        cfg = derive(cfg, ctx.recipes[arm])
    cfg = derive(cfg, {"optim.lr_student": lr})  # the grid's rate, over a recipe's own
    other = arm in ARMS and ARMS[arm].other_batch
    key = run_key({"cfg": cfg.model_dump(mode="json", exclude_defaults=True), "other_batch": other,
                        "eval_every": ctx.p["eval_every"], "eval_blocks": ctx.p["eval_blocks"], "val": val is not None})
    path = ctx.done / safe_name(arm) / f"seed{seed}-{key}.json"
    if path.is_file():
        return json.loads(path.read_text())
    plans, src = source
    if other:
        src = OtherBatchSource(src, ctx.scorer.train_split)
    t1 = time.time()
    run = train_in_process(cfg, plans, src, ctx.p["steps"], ctx.p["eval_every"],
                           lambda r: heldout_ce(r.distiller.student, val_head))
    student = run["recipe"].distiller.student
    score = ctx.scorer.model(student, ctx.tok)
    fig = _figures(score, *ctx.ends, ctx.job.teachers[0].name)
    out = {"seed": seed, "lr": lr, "figures": fig, "curve": run["curve"], "step_s": run["step_s"],
           "wall_s": time.time() - t1, "score": score,
           "val_ce": heldout_ce(student, val) if val is not None else None}
    write_json(path, out)
    ctx.say(f"{arm} seed {seed} lr {lr:.2g}: test CE {fig['test_ce']:.4f}, GR {100 * fig['gr']:.1f} %"
            + (f", validation CE {out['val_ce']:.4f}" if val is not None else "") + f" ({out['wall_s']:.0f} s)")
    return out


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "+-._" else "_" for c in name)


class OtherBatchSource:
    """A KV source that answers a training batch with the teacher outputs of *other* training blocks
    of the same length (each block's partner is fixed: half a length group away): the
    `ce+kv-otherbatch` arm, whose KV target carries no information about the tokens the student
    reads."""

    def __init__(self, inner, split):
        self.inner, self.fingerprint = inner, split.fingerprint
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(split.lengths.tolist()):
            by_len.setdefault(n, []).append(i)
        self.partner = {}
        for idx in by_len.values():
            for j, i in enumerate(idx):
                self.partner[i] = idx[(j + len(idx) // 2) % len(idx)]

    def submit(self, name: str, request):
        fp, rows = request.examples or (None, ())
        if fp != self.fingerprint:  # anything else would quietly be the ce+kv arm
            raise KavaError("bench heal: the other-batch arm reads an example-indexed cache of the training split; "
                            f"got a request for {fp!r}")
        return self.inner.submit(name, request._replace(examples=(fp, tuple(self.partner[int(i)] for i in rows))))

    def result(self, name: str, request, future) -> dict:
        return self.inner.result(name, request, future)


def _kv_control(runs: dict, start: dict, summary: dict) -> Optional[dict]:
    """The KV control: KV-only training must raise the projector-free KV cosine from the warm
    start's (paired per seed against that start, and against ce)."""
    if KV_CONTROL not in runs or start.get("kv_cos_free") is None:
        return None
    cos = [r["figures"]["kv_cos_free"] for r in runs[KV_CONTROL]]
    d = paired(cos, [start["kv_cos_free"]] * len(cos))
    return {"start": start["kv_cos_free"], "end": mean_sd(cos), "vs_start": d,
            "vs_base": summary.get(KV_CONTROL, {}).get("vs_base", {}).get("kv_cos_free"),
            "passes": bool(d and d["excludes_zero"] and d["mean"] > 0)}


def _figures(score: dict, ce_start: float, ce_teacher: float, teacher: str) -> dict:
    """A run's score -> its figures: test CE, gap recovered from the warm start, and KL, top-1 agreement and
    projector-free KV cosine against the teacher (None where not scored)."""
    return {"test_ce": score["ce"], "gr": gap_recovered(ce_start, score["ce"], ce_teacher),
            "kl": score.get(f"kl/{teacher}"), "top1": score.get(f"top1_agree/{teacher}"),
            "kv_cos_free": score.get(f"kv_cos_free/{teacher}")}


def _control_passes(runs: dict) -> Optional[bool]:
    """Whether the positive control (CONTROL against BASE, whatever the base arm of the table)
    helps; None: the bench did not run both."""
    if BASE not in runs or CONTROL not in runs:
        return None
    return bool(summarize({BASE: runs[BASE], CONTROL: runs[CONTROL]})[CONTROL]["decision"]["helps"])


def _plot(runs: dict, summary: dict, root: Path, ce_teacher: float, base_arm: str) -> dict:
    """Both plots in root: the held-out CE curves per arm (the teacher's CE as a line) and the gap
    recovered per arm; returns {"ce": path, "gr": path}."""
    ce_png, gr_png = root / "heal_ce_curves.png", root / "heal_gap_recovered.png"
    curves = {a: [{"eval_ce": r["curve"]} for r in rs] for a, rs in runs.items()}
    plot_curves(curves, ce_png, log_y=True, teacher_ce=ce_teacher)
    plot_gr(summary, gr_png, base_arm)
    return {"ce": str(ce_png), "gr": str(gr_png)}


def parse_recipe(text: str) -> tuple[str, dict]:
    """`NAME:key=value,key=value` (an arm of its own on top of `ce`, e.g. a Tune sweep's winner) ->
    (NAME, {dotted key: value}); each item is read as an override line (`parse_override`: values are YAML)."""
    name, sep, rest = text.partition(":")
    if not sep or not name or name in ARMS:
        raise KavaError(f"--recipe {text!r}: expected NAME:key=value,... with a new name "
                        f"(not one of {', '.join(ARMS)})")
    out = {}
    for item in filter(None, rest.split(",")):
        if "=" not in item:
            raise KavaError(f"--recipe {text!r}: {item!r} is not key=value")
        try:
            parts, value = parse_override(item)
        except KavaError as e:
            raise KavaError(f"--recipe {text!r}: {e}") from None
        out[".".join(parts)] = value
    return name, out


def load_splits_head(cfg: JobConfig, tok, n: int):
    """The first `n` blocks of the validation split: the curve's held-out CE, cheap enough every few steps."""
    return load_splits(cfg.data, cfg.train, tok)[1].head(n)


def summarize(runs: dict, base_arm: str = BASE) -> dict:
    """Per arm: mean ± sd of each figure; per non-base arm: paired differences against the base and
    the decision (gains are positive: CE and KL differences are reported as base - arm)."""
    out = {}
    base = runs.get(base_arm, [])
    for arm, rs in runs.items():
        figs = [r["figures"] for r in rs]
        s = {"mean": {k: mean_sd([f.get(k) for f in figs]) for k in figs[0]},
             "step_s": mean_sd([r["step_s"] for r in rs])}
        if arm != base_arm and base:
            ref = [r["figures"] for r in base]
            s["vs_base"] = {k: paired([f.get(k) for f in figs], [f.get(k) for f in ref]) for k in figs[0]}
            d_ce, d_gr = s["vs_base"]["test_ce"], s["vs_base"]["gr"]
            helps = bool(d_ce and d_ce["excludes_zero"] and d_ce["mean"] < 0
                         and (-d_ce["mean"] >= MIN_NATS or d_gr["mean"] >= MIN_GR))
            hurts = bool(d_ce and d_ce["excludes_zero"] and d_ce["mean"] > 0)
            verdict = "helps" if helps else "hurts" if hurts else "no measurable gain"
            s["decision"] = {"helps": helps, "verdict": verdict}
        out[arm] = s
    return out


def plot_gr(summary: dict, path: Path, base_arm: str = BASE) -> None:
    """The gap recovered per arm (mean over seeds) with the 95 % interval of its paired difference to the base."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # matplotlib: heavy, loaded for plots only
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    arms = list(summary)
    means = [100 * summary[a]["mean"]["gr"]["mean"] for a in arms]
    base = means[arms.index(base_arm)] if base_arm in arms else 0.0
    err = []
    for a, m in zip(arms, means):
        d = summary[a].get("vs_base", {}).get("gr")
        err.append(100 * (d["hi"] - d["mean"]) if d and d["lo"] is not None else 0.0)
    ax.bar(arms, means, yerr=err, capsize=4, color=["#999999" if a == base_arm else "#4477aa" for a in arms])
    ax.axhline(base, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel(f"gap recovered, % (error bar: 95 % interval vs {base_arm})")
    ax.set_title("share of the teacher-student gap recovered per arm")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)


def _kv_lines(r: dict) -> list[str]:
    """Run 2's decisions, where their arms ran."""
    d = r.get("kv_decision")
    if not d:
        return []

    def need(x: dict) -> str:
        return f" (a t-interval of this spread needs ~{x['seeds_needed']} seeds)" if x.get("seeds_needed") else ""

    lines = [f"KV rule (fixed before the run): {r['kv_rule']}"]
    if "verdict" in d:
        lines.append(f"{KV_ARM} - {CONTROL}: test CE {fmt_interval(d['kv_vs_logits'], 4)}; {KV_ARM} - {KV_OTHER}: "
                     f"{fmt_interval(d['kv_vs_control'], 4)}: KV {d['verdict']}{need(d)}")
    for arm, x in d.get("projectors", {}).items():
        worse = f" (its interval lies above 0: worse than {CONTROL} alone)" if x.get("worse") else ""
        lines.append(f"{arm} - {CONTROL}: test CE {fmt_interval(x['vs_logits'], 4)}: KV through this projector "
                     f"{x['verdict']}{worse}{need(x)} (no other-batch control in this run)")
    return lines


HEAL_FIGURES = [("test_ce", "test CE", 4, 1.0), ("gr", "GR %", 1, 100.0), ("kl", "KL(t||s)", 3, 1.0),
                ("top1", "top-1 %", 1, 100.0), ("kv_cos_free", "KV cos (no proj.)", 3, 1.0)]  # key, label, digits, x


def _heal_rows(r: dict) -> tuple[list, list]:
    """(the figures table's rows: the teacher, the warm start, each arm's mean ± sd over seeds and
    its verdict; the paired differences' rows, each arm against the base)."""
    keys = HEAL_FIGURES
    rows = [[f"teacher {r['teacher']}", f"{r['teacher_ce']:.4f}", "100.0", "0", "100.0", "—", "—", "—"]]
    st = r["start"]
    start_figures = [("—" if st.get(k) is None else f"{st[k] * sc:.{d}f}") for k, _, d, sc in keys[2:]]
    rows.append(["warm start", f"{st['test_ce']:.4f}", "0.0", *start_figures, "—", "(all arms start here)"])
    for arm, s in r["summary"].items():
        cells = []
        for k, _, d, sc in keys:
            ms = s["mean"].get(k)
            cells.append("—" if ms is None else f"{ms['mean'] * sc:.{d}f} ± {ms['sd'] * sc:.{d}f}")
        rows.append([arm, *cells, f"{s['step_s']['mean']:.2f}" if s.get("step_s") else "—",
                     s.get("decision", {}).get("verdict", "(base)")])
    d_rows = []
    for arm, s in r["summary"].items():
        if "vs_base" not in s:
            continue
        v = s["vs_base"]
        d_rows.append([arm, fmt_interval(v["test_ce"], 4), fmt_interval(v["gr"], 1, 100.0), fmt_interval(v["kl"], 3),
                       fmt_interval(v["top1"], 1, 100.0), fmt_interval(v["kv_cos_free"], 3)])
    return rows, d_rows


def format_heal(r: dict) -> str:
    g, base = r["gate"], r.get("base", BASE)
    keys = HEAL_FIGURES
    rows, d_rows = _heal_rows(r)
    calib, warm, kc = r["kv_calibration"], r["warm_start"], r.get("kv_control")
    hidden_line = ([f"hidden-state weight (ce+logits+hidden): {calib['hidden_unit']:.2f}, the logit loss "
                    f"({calib['logit_kl_at_start']:.4f}) over the hidden-state loss ({calib['hidden_loss_at_1']:.4f}) "
                    f"at the warm start (Minitron's dynamic α, fixed there)"] if "hidden_unit" in calib else [])
    lr_rows = [[arm, f"{v['lr']:.2g}", (" ".join(f"{float(x):.2g}:{c:.4f}" for x, c in v["grid"].items()) or
                                        f"(the {BASE} arm's rate)")
                + (" (best on an edge after the extensions)" if v.get("on_edge") else "")]
               for arm, v in r["lr"].items()]
    kv_line = "KV control (kv-only raises the projector-free KV cosine): " + (
        "not in this run" if kc is None else
        f"{'passes' if kc['passes'] else 'FAILS'}: {kc['start']:.3f} at the warm start -> {kc['end']['mean']:.3f} "
        f"(paired over seeds {fmt_interval(kc['vs_start'], 3)}; vs {BASE} {fmt_interval(kc['vs_base'], 3)})")
    return "\n".join([
        f"heal bench ({r['config']}): teacher {r['teacher']}, its pruned student, Python-docs text in "
        f"{r['block']}-token blocks x {r['batch_size']}; warm start {warm['steps']} CE steps (until a "
        f"{r['warm_every']}-step stretch gained < {r['warm_flat']:g} nats, at most {r['warm_max']}), then "
        f"{r['steps']} steps per arm; test seeds {test_seeds(r)} (each draws the block order, dropout and any "
        f"projector's initialisation; every arm starts from the warm start; seed 0 chose the rates)",
        f"gate: teacher {g['teacher_ce']:.3f} nats vs pruned student {g['student_ce']:.3f} nats on the test split "
        f"({r['test_tokens']} tokens): gap {g['gap']:.2f} nats (needs >= {g['min_gap']:g}); warm start "
        f"{r['ce_start']:.3f} nats (GR measured from here; its validation-head curve "
        + " ".join(f"{s}:{c:.3f}" for s, c in warm["curve"]) + ")",
        *([f"width-pruned student: {r['width']['kv_groups']} KV group(s) per layer (of the teacher's), kept by their "
           f"activations: {r['width']['kept']}"] if r.get("width") else []),
        f"KV weights: grad/kv_ratio (|KV's gradient| / |CE's| on the student) at weight 1 is {calib['ratio_at_1']:.4f} "
        f"at the warm start, so " + ", ".join(f"{a} {w:.1f}" for a, w in calib["weights"].items())
        + "".join(f"; through a {k} projector {u:.1f}" for k, u in calib.get("units", {}).items()),
        *hidden_line,
        "learning rate per arm (the selection seed 0, not a test seed, by CE on the whole validation split):",
        format_table(["arm", "lr", "grid (lr:validation CE)"], lr_rows),
        "",
        format_table(["arm", *[k[1] for k in keys], "s/step", "decision"], rows),
        "",
        f"paired differences against {base} (arm - {base}, mean [95 % t-interval], * = excludes 0):",
        format_table(["arm", "Δ test CE", "Δ GR %", "Δ KL", "Δ top-1 %", "Δ KV cos"], d_rows),
        f"decision rule (fixed before the run): {r['decision_rule']}",
        f"positive control ({CONTROL} vs {BASE}): " + {True: "passes", False: "FAILS: no conclusion about KV",
                                                        None: "not in this run"}[r["control_passes"]],
        *_kv_lines(r),
        kv_line,
        f"teacher forwards per training sample: {r['teacher_forwards_per_sample']:.2f} ({r['cached_blocks']} blocks "
        f"computed once in {r['teacher_forwards']} teacher batches, read by every arm and seed)",
        f"plots: {r['plots']['ce']}, {r['plots']['gr']}; wall {r['wall_s'] / 60:.1f} min (the runs' own: "
        f"{r['runs_wall_s'] / 60:.1f} min); out {r['out']}"])
