"""`kava-ray bench feed`'s cross-node regime: a teacher on one Ray node, the student on another.

    python -m kava_ray.bench.cross_node [--address HOST:PORT] [--json]

Step time with the teacher on the student's node, on another without and with prefetch, and the
bytes that crossed; without --address on a `local_cluster` of its own. The method:
docs/internals/runtime.md#bench-cross-node.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Optional

import numpy as np
import ray

from kava_ray.bench.timed_teacher import TimedTeacher
from kava_ray.common.files import format_table
from kava_ray.core.kv import KVBatch
from kava_ray.rollout.feed import ActorSource, KVFeed, KVRequest, get_kv
from kava_ray.runtime.connect import ray_session
from kava_ray.runtime.local_cluster import STUDENT_NODE, TEACHER_NODE, local_cluster

# Qwen2.5-1.5B's KV geometry (28 KiB of bf16 K+V per token, every layer served)
GEOMETRY = dict(num_layers=28, num_kv_heads=2, head_dim=128, num_attention_heads=12, hidden_size=1536,
                vocab_size=151936, rope_theta=1e6, model_type="qwen2")


@ray.remote(num_cpus=1)
class _Student:
    """A student on a GPU of its own: the production feed, then `step_s` busy without a CPU per batch."""

    def run(self, teacher, batches: list, step_s: float, depth: int, prefetch: bool) -> dict:
        layers = {"t": list(range(GEOMETRY["num_layers"]))}
        items = ((f"x/{i}", ids, mask, i) for i, (ids, mask) in enumerate(batches))
        feed = KVFeed(ActorSource({"t": teacher}, prefetch=prefetch), items, layers, depth=depth, dtype=None)
        stamps, nbytes = [], 0
        for _, kv in feed:
            stamps.append(time.perf_counter())
            nbytes += kv["t"].num_bytes()
            time.sleep(step_s)
        return {"step_s": (stamps[-1] - stamps[0]) / (len(stamps) - 1), "bytes_per_step": nbytes / len(stamps),
                "wait_s": sum(feed.wait_s[1:]) / (len(stamps) - 1)}

    def arrives_unasked(self, teacher, batch: tuple, prefetch: bool, within_s: float) -> bool:
        """Whether a batch's payload is on this node `within_s` after the teacher answered, with
        nobody asking for it (no `ray.get`): what prefetch changes. Locality is read once, with
        `ray.wait(timeout=0, fetch_local=True)`, which counts an object as ready only once it is on
        this node (and, asked again, would start a pull itself)."""
        source = ActorSource({"t": teacher}, prefetch=prefetch)
        answer = source.submit("t", KVRequest(None, *batch, None, "bf16"))
        ref = ray.get(answer)  # the teacher's answer: a ref to its payload (the payload itself stays put)
        time.sleep(within_s)
        return bool(ray.wait([ref], timeout=0, fetch_local=True)[0])

    def pull(self, answer: list) -> float:
        """Seconds to bring one payload that is ready on another node here (nothing asked for it before)."""
        ref = ray.get(answer[0])  # the teacher's answer: a ref to its payload, in the teacher node's store
        ray.wait([ref], fetch_local=False)  # ready there (it is: the answer exists once it was put)
        t0 = time.perf_counter()
        KVBatch.from_wire(ray.get(ref), dtype=None)
        return time.perf_counter() - t0


def _batches(n: int, batch: int, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 1000, (batch, tokens)), np.ones((batch, tokens), dtype=np.int64)) for _ in range(n)]


REGIMES = (("same node", STUDENT_NODE, True), ("same node, no prefetch", STUDENT_NODE, False),
           ("cross node, no prefetch", TEACHER_NODE, False),
           ("cross node, prefetch", TEACHER_NODE, True))  # (name, where the teacher runs, prefetch)


def _measure(steps: int, batch: int, tokens: int, step_s: float, teacher_s: float, depth: int,
             rounds: int) -> dict:
    student = _Student.options(label_selector=STUDENT_NODE).remote()
    batches = _batches(steps, batch, tokens)
    teachers = {node["kava-role"]: TimedTeacher.options(label_selector=node).remote(GEOMETRY, teacher_s)
                for node in (STUDENT_NODE, TEACHER_NODE)}
    for t in teachers.values():
        get_kv(t.kv.remote(None, *batches[0]))  # an actor's start is not a step
    runs: dict = {name: {} for name, _, _ in REGIMES}
    for _ in range(rounds):  # interleaved: each regime keeps its fastest round
        for name, where, prefetch in REGIMES:
            r = ray.get(student.run.remote(teachers[where["kava-role"]], batches, step_s, depth, prefetch))
            if not runs[name] or r["step_s"] < runs[name]["step_s"]:
                runs[name].update(r)
    far = teachers[TEACHER_NODE["kava-role"]]
    pull_s = min(ray.get(student.pull.remote([far.kv.remote(None, *batches[0])])) for _ in range(3))
    for name, where, prefetch in (r for r in REGIMES if r[1] is TEACHER_NODE):
        runs[name]["arrives_unasked"] = ray.get(student.arrives_unasked.remote(far, batches[0], prefetch,
                                                                             5 * step_s + 1.0))
    for t in teachers.values():
        ray.kill(t)
    ray.kill(student)
    base = runs["same node"]["step_s"]
    for r in runs.values():
        r["over_same_node"] = r["step_s"] / base
    nbytes = runs["cross node, prefetch"]["bytes_per_step"]
    return {"config": {"steps": steps, "batch": batch, "tokens": tokens, "step_s": step_s, "teacher_s": teacher_s,
                       "depth": depth, "rounds": rounds,
                       "geometry": "Qwen2.5-1.5B (28 layers, 2 KV heads, head_dim 128), bf16"},
            "runs": runs, "bytes_per_step": nbytes, "cross_node_Bps": nbytes / pull_s}


def run_cross_node(address: Optional[str] = None, steps: int = 12, batch: int = 4, tokens: int = 256,
                   step_s: float = 0.2, teacher_s: float = 0.1, depth: int = 2, rounds: int = 2) -> dict:
    """The cross-node figures, on the cluster at `address` or on a `local_cluster` of its own."""
    if address is None:
        with local_cluster() as own:
            return run_cross_node(own.gcs_address, steps, batch, tokens, step_s, teacher_s, depth, rounds)
    with ray_session(address, "kava-bench", client=True):
        return _measure(steps, batch, tokens, step_s, teacher_s, depth, rounds)


def format_cross_node(r: dict) -> str:
    c = r["config"]
    rows = [[name, f"{1000 * x['step_s']:.0f} ms", f"{x['over_same_node']:.2f}", f"{1000 * x['wait_s']:.0f} ms",
             {True: "yes", False: "no"}.get(x.get("arrives_unasked"), "—")] for name, x in r["runs"].items()]
    return "\n".join([
        f"cross-node feed: teacher node -> student node (two raylets and object stores on this machine), "
        f"{c['steps']} batches of {c['batch']} x {c['tokens']} tokens, {c['geometry']}; student busy "
        f"{1000 * c['step_s']:.0f} ms per step without a CPU, teacher {1000 * c['teacher_s']:.0f} ms per batch, "
        f"depth {c['depth']}; each regime's fastest of {c['rounds']} interleaved rounds",
        format_table(["teacher on", "step", "/ same node", "wait per step", "batch here before asked"], rows),
        f"moved between nodes: {r['bytes_per_step'] / 2**20:.1f} MiB per step; one payload pulled alone at "
        f"{r['cross_node_Bps'] / 1e9:.2f} GB/s"])


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kava_ray.bench.cross_node", description=__doc__.splitlines()[0])
    p.add_argument("--address")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run_cross_node(a.address, steps=a.steps, tokens=a.tokens, rounds=a.rounds)
    print(json.dumps(r) if a.json else format_cross_node(r))


if __name__ == "__main__":
    main()
