"""Per-node placement (kava_ray.common.placement): Ray's label selector syntax, and a job checked node by node — the
cases a cluster-wide sum lets through and Ray would then wait on forever."""

import pytest

from kava_ray.common.config import load_config
from kava_ray.common.placement import Demand, Node, fit, matches, parse_selector_value

GPU2 = [Node(f"n{i}aaaaaaa", f"10.0.0.{i}", {"CPU": 16, "GPU": 2}, {"kava-role": "teacher"}) for i in (1, 2)]
STUDENT = Node("s1aaaaaaa", "10.0.1.1", {"CPU": 8, "GPU": 4}, {"kava-role": "student"})


def test_selector_values_follow_rays_syntax():
    assert parse_selector_value("teacher") == (False, {"teacher"})
    assert parse_selector_value("!spot") == (True, {"spot"})
    assert parse_selector_value("in(a100, h100)") == (False, {"a100", "h100"})
    assert parse_selector_value("!in(a,b)") == (True, {"a", "b"})
    for bad in ("", "in()", "in(a,", "-x", "a b"):
        with pytest.raises(ValueError):
            parse_selector_value(bad)
    labels = {"kava-role": "teacher", "gpu": "h100"}
    assert matches(None, labels) and matches({}, {})
    assert matches({"kava-role": "teacher"}, labels) and not matches({"kava-role": "student"}, labels)
    assert matches({"zone": "!b"}, labels)  # no such label: "not b" holds
    assert matches({"gpu": "in(a100, h100)"}, labels) and not matches({"gpu": "!in(a100, h100)"}, labels)
    assert not matches({"kava-role": "teacher", "gpu": "a100"}, labels)  # every key must hold


def test_a_teacher_wider_than_any_node_is_refused_though_the_cluster_sum_fits():
    """4 GPUs in all (2 + 2), but a teacher's GPUs must be on one node."""
    err = fit(GPU2, [Demand("teacher 'qwen72b'", {"CPU": 4, "GPU": 4})])
    assert err == ("teacher 'qwen72b' needs 4 CPU + 4 GPU on one node; no node of the cluster has that: the closest "
                   "is node n1aaaaaa (10.0.0.1: 16 CPU, 2 GPU)")
    assert fit(GPU2, [Demand("teacher 'qwen14b'", {"CPU": 4, "GPU": 2})]) is None


def test_selectors_restrict_the_nodes_and_a_selector_no_node_has_is_named():
    teacher = Demand("teacher 'a'", {"CPU": 1, "GPU": 4}, selector={"kava-role": "teacher"},
                     selector_key="teachers[a].label_selector")
    err = fit(GPU2 + [STUDENT], [teacher])  # the student node has 4 GPUs, but the selector keeps it out
    assert err.startswith("teacher 'a' needs 1 CPU + 4 GPU on one node; no node that teachers[a].label_selector "
                          "admits has that: the closest is node n1aaaaaa"), err
    gone = Demand("teacher 'a'", {"CPU": 1}, selector={"kava-role": "tpu"}, selector_key="teachers[a].label_selector")
    assert fit(GPU2 + [STUDENT], [gone]) == ("teachers[a].label_selector {'kava-role': 'tpu'} matches no node of the "
                                             "cluster (its nodes' labels: kava-role=student, kava-role=teacher)")


def test_replicas_and_workers_are_placed_together():
    """Each fits alone; together the teacher node's GPUs run out (3 replicas of 1 GPU on 2 + 2 is fine, 5 is not),
    and the workers stay on the student node even where a teacher node has room."""
    def teacher(n):
        return Demand("teacher 'q'", {"CPU": 1, "GPU": 1}, count=n, selector={"kava-role": "teacher"},
                      selector_key="teachers[q].label_selector")

    workers = Demand("a Ray Train worker", {"CPU": 2, "GPU": 1}, count=4, selector={"kava-role": "student"},
                     selector_key="ray.worker_label_selector")
    assert fit(GPU2 + [STUDENT], [teacher(3), workers]) is None
    err = fit(GPU2 + [STUDENT], [teacher(5), workers])
    assert err.startswith("the job does not fit on the cluster's nodes together: teacher 'q' #4 needs 1 CPU + 1 GPU on "
                          "one node once the rest is placed; the closest is node n1aaaaaa"), err
    five = Demand("a Ray Train worker", {"CPU": 2, "GPU": 1}, count=5, selector={"kava-role": "student"})
    assert "a Ray Train worker #4 needs" in fit(GPU2 + [STUDENT], [five])


