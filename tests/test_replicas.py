"""Teacher replicas without Ray: which replica a batch goes to, and what the planner counts for them."""

from actors.pool import TeacherReplicas, actor_name, replica_for
from kava_ray.common.config import load_config
from kava_ray.data.batching import batch_key
from kava_ray.runtime.planner import plan


def test_a_batch_key_always_routes_to_one_replica_and_consecutive_batches_take_turns():
    keys = [batch_key("fp", 0, i) for i in range(12)]
    for n in (1, 2, 3, 4):
        routed = [replica_for(k, n) for k in keys]
        assert routed == [i % n for i in range(12)]  # balanced: n batches in flight keep n replicas busy
        assert routed == [replica_for(k, n) for k in keys]  # a function of the key: every consumer agrees
        # a key with the teacher's layer set still routes by its batch index; other keys by a stable hash
        assert [replica_for(batch_key("fp", 1, i, [0, 3]), n) for i in range(12)] == routed
        assert 0 <= replica_for("any/other/key", n) < n
        assert replica_for("any/other/key", n) == replica_for("any/other/key", n)
    assert replica_for(None, 2) is None and replica_for(None, 1) == 0
    # DDP: rank r of W reads global batches r, r+W, ...: with W = n every rank keeps to one replica, and
    # together the ranks keep all of them busy
    assert {replica_for(batch_key("fp", 0, r + 2 * s), 2) for s in range(4) for r in range(2)} == {0, 1}


def test_replica_handles_route_by_key_and_round_robin_without_one():
    reps = TeacherReplicas("t", ["h0", "h1", "h2"])
    assert [reps.route(batch_key("fp", 0, i)) for i in range(4)] == ["h0", "h1", "h2", "h0"]
    assert [reps.route(None) for _ in range(4)] == ["h0", "h1", "h2", "h0"]
    assert len(reps) == 3 and actor_name("t") == "kava-teacher-t" and actor_name("t", 2) == "kava-teacher-t#2"


def test_planner_counts_every_replica():
    one = plan(load_config("qwen_multi"), 80 * 2**30)
    two = plan(load_config("qwen_multi", ["teachers.2.replicas=2"]), 80 * 2**30)
    big = "teacher:qwen72b (4 GPUs)"
    assert set(two["devices"]) == set(one["devices"]) | {"teacher:qwen72b#1 (4 GPUs)"}
    assert two["devices"]["teacher:qwen72b#1 (4 GPUs)"]["total"] == one["devices"][big]["total"]
    cpu1 = plan(load_config("demo_cpu"))["devices"]["cpu"]["items"]
    cpu3 = plan(load_config("demo_cpu", ["teachers.0.replicas=3"]))["devices"]["cpu"]["items"]
    t0 = load_config("demo_cpu").teachers[0].name
    for item, v in cpu1.items():
        if item.startswith(f"teacher:{t0} "):
            assert cpu3[f"{item} x 3 replicas"] == 3 * v


def test_teacher_forward_memory_counts_only_the_layers_it_runs():
    """No logits: the teacher's KV cache holds the layers up to the deepest shipped one (the forward stops there)."""
    full = plan(load_config("qwen_multi"), 80 * 2**30)["devices"]["teacher:qwen7b (1 GPU)"]["items"]
    half = plan(load_config("qwen_multi", ["teachers.0.layers=[0,1,2,3,4,5,6,7,8,9,10,11,12,13]"]),
                80 * 2**30)["devices"]["teacher:qwen7b (1 GPU)"]["items"]
    assert half["teacher:qwen7b kv cache"] * 2 == full["teacher:qwen7b kv cache"]  # 14 of 28 layers
