"""Teachers and students on different nodes of one Ray cluster: three raylets on this machine, each with its own
object store (`kava_ray.local_cluster`: a head with no CPUs, a `kava-role: teacher` node, a `kava-role:
student` node), token auth on. Every job here is a `kava-ray ... --address` in a subprocess, as a user runs it
(the test session's own Ray stays out of it); what ran where comes from Ray's state API."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import uuid

import pytest

from jobs import read_jsonl, write_job
from kava_ray.local_cluster import STUDENT_NODE, TEACHER_NODE
from test_cluster import _client_env, _ray
from test_service_ray import _kava

TEACHER, STUDENT = TEACHER_NODE, STUDENT_NODE
ENV = _client_env(HF_HUB_OFFLINE="1")  # a user's shell: token auth on


@pytest.fixture(scope="module")
def cluster():
    """The three-node cluster, for this module: yields its GCS address."""
    proc = subprocess.Popen([sys.executable, "-m", "kava_ray.local_cluster", "--stdin"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_client_env())
    address = proc.stdout.readline().strip()
    if not address:
        proc.kill()
        pytest.fail(f"the cluster did not start: {proc.stderr.read()[-3000:]}")
    yield address
    proc.stdin.close()  # the helper shuts its nodes down
    proc.wait(timeout=120)


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
    return json.loads(out.stdout)


def _nodes(address: str) -> dict:
    """{kava-role label: node id} of the cluster's nodes."""
    return {n["labels"].get("kava-role"): n["node_id"] for n in _state(address, "nodes")}


def _actor_nodes(address: str, class_name: str) -> set:
    return {a["node_id"] for a in _state(address, "actors", f"class_name={class_name}")}


def test_teachers_run_on_the_teacher_node_and_train_workers_on_the_student_node(cluster, job):
    """Every KV batch crosses from the teacher node's object store to the student node's, and the run trains."""
    out = _kava("train", "--config", job, "--address", cluster, "--name", "placed", env=ENV, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    nodes = _nodes(cluster)
    assert _actor_nodes(cluster, "TeacherActor") == {nodes["teacher"]}
    assert _actor_nodes(cluster, "RayTrainWorker") == {nodes["student"]}
    run_dir = job.parent / "runs" / "placed"
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(math.isfinite(r["cos/qwen"]) for r in train)


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
    assert list(runs) == ["same node", "cross node, no prefetch", "cross node, prefetch"]
    assert runs["cross node, prefetch"]["arrives_unasked"] is True
    assert runs["cross node, no prefetch"]["arrives_unasked"] is False
    # 28 layers x batch 4 x 2 KV heads x 16 tokens x head_dim 128 x bf16, K and V: 1.75 MiB per step
    assert r["bytes_per_step"] == 2 * 28 * 4 * 2 * 16 * 128 * 2 > 100 * 2**10
    assert all(x["step_s"] >= r["config"]["step_s"] for x in runs.values())  # each step is busy step_s at least
    assert r["cross_node_Bps"] > 0
