"""Tune search spaces: shipped YAMLs load against the demo config, bad spaces fail with one line."""

import importlib.util
from types import SimpleNamespace

import pytest
import yaml
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.sample import Categorical, Float, Integer

from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.runtime.tune_space import (
    apply_params,
    load_space,
    make_scheduler,
    make_search_alg,
    space_names,
    to_param_space,
)


@pytest.fixture(scope="module")
def base():
    return load_config("demo_cpu")


def write_space(tmp_path, params=None, **top):
    doc = {"metric": "eval/cos_sim", "mode": "max", "num_samples": 2, **top}
    doc["params"] = params if params is not None else {"loss.beta": {"choice": [0.0, 0.01]}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def one_line_error(path_or_name, base, *needles):
    with pytest.raises(KavaError) as info:
        load_space(path_or_name, base)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_shipped_spaces_load_and_give_tune_domains(base):
    assert set(space_names()) >= {"default", "single_gpu_8gb", "large_teachers"}
    for name in space_names():
        spec = load_space(name, base)
        assert spec.metric == "eval/ce" and spec.mode == "min"  # the task loss: a KV metric favours KV recipes
        space = to_param_space(spec)
        assert set(space) == set(spec.params)
        lr = space["optim.lr_student"]
        assert isinstance(lr, Float) and isinstance(lr.sampler, Float._LogUniform)
        if not name.startswith("heal_"):  # the heal spaces sweep the heal levers (bench heal's job)
            assert isinstance(space["align.projector.mlp_ratio"], Categorical)
            assert isinstance(space["loss.beta"], Categorical)
        else:
            assert isinstance(space["loss.logit_weight"], Categorical)

    default = load_space("default", base)
    assert (default.num_samples, default.max_concurrent) == (8, None)
    sched = default.scheduler
    assert (sched.kind, sched.grace_period, sched.reduction_factor) == ("asha", 1, 2)
    assert default.search.kind == "random" and make_search_alg(default) is None
    space = to_param_space(default)
    assert space["align.projector.mlp_ratio"].categories == [0.5, 1.0, 2.0]
    dropout = space["align.projector.dropout"]
    assert isinstance(dropout.sampler, Float._Uniform) and (dropout.lower, dropout.upper) == (0.0, 0.2)
    assert (space["optim.lr_projector"].lower, space["optim.lr_projector"].upper) == (1e-4, 3e-3)
    # the loss mix: KV alignment vs logit KD, each switchable off
    assert space["loss.kv_weight"].categories == [0.0, 0.5, 1.0]
    assert space["loss.logit_weight"].categories == [0.0, 0.5, 1.0]
    trial = apply_params(base, {"loss.kv_weight": 0.0, "loss.logit_weight": 1.0})
    assert (trial.loss.kv_weight, trial.loss.logit_weight) == (0.0, 1.0)

    gpu8 = load_space("single_gpu_8gb", base)
    assert (gpu8.num_samples, gpu8.max_concurrent) == (6, 1)
    large = load_space("large_teachers", base)
    assert (large.num_samples, large.max_concurrent) == (4, 2)
    assert (large.scheduler.grace_period, large.scheduler.reduction_factor) == (2, 3)
    assert to_param_space(large)["fusion.kind"].categories == ["fixed", "gate"]


def test_grid_randint_and_yaml_exponents(tmp_path, base):
    path = tmp_path / "s.yaml"
    # PyYAML reads 1e-5 (no dot) as a string; ranges and choices still get floats
    path.write_text("params:\n"
                    "  optim.lr_student: {loguniform: [1e-5, 1e-4]}\n"
                    "  optim.lr_projector: {choice: [1e-3, 3e-3]}\n"
                    "  optim.warmup_steps: {randint: [0, 4]}\n"
                    "  align.mode: {grid: [flat, structured]}\n"
                    "  loss.kv_weight: {choice: [0.0, 0.5]}\n")
    spec = load_space(path, base)
    space = to_param_space(spec)
    assert (space["optim.lr_student"].lower, space["optim.lr_student"].upper) == (1e-5, 1e-4)
    assert space["optim.lr_projector"].categories == [1e-3, 3e-3]
    assert isinstance(space["optim.warmup_steps"], Integer)
    assert (space["optim.warmup_steps"].lower, space["optim.warmup_steps"].upper) == (0, 4)
    assert space["align.mode"] == {"grid_search": ["flat", "structured"]}


def test_a_sweeps_size_is_the_one_tune_runs(tmp_path, base):
    """`planned_trials` (the N of the status line's "D/N trials done") is what Tune's BasicVariantGenerator counts:
    num_samples times every grid point (Tune creates the trials one at a time, so its list is no measure)."""
    from ray.tune.experiment import Experiment
    from ray.tune.search import BasicVariantGenerator

    from kava_ray.runtime.tune_space import planned_trials

    path = tmp_path / "s.yaml"
    path.write_text("num_samples: 2\nparams:\n  align.mode: {grid: [flat, structured]}\n"
                    "  optim.lr_projector: {grid: [1.0e-3, 3.0e-3, 1.0e-2]}\n  loss.kv_weight: {choice: [0.0, 0.5]}\n")
    spec = load_space(path, base)
    for n in (None, 5):
        gen = BasicVariantGenerator()
        gen.add_configurations([Experiment("x", lambda c: None, config={"params": to_param_space(spec)},
                                           num_samples=n or spec.num_samples)])
        assert planned_trials(spec, n) == gen.total_samples == (n or 2) * 2 * 3
    assert planned_trials(load_space("default", base), 3) == 3  # no grid: num_samples


def test_apply_params_sets_values(base):
    cfg = apply_params(base, {"optim.lr_student": 2e-5, "align.projector.dropout": 0.05,
                              "fusion.kind": "gate", "teachers.1.num_gpus": 0.5})
    assert cfg.optim.lr_student == pytest.approx(2e-5)
    assert cfg.align.projector.dropout == pytest.approx(0.05)
    assert cfg.fusion.kind == "gate" and cfg.teachers[1].num_gpus == 0.5
    assert base.fusion.kind == "fixed"  # the base is untouched
    with pytest.raises(KavaError, match="align.projector.dropout"):
        apply_params(base, {"align.projector.dropout": 1.5})


def test_schedulers(base):
    from kava_ray.recipes.step_records import evals_before_end, evals_through

    spec = load_space("default", base)
    asha = make_scheduler(spec, max_t=evals_before_end(base.train))
    assert isinstance(asha, ASHAScheduler) and asha._time_attr == "evals"
    # ASHA's own decisions (grace 1 evaluation, rf 2) on reports as a run makes them (`evals`: evaluations after
    # step 0): a report before the first evaluation past step 0 is never judged, the worse trial stops at its first
    # evaluation, and a trial at its last step is never stopped (a STOP there can kill it before it saves final/).
    # 8 steps, eval every 2; and the demo's 24 steps, eval every 12
    for steps, eval_steps in ((8, 2), (24, 12)):
        t = base.train.model_copy(update={"steps": steps, "eval_steps": eval_steps, "save_steps": steps,
                                          "log_steps": 1})
        s = make_scheduler(spec, max_t=evals_before_end(t))
        s.set_search_properties("eval/ce", "min")
        good, bad, late = (SimpleNamespace(trial_id=n) for n in ("good", "bad", "late"))
        for trial in (good, bad, late):
            s.on_trial_add(None, trial)
        act = lambda trial, step, ce: s.on_trial_result(  # noqa: E731
            None, trial, {"step": step, "evals": evals_through(step, t), "eval/ce": ce})
        evals = list(range(eval_steps, steps, eval_steps))
        assert [act(good, e, 1.0) for e in evals + [steps]] == ["CONTINUE"] * (len(evals) + 1), (steps, eval_steps)
        # the step-0 evaluation, carried in every report until the first one after training: never judged
        assert all(act(bad, step, 9.0) == "CONTINUE" for step in range(1, eval_steps)), (steps, eval_steps)
        assert act(bad, evals[0], 5.0) == "STOP"
        assert all(act(late, e, 0.9) == "CONTINUE" for e in evals) and act(late, steps, 9.0) == "CONTINUE"
    t8 = base.train.model_copy(update={"steps": 8, "eval_steps": 2, "save_steps": 8})
    assert evals_before_end(t8) == 3 and [evals_through(s, t8) for s in range(9)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    large = load_space("large_teachers", base)
    with pytest.raises(KavaError, match="grace_period 2 counts evaluations after training began, and a trial makes 1"):
        make_scheduler(large, max_t=1)
    fifo = spec.model_copy(update={"scheduler": spec.scheduler.model_validate({"kind": "fifo"})})
    assert type(make_scheduler(fifo, max_t=10)) is FIFOScheduler


BAD_PARAMS = [
    # (description, params, text the one line must contain)
    ("unknown key", {"optim.lr_studnet": {"uniform": [0.1, 0.2]}},
     "'optim.lr_studnet': not a JobConfig key (did you mean 'optim.lr_student'?)"),
    ("a section, not a leaf", {"align.projector": {"choice": [{}]}}, "'align.projector': not a JobConfig key"),
    # keys every trial shares with the sweep (a trial could not apply them): refused with the reason
    ("a teacher's key", {"teachers.0.model": {"choice": ["a", "b"]}},
     "'teachers.0.model': not searchable: the trials share one teacher pool"),
    ("a data key", {"data.num_train": {"choice": [8, 16]}}, "'data.num_train': not searchable"),
    ("the student's model", {"student.keep_layers": {"choice": [[0], [1]]}}, "'student.keep_layers': not searchable"),
    ("uniform over an integer key", {"train.batch_size": {"uniform": [2, 8]}},
     "'train.batch_size': an integer key, and uniform draws fractions"),
    ("unknown distribution", {"loss.beta": {"normal": [0, 1]}}, "'loss.beta': unknown distribution 'normal'"),
    ("two distributions", {"loss.beta": {"choice": [0.0], "uniform": [0, 1]}}, "'loss.beta': needs exactly one"),
    ("empty uniform", {"loss.beta": {"uniform": [1, 1]}}, "'loss.beta': empty range [1, 1]"),
    ("reversed loguniform", {"optim.lr_student": {"loguniform": [1e-4, 1e-5]}}, "'optim.lr_student': empty range"),
    ("loguniform low <= 0", {"optim.lr_student": {"loguniform": [0.0, 1e-4]}},
     "'optim.lr_student': loguniform needs 0 < low"),
    ("randint of floats", {"optim.warmup_steps": {"randint": [0.5, 3]}}, "'optim.warmup_steps': randint needs"),
    ("empty choice", {"loss.beta": {"choice": []}}, "'loss.beta': choice needs a non-empty list"),
    ("choice value invalid for the key", {"align.projector.dropout": {"choice": [0.1, 1.5]}},
     "'align.projector.dropout': value 1.5 is invalid"),
    ("uniform end invalid for the key", {"align.projector.dropout": {"uniform": [0.0, 1.0]}},
     "'align.projector.dropout': value 1.0 is invalid"),
    ("randint high-1 invalid", {"optim.accumulation": {"randint": [0, 3]}}, "'optim.accumulation': value 0 is invalid"),
    ("bad literal in choice", {"fusion.kind": {"choice": ["fixed", "vote"]}}, "'fusion.kind': value 'vote'"),
    ("negative logit weight", {"loss.logit_weight": {"choice": [-0.5, 1.0]}}, "'loss.logit_weight': value -0.5"),
    ("zero logit temperature", {"loss.logit_temperature": {"choice": [0.0, 2.0]}},
     "'loss.logit_temperature': value 0.0 is invalid"),
]


@pytest.mark.parametrize("desc,params,needle", BAD_PARAMS, ids=[b[0] for b in BAD_PARAMS])
def test_bad_params_fail_with_one_line(tmp_path, base, desc, params, needle):
    path = write_space(tmp_path, params)
    msg = one_line_error(path, base, needle)
    assert msg.startswith(f"search space {path}: param ")


def test_keys_are_checked_without_a_base_too(tmp_path):
    one_line_error(write_space(tmp_path, {"optim.lr_studnet": {"choice": [1e-4]}}), None, "optim.lr_studnet")
    one_line_error(write_space(tmp_path, {"teachers.7.num_gpus": {"choice": [1]}}), None, "not searchable")


BAD_TOP = [
    ("unknown top-level key", {"samples": 3}, "unknown key 'samples'"),
    ("bad mode", {"mode": "maximize"}, "mode"),
    ("mode against the metric", {"metric": "eval/ce", "mode": "max"}, "eval/ce is optimised with mode min"),
    ("not a held-out metric", {"metric": "loss"}, "metric 'loss'"),
    ("a metric the job does not report", {"metric": "eval/cee"},
     "metric 'eval/cee': not a metric the job reports (did you mean 'eval/ce'?)"),
    ("num_samples < 1", {"num_samples": 0}, "num_samples"),
    ("unknown scheduler", {"scheduler": {"kind": "pbt"}}, "scheduler.kind"),
    ("asha knobs on fifo", {"scheduler": {"kind": "fifo", "grace_period": 2}}, "only to kind asha"),
    ("reduction_factor < 2", {"scheduler": {"kind": "asha", "reduction_factor": 1}}, "scheduler.reduction_factor"),
    ("unknown scheduler key", {"scheduler": {"kind": "asha", "patience": 3}}, "unknown key 'scheduler.patience'"),
    ("unknown search", {"search": {"kind": "bayes"}}, "search.kind"),
]


@pytest.mark.parametrize("desc,top,needle", BAD_TOP, ids=[b[0] for b in BAD_TOP])
def test_bad_top_level_fails_with_one_line(tmp_path, base, desc, top, needle):
    one_line_error(write_space(tmp_path, **top), base, needle)


def test_grid_needs_random_search(tmp_path, base):
    path = write_space(tmp_path, {"loss.beta": {"grid": [0.0, 0.1]}}, search={"kind": "optuna"})
    one_line_error(path, base, "'loss.beta': grid needs search kind random")


def test_bad_yaml_missing_file_and_unknown_name(tmp_path, base):
    bad = tmp_path / "bad.yaml"
    bad.write_text("params: {loss.beta: {choice: [0.0\n")
    one_line_error(bad, base, str(bad), "not valid YAML")
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    one_line_error(lst, base, "top level must be a mapping")
    one_line_error(tmp_path / "nope.yaml", base, "nope.yaml", "no such file", ", ".join(space_names()))
    one_line_error("defualt", base, "'defualt'", "shipped: default")


def test_optuna_search_needs_the_package(tmp_path, base):
    spec = load_space(write_space(tmp_path, search={"kind": "optuna"}), base)
    if importlib.util.find_spec("optuna") is None:
        with pytest.raises(KavaError) as info:
            make_search_alg(spec)
        assert "\n" not in str(info.value) and "pip install optuna" in str(info.value)
    else:
        from ray.tune.search.optuna import OptunaSearch

        assert isinstance(make_search_alg(spec), OptunaSearch)


def _plans(cfg):
    """The teachers' plans as a sweep's driver gets them (here from the tiny models loaded in process)."""
    from kava_ray.core.models import load_model
    from kava_ray.core.plans import student_geometry
    from kava_ray.testing.inprocess_source import in_process_plans

    return in_process_plans(cfg, {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}), \
        student_geometry(cfg.student)


def test_a_dimension_the_job_makes_inert_is_dropped_with_one_line(tiny_job, tiny_qwen2_dir, capsys):
    """The default space on a job whose projector `auto` resolves to a projector without an elastic's knobs:
    mlp_ratio and dropout change nothing and are dropped, with one line naming them and why; with one teacher of the
    student's geometry there is no projector parameter at all, and lr_projector goes too. The rest is searched."""
    from kava_ray.runtime.tune_space import drop_inert, projector_kinds

    two = load_config(str(tiny_job), ["align.projector.kind=auto"])  # qwen: the student's geometry; llama: not
    plans, s_geom = _plans(two)
    kinds = projector_kinds(two, plans, s_geom)
    assert kinds["llama"] == "linear" and kinds["qwen"] != "elastic", kinds
    spec, line = drop_inert(load_space("default", two), two, kinds)
    assert sorted(set(load_space("default", two).params) - set(spec.params)) == [
        "align.projector.dropout", "align.projector.mlp_ratio"]
    assert line.startswith("tune: not searched, inert for this job: align.projector.mlp_ratio, "
                           "align.projector.dropout: only an elastic projector has them, and this job's is ") and \
        "\n" not in line, line
    one = load_config(str(tiny_job), ["align.projector.kind=auto", "teachers=[{name: qwen, model: "
                                      f"{tiny_qwen2_dir}, dtype: float32}}]"])
    plans, s_geom = _plans(one)
    spec, line = drop_inert(load_space("default", one), one, projector_kinds(one, plans, s_geom))
    assert "optim.lr_projector" not in spec.params and "optim.lr_projector: no parameter trains at it" in line
    assert {"loss.beta", "loss.kv_weight", "loss.logit_weight", "optim.lr_student"} <= set(spec.params)
    # an elastic projector uses them; a searched projector kind may wake them: both kept
    elastic = load_config(str(tiny_job), ["align.projector.kind=elastic"])
    assert drop_inert(load_space("default", elastic), elastic, projector_kinds(elastic, *_plans(elastic)))[1] is None


def test_knobs_of_a_term_the_job_has_off_are_dropped_and_nothing_left_is_refused(tiny_job, tmp_path):
    from kava_ray.runtime.tune_space import drop_inert

    cfg = load_config(str(tiny_job), ["align.projector.kind=elastic", "loss.logit_weight=0"])
    kinds = {"qwen": "elastic", "llama": "elastic"}
    spec, line = drop_inert(load_space(write_space(tmp_path, {"loss.logit_top_k": {"choice": [8, 16]},
                                                              "loss.beta": {"choice": [0.0, 0.1]}}), cfg), cfg, kinds)
    assert list(spec.params) == ["loss.beta"] and "loss.logit_top_k: loss.logit_weight is 0" in line
    with pytest.raises(KavaError, match="every param changes nothing for this job"):
        drop_inert(load_space(write_space(tmp_path, {"loss.logit_top_k": {"choice": [8, 16]}}), cfg), cfg, kinds)
    # kv_weight 0: the KV knobs go, but the token mask stays while the relation loss (which reads it) is on
    tokens = {"loss.loss_tokens": {"choice": ["all", "answer"]}, "loss.alpha": {"choice": [1.0, 2.0]}}
    for relation, kept in ((0.0, []), (0.5, ["loss.loss_tokens"])):
        job = load_config(str(tiny_job), ["loss.kv_weight=0", f"loss.relation_weight={relation}"])
        if kept:
            spec, line = drop_inert(load_space(write_space(tmp_path, tokens), job), job, kinds)
            assert list(spec.params) == kept and "loss.alpha: loss.kv_weight is 0" in line
        else:
            with pytest.raises(KavaError, match="every param changes nothing for this job"):
                drop_inert(load_space(write_space(tmp_path, tokens), job), job, kinds)
