"""Fault suite: what a run does when a part of it fails, each case with a bounded time.

    driver SIGTERM, then --resume    exit 143 in one line (Ctrl-C's path) with the resume hint, its embedded Ray
      with the teacher killed        gone; the resumed run, whose teacher is SIGKILLed mid-way, finishes on the
                                     uninterrupted curve
    group SIGTERM while sampling     the same line and exit within 45 s (no dead-GCS wait), no sampling.now left
    a loss that is not finite        one line naming the step and the terms; the last good checkpoint stays
    disk full / partial copy         one line; the previous checkpoint is never replaced and still loads
    NaN/Inf teacher KV               train.on_bad_kv: skip (counted, resume stays exact) | stop (one line)
    corrupt / truncated checkpoint   one line naming the file, for --resume and `kava-ray eval`

Fast cases run the real DistillRecipe + KVFeed in process (`InProcessSource`, `jobs.run_recipe`); the Ray
case is compared with one reference curve computed the same way in process (`ref_curve`): `kava-ray train` runs
as a subprocess with its own embedded Ray until the SIGTERM, and the resume runs on the session's Ray and its
teacher pool, where the teacher is killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from jobs import assert_same_curve, run_recipe, train_steps, train_steps_so_far, write_job
from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.checkpoint import load_data_state
from kava_ray.rollout.feed import BadKV, KVFeed, feed_items
from kava_ray.testing.inprocess_source import InProcessSource

STEPS, SAVE = 24, 3
KVCLI = str(Path(sys.executable).with_name("kava-ray"))


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_qwen2_dir, tiny_student_dir):
    """One fp32 teacher -> the 2-layer student; 24 steps, a checkpoint every 3, evaluation only at 0 and 24
    (21 steps after the first checkpoint: room for the SIGTERM case's interrupt to land on a loaded box)."""
    return write_job(tmp_path_factory.mktemp("faults"), tiny_qwen2_dir, None, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"}],
                     data={"num_train": 64, "num_val": 4, "num_test": 4},
                     train={"steps": STEPS, "save_steps": SAVE, "eval_steps": 1000, "batch_size": 2,
                            "num_to_keep": 2})


# ------------------------------------------------------------------------ in process: NaN KV, checkpoints


class PoisonSource(InProcessSource):
    """The real teacher forward, with NaN written into one teacher's K (or V) for the batch keys in `poison`."""

    def __init__(self, models: dict, poison: set, teacher: str = "qwen", what: str = "keys"):
        super().__init__(models)
        self.poison, self.teacher, self.what = poison, teacher, what

    def result(self, name, request, future):
        payload = super().result(name, request, future)
        if name == self.teacher and request.key in self.poison:
            from kava_ray.core.kv import KVBatch

            kv = KVBatch.from_wire(payload, dtype=torch.float32)
            getattr(kv, self.what)[..., 0] = float("nan") if self.what == "keys" else float("inf")
            payload = kv.to_wire(request.wire_dtype)
        return payload


@pytest.fixture(scope="module")
def teachers(job):
    from kava_ray.core.models import load_model

    cfg = load_config(job)
    return {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}


@pytest.fixture(scope="module")
def plans(job, teachers):
    from kava_ray.core.models import kv_geometry
    from kava_ray.core.plans import student_geometry, teacher_plans

    cfg = load_config(job)
    geoms = {n: kv_geometry(m).to_dict() for n, m in teachers.items()}
    return teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))


def stream_keys(cfg, n: int) -> list[str]:
    from kava_ray.core.plans import student_tokenizer
    from kava_ray.data import BatchStream
    from kava_ray.data.splits import data_seed, load_splits

    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    stream = BatchStream(train, cfg.train.batch_size, data_seed(cfg.train))
    return [stream.next()[0] for _ in range(n)]


