"""Students sharded with FSDP2 (`ray.strategy: fsdp`, `kava_ray.core.fsdp`) through Ray Train: two CPU workers on
gloo, the session's live fp32 teacher (KV and top-k logits). The loss curve equals DDP's on the same data (within 1e-4
relative over 8 steps; DDP's 2-rank step computed in this process), its sharded step-4 checkpoint
(`torch.distributed.checkpoint`, every rank's shard in one Ray checkpoint) continues on the same curve, and
`final/student` is a whole Hugging Face model. Without Ray (2 spawned gloo ranks): gradient accumulation reduces once
per step under FSDP2 and DDP, and the shards live on the worker's device.
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
                     # (DDP's reference below runs both ranks as rank 0); identity: the tiny student has the
                     # teacher's KV geometry, and auto, fit for it, would be linear under FSDP2 and fit under DDP
                     align={"projector": {"dropout": 0.0, "kind": "identity"}},
                     ray={"num_workers": 2, "use_gpu": False})


def _run(job, strategy: str, name: str, resume=None, extra=()):
    from kava_ray.recipes.train import run_training

    cfg = load_config(job, [f"ray.strategy={strategy}", *extra])
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
    from kava_ray.core.checkpoint import load_data_state, load_into, read_state
    from kava_ray.core.models import load_model
    from kava_ray.recipes.distill import DistillRecipe
    from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

    cfg = load_config(job)
    teachers = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    plans, source = in_process_plans(cfg, teachers), InProcessSource(teachers)
    ranks = [DistillRecipe(cfg, plans, rank=r, world=2) for r in (0, 1)]
    state = read_state(resume) if resume else None
    feeds = []
    for r in ranks:
        r.setup()
        r.start_step = state["step"] if state else 0
        # the checkpoint's stream position on this rank's shard
        feeds.append(r.data(source, state=load_data_state(resume) if state else None))
    model = ranks[0]
    if state:
        load_into(resume, model.distiller, model.opt, model.sched)
    model.cfg, model.world = derive(cfg, {"optim.accumulation": 2}), 1  # two micro-batches, no DDP wrapper
    curve = {}
    for step in range(model.start_step + 1, cfg.train.steps + 1):
        micro = [next(f.next_step(step)) for f in feeds]
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


def test_a_sharded_checkpoint_continues_only_sharded(runs, fsdp_job):
    """Shards into DDP (or a whole checkpoint into FSDP2) is one line naming the strategy."""
    from kava_ray.common.errors import KavaError
    from kava_ray.core.checkpoint import check_compatible

    with pytest.raises(KavaError, match="holds FSDP2 shards: continue it with ray.strategy=fsdp"):
        check_compatible(runs["step4"], load_config(fsdp_job))


ON = ["onpolicy.fraction=1", "onpolicy.max_new_tokens=8", "train.steps=4", "train.save_steps=2"]


@pytest.mark.parametrize("lag,fraction", [(0, 1), (1, 0.5)])
def test_on_policy_samples_from_the_sharded_student_and_resumes_exactly(tiny_pool, fsdp_job, lag, fraction):
    """On-policy under FSDP2 (`rollout.student_weights`): every rank gathers the sharded student whole into its
    sampler's copy each round and samples its own rows; the run trains on the samples (its CE is off on them), and
    from its sharded step-2 checkpoint -- at lag 1 with each rank's batch sampled ahead in flight -- steps 3-4 are
    the uninterrupted curve, sampled tokens included. At fraction 0.5 some steps sample and some do not, on every
    rank alike (drawn per step: the ranks' gathers pair up, where a per-batch draw would hang them)."""
    from kava_ray.core.checkpoint import find_checkpoint

    extra = ON + [f"onpolicy.lag={lag}", f"onpolicy.fraction={fraction}"]
    full = _run(fsdp_job, "fsdp", f"onpolicy{lag}", extra=extra)
    curve = train_steps(full)
    assert sorted(curve) == [1, 2, 3, 4]
    sampled = {s for s, r in curve.items() if r.get("onpolicy/sampled_tokens", 0) > 0}
    assert sampled == {1, 2, 3, 4} if fraction == 1 else 0 < len(sampled) < 4, curve
    step2 = next(c for c in full.glob("checkpoint_2*") if '"step": 2' in (c / "state.json").read_text())
    assert (step2 / "sharded").is_dir() and find_checkpoint(full, for_resume=True) != step2
    resumed = train_steps(_run(fsdp_job, "fsdp", f"onpolicy{lag}-resumed", resume=str(step2), extra=extra))
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for k in ("loss", "logit_kl", "kv_loss", "onpolicy/sampled_tokens"):
            assert resumed[step].get(k) == curve[step].get(k), (step, k)


ACCUM = 3


def _accumulating_rank(rank: int, world: int, port: int, job: str, out: str) -> None:
    """One gloo rank (a spawned process, no Ray) of `test_accumulation_reduces_once_per_step`: the production step with
    optim.accumulation 3, sharded with FSDP2 on a host that looks like a GPU host (the machine's accelerator reported
    as cuda: the mesh must follow the worker's device, not the host), then unsharded under DDP; it counts FSDP2's
    reduce-scatters and DDP's bucket all-reduces per step and writes them, the mesh and the trained weights."""
    import os
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from kava_ray.bench.gpu import teacher_kv, teacher_model
    from kava_ray.core import fsdp
    from kava_ray.core.models import decoder_layers
    from kava_ray.recipes.distill import DistillRecipe
    from kava_ray.testing.inprocess_source import in_process_plans

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    for strategy in ("fsdp", "fsdp-micro", "ddp"):  # fsdp-micro: ray.fsdp_reduce micro_batch
        cfg = load_config(job, ["ray.strategy=ddp"] if strategy == "ddp" else
                          ["ray.strategy=fsdp",
                           f"ray.fsdp_reduce={'micro_batch' if strategy == 'fsdp-micro' else 'step'}"])
        t_model = teacher_model(cfg, "cpu")
        plans = in_process_plans(cfg, {"t": t_model})
        micro = [(b, teacher_kv(cfg, plans, t_model, b, "cpu")) for b in _micro_batches(cfg)[rank::world]]
        recipe = DistillRecipe(cfg, plans, rank, world)
        calls = {"n": 0, "before": []}
        if strategy != "ddp":
            with mock.patch.object(torch._C, "_get_accelerator", lambda: torch.device("cuda")):
                recipe.build_model()
            layer = decoder_layers(recipe.distiller.student)[0]
            result["mesh"] = [layer.self_attn.q_proj.weight.device_mesh.device_type,
                              str(layer.self_attn.q_proj.weight.device)]
            result["units"] = sum(fsdp.is_sharded(m) for m in recipe.distiller.modules())
            real = dist.reduce_scatter_single

            def counted(*a, **kw):
                calls["n"] += 1
                return real(*a, **kw)

            with mock.patch.object(dist, "reduce_scatter_single", counted):
                recipe.step(1, _seen(micro, calls))
            state = fsdp.full_model_state(recipe.distiller)
        else:
            def hook(pg, bucket):
                calls["n"] += 1
                return allreduce_hook(pg, bucket)

            def wrap(m):
                ddp = DistributedDataParallel(m)
                ddp.register_comm_hook(dist.group.WORLD, hook)
                return ddp

            recipe.build_model(wrap=wrap)
            recipe.step(1, _seen(micro, calls))
            state = recipe.distiller.state_dict()
        result[strategy] = calls["before"] + [calls["n"]]
        if rank == 0:
            torch.save({k: v.detach().cpu() for k, v in state.items()}, Path(out) / f"{strategy}.pt")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _seen(micro: list, calls: dict):
    """The micro-batches, noting before each how many reductions ran so far (micro-batch i's backward is done when
    the step asks for i + 1)."""
    for m in micro:
        calls["before"].append(calls["n"])
        yield m


def _micro_batches(cfg) -> list:
    """2 ranks x ACCUM micro-batches, each its own random tokens (rank r's are [r::2])."""
    from kava_ray.data import Batch

    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2 * ACCUM):
        ids = torch.randint(0, 256, (cfg.train.batch_size, 16), generator=g)
        mask = torch.ones_like(ids)
        out.append(Batch(ids, mask, labels=ids.clone(), answer_mask=mask))
    return out


