"""Teachers and students on different nodes of one Ray cluster: three raylets on this machine, each with its own
object store (`kava_ray.runtime.local_cluster`: a head with no CPUs, a `kava-role: teacher` node, a `kava-role:
student` node), token auth on. Every job here is a `kava-ray ... --address` in a subprocess, as a user runs it
(the test session's own Ray stays out of it); what ran where comes from Ray's state API."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from jobs import write_job
from kava_ray.runtime.local_cluster import STUDENT_NODE, TEACHER_NODE
from test_cluster import BIN, _client_env, _ray
from test_service_ray import _kava

TEACHER, STUDENT = TEACHER_NODE, STUDENT_NODE
ENV = _client_env(HF_HUB_OFFLINE="1")  # a user's shell: token auth on


class LocalCluster:
    """The `kava_ray.runtime.local_cluster` helper process: its GCS address, and `do` for its commands (add or remove a
    node), one answer line each."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "kava_ray.runtime.local_cluster", "--stdin"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=_client_env())
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.proc.kill()
            pytest.fail(f"the cluster did not start: {self.proc.stderr.read()[-3000:]}")

    def do(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()  # the helper shuts its nodes down
        self.proc.wait(timeout=120)


@pytest.fixture(scope="module")
def local():
    """The three-node cluster, for this module."""
    c = LocalCluster()
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster(local):
    """The three-node cluster's GCS address."""
    return local.address


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    """One fp32 teacher on the teacher node, one Ray Train worker on the student node."""
    root = tmp_path_factory.mktemp("multinode")
    return write_job(root, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32",
                                "label_selector": TEACHER}],
                     train={"steps": 3, "eval_steps": 3, "save_steps": 3, "max_length": 160},
                     data={"num_train": 24, "num_test": 4, "num_val": 4},
                     ray={"namespace": f"kava-mn-{uuid.uuid4().hex[:6]}", "worker_label_selector": STUDENT})


def _state(address: str, kind: str, *filters: str) -> list:
    """`ray list KIND` on the cluster (the state API, with the token as a user's shell sends it)."""
    out = _ray("list", kind, "--address", address, "--detail", "--format", "json", "--limit", "1000",
               *(a for f in filters for a in ("--filter", f)))
    assert out.returncode == 0, out.stderr[-2000:]
    return [] if out.stdout.strip() == "No resource in the cluster" else json.loads(out.stdout)


def _nodes(address: str) -> dict:
    """{kava-role label: node id} of the cluster's live nodes (one per role, as the cluster starts)."""
    return {n["labels"].get("kava-role"): n["node_id"] for n in _state(address, "nodes") if n["state"] == "ALIVE"}


@pytest.mark.parametrize("override,expect", [
    ("teachers.0.label_selector={kava-role: gpu}",
     "error: teachers[qwen].label_selector {'kava-role': 'gpu'} matches no node of the cluster (its nodes' labels: "
     "kava-role=head, kava-role=student, kava-role=teacher)"),
    ("teachers.0.num_cpus=2.5",  # 2.5 CPUs in all fit the cluster (5), but not on the teacher node (2)
     "error: teacher 'qwen' needs 2.5 CPU on one node; no node that teachers[qwen].label_selector admits has that: "
     "the closest is node "),
], ids=["selector-matches-no-node", "too-big-for-any-admitted-node"])
def test_a_job_that_cannot_be_placed_is_one_line_before_anything_starts(cluster, job, override, expect):
    out = _kava("train", "--config", job, "--address", cluster, override, env=ENV, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and errors[0].startswith(expect), out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_plan_places_the_job_on_the_live_nodes(cluster, job):
    """`kava-ray plan --address`: the same per-node check as a job's, before a job, naming the node each actor can
    go to; what cannot be placed is exit 3 and the one line a job would print."""
    out = _kava("plan", "--config", job, "--address", cluster, env=ENV, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    nodes = _nodes(cluster)
    placed = out.stdout[out.stdout.index(f"placement on the cluster at {cluster} (3 nodes):"):].splitlines()[1:]
    where = [(what.strip(), node.split()[0]) for what, node in (line.split(" node ", 1) for line in placed)]
    assert where == [("teacher 'qwen'", nodes["teacher"][:8]), ("a Ray Train worker", nodes["student"][:8])], placed
    out = _kava("plan", "--config", job, "--address", cluster, "teachers.0.num_cpus=2.5", env=ENV, timeout=120)
    assert out.returncode == 3 and out.stderr.strip().splitlines()[-1].startswith(
        "teacher 'qwen' needs 2.5 CPU on one node; no node that teachers[qwen].label_selector admits has that"), (
        out.stderr[-3000:])


def test_paths_only_the_drivers_node_has_are_one_line_naming_each_key_and_the_node(cluster, job, tmp_path):
    """The driver runs in a mount namespace of its own (`unshare -m`) with a tmpfs over a directory: what it
    puts there no node of the cluster sees, as a file on the local disk of a real cluster's driver. The data it
    reads there and a storage path there are refused before any teacher starts, in one line naming each key and the
    student node (both fixed in one go, not one run each)."""
    local = tmp_path / "local"
    local.mkdir()
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(40)))
    after = tmp_path / "after.txt"  # what the driver's private directory holds once the command is done
    script = (f"mount -t tmpfs tmpfs {local} && cp {qa} {local}/ && {sys.executable} -m kava_ray.cli train "
              f"--config {job} --address {cluster} data.source={local}/qa.jsonl ray.storage_path={local}/runs; "
              f"rc=$?; ls -A {local} {local}/runs > {after} 2>&1; exit $rc")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], env=ENV, capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    student = _nodes(cluster)["student"][:8]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    cut = errors[0].find("; ray.storage_path ")  # the data's problem, then the storage's
    data, storage = errors[0][:cut], errors[0][cut + 2:]
    assert data.startswith(f"error: data.source {local}/qa.jsonl is not on node {student} (127.0.0.1: 3 CPU), where "
                           f"the Ray Train workers read it: "), errors[0]
    assert storage.startswith(f"ray.storage_path {local}/runs is not shared with node {student} (127.0.0.1: 3 CPU), "
                              f"where the Ray Train workers write checkpoints: "), errors[0]
    alive = [a["class_name"] for a in _state(cluster, "actors") if a["state"] != "DEAD"]
    assert "TeacherActor" not in alive, alive
    assert ".kava-shared-check" not in after.read_text(), after.read_text()  # the storage check cleans up