def test_on_bad_kv_config(job):
    assert load_config(job).train.on_bad_kv == "skip"
    assert load_config(job, ["train.on_bad_kv=stop"]).train.on_bad_kv == "stop"
    with pytest.raises(KavaError) as e:
        load_config(job, ["train.on_bad_kv=ignore"])
    assert "on_bad_kv" in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_nan_kv_is_skipped_counted_and_resume_stays_exact(job, teachers, plans, tmp_path, caplog):
    """Two poisoned batches (one before the checkpoint, one in flight at it): each is dropped with one warning,
    the step takes the next batch, `skipped` counts both, and a run resumed from the checkpoint continues on
    the same curve (the saved stream position accounts for the skip)."""
    cfg = load_config(job, ["optim.accumulation=1"])
    keys = stream_keys(cfg, 8)
    poison = {keys[1], keys[4]}  # b1 before the step-3 checkpoint; b4 is in flight when it is written
    clean, _, _ = run_recipe(cfg, plans, InProcessSource(teachers), 3)
    with caplog.at_level("WARNING", logger="kava_ray.rollout.feed"):
        full, _, data = run_recipe(cfg, plans, PoisonSource(teachers, poison), 6, tmp_path / "ck", save_at=3)
    warned = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(warned) == 2 and keys[1] in warned[0] and "qwen" in warned[0], warned
    assert data.skipped == 2 and [full[s]["skipped"] for s in range(1, 7)] == [0, 1, 1, 2, 2, 2]
    assert full[1]["loss"] == pytest.approx(clean[1]["loss"], abs=1e-6)  # b0 both times
    assert full[2]["loss"] != pytest.approx(clean[2]["loss"], abs=1e-6)  # b2 instead of b1
    state = load_data_state(tmp_path / "ck")
    assert state["stream"]["skipped"] == [1] and state["stream"]["position"] == 3  # trained-on batches only
    assert not (tmp_path / "ck" / "data_state.pt").exists()  # nothing pickled off-policy: plain JSON
    # a checkpoint of an earlier version (the stream in state.json, no data_state.json) reads the same
    legacy = json.loads((tmp_path / "ck" / "state.json").read_text())
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "state.json").write_text(json.dumps({**legacy, "stream": state["stream"]}))
    assert load_data_state(tmp_path / "legacy") == {**state, "in_flight": []}
    resumed, recipe, data2 = run_recipe(cfg, plans, PoisonSource(teachers, poison), 6, resume=str(tmp_path / "ck"))
    assert data2.skipped_before == 1 and data2.feed.skipped == 1  # b4 skipped again, after the restored b1
    for step in (4, 5, 6):
        for k in ("loss", "ce", "kv_loss", "cos_sim", "grad_norm"):
            assert resumed[step][k] == pytest.approx(full[step][k], abs=1e-6), (step, k)
        assert resumed[step]["skipped"] == full[step]["skipped"]


def test_skip_accounting_per_rank_under_ddp_sharding(job):
    """Ranks skip different batches (each reads its own shard): the checkpoint saves the trained-on position
    (the same for all ranks) plus each rank's count, and each rank resumes past exactly its own skips."""
    from kava_ray.core.plans import student_tokenizer
    from kava_ray.data import BatchStream
    from kava_ray.data.splits import data_seed, load_splits
    from kava_ray.rollout.step_source import skip_resumed, stream_state_after

    cfg = load_config(job)
    tok, _ = student_tokenizer(cfg.student)
    train, _ = load_splits(cfg.data, cfg.train, tok)
    streams = [BatchStream(train, 2, data_seed(cfg.train), rank=r, world_size=2) for r in (0, 1)]
    skips, in_flight, trained = [0, 3], 2, 5
    for r, s in enumerate(streams):
        for _ in range(trained + skips[r] + in_flight):
            s.next()
    states = [stream_state_after(s, in_flight, skips) for s in streams]
    assert states[0]["position"] == states[1]["position"] == trained and states[0]["skipped"] == skips
    for r in (0, 1):
        restored = BatchStream(train, 2, data_seed(cfg.train), rank=r, world_size=2, state=states[0])
        assert skip_resumed(restored, states[0]) == skips[r]
        expect = BatchStream(train, 2, data_seed(cfg.train), rank=r, world_size=2)
        for _ in range(trained + skips[r]):
            expect.next()
        assert restored.next()[0] == expect.next()[0]
    wrap = BatchStream(train, 2, data_seed(cfg.train))
    wrap.position = wrap.steps_per_epoch - 1
    skip_resumed(wrap, {"skipped": [3]})
    assert (wrap.epoch, wrap.position) == (1, 2)


