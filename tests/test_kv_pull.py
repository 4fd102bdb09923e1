"""The KV loss pulls the student toward its teacher (issue 39's positive control), on tiny real models in process.

A layer-dropped student (teacher layers 0 and 3) is copied from its teacher (so it has its KV geometry and basis),
so `align.projector.kind: auto` makes the teacher's own KV the target (identity); a student of the same geometry
trained apart gets a student-side map (fit). KV-only training then raises the *projector-free* centred
cosine between the student's KV and its source layers' on held-out batches, against CE-only training (the trivial
baseline) and against a randomly initialised learned projector (the old default, which aligns the student with a
random image of the teacher).
"""

import pytest
import torch

from jobs import run_recipe, write_job
from kava_ray.bench.pull import projector_free
from kava_ray.common.config import derive, load_config
from kava_ray.core.models import load_model
from kava_ray.core.projectors import resolve_kind
from kava_ray.recipes.fit_maps import fit_maps
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

STEPS = 12


@pytest.fixture(scope="module")
def pull_job(tmp_path_factory, tiny_qwen2_dir):
    tmp = tmp_path_factory.mktemp("pull")
    return write_job(tmp, tiny_qwen2_dir, tiny_qwen2_dir, tiny_qwen2_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"}],
                     student={"model": str(tiny_qwen2_dir), "dtype": "float32", "keep_layers": [0, 3]},
                     align={"mode": "structured", "layer_map": "auto", "projector": {"kind": "auto", "dropout": 0.0}},
                     data={"source": "synthetic", "num_train": 64, "num_val": 8, "num_test": 8},
                     optim={"lr_student": 3e-3, "lr_projector": 3e-3, "warmup_steps": 0, "schedule": "constant"},
                     train={"steps": STEPS, "batch_size": 4, "max_length": 288, "log_steps": 1,
                            "eval_steps": STEPS, "save_steps": STEPS})


def _free_cos(cfg, recipe, models, plans) -> dict:
    """The projector-free centred KV cosine per student layer on the validation split (the benches' scoring path)."""
    res = projector_free(recipe, cfg, plans, InProcessSource(models), "qwen")
    return {"mean": res["kv_cos_free"], "layers": res["per_layer"]}


def _arm(pull_job, *overrides):
    cfg = load_config(pull_job, list(overrides))
    models = {"qwen": load_model(cfg.teachers[0].model, dtype="float32")}
    plans = in_process_plans(cfg, models)
    curve, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 0)  # step 0: the start
    start = _free_cos(cfg, recipe, models, plans)
    curve, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), STEPS, grad_share=True)
    end = _free_cos(cfg, recipe, models, plans)
    # the training evaluation (eval/, what metrics.jsonl and Tune read) reports the same figures
    held = recipe.evaluate(InProcessSource(models))
    assert held["eval/kv_cos_free/qwen"] == pytest.approx(end["mean"], abs=1e-5)
    assert [held[f"eval/kv_cos_free/qwen/layer{i}"] for i in range(2)] == pytest.approx(end["layers"], abs=1e-5)
    return start, end, curve


def test_auto_is_identity_for_a_copied_student_fit_for_another_and_linear_where_neither_can_serve():
    from kava_ray.core.projectors import fit_allowed

    assert resolve_kind("auto", "structured", 2, 16, 2, 16, copied=True) == "identity"
    # the same geometry without the provenance: a student trained apart holds its KV in a basis of its own
    assert resolve_kind("auto", "structured", 2, 16, 2, 16, copied=False) == "fit"
    assert resolve_kind("auto", "structured", 2, 16, 2, 16, fit_ok=False, copied=False) == "linear"
    assert resolve_kind("auto", "structured", 2, 16, 2, 8, copied=False) == "fit"
    assert resolve_kind("auto", "structured", 2, 16, 2, 8, fit_ok=False, copied=True) == "linear"
    assert resolve_kind("auto", "flat", 2, 16, 2, 16, copied=True) == "linear"
    assert resolve_kind("elastic", "structured", 2, 16, 2, 16, copied=True) == "elastic"
    # fit needs the teacher's own loss (one teacher, or fusion sum) and its tokenizer
    assert fit_allowed("fixed", 1) and fit_allowed("sum", 3) and not fit_allowed("fixed", 2)
    assert not fit_allowed("sum", 1, aligned=True)


