"""On-policy distillation (`onpolicy`): the student samples completions of the records' prompts, the teachers -- one of
its tokenizer, one of another (SmolLM2's, aligned by characters) -- score what it wrote, and it trains on that;
in process (the production DistillRecipe and KVFeed over `InProcessSource`), then through Ray Train.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from jobs import assert_same_curve, pool_beside, run_recipe, write_job
from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import next_token_logprobs
from kava_ray.core.models import load_model
from kava_ray.data import IGNORE_INDEX
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

ON = ["onpolicy.fraction=1", "onpolicy.max_new_tokens=12", "loss.logit_weight=1", "loss.logit_top_k=8",
      "loss.kv_weight=0.1"]


@pytest.fixture(scope="module")
def ojob(tmp_path_factory, tiny_qwen2_dir, smol_teacher_dir, tiny_student_dir):
    tmp = tmp_path_factory.mktemp("onpolicy")
    return write_job(tmp, tiny_qwen2_dir, smol_teacher_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                               {"name": "smol", "model": str(smol_teacher_dir), "dtype": "float32"}],
                     data={"num_train": 32, "num_val": 4, "num_test": 4},
                     train={"steps": 6, "save_steps": 3, "eval_steps": 6, "batch_size": 2, "max_length": 320})


@pytest.fixture(scope="module")
def teachers(ojob):
    cfg = load_config(ojob)
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    return models, in_process_plans(cfg, models)


def _first_batch(cfg, plans, models):
    from kava_ray.recipes.distill import DistillRecipe

    recipe = DistillRecipe(cfg, plans)
    recipe.setup()
    data = recipe.data(InProcessSource(models), until=1)
    batch, kv = next(data.next_step(1))
    return recipe, data, batch, kv


def test_a_sampled_batch_is_the_prompt_and_the_students_completion_scored_by_both_teachers(ojob, teachers):
    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.lag=0"])
    recipe, _, batch, kv = _first_batch(cfg, plans, models)
    assert batch.source == "student"
    # the prompt is the record's own (everything before its answer), the completion what the student sampled
    data = recipe.train_split.items[0]
    for b in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[b].sum())
        loss = (batch.labels[b, :n] != IGNORE_INDEX).tolist()
        start = loss.index(True)
        assert all(loss[start:]) and 0 < n - start <= 12  # one run of sampled tokens, at most max_new_tokens
        assert batch.labels[b, start:n].tolist() == batch.input_ids[b, start:n].tolist()
    assert batch.input_ids.shape[1] <= len(data["input_ids"]) + 12
    # the sampling log-probs are the student's own at lag 0 (the same weights): an importance ratio of 1
    with torch.no_grad():
        logits = recipe.distiller.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    own = next_token_logprobs(logits, batch.input_ids)
    where = torch.nn.functional.pad(batch.labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False)
    torch.testing.assert_close(batch.sample_logp[where], own[where], atol=1e-4, rtol=1e-4)
    assert (batch.sample_logp[~where] == 0).all()
    # the teacher of the student's tokenizer scored every sampled token; SmolLM2's got the text in its tokens
    assert kv["qwen"].token_logp is not None and (kv["qwen"].token_logp[where] < 0).all()
    # ... aligned by characters about as well as the records' own rows are (causal: a byte takes a SmolLM2 token
    # where that token ends), the sampled completions included
    view = batch.teachers["smol"]
    real = batch.attention_mask != 0
    ok = view.align_hi > view.align_lo
    data_share = recipe.train_split.views["smol"].stats["aligned_fraction"]
    assert abs(float(ok[real].float().mean()) - data_share) < 0.1, (float(ok[real].float().mean()), data_share)
    assert float(ok[where].float().mean()) > 0.5 * data_share  # the completions too


def test_nothing_is_sampled_past_train_max_length(ojob, teachers, monkeypatch):
    """max_new_tokens just below train.max_length (320; the config refuses more): the student is asked for no token
    past max_length - the shortest prompt of the batch, where `sampled_batch` would cut it anyway (a huge
    max_new_tokens sampled for minutes)."""
    import kava_ray.rollout.engines
    from kava_ray.data.completions import prompts_of

    asked = []
    real = kava_ray.rollout.engines.sample
    monkeypatch.setattr(kava_ray.rollout.engines, "sample", lambda model, prompts, n, *a, **k: asked.append(n) or
                        real(model, prompts, n, *a, **k))
    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.lag=0", "onpolicy.max_new_tokens=319"])
    _, data, batch, _ = _first_batch(cfg, plans, models)
    assert asked == [320 - min(len(p) for p in prompts_of(batch))] and asked[0] < 319
    assert 0 < data.sampler.tokens <= batch.input_ids.shape[0] * asked[0]


def test_several_samples_per_prompt_form_groups_whose_other_rows_are_each_tokens_baseline(ojob, teachers):
    """onpolicy.samples_per_prompt 2 with loss.rkl_baseline loo (tinker's group of samples, RLOO's baseline): each
    prompt of the batch is sampled twice (two rows, one group id, their own completions), and the sampled reverse
    KL's baseline of a row is the mean advantage over the sampled tokens of the other row of its group; a step trains
    on it. group_mean (GRPO's mean, the row's own tokens included: a biased gradient) is refused, naming loo."""
    from kava_ray.core.logit_kd import logit_targets
    from kava_ray.data.completions import prompts_of

    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.lag=0", "onpolicy.samples_per_prompt=2", "loss.rkl_clip=0.2",
                                  "loss.logit_divergence=reverse_kl_sampled", "loss.rkl_baseline=loo"])
    recipe, _, batch, kv = _first_batch(cfg, plans, models)
    assert batch.input_ids.shape[0] == 2 * cfg.train.batch_size and batch.group.tolist() == [0, 0, 1, 1]
    prompts = prompts_of(batch)
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3] and prompts[0] != prompts[2]
    from kava_ray.core.losses import next_token_mask

    mask = next_token_mask(batch.labels)
    tg, _ = logit_targets(recipe.distiller.logit_specs["qwen"], kv["qwen"], batch, mask, cfg.loss, 10**6, "cpu")
    adv = (tg.token_logp - tg.sample_logp)[tg.m]
    rows = torch.arange(4)[:, None].expand_as(tg.m)[tg.m]
    assert float(tg.baseline[0, 0]) == pytest.approx(float(adv[rows == 1].mean()), rel=1e-6)
    assert float(tg.baseline[1, 0]) == pytest.approx(float(adv[rows == 0].mean()), rel=1e-6)
    assert float(tg.baseline[3, 0]) == pytest.approx(float(adv[rows == 2].mean()), rel=1e-6)
    out = recipe.step(1, [(batch, kv)])
    assert math.isfinite(float(out["loss"])) and float(out["onpolicy/sampled_tokens"]) > 0
    with pytest.raises(KavaError, match="loo needs several samples of each prompt"):
        load_config(ojob, ON + ["loss.logit_divergence=reverse_kl_sampled", "loss.rkl_baseline=loo"])
    with pytest.raises(KavaError, match=r"'loss.rkl_baseline': group_mean .* set loss.rkl_baseline=loo"):
        load_config(ojob, ON + ["loss.logit_divergence=reverse_kl_sampled", "onpolicy.samples_per_prompt=2",
                                "loss.rkl_baseline=group_mean"])
    with pytest.raises(KavaError, match="samples of each prompt, but onpolicy.fraction is 0"):
        load_config(ojob, ["onpolicy.samples_per_prompt=4"])  # an inert key is refused, not ignored
    with pytest.raises(KavaError, match="loss.rkl_clip': a stabiliser of loss.logit_divergence reverse_kl_sampled"):
        load_config(ojob, ON + ["loss.rkl_clip=0.2"])


def test_every_divergence_trains_on_the_samples_and_resume_is_exact(ojob, teachers, tmp_path):
    """jsd at lag 1 (sampled one step ahead) and the sampled reverse KL at lag 0: from a step-3 checkpoint, steps
    4..6 repeat the uninterrupted run (the batch sampled ahead is kept in the checkpoint; sampling is seeded by
    batch and rank)."""
    models, plans = teachers
    for extra in (["loss.logit_divergence=jsd", "onpolicy.lag=1"],
                  ["loss.logit_divergence=reverse_kl_sampled", "onpolicy.lag=0"]):
        cfg = load_config(ojob, ON + extra)
        full, _, _ = run_recipe(cfg, plans, InProcessSource(models), 6, tmp_path / extra[1][-5:], save_at=3)
        assert all(full[s]["onpolicy/sampled_tokens"] > 0 and full[s]["ce"] > 0 for s in full)
        assert all(math.isfinite(full[s]["logit_kl"]) for s in full)
        # lag 1: the batch sampled ahead is in flight at the save, pickled; lag 0: none, the state is plain JSON
        assert (tmp_path / extra[1][-5:] / "data_state.pt").is_file() == extra[1].endswith("1")
        resumed, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 6, resume=str(tmp_path / extra[1][-5:]))
        assert recipe.start_step == 3
        assert_same_curve(resumed, full, resumed, keys=("loss", "logit_kl", "onpolicy/sampled_tokens",
                                                        "onpolicy/reverse_kl_sum/qwen", "grad_norm"), tol=1e-6)


def test_a_figure_a_step_did_not_measure_is_absent_not_zero(ojob, teachers):
    """fraction 0.5, two micro-batches a step: a step that sampled nothing has no reverse KL in its record (it was
    0.0, diluting every mean over a run); a step with one sampled micro-batch of two has the sampled reverse KL of
    that one (the logit term's `logit_sampled_rkl`, the mean over the micro-batches that measured it, equal to the
    record's own reverse KL of the same tokens: it was half of it)."""
    from kava_ray.recipes.distill import DistillRecipe
    from kava_ray.recipes.step_records import step_record

    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.fraction=0.5", "onpolicy.lag=0", "optim.accumulation=2",
                                  "loss.logit_divergence=reverse_kl_sampled"])
    recipe = DistillRecipe(cfg, plans)
    recipe.setup()
    data = recipe.data(InProcessSource(models), until=6)
    kinds = set()
    for step in range(1, 7):
        values = recipe.step(step, data.next_step(step))
        values.update({k: torch.tensor(v, dtype=torch.float64) for k, v in data.step_metrics().items()})
        record = step_record(values, step, 1.0, recipe.last_lrs, 1, recipe.measured)
        sampled = recipe.measured.get("logit_sampled_rkl/qwen", 0)
        kinds.add(sampled)
        assert ("onpolicy/reverse_kl/qwen" in record) == (sampled > 0) == (record["onpolicy/sampled_tokens"] > 0)
        assert ("logit_sampled_rkl/qwen" in record) == (sampled > 0), record
        if sampled:
            assert record["logit_sampled_rkl/qwen"] == pytest.approx(record["onpolicy/reverse_kl/qwen"], rel=1e-4)
        assert math.isfinite(record["loss"]) and recipe.measured["loss"] == 2
    assert kinds >= {0, 1}, kinds  # (the draw is by batch key: fixed for this job and seed)