def test_nan_kv_stop_is_one_line_naming_teacher_key_and_step(job, teachers, plans):
    cfg = load_config(job, ["train.on_bad_kv=stop", "optim.accumulation=1"])
    keys = stream_keys(cfg, 3)
    with pytest.raises(KavaError) as e:
        run_recipe(cfg, plans, PoisonSource(teachers, {keys[2]}, what="values"), 4)
    msg = str(e.value)
    assert msg == f"teacher 'qwen' sent non-finite V (NaN/Inf) for batch {keys[2]} at step 3 (train.on_bad_kv=stop)"
    feed = KVFeed(PoisonSource(teachers, {keys[0]}), feed_items(_stream(cfg), 1), {"qwen": plans["qwen"].layers},
                  on_bad_kv="stop")
    with pytest.raises(BadKV) as e2:
        next(feed)
    assert e2.value.teacher == "qwen" and e2.value.key == keys[0]


def _stream(cfg):
    from kava_ray.core.plans import student_tokenizer
    from kava_ray.data import BatchStream
    from kava_ray.data.splits import data_seed, load_splits

    tok, _ = student_tokenizer(cfg.student)
    return BatchStream(load_splits(cfg.data, cfg.train, tok)[0], cfg.train.batch_size, data_seed(cfg.train))


@pytest.fixture(scope="module")
def good_ckpt(job, teachers, plans, tmp_path_factory):
    """A checkpoint after 2 steps (with optimizer state)."""
    cfg = load_config(job)
    path = tmp_path_factory.mktemp("good") / "checkpoint_2000-01-01_00-00-00.000000"
    run_recipe(cfg, plans, InProcessSource(teachers), 2, ckpt_dir=path, save_at=2)
    return path


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    from kava_ray.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, [ln for ln in err.strip().splitlines() if ln.strip()]