def test_auto_reads_the_students_provenance_not_its_geometry_alone(pull_job, tmp_path, tiny_student_dir):
    """On the Distiller and the planner: the layer-dropped student (keep_layers of the teacher's model), the teacher's
    model whole and a saved copy of the layer-dropped one (its config's `copied_from`) get identity; a student of the
    same KV geometry built apart from the teacher (2 kv heads x 16, like tiny Qwen2's) gets fit; the demo preset's
    layer-dropped student keeps identity for both of its teachers."""
    from kava_ray.core.models import kv_geometry, load_student
    from kava_ray.core.plans import copied_from_teacher
    from kava_ray.recipes.build import build_distiller
    from kava_ray.runtime.planner import plan

    saved = tmp_path / "saved"
    load_student(load_config(pull_job).student.model, keep=[0, 3]).save_pretrained(saved)
    cases = {"copied": ([], True), "whole": (["student.keep_layers=null"], True),
             "saved copy": ([f"student.model={saved}", "student.keep_layers=null"], True),
             "apart": ([f"student.model={tiny_student_dir}", "student.keep_layers=null"], False)}
    models = {"qwen": load_model(load_config(pull_job).teachers[0].model, dtype="float32")}
    for name, (overrides, copied) in cases.items():
        cfg = load_config(pull_job, overrides)
        student = load_student(cfg.student.model, dtype="float32", keep=cfg.student.keep_layers)
        assert kv_geometry(student).num_kv_heads == 2 and kv_geometry(student).head_dim == 16  # one geometry
        pr = build_distiller(student, in_process_plans(cfg, models), kv_geometry(student), cfg).projectors["qwen"]
        assert copied_from_teacher(cfg.student, cfg.teacher("qwen")) is copied, name
        assert (pr.kind, pr.student_side) == (("identity", False) if copied else ("fit", True)), name
        planned = plan(cfg)["devices"]["cpu"]["items"]  # identity: nothing trained, nothing saved for backward
        assert (sum(v for k, v in planned.items() if k.startswith("projectors + fusion")) == 0) is copied, name
    # FSDP2 would shard the maps fit fills on rank 0 and broadcasts: a sharded Distiller (its caller says so:
    # `RayConfig.sharded`; the Distiller reads no `ray` section) trains the apart student's projector linear
    fsdp = derive(cfg, {"ray.strategy": "fsdp", "ray.num_workers": 2})
    assert fsdp.ray.sharded and not cfg.ray.sharded
    fsdp_plans = in_process_plans(fsdp, models)
    assert build_distiller(student, fsdp_plans, kv_geometry(student), fsdp,
                           sharded=True).projectors["qwen"].kind == "linear"
    assert build_distiller(student, fsdp_plans, kv_geometry(student), fsdp).projectors["qwen"].kind == "fit"
    demo = load_config("demo_cpu")
    assert demo.align.projector.kind == "auto"
    assert all(copied_from_teacher(demo.student, t) for t in demo.teachers)


def test_kv_only_training_from_the_teachers_own_kv_raises_the_projector_free_cosine(pull_job):
    start, kv_id, curve = _arm(pull_job, "loss.ce_weight=0", "loss.kv_weight=1")
    _, ce_only, _ = _arm(pull_job, "loss.ce_weight=1", "loss.kv_weight=0")
    _, kv_random, random_curve = _arm(pull_job, "loss.ce_weight=0", "loss.kv_weight=1", "align.projector.kind=linear")
    # the identity start: student layer 0 reads the teacher's own embeddings (a copy, left out of the mean)
    assert start["layers"][0] == pytest.approx(1.0, abs=1e-4) and start["mean"] == pytest.approx(start["layers"][1])
    # through the identity "projector" the step's cosine is the projector-free one; through a random map it is ~0
    assert curve[1]["cos_sim"] > 0.5 and abs(random_curve[1]["cos_sim"]) < 0.2
    assert "grad_norm_projector" not in curve[1] and "grad_norm_projector" in random_curve[1]
    # measured on held-out batches: KV-only training moves the student toward its teacher; CE-only training and
    # a KV loss through a random projector move it away (measured: 0.905 -> 0.963, 0.428, 0.052)
    assert kv_id["mean"] - start["mean"] > 0.03, (start, kv_id)
    assert kv_id["mean"] > ce_only["mean"] + 0.1 and kv_id["mean"] > kv_random["mean"] + 0.1, (
        kv_id, ce_only, kv_random)
    # KV-only: the KV term is the whole loss, so its share of the student's gradient is 1
    assert all(v["grad/kv_share"] == pytest.approx(1.0, rel=1e-4) for v in curve.values())