def _rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks of `test_a_metric_some_ranks_measured_is_their_mean`: its step values -> reduce_metrics."""
    import json

    import torch.distributed as dist

    from kava_ray.recipes.step_records import reduce_metrics

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    values = {"loss": t(1.0 + rank), "cos_sim": t(0.2 if rank == 0 else 0.8), "tokens": t(10.0 * (rank + 1))}
    measured = {"loss": 2, "cos_sim": 2 if rank == 0 else 1, "tokens": 2}
    if rank == 1:  # only rank 1 sampled (one of its two micro-batches)
        values["logit_sampled_rkl/qwen"], measured["logit_sampled_rkl/qwen"] = t(0.3), 1
    got = reduce_metrics(values, 2, measured)
    dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(got))


def test_a_metric_some_ranks_measured_is_their_mean(tmp_path):
    """Two ranks (gloo, two processes): `reduce_metrics` averages a metric over the micro-batches of every rank that
    measured it -- a rank (or micro-batch) that did not adds no 0 -- and sums counts; the ranks' names may differ."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got == pytest.approx({"loss": 1.5, "cos_sim": (2 * 0.2 + 0.8) / 3, "tokens": 30.0,
                                     "logit_sampled_rkl/qwen": 0.3}), (rank, got)


def test_a_teacher_writes_the_completions_for_sequence_level_kd(ojob, teachers):
    """`onpolicy.source: teacher` (TRL's seq_kd): the named teacher writes each completion, seeded like the student's
    samples; CE stays on (it is the teacher's text) and no sampling log-probs travel."""
    from kava_ray.data.completions import prompts_of

    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.source=teacher", "onpolicy.teacher=qwen", "onpolicy.lag=0"])
    _, data, batch, kv = _first_batch(cfg, plans, models)
    assert batch.source == "teacher" and batch.sample_logp is None
    prompts = prompts_of(batch)
    written = [batch.input_ids[b, len(p):int(batch.attention_mask[b].sum())].tolist() for b, p in enumerate(prompts)]
    key = data.stream.state()  # the batch's seed: (train.seed, its data key, rank)
    assert key["step"] == 1 and all(0 < len(w) <= 12 for w in written)
    out, _, _ = run_recipe(cfg, plans, InProcessSource(models), 2)
    assert all(math.isfinite(out[s]["loss"]) and out[s]["loss"] >= out[s]["ce"] > 0 for s in out)
    assert all(out[s]["onpolicy/sampled_tokens"] == 0 for s in out)  # nothing the student sampled