CORRUPTIONS = {
    "state_not_json": ("state.json", lambda f: f.write_text('{"step": 2, "stre')),
    "student_truncated": ("student/model.safetensors", lambda f: f.write_bytes(f.read_bytes()[:1000])),
    "projectors_truncated": ("projectors.safetensors", lambda f: f.write_bytes(f.read_bytes()[:-7])),
    "optimizer_missing": ("optimizer.pt", lambda f: f.unlink()),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
@pytest.mark.parametrize("command", ["eval", "resume"])
def test_corrupt_checkpoint_is_one_line_naming_the_file(good_ckpt, job, tmp_path, capsys, case, command):
    """Before any Ray starts: `kava-ray eval CKPT` and `kava-ray train --resume CKPT` exit 2 with one line."""
    rel, corrupt = CORRUPTIONS[case]
    ck = tmp_path / good_ckpt.name
    shutil.copytree(good_ckpt, ck)
    corrupt(ck / rel)
    argv = ["eval", str(ck)] if command == "eval" else ["train", "--config", str(job), "--resume", str(ck)]
    rc, err = _cli(capsys, *argv)
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and rel in err[0], err


# ------------------------------------------------------------------------ one writer per run dir


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_one_writer_per_run_dir_with_two_real_processes(good_ckpt, job, tmp_path, capsys):
    """A live `kava-ray train` holds its run dir (`common.run_lock`, taken before Ray starts): a second `train` of
    that name or a `--resume` of it is one line naming the holder's command and pid, exit 2, nothing written; `eval`
    of a live run pins the checkpoint it reads (the run may delete it: `num_to_keep`) and says so, and before the
    first checkpoint says "no checkpoint yet"; once the holder is SIGKILLed its lock is taken over with a line."""
    from kava_ray.common.run_lock import LOCK, run_lock
    from kava_ray.core.checkpoint import check_files, held_checkpoint

    storage = Path(load_config(job).ray.storage_path)
    run = storage / "live"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    holder = subprocess.Popen([KVCLI, "train", "--config", str(job), "--name", "live"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not ((run / LOCK).is_file() and (run / LOCK).read_text()):
            time.sleep(0.01)
        os.killpg(holder.pid, signal.SIGSTOP)  # held, before its Ray: the writer stays live and does no more
        assert json.loads((run / LOCK).read_text())["pid"] == holder.pid
        # a live run without a checkpoint: eval says so and writes nothing
        (run / "metrics.jsonl").write_text("")  # (what the run writes at its first step)
        before = _listing(run)
        rc, err = _cli(capsys, "eval", str(run))
        assert rc == 2 and len(err) == 1 and "no checkpoint yet (its run is live: `kava-ray train`" in err[0], err
        assert f"pid {holder.pid} " in err[0] and _listing(run) == before, err
        # a second writer, by name and by --resume: one line naming the holder; nothing written
        shutil.copytree(good_ckpt, run / good_ckpt.name)
        before = _listing(run)
        for argv in (["train", "--config", str(job), "--name", "live"], ["train", "--resume", str(run)]):
            rc, err = _cli(capsys, *argv)  # (this process: the second of the two)
            assert rc == 2 and len(err) == 1, err
            assert err[0].startswith(f"error: {run} is in use by `kava-ray train` (pid {holder.pid} on "), err
            assert _listing(run) == before
        # eval's read of a live run: pinned (hard links), so the run deleting it mid-read loses nothing
        with held_checkpoint(run) as (ckpt, real, live):
            assert real == run / good_ckpt.name and ckpt != real and live and f"pid {holder.pid}" in live
            assert "checkpoint of step 2, pinned" in live
            shutil.rmtree(real)  # what num_to_keep does when the run saves its next one
            check_files(ckpt)  # every file whole
        assert not [p for p in storage.iterdir() if p.name.startswith(".live-read-")]  # the pin is gone
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    said = []
    with run_lock(run, "kava-ray train --resume", say=said.append):  # the dead holder's lock: taken over, a line
        assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"taking over the lock of `kava-ray train` (pid {holder.pid} on " in said[0], said
    assert "which is no longer running" in said[0]
    # a finished run's name without --resume: one line, before anything starts
    rc, err = _cli(capsys, "train", "--config", str(job), "--name", "live")
    assert rc == 2 and err == ["error: live exists: `--resume` it or pick another `--name`"], err


def test_train_needs_a_config_or_a_run_to_resume(capsys):
    rc, err = _cli(capsys, "train", "train.steps=2")
    assert rc == 2 and err == ["error: train: --config is required (a YAML file or a preset), or --resume RUN_DIR "
                               "to continue a run with the config it saved"], err


def test_corrupt_tensor_file_without_a_size_record_is_one_line(good_ckpt, job, plans, tmp_path):
    """A checkpoint whose state.json has no size record (older versions): load_into names the bad file."""
    from kava_ray.core.checkpoint import load_into, read_state
    from kava_ray.core.models import kv_geometry, load_student
    from kava_ray.recipes.build import build_distiller

    ck = tmp_path / "old"
    shutil.copytree(good_ckpt, ck)
    state = json.loads((ck / "state.json").read_text())
    del state["files"]
    (ck / "state.json").write_text(json.dumps(state))
    (ck / "fusion.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    read_state(ck)
    student = load_student(str(ck / "student"), dtype="float32")
    with pytest.raises(KavaError, match=r"fusion.safetensors is corrupt") as e:
        load_into(ck, build_distiller(student, plans, kv_geometry(student), load_config(job)))
    assert len(str(e.value).splitlines()) == 1


def test_disk_full_during_a_checkpoint_write_keeps_the_previous_one(good_ckpt, job, plans, tmp_path):
    """A write that hits the file size limit (RLIMIT_FSIZE, what a full disk looks like to the writer) over
    an existing checkpoint: one line, the old checkpoint is untouched and loads, no temp dir is left."""
    ck = tmp_path / good_ckpt.name
    shutil.copytree(good_ckpt, ck)
    before = {p.relative_to(ck): p.read_bytes() for p in ck.rglob("*") if p.is_file()}
    geoms = json.dumps({n: p.geometry.to_dict() for n, p in plans.items()})
    script = textwrap.dedent(f"""
        import sys
        from kava_ray.common.config import load_config
        from kava_ray.common.errors import KavaError
        from kava_ray.core.plans import student_geometry, teacher_plans
        from kava_ray.recipes.distill import DistillRecipe
        cfg = load_config({str(job)!r})
        plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, {geoms}, student_geometry(cfg.student))
        recipe = DistillRecipe(cfg, plans)
        recipe.setup({str(ck)!r})
        import resource
        sys.dont_write_bytecode = True  # a module first imported under the limit would leave a cut-off .pyc
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
        try:
            recipe.save({str(ck)!r}, 3, recipe.data(None).state_dict())
        except KavaError as e:
            print(f"error: {{e}}", file=sys.stderr)
            sys.exit(2)
    """)

    def no_sigxfsz():  # an ignored SIGXFSZ survives exec: the write fails with EFBIG instead of killing
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       preexec_fn=no_sigxfsz, cwd=str(Path(__file__).parent))
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]  # (loading bars and warnings aside)
    assert p.returncode == 2 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr
    assert err[0].startswith(f"error: cannot write checkpoint {ck}: ") and "File too large" in err[0], err
    after = {q.relative_to(ck): q.read_bytes() for q in ck.rglob("*") if q.is_file()}
    assert after == before
    assert sorted(q.name for q in ck.parent.iterdir()) == [ck.name]  # no temp or .old dir left
    from kava_ray.core.checkpoint import read_state

    assert read_state(ck)["step"] == 2


def test_a_partial_copy_in_a_run_dir_is_passed_over(good_ckpt, tmp_path, capsys):
    """Ray Train copies a checkpoint into storage file by file (not atomically): a copy cut off (disk full)
    leaves a newer checkpoint_* with a file missing or short. --resume / eval of the run dir take the
    previous complete one; the partial one given by name is one line naming the file."""
    from kava_ray.core.checkpoint import find_checkpoint

    run = tmp_path / "run"
    shutil.copytree(good_ckpt, run / "checkpoint_2000-01-01_00-00-00.000000")
    partial = run / "checkpoint_2000-01-01_00-00-09.000000"
    shutil.copytree(good_ckpt, partial)
    f = partial / "student" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    assert find_checkpoint(run, for_resume=True).name == "checkpoint_2000-01-01_00-00-00.000000"
    assert find_checkpoint(run).name == "checkpoint_2000-01-01_00-00-00.000000"
    # an interrupted run's line (`train.resume_hint`) names the step --resume would continue from, else says none
    from kava_ray.recipes.train import resume_hint

    assert resume_hint(run) == f"`kava-ray train --resume {run}` continues it (from step 2)"
    assert resume_hint(run, address="auto") == (
        f"`kava-ray train --resume {run} --address auto` continues it (from step 2)")
    (tmp_path / "fresh" / "logs").mkdir(parents=True)
    assert resume_hint(tmp_path / "fresh") == "no checkpoint was saved yet: nothing to resume"
    rc, err = _cli(capsys, "eval", str(partial))
    assert rc == 2 and len(err) == 1 and "student/model.safetensors is truncated" in err[0], err


# ------------------------------------------------------------------------ on Ray: teacher killed, SIGTERM


@pytest.fixture(scope="module")
def ref_curve(job, teachers, plans):
    """The uninterrupted curve every Ray case is compared with: the same recipe in this process (a Ray Train
    run of one worker computes the same numbers, which the cases below check along the way)."""
    curve, _, feed = run_recipe(load_config(job), plans, InProcessSource(teachers), STEPS)
    assert sorted(curve) == list(range(1, STEPS + 1)) and feed.skipped == 0
    return curve


def _actors(**filters):
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, limit=1000, raise_on_missing_output=False,
                       detail=True, filters=[(k, "=", v) for k, v in filters.items()])


def _ended_like_ctrl_c(proc, err: str, run_dir: Path) -> None:
    """A SIGTERM'd `kava-ray train`: exit 143, one line with the resume hint, no traceback, and within 30 s nothing
    of its process group left (its embedded Ray included)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 143 and lines == [f"error: terminated (SIGTERM); {_resume_hint(run_dir)}"], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    deadline = time.time() + 30
    while _session_pids(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert not _session_pids(proc.pid), "the terminated run's processes outlived it"


def _session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (what a `kava-ray` started with start_new_session left behind)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


def test_an_interrupt_swallowed_inside_the_fit_is_raised_when_it_returns():
    """Ray checks signals inside `ray.get`; a KeyboardInterrupt raised there as the result lands is dropped, and
    the run used to finish and exit 0. `train._interruptible` raises it again when the block returns."""
    from kava_ray.recipes.train import _interruptible

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with _interruptible():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here and raises
            except KeyboardInterrupt:
                pass  # what ray.get did with it
    assert signal.getsignal(signal.SIGINT) is before
    with _interruptible():  # no signal: nothing raised
        pass


@pytest.mark.ray  # `kava-ray train` starts its own embedded Ray
def test_sigterm_exits_in_one_line_then_resume_continues_the_curve_through_a_teacher_kill(tiny_pool, ref_curve, job):
    """SIGTERM the driver (`kill`, Slurm, Kubernetes) once a checkpoint exists: it takes Ctrl-C's path
    (`kava_ray.common.signals`; Ray's own SIGTERM handler, which ray.init installs, would exit 1 with a C++ dump and
    no line): exit 143 with one `error: terminated (SIGTERM); `kava-ray train --resume RUN_DIR` continues it (from step
    N)` line within 60 s and nothing of its embedded Ray left; that command, alone (no --config: the run's saved job
    and the override it started with, which --config would refuse without --resume-override), then finishes the run
    on the reference curve (the steps past the checkpoint it resumes from are dropped from metrics.jsonl and run
    again), although its teacher actor's process is SIGKILLed two steps past the interrupt: it restarts
    (max_restarts) and the feed's requests are retried."""
    env = dict(os.environ, RAY_ADDRESS="", PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS")
    name = "sigterm"
    cmd = [KVCLI, "train", "--config", str(job), "--name", name, "train.num_to_keep=3"]  # an override to keep
    run_dir = Path(load_config(job).ray.storage_path) / name
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.time() + 300  # generous: data, an embedded Ray, a teacher and Ray Train start on a loaded box
        steps = {}
        while time.time() < deadline and proc.poll() is None:
            steps = train_steps_so_far(run_dir)
            if steps and max(steps) >= SAVE and list(run_dir.glob("checkpoint_*")):
                break
            time.sleep(0.05)
        assert steps and max(steps) >= SAVE, f"no checkpoint within 300 s (steps so far: {sorted(steps)})"
        # freeze the run (driver, workers, its Ray) before the interrupt, so a loaded box that starves this test
        # cannot let the last steps finish first; the SIGTERM is pending in the driver when the group continues
        os.killpg(proc.pid, signal.SIGSTOP)
        assert proc.poll() is None, f"finished before the interrupt: {proc.stderr.read()}"
        assert max(train_steps(run_dir)) < STEPS
        err, elapsed = _sigterm_stopped(proc, whole_group=False, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _ended_like_ctrl_c(proc, err, run_dir)
    interrupted_at = max(train_steps(run_dir))
    assert interrupted_at < STEPS and list(run_dir.glob("checkpoint_*")), interrupted_at

    from kava_ray.cli import main  # the same command in this process, on the session's Ray (saves a Ray start)

    cfg = load_config(job)
    killed = {}

    def killer():  # the resumed run rewrites steps from its checkpoint on: new ground starts past interrupted_at
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            steps = train_steps_so_far(run_dir)
            if steps and max(steps) >= interrupted_at + 2:
                alive = _actors(name="kava-teacher-qwen", state="ALIVE", ray_namespace=cfg.ray.namespace)
                if alive:
                    killed.update(pid=alive[0].pid, step=max(steps), actor_id=alive[0].actor_id)
                    os.kill(alive[0].pid, signal.SIGKILL)
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    assert main(["train", "--resume", str(run_dir)]) == 0  # the hint's command
    thread.join()
    assert killed and killed["step"] < STEPS, killed
    got = train_steps(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_same_curve(got, ref_curve, range(1, STEPS + 1))
    restarts = [a.num_restarts for a in _actors(actor_id=killed["actor_id"])]
    assert restarts and int(restarts[0]) >= 1, restarts
    print(f"SIGTERM at step {interrupted_at}: exited in {elapsed:.1f} s; teacher killed at step {killed['step']}")


def _sigterm_stopped(proc, whole_group: bool, timeout: float) -> tuple[str, float]:
    """SIGTERM a run whose process group is stopped (SIGSTOP) -- its driver alone, or the whole group as Slurm and
    `timeout` do -- then let the group go on and wait for the end: (its stderr, seconds from the signal)."""
    sent = time.time()
    (os.killpg if whole_group else os.kill)(proc.pid, signal.SIGTERM)
    os.killpg(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=timeout)
    return err, time.time() - sent


def _resume_hint(run_dir: Path) -> str:
    """`kava-ray train --resume RUN_DIR` continues it (from step N), N the step of the run dir's latest complete
    checkpoint."""
    from kava_ray.core.checkpoint import find_checkpoint

    step = json.loads((find_checkpoint(run_dir, for_resume=True) / "state.json").read_text())["step"]
    return f"`kava-ray train --resume {run_dir}` continues it (from step {step})"


@pytest.mark.ray  # `kava-ray train` starts its own embedded Ray
def test_a_sigterm_to_the_whole_group_while_sampling_ends_like_ctrl_c(job):
    """What Slurm and `timeout` send: SIGTERM to every process of the command's group (its embedded Ray's too) while
    rank 0 samples an on-policy batch. It printed no line, waited 60 s on "Failed to connect to GCS" (the way out
    called the dead GCS) and left RUN_DIR/sampling.now; now: the one line with the resume hint, exit 143, within
    45 s (~14 s here, most of it Ray's own shutdown), no sampling.now and nothing of the group left."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RAY_ADDRESS", None)
    name = "group-sigterm"
    run_dir = Path(load_config(job).ray.storage_path) / name
    flag = run_dir / "sampling.now"
    proc = subprocess.Popen([KVCLI, "train", "--config", str(job), "--name", name, "onpolicy.fraction=1",
                             "onpolicy.max_new_tokens=48", "train.save_steps=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline, caught = time.time() + 300, False  # data, an embedded Ray, a teacher, Ray Train on a loaded box
        while time.time() < deadline and proc.poll() is None and not caught:
            if flag.exists() and list(run_dir.glob("checkpoint_*")):
                os.killpg(proc.pid, signal.SIGSTOP)  # the whole group held while rank 0 is sampling
                caught = flag.exists() or os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.01)
        assert caught, f"no sampling step after a checkpoint within 300 s (rc {proc.poll()})"
        err, elapsed = _sigterm_stopped(proc, whole_group=True, timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    _ended_like_ctrl_c(proc, err, run_dir)
    assert elapsed < 45, (elapsed, err[-3000:])
    assert not flag.exists()
    print(f"group SIGTERM while sampling: exited in {elapsed:.1f} s")


def test_a_loss_that_is_not_finite_stops_the_run_in_one_line_and_keeps_the_last_good_checkpoint(tiny_pool, job,
                                                                                                capsys):
    """A student learning rate of 1e30 makes step 2's loss NaN: the run (the real command, on the session's Ray,
    under a run name with a non-ASCII letter) stops at the log step that sees it with one line naming the step and
    the terms, exit 2 -- not a NaN student saved with exit 0 -- and the checkpoint of step 1 stays the latest (no
    checkpoint of the NaN weights, no final/). The worker ends the run itself: Ray Train's retry from the checkpoint
    (train.max_failures) would only go bad again."""
    from kava_ray.cli import main
    from kava_ray.core.checkpoint import find_checkpoint

    name = "modèle-nan"
    code = main(["train", "--config", str(job), "--name", name, "optim.lr_student=1e30", "train.steps=6",
                 "train.save_steps=1", "train.log_steps=1"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    run_dir = Path(load_config(job).ray.storage_path) / name
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: step 2: the loss is not finite (the CE and KV terms); training stopped and the "
                             "checkpoint of step 1 stays the latest"), err[0]
    latest = find_checkpoint(run_dir, for_resume=True)
    assert json.loads((latest / "state.json").read_text())["step"] == 1 and not (run_dir / "final").exists()
    assert max(train_steps(run_dir)) == 1  # step 2's record never logged: the stop comes first


def test_a_sigterm_ends_a_command_whose_sigint_is_ignored():
    """A shell script's background job (`kava-ray ... &`, `nohup`) starts with SIGINT ignored, so Python installs
    no Ctrl-C handler: a SIGTERM turned into SIGINT was then swallowed and the command ran on. It ends as Ctrl-C
    would (KeyboardInterrupt, `terminated()` true) — and before the fix the child sleeps out its 20 s."""
    code = textwrap.dedent("""
        import os, signal, time
        from kava_ray.common.signals import sigterm_as_interrupt, terminated
        sigterm_as_interrupt()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(20)
        except KeyboardInterrupt:
            print("interrupted", terminated())
    """)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert out.stdout.strip() == "interrupted True" and time.time() - t0 < 15, (out.stdout, out.stderr[-2000:])