def test_grad_kv_share_is_a_part_of_the_whole_with_ce(pull_job):
    _, _, curve = _arm(pull_job, "loss.ce_weight=1", "loss.kv_weight=1")
    shares = [v["grad/kv_share"] for v in curve.values()]
    assert all(0.0 < s < 1.0 for s in shares), shares
    _, _, ce_curve = _arm(pull_job, "loss.ce_weight=1", "loss.kv_weight=0")
    assert all(v["grad/kv_share"] == 0.0 == v["grad/kv_ratio"] for v in ce_curve.values())  # kv_weight 0: none


def test_bench_pull_reports_both_arms_per_layer(pull_job, tmp_path):
    from kava_ray.bench.pull import format_pull, run_pull_bench

    out = run_pull_bench(str(pull_job), steps=2, eval_every=1, share_steps=1, out=str(tmp_path / "pull"))
    assert set(out["arms"]) == {"old: linear projector", "new: auto"} and out["student_layers"] == [0, 3]
    for arm in out["arms"].values():
        assert [s for s, _ in arm["trajectory"]] == [0, 1, 2] and all(len(c) == 2 for _, c in arm["trajectory"])
        assert len(arm["grad_kv_share"]) == 1 and 0.0 < arm["grad_kv_share"][0] <= 1.0
        assert len(arm["grad_kv_ratio"]) == 1 and arm["grad_kv_ratio"][0] > 0  # |KV's gradient| / |CE's|
    new, old = out["arms"]["new: auto"], out["arms"]["old: linear projector"]
    assert (old["kind"], old["kv_weight"], new["kind"]) == ("linear", 1.0, "auto")  # the recipe before issue 39
    assert new["trajectory"][0] == old["trajectory"][0]  # one start
    assert new["step1_cos_through_projector"] > 0.5 > abs(old["step1_cos_through_projector"])
    assert "L1" in format_pull(out) and (tmp_path / "pull" / "bench_pull.json").exists()


def test_identity_with_flat_mode_is_one_line_before_anything_starts(pull_job):
    from kava_ray.common.errors import KavaError

    with pytest.raises(KavaError, match=r"identity needs align.mode: structured"):
        load_config(pull_job, ["align.projector.kind=identity", "align.mode=flat"])


@pytest.fixture(scope="module")
def fit_job(tmp_path_factory, tiny_qwen2_dir):
    """Another geometry: a 2-layer student of its own (1 kv head of 16 against the teacher's 2), layer map ratio."""
    from kava_ray.testing.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("fit")
    student = build_tiny_model(tmp / "student", family="qwen2", num_layers=2, hidden_size=32, num_heads=2,
                               num_kv_heads=1, seed=3)
    return write_job(tmp, tiny_qwen2_dir, tiny_qwen2_dir, tiny_qwen2_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"}],
                     student={"model": str(student), "dtype": "float32"},
                     align={"mode": "structured", "layer_map": "auto", "projector": {"kind": "fit", "dropout": 0.0}},
                     data={"source": "synthetic", "num_train": 64, "num_val": 8, "num_test": 8},
                     optim={"lr_student": 3e-3, "lr_projector": 3e-3, "warmup_steps": 0, "schedule": "constant"},
                     train={"steps": STEPS, "batch_size": 4, "max_length": 288, "log_steps": 1,
                            "eval_steps": STEPS, "save_steps": STEPS})


