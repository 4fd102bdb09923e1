"""Students sharded with FSDP2 (`ray.strategy: fsdp`, `kava_ray.core.fsdp`) through Ray Train: two CPU workers on
gloo, the session's live teachers. The loss curve equals DDP's on the same data (within 1e-4 relative over 8 steps),
a run resumed from its sharded step-4 checkpoint (`torch.distributed.checkpoint`, every rank's shard in one Ray
checkpoint) continues on the same curve, and `final/student` is a whole Hugging Face model.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from jobs import train_steps, write_job
from kava_ray.common.config import load_config


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    return write_job(tmp_path_factory.mktemp("fsdpjob"), tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                     data={"num_train": 32, "num_val": 4, "num_test": 4},
                     train={"steps": 8, "save_steps": 4, "eval_steps": 100, "batch_size": 2, "num_to_keep": 2},
                     loss={"logit_weight": 0.5, "logit_top_k": 8},
                     ray={"num_workers": 2, "use_gpu": False})


def _run(job, strategy: str, name: str, resume=None):
    from kava_ray.recipes.train import run_training

    cfg = load_config(job, [f"ray.strategy={strategy}"])
    out = run_training(cfg, name=name, resume=resume, progress=False)
    return Path(out["run_dir"])


@pytest.fixture(scope="module")
def runs(tiny_pool, fsdp_job):
    """{ddp, fsdp, resumed}: run dirs of 8 steps each way, and an FSDP run resumed from the fsdp run's step 4."""
    ddp = _run(fsdp_job, "ddp", "ddp")
    fsdp = _run(fsdp_job, "fsdp", "fsdp")
    step4 = next(c for c in sorted(fsdp.glob("checkpoint_2*")) if '"step": 4' in (c / "state.json").read_text())
    resumed = _run(fsdp_job, "fsdp", "fsdp-resumed", resume=str(step4))
    return {"ddp": ddp, "fsdp": fsdp, "resumed": resumed, "step4": step4}


KEYS = ("loss", "ce", "kv_loss", "logit_kl", "cos_sim")


def test_fsdp_loss_curve_equals_ddp(runs):
    ddp, fsdp = train_steps(runs["ddp"]), train_steps(runs["fsdp"])
    assert sorted(fsdp) == sorted(ddp) == list(range(1, 9))
    for step in range(1, 9):
        for k in KEYS:
            assert fsdp[step][k] == pytest.approx(ddp[step][k], rel=1e-4), (step, k)
    assert fsdp[8]["loss"] != ddp[1]["loss"]  # it trained


def test_a_sharded_checkpoint_resumes_exactly(runs):
    step4 = runs["step4"]
    shards = sorted(p.name for p in (step4 / "sharded").iterdir())
    assert ".metadata" in shards and sum(p.endswith(".distcp") for p in shards) == 2  # both ranks' shards, merged
    assert not (step4 / "student" / "model.safetensors").exists()  # its weights are the shards
    whole, resumed = train_steps(runs["fsdp"]), train_steps(runs["resumed"])
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in range(5, 9):
        for k in KEYS:
            assert resumed[step][k] == pytest.approx(whole[step][k], rel=1e-6), (step, k)


def test_the_final_student_is_a_whole_hugging_face_model(runs):
    final = runs["fsdp"] / "final" / "student"
    student = AutoModelForCausalLM.from_pretrained(final)
    ddp = AutoModelForCausalLM.from_pretrained(runs["ddp"] / "final" / "student")
    for (n, a), (_, b) in zip(student.state_dict().items(), ddp.state_dict().items()):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-5), n


def test_eval_of_a_sharded_checkpoint_is_one_line(runs, capsys):
    from kava_ray.cli import main

    assert main(["eval", str(runs["step4"])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "FSDP2 shards" in err[0] and "final/" in err[0], err
