"""Ray Tune search spaces as YAML: dotted JobConfig keys -> distributions, plus metric/scheduler/search.

`load_space` checks everything up front (keys exist in JobConfig, ranges are non-empty, and, given
a base config, every extreme value validates), so a bad space fails with one `KavaError` line
before any trial starts. An example space: docs/internals/runtime.md#tune-space.
"""

from __future__ import annotations

import re
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from kava_ray.common.config import (
    JobConfig,
    derive,
    did_you_mean,
    format_validation_error,
    read_yaml_mapping,
    section_of,
)
from kava_ray.common.errors import KavaError
from kava_ray.core.metric_names import EVALS
from kava_ray.core.projectors import job_kind

SPACE_PACKAGE = "tune_spaces"
DISTRIBUTIONS = ("choice", "grid", "uniform", "loguniform", "randint")
# metrics whose direction is unambiguous; a space that optimises them the wrong way is a mistake
_DIRECTION = {"eval/ce": "min", "eval/cos_sim": "max", "eval/cos_raw": "max", "eval/contrast_gap": "max"}


# keys every trial shares with the sweep's base config, so a trial could not apply them: refused with the reason
FIXED = (("teachers", "the trials share one teacher pool, started from the base config"),
         ("data", "the trials share the teachers' batches, keyed by the base config's data"),
         ("student.model", "the teachers' plans are made for the base config's student"),
         ("student.keep_layers", "the teachers' plans are made for the base config's student"),
         ("ray", "the sweep places its trials by the base config's resources"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SchedulerSpec(_Strict):
    """`asha` stops weak trials early, `fifo` runs all to the end.

    ASHA counts evaluations after training has begun (`EVALS`, reported with every result):
    `grace_period` evaluations before its first decision, so no trial is judged on the step-0
    evaluation (every trial scores the same there, before any training) nor on a number carried over
    from it.
    """

    kind: Literal["asha", "fifo"] = "asha"
    grace_period: Optional[int] = Field(None, ge=1)
    reduction_factor: Optional[int] = Field(None, ge=2)

    @model_validator(mode="after")
    def _asha_only(self):
        if self.kind == "fifo" and (self.grace_period is not None or self.reduction_factor is not None):
            raise ValueError("scheduler: grace_period/reduction_factor apply only to kind asha")
        if self.kind == "asha":
            self.grace_period = 1 if self.grace_period is None else self.grace_period
            self.reduction_factor = 2 if self.reduction_factor is None else self.reduction_factor
        return self


class SearchSpec(_Strict):
    """`random` = Tune's BasicVariantGenerator; `optuna`/`hyperopt` need their packages."""

    kind: Literal["random", "optuna", "hyperopt"] = "random"


class SpaceSpec(_Strict):
    """A parsed search space; `params` maps a dotted JobConfig key to one `{distribution: args}`."""

    metric: str = "eval/ce"  # the task loss: a KV metric (eval/cos_sim) would favour kv_weight > 0 by construction
    mode: Literal["max", "min"] = "min"
    num_samples: int = Field(8, ge=1)
    max_concurrent: Optional[int] = Field(None, ge=1)
    scheduler: SchedulerSpec = SchedulerSpec()
    search: SearchSpec = SearchSpec()
    params: dict[str, dict]

    @field_validator("params", mode="before")
    @classmethod
    def _check_params(cls, v):
        if not isinstance(v, dict) or not v:
            raise ValueError("params: needs a non-empty mapping of dotted JobConfig keys to distributions")
        out = {}
        for key, dist in v.items():
            key = str(key)
            if not _is_leaf(key.split(".")):
                raise ValueError(f"param {key!r}: not a JobConfig key{did_you_mean(JobConfig, tuple(key.split('.')))}")
            why = next((w for prefix, w in FIXED if key == prefix or key.startswith(prefix + ".")), None)
            if why:
                raise ValueError(f"param {key!r}: not searchable: {why} (run one sweep per value instead)")
            out[key] = _check_dist(key, dist)
        return out

    @model_validator(mode="after")
    def _cross_checks(self):
        if not self.metric.startswith("eval/"):
            raise ValueError(f"metric {self.metric!r}: must be a held-out metric reported every eval_steps "
                             "(eval/cos_sim, eval/ce, eval/contrast_gap, eval/cos/<teacher>)")
        want = "max" if self.metric.startswith(("eval/cos/", "eval/cos_raw/")) else _DIRECTION.get(self.metric)
        if want and want != self.mode:
            raise ValueError(f"mode {self.mode!r}: {self.metric} is optimised with mode {want}")
        grids = [k for k, d in self.params.items() if "grid" in d]
        if grids and self.search.kind != "random":
            raise ValueError(f"param {grids[0]!r}: grid needs search kind random (got {self.search.kind})")
        return self


def planned_trials(spec: SpaceSpec, num_samples: Optional[int] = None) -> int:
    """How many trials a sweep runs: `num_samples` times every point of its grids (Tune's rule; Tune
    itself creates them one at a time as slots free up, so the trials it lists so far are not the
    sweep's size)."""
    n = num_samples or spec.num_samples
    for dist in spec.params.values():
        if "grid" in dist:
            n *= len(dist["grid"])
    return n


# ----------------------------------------------------------------------------- params


_SCI = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _num(x: Any) -> Any:
    """PyYAML reads `1e-5` (no dot) as a string; turn such strings into floats."""
    return float(x) if isinstance(x, str) and _SCI.fullmatch(x.strip()) else x


def _is_number(x: Any, integer: bool = False) -> bool:
    return isinstance(x, int if integer else (int, float)) and not isinstance(x, bool)


def _check_dist(key: str, dist: Any) -> dict:
    """Normalised `{kind: values}`; a ValueError names the param and what is wrong."""
    where = f"param {key!r}"
    if not isinstance(dist, dict) or len(dist) != 1:
        raise ValueError(f"{where}: needs exactly one distribution, e.g. {{choice: [...]}} "
                         f"(one of {', '.join(DISTRIBUTIONS)})")
    (kind, args), = dist.items()
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"{where}: unknown distribution {kind!r} (expected {', '.join(DISTRIBUTIONS)})")
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ValueError(f"{where}: {kind} needs a non-empty list")
        return {kind: [_num(a) for a in args]}
    integer = kind == "randint"
    if not isinstance(args, list) or len(args) != 2 or not all(_is_number(_num(a), integer) for a in args):
        raise ValueError(f"{where}: {kind} needs [low, high] with two {'integers' if integer else 'numbers'}")
    low, high = (_num(a) for a in args)
    if low >= high:
        raise ValueError(f"{where}: empty range [{low!r}, {high!r}] (needs low < high)")
    if kind == "loguniform" and low <= 0:
        raise ValueError(f"{where}: loguniform needs 0 < low (got [{low!r}, {high!r}])")
    return {kind: [low, high]}


def _unwrap(ann: Any) -> Any:
    """Optional[X] -> X (only single-type unions wrap a section)."""
    if typing.get_origin(ann) is Union:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def _is_leaf(parts: list[str], base: Optional[dict] = None) -> bool:
    """Whether parts name a leaf field of JobConfig; with a base dict, list indices must exist in it."""
    model, node, i = JobConfig, base, 0
    while i < len(parts):
        field = model.model_fields.get(parts[i])
        if field is None:
            return False
        section = section_of(field.annotation)
        node = node.get(parts[i]) if isinstance(node, dict) else None
        i += 1
        if section is not None and typing.get_origin(_unwrap(field.annotation)) is list:  # teachers.N.field
            if i == len(parts) or not parts[i].isdigit():
                return False
            if base is not None:
                if int(parts[i]) >= len(node or []):
                    return False
                node = node[int(parts[i])]
            i += 1
        if section is None:
            return i == len(parts)
        model = section
    return False  # a section, not a leaf


def _extremes(dist: dict) -> list:
    (kind, args), = dist.items()
    if kind == "randint":
        return [args[0], args[1] - 1]  # tune.randint's high is exclusive
    return list(args)


def _leaf_type(parts: list[str]) -> Any:
    """The annotation of the JobConfig leaf `parts` names (`_is_leaf` said it is one), Optional unwrapped."""
    model, i = JobConfig, 0
    while True:
        field = model.model_fields[parts[i]]
        section = section_of(field.annotation)
        i += 1
        if section is None:
            return _unwrap(field.annotation)
        if typing.get_origin(_unwrap(field.annotation)) is list:
            i += 1  # the list index
        model = section


def _check_against(key: str, dist: dict, base: JobConfig) -> None:
    data = base.to_dict()
    if not _is_leaf(key.split("."), data):
        n = len(data.get("teachers", []))
        raise KavaError(f"param {key!r}: not a JobConfig key (the base config has {n} teachers)")
    (kind, _), = dist.items()
    if kind in ("uniform", "loguniform") and _leaf_type(key.split(".")) is int:
        raise KavaError(f"param {key!r}: an integer key, and {kind} draws fractions (a trial would be refused); "
                        f"use randint: [low, high) or choice: [...]")
    for value in _extremes(dist):
        try:
            apply_params(base, {key: value})
        except KavaError as e:
            raise KavaError(f"param {key!r}: value {value!r} is invalid for this job ({e})") from None


# what a run reports under eval/ (recipes.evaluate.evaluate_heldout): overall, and per teacher as eval/<name>/<t>
_EVAL_METRICS = ("ce", "ppl", "cos_sim", "cos_raw", "contrast_gap", "logit_kl")
_EVAL_PER_TEACHER = ("cos", "cos_raw", "aligned", "logit_kl", "logit_uld", "logit_aligned", "top1_agree",
                     "kv_cos_free")


def _check_metric(metric: str, base: JobConfig) -> None:
    """The metric is one the job reports (a misspelt one would end the sweep in Ray's traceback
    after the first trial started); the closest name is suggested."""
    import difflib

    known = [f"eval/{m}" for m in _EVAL_METRICS] + [f"eval/{m}/{t.name}" for m in _EVAL_PER_TEACHER
                                                     for t in base.teachers]
    if metric in known or re.fullmatch(r"eval/kv_cos_free/[^/]+/layer\d+", metric):
        return
    close = difflib.get_close_matches(metric, known, n=1, cutoff=0.6)
    raise KavaError(f"metric {metric!r}: not a metric the job reports" +
                    (f" (did you mean {close[0]!r}?)" if close else f" (e.g. {', '.join(known[:5])})"))


# ----------------------------------------------------------------------------- loading


def space_names() -> list[str]:
    """Names of the search spaces shipped in the `tune_spaces` package."""
    return sorted(p.name[:-5] for p in resources.files(SPACE_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def _read(path_or_name: Union[str, Path]) -> tuple[str, str]:
    p = Path(path_or_name)
    if p.is_file():
        return p.read_text(), str(p)
    name = str(path_or_name)
    if name in space_names():
        return resources.files(SPACE_PACKAGE).joinpath(f"{name}.yaml").read_text(), f"{SPACE_PACKAGE}/{name}.yaml"
    shipped = ", ".join(space_names())
    raise KavaError(f"search space {name!r}: no such file and no such shipped space (shipped: {shipped})")


def load_space(path_or_name: Union[str, Path], base: Optional[JobConfig] = None) -> SpaceSpec:
    """A validated SpaceSpec from a YAML path or shipped name; with `base`, every extreme value must validate."""
    text, origin = _read(path_or_name)
    raw = read_yaml_mapping(text, origin, "search space", "a mapping (metric, mode, params, ...)")
    try:
        spec = SpaceSpec.model_validate(raw)
        if base is not None:
            _check_metric(spec.metric, base)
            for key, dist in spec.params.items():
                _check_against(key, dist, base)
    except ValidationError as err:
        problem = format_validation_error(err, key=None, fields=SpaceSpec.model_fields)
        raise KavaError(f"search space {origin}: {problem}") from None
    except KavaError as err:
        raise KavaError(f"search space {origin}: {err}") from None
    return spec


# ----------------------------------------------------------------------------- inert dimensions


def projector_kinds(base: JobConfig, plans: dict, s_geom) -> dict[str, str]:
    """{teacher: the projector kind its trials train}: `projectors.job_kind`, the Distiller's rule
    (`auto`: identity, fit or linear)."""
    return {n: job_kind(base.align, base.fusion.kind, len(base.teachers), p.geometry, s_geom, copied=p.copied,
                        sharded=base.ray.sharded, aligned=p.aligned)
            for n, p in plans.items()}


def inert_params(spec: SpaceSpec, base: JobConfig, kinds: dict[str, str]) -> dict[str, str]:
    """{param: why it changes nothing}: the searched keys this job's config makes inert in every
    trial (none of the keys that would wake it is searched). kinds: `projector_kinds`."""
    searched = set(spec.params)
    kind_keys = ("align.projector.kind", "align.mode", "fusion.kind")  # what a trial's projector kind follows
    woken = lambda *keys: bool(searched & set(keys))  # noqa: E731
    named = ", ".join(sorted(set(kinds.values())))
    auto = " (align.projector.kind auto)" if base.align.projector.kind == "auto" else ""
    out = {}
    if "elastic" not in kinds.values() and not woken(*kind_keys):
        for key in ("align.projector.mlp_ratio", "align.projector.dropout"):
            out[key] = f"only an elastic projector has them, and this job's is {named}{auto}"
    heads = (set(kinds.values()) <= {"identity", "fit"} and base.fusion.kind in ("fixed", "sum")
             and base.loss.hidden_weight == 0)
    if heads and not woken(*kind_keys, "loss.hidden_weight"):
        out["optim.lr_projector"] = f"no parameter trains at it: projector {named}{auto}, fusion {base.fusion.kind}"
    if base.loss.kv_weight == 0 and "loss.kv_weight" not in searched:
        for key in searched:
            if key == "loss.loss_tokens" and (base.loss.relation_weight > 0 or "loss.relation_weight" in searched):
                continue  # the relation loss reads the same token mask
            if key in _KV_LOSS_KEYS or key.startswith("align.projector."):
                out[key] = "loss.kv_weight is 0: there is no KV loss"
    if base.loss.logit_weight == 0 and "loss.logit_weight" not in searched:
        for key in searched & set(_LOGIT_KEYS):
            out[key] = "loss.logit_weight is 0: there is no logit term"
    return {k: why for k, why in out.items() if k in searched}


_KV_LOSS_KEYS = ("loss.kind", "loss.alpha", "loss.beta", "loss.hybrid_weight", "loss.kv_parts", "loss.center",
                 "loss.loss_tokens")
_LOGIT_KEYS = ("loss.logit_top_k", "loss.logit_temperature", "loss.logit_tail", "loss.logit_divergence",
               "loss.jsd_beta", "loss.logit_hybrid_matched_weight", "loss.logit_cross_vocab")


def drop_inert(spec: SpaceSpec, base: JobConfig, kinds: dict[str, str]) -> tuple[SpaceSpec, Optional[str]]:
    """(the space without the dimensions `inert_params` finds, the one line that says which and why;
    None when none is). A space with nothing left to search is refused."""
    inert = inert_params(spec, base, kinds)
    if not inert:
        return spec, None
    left = {k: d for k, d in spec.params.items() if k not in inert}
    whys: dict[str, list[str]] = {}
    for k, why in inert.items():
        whys.setdefault(why, []).append(k)
    said = "; ".join(f"{', '.join(keys)}: {why}" for why, keys in whys.items())
    if not left:
        raise KavaError(f"search space: every param changes nothing for this job ({said})")
    return spec.model_copy(update={"params": left}), f"tune: not searched, inert for this job: {said}"


# ----------------------------------------------------------------------------- Ray Tune objects


def to_param_space(spec: SpaceSpec) -> dict[str, Any]:
    """Flat {dotted key: ray.tune domain} for `Tuner(param_space=...)`."""
    make = {"choice": tune.choice, "grid": tune.grid_search, "uniform": lambda a: tune.uniform(*a),
            "loguniform": lambda a: tune.loguniform(*a), "randint": lambda a: tune.randint(*a)}
    out = {}
    for key, dist in spec.params.items():
        (kind, args), = dist.items()
        out[key] = make[kind](list(args))
    return out


def apply_params(base: JobConfig, params: dict[str, Any]) -> JobConfig:
    """A validated copy of `base` with flat dotted params (a trial's config) set."""
    return derive(base, params)


def make_scheduler(spec: Union[SpaceSpec, SchedulerSpec], max_t: int):
    """ASHAScheduler(time_attr=EVALS, ...) for asha, FIFOScheduler for fifo; metric/mode come from TuneConfig.

    max_t: the evaluations a trial makes before its last step
    (`recipes.step_records.evals_before_end`). A STOP at a trial's last step ends it while it saves
    final/ and evaluates the test split, which can lose both: so every rung (grace_period * rf**k <=
    max_t) lies before the end, and stop_last_trials=False leaves a trial past max_t to finish on
    its own.
    """
    s = spec.scheduler if isinstance(spec, SpaceSpec) else spec
    if s.kind == "fifo":
        return FIFOScheduler()
    if max_t < s.grace_period:
        raise KavaError(f"scheduler: grace_period {s.grace_period} counts evaluations after training began, and a "
                        f"trial makes {max_t} before its last step (train.steps / train.eval_steps): no rung could "
                        f"be judged; lower it, evaluate more often, or use scheduler kind fifo")
    return ASHAScheduler(time_attr=EVALS, grace_period=s.grace_period, reduction_factor=s.reduction_factor,
                         max_t=max_t, stop_last_trials=False)


def make_search_alg(spec: Union[SpaceSpec, SearchSpec]):
    """None for random (Tune's BasicVariantGenerator), else an OptunaSearch / HyperOptSearch."""
    kind = (spec.search if isinstance(spec, SpaceSpec) else spec).kind
    if kind == "random":
        return None
    try:
        __import__(kind)
    except ImportError:
        raise KavaError(f"search kind {kind!r} needs the {kind} package: pip install {kind}") from None
    if kind == "optuna":
        from ray.tune.search.optuna import OptunaSearch  # optional packages: imported for the search asked for

        return OptunaSearch()
    from ray.tune.search.hyperopt import HyperOptSearch

    return HyperOptSearch()