def test_accumulation_reduces_once_per_step_and_the_shards_stay_on_the_workers_device(tmp_path, tiny_qwen2_dir,
                                                                                      tiny_student_dir):
    """optim.accumulation 3 on 2 gloo ranks (spawned, no Ray): FSDP2 reduce-scatters once per unit per step (the
    micro-batches before the last skip it through their backward, where FSDP2 reads the flag), not once per
    micro-batch; DDP all-reduces each bucket once per step; both end the step with the weights of one unsharded step
    over all 6 micro-batches. The FSDP2 mesh is the worker's device (cpu) on a host whose accelerator reads cuda."""
    import socket

    import torch.multiprocessing as mp

    from kava_ray.bench.gpu import teacher_kv, teacher_model
    from kava_ray.common.config import derive
    from kava_ray.recipes.distill import DistillRecipe
    from kava_ray.testing.inprocess_source import in_process_plans

    job = write_job(tmp_path, tiny_qwen2_dir, None, tiny_student_dir,
                    teachers=[{"name": "t", "model": str(tiny_qwen2_dir), "dtype": "float32"}],
                    optim={"accumulation": ACCUM, "warmup_steps": 0}, train={"batch_size": 2},
                    loss={"logit_weight": 0.5, "logit_top_k": 8},
                    align={"projector": {"dropout": 0.0, "kind": "linear"}}, ray={"num_workers": 2, "use_gpu": False})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_accumulating_rank, args=(2, port, str(job), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["mesh"] == ["cpu", "cpu"], r
        # reductions so far before micro-batch 1, 2, 3 and after the step: 2 decoder layers + the root, once
        assert r["units"] == 3 and r["fsdp"] == [0, 0, 0, 3], r
        assert r["fsdp-micro"] == [0, 3, 6, 9], r  # ray.fsdp_reduce: micro_batch: after every micro-batch
        assert r["ddp"][:ACCUM] == [0] * ACCUM and r["ddp"][-1] >= 1, r  # DDP's buckets: only in the last backward

    cfg = derive(load_config(job), {"optim.accumulation": 2 * ACCUM, "ray.num_workers": 1})
    t_model = teacher_model(cfg, "cpu")
    plans = in_process_plans(cfg, {"t": t_model})
    one = DistillRecipe(cfg, plans)
    one.build_model()
    micro = _micro_batches(cfg)
    one.step(1, [(b, teacher_kv(cfg, plans, t_model, b, "cpu")) for b in micro[0::2] + micro[1::2]])
    want = one.distiller.state_dict()
    for strategy in ("fsdp", "fsdp-micro", "ddp"):
        got = torch.load(tmp_path / f"{strategy}.pt")
        assert set(got) == set(want), strategy
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{strategy} {k}: {m}")
