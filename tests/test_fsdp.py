"""Students sharded with FSDP2 (`ray.strategy: fsdp`, `kava_ray.core.fsdp`) through Ray Train: two CPU workers on
gloo, the session's live fp32 teacher (KV and top-k logits). The loss curve equals DDP's on the same data (within 1e-4
relative over 8 steps; DDP's 2-rank step computed in this process), its sharded step-4 checkpoint
(`torch.distributed.checkpoint`, every rank's shard in one Ray checkpoint) continues on the same curve, and
`final/student` is a whole Hugging Face model.
"""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from jobs import train_steps, write_job
from kava_ray.common.config import load_config


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory, tiny_qwen2_dir, tiny_student_dir):
    return write_job(tmp_path_factory.mktemp("fsdpjob"), tiny_qwen2_dir, None, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"}],
                     data={"num_train": 32, "num_val": 4, "num_test": 4},
                     train={"steps": 8, "save_steps": 4, "eval_steps": 100, "batch_size": 2, "num_to_keep": 2},
                     loss={"logit_weight": 0.5, "logit_top_k": 8},
                     align={"projector": {"dropout": 0.0}},  # (DDP's reference below runs both ranks as rank 0)
                     ray={"num_workers": 2, "use_gpu": False})


def _run(job, strategy: str, name: str, resume=None):
    from kava_ray.recipes.train import run_training

    cfg = load_config(job, [f"ray.strategy={strategy}"])
    out = run_training(cfg, name=name, resume=resume, progress=False)
    return Path(out["run_dir"])


@pytest.fixture(scope="module")
def runs(tiny_pool, fsdp_job):
    """{fsdp, step4}: the FSDP run's dir (8 steps through Ray Train) and its sharded step-4 checkpoint."""
    fsdp = _run(fsdp_job, "fsdp", "fsdp")
    step4 = next(c for c in sorted(fsdp.glob("checkpoint_2*")) if '"step": 4' in (c / "state.json").read_text())
    return {"fsdp": fsdp, "step4": step4}


def ddp_steps(job, resume=None) -> dict:
    """{step: metrics} of DDP on 2 ranks computed in this process (a Ray Train run of it would cost another worker
    group): rank 0's and rank 1's batches of each step (each rank's shard of the stream, as a DDP run reads them) as
    two micro-batches of one production step, each loss halved -- the gradient DDP all-reduces, (g0 + g1) / 2, and
    the metrics it averages over ranks (`tests/test_train.py` runs real DDP through Ray Train). resume: a sharded
    checkpoint to continue from (`checkpoint.load_into` -> `fsdp.load_sharded`: DCP reads every rank's shard into
    the whole model and optimizer) at its stream position."""
    from kava_ray.common.config import derive
    from kava_ray.core.checkpoint import load_into, read_state
    from kava_ray.core.models import load_model
    from kava_ray.core.plans import data_seed, in_process_plans
    from kava_ray.data import BatchStream
    from kava_ray.recipes.distill import DistillRecipe
    from kava_ray.testing.sources import InProcessSource

    cfg = load_config(job)
    teachers = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    plans, source = in_process_plans(cfg, teachers), InProcessSource(teachers)
    ranks = [DistillRecipe(cfg, plans, rank=r, world=2) for r in (0, 1)]
    state = read_state(resume) if resume else None
    feeds = []
    for r in ranks:
        r.setup()
        if state:  # the checkpoint's stream position on this rank's shard
            r.stream = BatchStream(r.train_split, cfg.train.batch_size, data_seed(cfg), rank=r.rank, world_size=2,
                                   state=state["stream"])
            r.start_step = state["step"]
        feeds.append(r.feed(source))
    model = ranks[0]
    if state:
        load_into(resume, model.distiller, model.opt, model.sched)
    model.cfg, model.world = derive(cfg, {"optim.accumulation": 2}), 1  # two micro-batches, no DDP wrapper
    curve = {}
    for step in range(model.start_step + 1, cfg.train.steps + 1):
        micro = [(batch, kv) for ((_, _, _, batch), kv) in (next(f) for f in feeds)]
        curve[step] = {k: float(v) for k, v in model.step(step, micro).items()}
    return curve


@pytest.fixture(scope="module")
def ddp_curve(fsdp_job):
    return ddp_steps(fsdp_job)


KEYS = ("loss", "ce", "kv_loss", "logit_kl", "cos_sim")


def test_fsdp_loss_curve_equals_ddp(runs, ddp_curve):
    fsdp = train_steps(runs["fsdp"])
    assert sorted(fsdp) == sorted(ddp_curve) == list(range(1, 9))
    for step in range(1, 9):
        for k in KEYS:
            assert fsdp[step][k] == pytest.approx(ddp_curve[step][k], rel=1e-4), (step, k)
    assert fsdp[8]["loss"] != fsdp[1]["loss"]  # it trained


def test_a_sharded_checkpoint_resumes_exactly(runs, fsdp_job, ddp_curve):
    """The sharded step-4 checkpoint holds every rank's shard (recorded in state.json) and the whole state: DDP's
    step continued from it (weights, AdamW moments, schedule, stream position) is the uninterrupted curve."""
    step4 = runs["step4"]
    shards = sorted(p.name for p in (step4 / "sharded").iterdir())
    assert ".metadata" in shards and sum(p.endswith(".distcp") for p in shards) == 2  # both ranks' shards, merged
    assert not (step4 / "student" / "model.safetensors").exists()  # its weights are the shards
    recorded = json.loads((step4 / "state.json").read_text())["files"]  # every rank's shard, checked before a resume
    assert {f"sharded/{p}" for p in shards} <= set(recorded)
    resumed, fsdp = ddp_steps(fsdp_job, resume=step4), train_steps(runs["fsdp"])
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in range(5, 9):
        for k in KEYS:
            assert resumed[step][k] == pytest.approx(ddp_curve[step][k], rel=1e-5), (step, k)
            assert resumed[step][k] == pytest.approx(fsdp[step][k], rel=1e-4), (step, k)


def test_the_final_student_is_a_whole_hugging_face_model(runs, fsdp_job):
    """final/student loads with transformers, has every weight, and is the trained student (not the start)."""
    from kava_ray.core.models import load_student

    student = AutoModelForCausalLM.from_pretrained(runs["fsdp"] / "final" / "student")
    start = load_student(load_config(fsdp_job).student.model, dtype="float32")
    got, init = student.state_dict(), start.state_dict()
    assert set(got) == set(init)
    changed = [n for n in got if not torch.equal(got[n], init[n])]
    assert len(changed) > 0.9 * len(got), len(changed)


def test_eval_of_a_sharded_checkpoint_is_one_line(runs, capsys):
    from kava_ray.cli import main

    assert main(["eval", str(runs["step4"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FSDP2 shards" in err[0] and "final/" in err[0], err


def test_a_sharded_checkpoint_continues_only_sharded_and_fsdp_refuses_student_sampling(runs, fsdp_job):
    """Shards into DDP (or a whole checkpoint into FSDP2) is one line naming the strategy; FSDP2 with the student
    sampling on-policy is refused at config (each rank's generate would gather layers a different number of times)."""
    from kava_ray.common.errors import KavaError
    from kava_ray.core.checkpoint import check_compatible

    with pytest.raises(KavaError, match="holds FSDP2 shards: continue it with ray.strategy=fsdp"):
        check_compatible(runs["step4"], load_config(fsdp_job))
    with pytest.raises(KavaError, match="ray.strategy.: fsdp cannot sample from the sharded student"):
        load_config(fsdp_job, ["ray.strategy=fsdp", "onpolicy.fraction=1"])