def _probe_arm(job, *overrides):
    """(the linear-probe cosine at step 0, after STEPS steps, the step metrics, the recipe): another geometry has
    no direct comparison, so the projector-free figure is a ridge probe fit on training batches, scored held out."""
    cfg = load_config(job, list(overrides))
    models = {"qwen": load_model(cfg.teachers[0].model, dtype="float32")}
    plans = in_process_plans(cfg, models)
    _, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 0)
    start = projector_free(recipe, cfg, plans, InProcessSource(models), "qwen")["kv_cos_free"]
    curve, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), STEPS)
    return start, projector_free(recipe, cfg, plans, InProcessSource(models), "qwen")["kv_cos_free"], curve, recipe


def test_a_fitted_student_side_map_starts_at_the_best_linear_fit_and_kv_training_pulls(fit_job):
    start, fit_end, curve, recipe = _probe_arm(fit_job, "loss.ce_weight=0")
    _, ce_end, _, _ = _probe_arm(fit_job, "loss.kv_weight=0")
    _, linear_end, linear_curve, _ = _probe_arm(fit_job, "loss.ce_weight=0", "align.projector.kind=linear")
    # step 1 compares the student's best linear image with the teacher: the probe's held-out score, not ~0 as
    # through a random linear projector (measured: 0.665 vs the probe's 0.664; linear 0.032)
    assert curve[1]["cos_sim"] == pytest.approx(start, abs=0.05) and start > 0.3
    assert abs(linear_curve[1]["cos_sim"]) < 0.2
    # frozen (train_map false): nothing but the student trains, and the map's fitted flag is saved with it
    pr = recipe.distiller.projectors["qwen"]
    assert pr.student_side and not any(p.requires_grad for p in pr.parameters()) and float(pr.k_map.fitted) == 1.0
    assert fit_maps(recipe, None) == []  # fitted once: a resumed run keeps its map
    # a map never fitted would train nothing (the KV gradient on the student is 0): refused
    from kava_ray.common.errors import KavaError
    from kava_ray.recipes.distill import DistillRecipe

    cfg = load_config(fit_job, ["loss.ce_weight=0"])
    models = {"qwen": load_model(cfg.teachers[0].model, dtype="float32")}
    unfitted = DistillRecipe(cfg, in_process_plans(cfg, models))
    unfitted.setup()
    with pytest.raises(KavaError, match="student-side map was never fitted"):
        unfitted.step(1, unfitted.data(InProcessSource(models), until=1).next_step(1))
    assert "grad_norm_projector" not in curve[1]
    # KV-only training raises the probe's cosine; CE-only (the trivial baseline) does not, and a random learned
    # projector pulls less (measured: 0.664 -> 0.865; CE-only 0.658; linear 0.812)
    assert fit_end - start > 0.1 and fit_end > ce_end + 0.1 and fit_end > linear_end + 0.02, (start, fit_end, ce_end,
                                                                                             linear_end)


def test_a_trained_map_learns_at_the_students_rate_and_fit_refuses_a_fused_target(fit_job):
    from kava_ray.common.errors import KavaError
    from kava_ray.core.distiller import param_groups
    from kava_ray.core.models import kv_geometry, load_student
    from kava_ray.recipes.build import build_distiller

    cfg = load_config(fit_job, ["align.projector.train_map=true", "optim.lr_projector=1e-2"])
    models = {"qwen": load_model(cfg.teachers[0].model, dtype="float32")}
    plans = in_process_plans(cfg, models)
    student = load_student(cfg.student.model, dtype="float32")
    groups = {g["name"]: g for g in param_groups(build_distiller(student, plans, kv_geometry(student), cfg), cfg.optim)}
    assert set(groups) == {"student", "map"} and groups["map"]["lr"] == cfg.optim.lr_student
    two = {"a": plans["qwen"], "b": plans["qwen"]}
    with pytest.raises(KavaError, match="use fusion.kind: sum with 2 teachers"):
        build_distiller(student, two, kv_geometry(student), cfg)
    assert build_distiller(student, two, kv_geometry(student),
                           load_config(fit_job, ["fusion.kind=sum"])).names == ["a", "b"]
    with pytest.raises(KavaError, match=r"fit needs align.mode: structured"):
        load_config(fit_job, ["align.mode=flat"])