def test_records_that_name_their_teacher_are_taught_by_it_alone(ojob, teachers, tmp_path):
    """A `teacher` column (NeMo-RL's MOPD): a row's logit term is its named teacher's alone, and the step's logit loss
    is the mean over positions of each position's own teacher's term -- here on the student's own samples."""
    import json

    from kava_ray.core.losses import next_token_mask
    from kava_ray.recipes.distill import DistillRecipe
    from tiny_models import logit_term

    models, plans = teachers
    for split, n in (("train", 16), ("validation", 4), ("test", 4)):
        rows = [{"prompt": f"Q: what is {i} plus {i + 3}?\nA:", "completion": f" {2 * i + 3}",
                 "teacher": ("qwen", "smol")[i % 2]} for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = load_config(ojob, ON + ["onpolicy.lag=0", f"data.source={tmp_path}/{{split}}.jsonl",
                                  "data.val_split=validation", "data.num_train=16", "data.num_val=4", "data.num_test=4",
                                  "train.batch_size=4"])
    recipe = DistillRecipe(cfg, plans)
    recipe.setup()
    data = recipe.data(InProcessSource(models), until=2)
    for step in (1, 2):
        batch, kv = next(data.next_step(step))
        assert batch.source == "student" and sorted(set(batch.route)) <= ["qwen", "smol"]
        with torch.no_grad():
            m = recipe.distiller(batch, kv).metrics
            logits = recipe.distiller.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            mask = next_token_mask(batch.labels)
            expected, count = 0.0, 0
            for t in ("qwen", "smol"):  # each teacher's term on its own rows, weighted by their positions
                rows = torch.tensor([r == t for r in batch.route])[:, None]
                spec = recipe.distiller.logit_specs[t]
                loss_t, _ = logit_term(spec, logits, kv[t], batch, mask & rows, cfg.loss)
                expected += float(loss_t) * int((mask & rows).sum())
                count += int((mask & rows).sum())
        assert float(m["logit_kl"]) == pytest.approx(expected / count, rel=1e-5)
    # a batch that mixes named and unnamed rows: a named row's positions are its teacher's alone (weight 1), an
    # unnamed row's split by the fusion weights -- each position exactly its teachers' weights (one coefficient per
    # teacher times a mean over all its positions gave a named row 0.75 here, not 1)
    batch.route = ["qwen", "", "smol", ""]
    w = recipe.distiller.fusion.current_weights()
    with torch.no_grad():
        m = recipe.distiller(batch, kv).metrics
        free = torch.tensor([not r for r in batch.route])[:, None] & mask
        expected = 0.0
        for t in ("qwen", "smol"):
            spec = recipe.distiller.logit_specs[t]
            rows = torch.tensor([r == t for r in batch.route])[:, None] & mask
            expected += float(logit_term(spec, logits, kv[t], batch, rows, cfg.loss)[0]) * int(rows.sum())
            expected += float(w[t]) * float(logit_term(spec, logits, kv[t], batch, free, cfg.loss)[0]) * int(free.sum())
    assert float(m["logit_kl"]) == pytest.approx(expected / int(mask.sum()), rel=1e-5)
    batch.route = ["qwen"] * len(batch.route)  # no row for smol: its figures are not measured (absent, not 0)
    with torch.no_grad():
        m = recipe.distiller(batch, kv).metrics
    assert "logit_kl/qwen" in m and "top1_agree/qwen" in m
    assert not [k for k in m if k.endswith("/smol") and k.startswith(("logit_", "top1_agree"))], sorted(m)
    with pytest.raises(KavaError, match="names teacher 'nobody'"):
        batch.route = ["nobody"] * len(batch.route)
        recipe.distiller(batch, kv)


def test_a_flag_file_says_when_the_worker_is_sampling(ojob, teachers, tmp_path):
    """What the driver's progress bar reads (`runtime.progress`): rank 0's sampler holds `RUN_DIR/sampling.now` while it
    samples, and only then."""
    from kava_ray.common.metrics_file import SAMPLING
    from kava_ray.recipes.distill import DistillRecipe

    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.lag=0"])
    recipe = DistillRecipe(cfg, plans)
    recipe.setup()
    flag = tmp_path / SAMPLING
    data = recipe.data(InProcessSource(models), until=2, flag=flag)
    seen, inner = [], data.sampler._sample
    data.sampler._sample = lambda *a: (seen.append(flag.exists()), inner(*a))[1]
    next(data.next_step(1))
    assert seen == [True] and not flag.exists()


def test_a_typo_in_the_section_is_one_line(ojob):  # text records: tests/test_preflight.py (where they are known)
    with pytest.raises(KavaError, match="onpolicy.fractoin"):
        load_config(ojob, ["onpolicy.fractoin=1"])
    with pytest.raises(KavaError, match="reverse_kl_sampled needs the student's samples"):
        load_config(ojob, ["loss.logit_divergence=reverse_kl_sampled"])
    with pytest.raises(KavaError, match=r"'onpolicy.top_p': 0.9 never samples the student's tokens "
                                        r"outside the nucleus"):
        load_config(ojob, ON + ["loss.logit_divergence=reverse_kl_sampled", "onpolicy.top_p=0.9"])
    with pytest.raises(KavaError, match=r"^config key 'onpolicy.temperature': 0.7 draws the samples' prefixes from "
                                        r"the tempered q.*: set onpolicy.temperature=1 with"):
        load_config(ojob, ON + ["loss.logit_divergence=reverse_kl_sampled", "onpolicy.temperature=0.7"])
    load_config(ojob, ON + ["loss.logit_divergence=jsd", "onpolicy.temperature=0.7"])  # the dense forms take any q


@pytest.fixture(scope="module")
def sure_teacher(tmp_path_factory, tiny_qwen2_dir):
    """The tiny Qwen2 teacher with its LM head scaled 30x: a confident next-token distribution (a random tiny model's
    is nearly uniform, which a student already matches)."""
    path = tmp_path_factory.mktemp("sure")
    model = load_model(str(tiny_qwen2_dir), dtype="float32")
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    from kava_ray.core.models import load_tokenizer

    load_tokenizer(str(tiny_qwen2_dir)).save_pretrained(path)
    return path


@pytest.mark.parametrize("divergence", ["jsd", "reverse_kl"])
def test_on_policy_lowers_the_teacher_scored_reverse_kl_of_the_students_samples(sure_teacher, tiny_student_dir,
                                                                               tmp_path, divergence):
    """The learning metric against a trivial baseline: 16 on-policy steps with the logit term lower the teacher's
    reverse KL of what the student samples (`onpolicy/reverse_kl/<t>`, log q - log pi_T per sampled token) well below
    the same run without it (the KV term alone, the same samples' seeds). (The sampled form, a one-sample policy
    gradient, moves the same metric far more slowly at this size: its gradient is checked exactly in
    tests/test_divergences.py.)"""
    job = write_job(tmp_path, sure_teacher, sure_teacher, tiny_student_dir,
                    teachers=[{"name": "sure", "model": str(sure_teacher), "dtype": "float32"}],
                    data={"num_train": 64, "num_val": 4, "num_test": 4},
                    train={"steps": 16, "batch_size": 4, "max_length": 320},
                    optim={"lr_student": 1e-2, "lr_projector": 1e-2, "warmup_steps": 0})
    models = {"sure": load_model(str(sure_teacher), dtype="float32")}
    curves = {}
    for arm, extra in (("logits", [f"loss.logit_divergence={divergence}"]), ("baseline", ["loss.logit_weight=0"])):
        cfg = load_config(job, ON + ["onpolicy.lag=0"] + extra)
        out, _, _ = run_recipe(cfg, in_process_plans(cfg, models), InProcessSource(models), 16)
        curves[arm] = [out[s]["onpolicy/reverse_kl_sum/sure"] / out[s]["onpolicy/sampled_tokens"] for s in sorted(out)]
    assert curves["logits"][0] == pytest.approx(curves["baseline"][0])  # the same start, the same first samples
    last = {arm: sum(c[-4:]) / 4 for arm, c in curves.items()}
    assert last["logits"] < 0.8 * last["baseline"], curves


@pytest.fixture(scope="module")
def opool(tiny_pool, ojob):
    """`smol` beside the session's pool (its `qwen` is this job's) for this module."""
    yield from pool_beside(ojob)


def test_fraction_one_trains_on_its_own_samples_through_ray_train(opool, ojob, capfd):
    """`onpolicy.fraction: 1` through Ray Train and the teacher actors (one of the student's tokenizer, one of
    SmolLM2's): every step samples, both teachers score the samples, the step's time says what sampling took. The
    console says the run is on-policy and what its loss is; the final table has the on-policy figures."""
    from jobs import read_jsonl
    from kava_ray.cli.train import format_final
    from kava_ray.recipes.train import run_training

    cfg = load_config(ojob, ON + ["loss.logit_divergence=reverse_kl_sampled", "train.steps=4", "train.save_steps=2",
                                  "train.eval_steps=4"])
    capfd.readouterr()
    out = run_training(cfg, name="onpolicy", progress=False)
    err = capfd.readouterr().err.splitlines()
    at = next(i for i, line in enumerate(err) if line.startswith("training: 4 steps, 1 worker -> "))
    assert err[at + 1:at + 3] == [
        "loss: ce 1 (off on the student's samples) + kv 0.1 (mercator, fusion fixed) + logit 1 (reverse_kl_sampled, "
        "top-8)",
        "on-policy: fraction 1 of the batches completed by the student (up to 12 new tokens, temperature 1, top_p 1), "
        "lag 1"], err
    table = {line.split()[0] for line in format_final(out).splitlines()[2:-1]}
    assert {"onpolicy/reverse_kl/qwen", "onpolicy/sampled_tokens", "logit_kl", "logit_kl/smol", "time/sample_s",
            "logit_sampled_rkl/qwen", "top1_agree/qwen", "loss", "eval/ce"} <= table, table
    records = read_jsonl(Path(out["run_dir"]) / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["onpolicy/sampled_tokens"] > 0, r
        # (a one-sample estimate of KL: near 0, either sign, between two near-uniform random models)
        assert abs(r["onpolicy/reverse_kl/qwen"]) < 5 and math.isfinite(r["logit_kl/smol"]), r
        assert r["time_s"] > r["time/sample_s"] + r["teacher_wait_s"]
    # lag 1: each step samples the next one's batch (the last step has none to sample)
    assert all(r["time/sample_s"] > 0 for r in train[:-1]) and train[-1]["time/sample_s"] == 0
    assert (Path(out["run_dir"]) / "final" / "student" / "config.json").is_file()
    assert any(r["kind"] == "test" and math.isfinite(r["test/ce"]) for r in records)