def test_precompute_from_a_driver_on_another_node_writes_the_cache_on_the_teachers_node(cluster, job, tmp_path):
    """The driver (on the head) never holds the KV: a CacheWriter on the teacher node runs the production
    precompute there and writes the cache dir, which the driver then reads."""
    from actors.kv_cache import KVCache

    out = tmp_path / "kv"
    run = _kava("teachers", "precompute", "--config", job, "--address", cluster, "--out", out, "--json", env=ENV,
                timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    stats = json.loads(run.stdout.strip().splitlines()[-1])
    assert stats["written"] == stats["total"] == 24 + 4 + 4 and stats["forwards"] > 0, stats
    writers = [a for a in _state(cluster, "actors") if a["class_name"] == "CacheWriter"]
    assert [a["node_id"] for a in writers] == [_nodes(cluster)["teacher"]], writers
    cache = KVCache(out)
    assert len(cache.shards) == stats["total"] and all(cache.has(k) for k in cache.shards)
    assert set(cache.get(next(iter(cache.shards)))) == {"qwen"}


def test_bench_cross_node_pulls_a_batch_here_before_the_student_asks_only_with_prefetch(cluster):
    """`kava-ray bench feed`'s cross-node regime at toy size on this cluster: the production feed from a teacher on
    the teacher node to a student on the student node. With prefetch a batch's payload reaches the student's node
    while nobody asks for it; without, it stays put (Ray's own locality test: `ray.wait(fetch_local=True)`). The
    payload is past Ray's inline limit, so it really crosses object stores. No figure of this box is asserted."""
    out = subprocess.run([sys.executable, "-m", "kava_ray.bench.cross_node", "--address", cluster, "--json",
                          "--steps", "3", "--tokens", "16"], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    runs = r["runs"]
    assert list(runs) == ["same node", "same node, no prefetch", "cross node, no prefetch", "cross node, prefetch"]
    assert runs["cross node, prefetch"]["arrives_unasked"] is True
    assert runs["cross node, no prefetch"]["arrives_unasked"] is False
    # 28 layers x batch 4 x 2 KV heads x 16 tokens x head_dim 128 x bf16, K and V: 1.75 MiB per step
    assert r["bytes_per_step"] == 2 * 28 * 4 * 2 * 16 * 128 * 2 > 100 * 2**10
    assert all(x["step_s"] >= r["config"]["step_s"] for x in runs.values())  # each step is busy step_s at least
    assert r["cross_node_Bps"] > 0


LOST_STEPS = 60


@pytest.fixture(scope="module")
def long_job(tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    """The placed job, 60 steps of batch 2 with a checkpoint every 5 and no evaluation on the way: room for nodes
    to die; a teacher no node can hold stops the run after 2 s."""
    root = tmp_path_factory.mktemp("lost")
    return write_job(root, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32",
                                "label_selector": TEACHER}],
                     train={"steps": LOST_STEPS, "eval_steps": 1000, "save_steps": 5, "max_length": 160,
                            "batch_size": 2},
                     data={"num_train": 64, "num_test": 4, "num_val": 4},
                     ray={"namespace": f"kava-mn-{uuid.uuid4().hex[:6]}", "worker_label_selector": STUDENT,
                          "lost_teacher_wait_s": 2})


def lost_ref_curve(long_job, steps: int) -> dict:
    """The uninterrupted curve to `steps`: the same recipe in this process, with the same teacher
    (tests/test_faults.py checks that a Ray Train run of one worker computes these numbers)."""
    from jobs import run_recipe
    from kava_ray.common.config import load_config
    from kava_ray.core.models import kv_geometry, load_model
    from kava_ray.core.plans import student_geometry, teacher_plans
    from kava_ray.testing.inprocess_source import InProcessSource

    cfg = load_config(long_job)
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    geoms = {n: kv_geometry(m).to_dict() for n, m in models.items()}
    plans = teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
    curve, _, _ = run_recipe(cfg, plans, InProcessSource(models), steps)
    return curve


def _when(run_dir, ready, proc, timeout=300) -> dict:
    """Poll the run's train steps until `ready(steps)` (or the run ends: then whatever it logged)."""
    from jobs import train_steps_so_far

    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        steps = train_steps_so_far(run_dir)
        if steps and ready(steps):
            return steps
        time.sleep(0.05)
    return {}


def test_nodes_lost_mid_run_teacher_and_worker_restart_elsewhere_on_the_curve_then_no_teacher_node_is_one_line(
        local, long_job):
    """One placed run, three nodes killed under it (every process of a node at once, `Cluster.remove_node`), on a
    cluster with a second teacher node and a second student node:

    - the teacher runs on a teacher node and the Ray Train worker on a student node (Ray's state API), so every KV
      batch crosses object stores;
    - the teacher's node dies: Ray restarts the teacher on the other teacher node and the feed asks again for what
      was lost with it;
    - after a checkpoint, the worker's node dies: Ray Train (train.max_failures: 1) starts the worker again on the
      other student node from that checkpoint;
    - the last teacher node dies: no node can hold the teacher; after ray.lost_teacher_wait_s the worker fails with
      one line and, its one restart spent, the run stops with it (exit 2), naming the teacher and the dead nodes.

    Every step the run logged (the last record of each) is on the uninterrupted curve."""
    from jobs import assert_same_curve, train_records_so_far, train_steps

    teacher_nodes = {_nodes(local.address)["teacher"], local.do("add teacher")}
    student_nodes = {_nodes(local.address)["student"], local.do("add student")}
    run_dir = long_job.parent / "runs" / "lost"
    cmd = [str(BIN / "kava-ray"), "train", "--config", str(long_job), "--address", local.address, "--name", "lost",
           "train.max_failures=1"]
    log = long_job.parent / "lost.log"  # a file, not a pipe nobody reads while the test polls
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=open(log, "w"), text=True)

    try:
        at = _when(run_dir, lambda steps: max(steps) >= 3, proc)
        placed = {a["class_name"]: a["node_id"] for a in _state(local.address, "actors", "state=ALIVE")}
        teacher_first, worker_first = placed["TeacherActor"], placed["RayTrainWorker"]
        assert teacher_first in teacher_nodes and worker_first in student_nodes, (placed, teacher_nodes, student_nodes)
        assert at and local.do(f"remove {teacher_first}") == "removed", at
        teacher_second = (teacher_nodes - {teacher_first}).pop()  # the only node left that can hold the teacher
        later = _when(run_dir, lambda steps: max(steps) >= max(at) + 6 and list(run_dir.glob("checkpoint_*")), proc)
        assert later and max(later) < LOST_STEPS, sorted(later)  # it trained on after the teacher's node died
        logged = len(train_records_so_far(run_dir))  # the old worker may log one more line as its node goes
        assert local.do(f"remove {worker_first}") == "removed"
        # the worker again, from the last checkpoint: three lines past those (the file, not the state API, is polled)
        again = _when(run_dir, lambda _: len(train_records_so_far(run_dir)) >= logged + 3, proc)
        assert again and max(again) < LOST_STEPS, sorted(again)
        (worker_second,) = [a["node_id"] for a in _state(local.address, "actors", "state=ALIVE",
                                                         "class_name=RayTrainWorker")]
        assert local.do(f"remove {teacher_second}") == "removed"
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, err[-3000:]
    assert "teacher 'qwen' cannot run again: the nodes it ran on or could run on are gone (" in errors[0] \
        and f"node {teacher_second[:8]} (" in errors[0] \
        and "teachers[qwen].label_selector {'kava-role': 'teacher'} matches no node" in errors[0], errors[0]
    assert worker_second in student_nodes - {worker_first}
    got = train_steps(run_dir)
    stopped = max(got)
    assert max(again) <= stopped < LOST_STEPS and sorted(got) == list(range(1, stopped + 1))
    # through both restarts, on the curve (computed once the run has stopped: only the steps it took)
    assert_same_curve(got, lost_ref_curve(long_job, stopped), range(1, stopped + 1))
    # (a run stopped this way resumes like any other, once a node can hold its teacher: tests/test_faults.py)
    print(f"teacher node {teacher_first[:8]} removed at step {max(at)}, the run went on; worker node "
          f"{worker_first[:8]} removed at step {max(later)}, the worker went on on "
          f"{worker_second[:8]}; teacher node {teacher_second[:8]} removed at step {max(again)}, stopped at {stopped}: "
          f"{errors[0]}")