def _hidden_loss(recipe, teacher, cfg) -> float:
    """Minitron's hidden-state loss of the recipe's student against `teacher` on the validation split, every
    student layer against its matched teacher layer (no map: one width), on the CE positions."""
    import torch

    from kava_ray.core.align.layers import heaviest_sources
    from kava_ray.core.kv import student_forward_kv, teacher_forward_kv
    from kava_ray.core.losses import hidden_cosine_loss, next_token_mask
    from kava_ray.data import collate

    student, split, total = recipe.distiller.student, recipe.val, []
    layers = recipe.plans["qwen"].layers  # each student layer against its heaviest mapped teacher layer (the term's)
    pairs = [list(layers).index(t) for t in heaviest_sources(recipe.plans["qwen"].layer_map)]
    with torch.no_grad():
        for s in range(0, len(split), 4):
            b = collate(split.items[s:s + 4], split.pad_id)
            t = teacher_forward_kv(teacher, b.input_ids, b.attention_mask, layers=layers, hidden=True)
            _, skv = student_forward_kv(student, b.input_ids, b.attention_mask, hidden=True)
            total.append(float(hidden_cosine_loss(skv.hidden, t.hidden[pairs], next_token_mask(b.labels))))
    return sum(total) / len(total)


def test_minitrons_hidden_state_loss_pulls_the_students_hidden_states(pull_job, fit_job):
    cfg = load_config(pull_job, ["loss.ce_weight=0", "loss.kv_weight=0", "loss.hidden_weight=1"])
    models = {"qwen": load_model(cfg.teachers[0].model, dtype="float32")}
    plans = in_process_plans(cfg, models)
    _, start_recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 0)
    start = _hidden_loss(start_recipe, models["qwen"], cfg)
    curve, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), STEPS)
    assert isinstance(recipe.distiller.hidden_proj["qwen"], torch.nn.Identity)  # one width: no map
    ce_cfg = load_config(pull_job, ["loss.kv_weight=0"])
    _, ce_recipe, _ = run_recipe(ce_cfg, plans, InProcessSource(models), STEPS)
    hid, ce = _hidden_loss(recipe, models["qwen"], cfg), _hidden_loss(ce_recipe, models["qwen"], cfg)
    # the step's own figure is the loss it trains; held out, the student's states move toward the teacher's
    # while CE-only training (the trivial baseline) moves them away (measured: 0.155 -> 0.027; CE-only 0.601)
    assert curve[1]["hidden_loss"] == pytest.approx(curve[1]["loss"]) and curve[1]["hidden_loss"] > 0
    assert hid < start - 0.02 and hid < ce - 0.05, (start, hid, ce)
    # another width: ModelOpt's ProjectionLayer (student hidden -> teacher hidden), trained with the projectors
    wide = load_config(fit_job, ["loss.ce_weight=0", "loss.kv_weight=0", "loss.hidden_weight=1"])
    curve, recipe, _ = run_recipe(wide, in_process_plans(wide, models), InProcessSource(models), 4)
    proj = recipe.distiller.hidden_proj["qwen"]
    assert isinstance(proj, torch.nn.Linear) and tuple(proj.weight.shape) == (64, 32)
    assert "grad_norm_projector" in curve[1] and curve[4]["hidden_loss"] < curve[1]["hidden_loss"]


def test_grad_kv_ratio_is_kvs_gradient_over_the_rest(pull_job):
    """grad/kv_ratio = |KV's gradient| / |CE's| on the student: with KV at weight w it scales with w (the KV gradient
    is linear in it, CE's is not touched); 0 without KV (`test_grad_kv_share_is_a_part_of_the_whole_with_ce`)."""
    ratios = {}
    for w in (1.0, 4.0):
        _, _, curve = _arm(pull_job, "loss.ce_weight=1", f"loss.kv_weight={w}")
        ratios[w] = curve[1]["grad/kv_ratio"]  # step 1: both from the same start
    assert ratios[4.0] == pytest.approx(4 * ratios[1.0], rel=1e-4) and ratios[1.0] > 0