def test_the_verdict_does_not_depend_on_the_order_of_the_nodes():
    """A 2-GPU teacher kept to the 4-GPU teacher node and a 3-GPU worker allowed anywhere fit (worker on the
    3-GPU node) in either order of `ray.nodes()`: the demand with fewer admitted nodes is placed first."""
    nodes = [Node("t1aaaaaaa", "10.0.0.1", {"CPU": 8, "GPU": 4}, {"kava-role": "teacher"}),
             Node("s1aaaaaaa", "10.0.1.1", {"CPU": 8, "GPU": 3}, {"kava-role": "student"})]
    demands = [Demand("teacher 'q'", {"CPU": 1, "GPU": 2}, selector={"kava-role": "teacher"}),
               Demand("a Ray Train worker", {"CPU": 1, "GPU": 3})]
    assert fit(nodes, demands) is None and fit(nodes[::-1], demands) is None


def test_selectors_in_a_job_config_are_checked_when_it_loads(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("teachers: [{name: t, model: m, label_selector: {kava-role: teacher}}]\nstudent: {model: s}\n"
                    "ray: {worker_label_selector: {kava-role: 'in(student, spare)'}}\n")
    cfg = load_config(path)
    assert cfg.teachers[0].label_selector == {"kava-role": "teacher"}
    # as Ray must get it: its scheduler splits in(...) on ',' without trimming, so 'in(a, b)' would ask for ' b'
    assert cfg.ray.worker_label_selector == {"kava-role": "in(student,spare)"}
    with pytest.raises(Exception, match="is not a label selector value"):
        load_config(path, ["ray.worker_label_selector={kava-role: 'in(student,'}"])
    with pytest.raises(Exception, match="is not a label name"):
        load_config(path, ["ray.worker_label_selector={'kava role': student}"])


def test_the_selectors_reach_the_teacher_actors_and_ray_trains_scaling_config(tmp_path):
    """What tests/test_multinode.py sees placed is what the config asked for: the selectors are in the actor
    options and in ScalingConfig (built, not started)."""
    from actors.pool import _actor_options
    from kava_ray.common.config import validate_config
    from kava_ray.recipes.train import build_trainer

    cfg = validate_config({"teachers": [{"name": "t", "model": "m", "label_selector": {"kava-role": "teacher"}},
                                        {"name": "u", "model": "m"}],
                           "student": {"model": "s"}, "ray": {"worker_label_selector": {"kava-role": "student"}}})
    assert _actor_options(cfg.teachers[0], "ns", False)["label_selector"] == {"kava-role": "teacher"}
    assert "label_selector" not in _actor_options(cfg.teachers[1], "ns", False)  # Ray's default: anywhere it fits
    trainer = build_trainer(cfg, {}, tmp_path / "run", use_gpu=False)
    assert trainer.scaling_config.label_selector == {"kava-role": "student"}


def test_plan_places_a_preset_on_the_node_types_of_cluster_yaml(tmp_path, capsys):
    """`kava-ray plan --cluster cluster.yaml`: the repo's cluster.yaml brings up a head, a teacher node and four
    student nodes; qwen_multi's teachers go to the teacher node, its workers to student nodes. Nodes of 2 GPUs
    cannot hold the 4-GPU teacher (exit 3, one line naming the closest node); a missing file is exit 2."""
    import yaml

    from kava_ray.cli import main
    from kava_ray.common.placement import cluster_yaml_nodes

    spec = yaml.safe_load(open("cluster.yaml"))
    nodes = cluster_yaml_nodes(spec)
    assert [n.name for n in nodes] == ["head", "teacher_gpu#0"] + [f"student_gpu#{i}" for i in range(4)]
    assert nodes[1].labels == {"kava-role": "teacher"} and nodes[1].resources == {"CPU": 96.0, "GPU": 8.0}

    assert main(["plan", "--config", "qwen_multi", "--cluster", "cluster.yaml"]) == 0
    out = capsys.readouterr().out
    placed = dict(line.split("node ", 1) for line in out.splitlines()[out.splitlines().index(
        "placement on cluster.yaml (6 nodes):") + 1:] if "node " in line)
    assert {k.strip(): v.split(" ")[0] for k, v in placed.items()} == {
        "teacher 'qwen72b'": "teacher_gpu#0", "teacher 'qwen7b'": "teacher_gpu#0", "teacher 'qwen14b'": "teacher_gpu#0",
        "a Ray Train worker #0": "student_gpu#0", "a Ray Train worker #1": "student_gpu#0"}, out

    spec["available_node_types"]["teacher_gpu"].update(max_workers=4, resources={"CPU": 32, "GPU": 2})
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(spec))
    assert main(["plan", "--config", "qwen_multi", "--cluster", str(small)]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["teacher 'qwen72b' needs 4 CPU + 4 GPU on one node; no node that teachers[qwen72b].label_selector "
                   "admits has that: the closest is node teacher_gpu#0 (teacher_gpu: 32 CPU, 2 GPU)"], err
    del spec["available_node_types"]["student_gpu"]["resources"]
    with pytest.raises(ValueError, match="node type student_gpu declares no resources"):
        cluster_yaml_nodes(spec)
    assert main(["plan", "--config", "qwen_multi", "--cluster", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --cluster ") and "nope.yaml" in err[0], err
