"""Where a job's actors can go, decided per node before anything starts (Ray-free: nodes are plain data).

Ray schedules an actor on one node, so a cluster-wide sum of resources hides a demand no node can
meet (Ray then waits forever). `fit` places every teacher replica and train worker on the nodes'
total resources (first fit) and names what cannot be placed, with the node that comes closest. Label
selectors use Ray 2.60's syntax. The rule, fractional GPUs and the selectors:
docs/internals/runtime.md#placement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

_VALUE = r"[a-zA-Z0-9](?:[a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
_SELECTOR = re.compile(rf"^(!)?(?:in\(({_VALUE}(?:, ?{_VALUE})*)\)|({_VALUE}))$")
_KEY = re.compile(rf"^(?:[a-z0-9](?:[a-z0-9.-]{{0,251}}[a-z0-9])?/)?{_VALUE}$")  # [DNS prefix/]name, as Ray's


def normalize_selector(selector: dict) -> dict:
    """The selector as Ray must get it: keys checked, and no space inside `in(...)` (Ray 2.60's
    scheduler splits the list on ',' without trimming, so 'in(a, b)' would ask for ' b'). ValueError
    names what is wrong."""
    out = {}
    for key, value in selector.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"{key!r} is not a label name ([prefix/]name of letters, digits, '-', '_', '.')")
        if not isinstance(value, str):
            raise ValueError(f"{key}: a label selector value is a string, not {value!r}")
        parse_selector_value(value)
        out[key] = re.sub(r",\s+", ",", value)
    return out


def parse_selector_value(value: str) -> tuple[bool, frozenset]:
    """'gpu' -> (False, {'gpu'}); '!gpu' -> (True, {'gpu'}); 'in(a, b)' -> (False, {'a', 'b'}). ValueError if
    it is not Ray's syntax."""
    m = _SELECTOR.match(value)
    if not m:
        raise ValueError(f"{value!r} is not a label selector value (value, !value, in(a, b) or !in(a, b))")
    values = m.group(2).split(",") if m.group(2) is not None else [m.group(3)]
    return bool(m.group(1)), frozenset(v.strip() for v in values)


def matches(selector: Optional[dict], labels: dict) -> bool:
    """Does a node with `labels` satisfy `selector` (every key's condition)?"""
    for key, value in (selector or {}).items():
        negate, values = parse_selector_value(value)
        if (labels.get(key) in values) == negate:
            return False
    return True


@dataclass
class Node:
    node_id: str
    address: str
    resources: dict  # the node's totals: {"CPU": 8.0, "GPU": 2.0, ...}
    labels: dict = field(default_factory=dict)
    name: str = ""  # how to call it; Ray's node id's first 8 digits when empty

    def describe(self) -> str:
        res = ", ".join(f"{self.resources.get(k, 0):g} {k}" for k in ("CPU", "GPU")
                        if k == "CPU" or k in self.resources)
        return f"node {self.name or self.node_id[:8]} ({self.address}: {res})"


@dataclass
class Demand:
    what: str  # "teacher 'qwen72b'", "Ray Train worker"
    resources: dict  # one actor's: {"CPU": 4, "GPU": 4}
    count: int = 1
    selector: Optional[dict] = None
    selector_key: str = ""  # the config key that holds `selector`, for the message


def _short(need: dict) -> str:
    return " + ".join(f"{v:g} {k}" for k, v in need.items() if v > 0) or "nothing"


def _fits(need: dict, free: dict) -> bool:
    return all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)


def admits(d: Demand, node: Node) -> bool:
    """Could one actor of `d` run on `node` (its selector admits it, and the node's totals hold it)?"""
    return matches(d.selector, node.labels) and _fits(d.resources, node.resources)


def _shortfall(need: dict, have: dict) -> float:
    """How far `have` is from `need` (GPUs weigh more than CPUs): the closest node has the smallest."""
    return sum((1000.0 if k == "GPU" else 1.0) * max(0.0, v - have.get(k, 0.0)) for k, v in need.items())


def fit(nodes: list[Node], demands: list[Demand]) -> Optional[str]:
    """None when every demand can be placed on the nodes at once; else one line saying what cannot, and why."""
    return place(nodes, demands)[1]


def place(nodes: list[Node], demands: list[Demand]) -> tuple[list[tuple[str, Node]], Optional[str]]:
    """Where each actor goes, ([(what, node)] in placing order, None), or what cannot be placed ([], one line).

    A first fit on the nodes' totals, as a check: Ray's scheduler decides the real spots at run time
    and may choose other nodes of the same kind.
    """
    admitted = {id(d): [n for n in nodes if matches(d.selector, n.labels)] for d in demands}
    for d in demands:  # each actor alone: its selector admits a node, and one admitted node is big enough
        if not admitted[id(d)]:
            seen = sorted({f"{k}={v}" for n in nodes for k, v in n.labels.items() if not k.startswith("ray.io/")})
            return [], (f"{d.selector_key} {d.selector} matches no node of the cluster "
                        f"(its nodes' labels: {', '.join(seen) or 'none'})")
        if not any(_fits(d.resources, n.resources) for n in admitted[id(d)]):
            closest = min(admitted[id(d)], key=lambda n: _shortfall(d.resources, n.resources))
            where = f"that {d.selector_key} admits" if d.selector else "of the cluster"
            return [], (f"{d.what} needs {_short(d.resources)} on one node; no node {where} has that: the closest "
                        f"is {closest.describe()}")
    free = {n.node_id: dict(n.resources) for n in nodes}
    units = sorted(((d, i) for d in demands for i in range(d.count)),  # the most constrained, then the largest
                   key=lambda u: (len(admitted[id(u[0])]), -u[0].resources.get("GPU", 0),
                                  -u[0].resources.get("CPU", 0)))
    where = []
    for d, i in units:  # all together: first fit
        what = f"{d.what}{f' #{i}' if d.count > 1 else ''}"
        spot = next((n for n in admitted[id(d)] if _fits(d.resources, free[n.node_id])), None)
        if spot is None:
            closest = min(admitted[id(d)], key=lambda n: _shortfall(d.resources, free[n.node_id]))
            left = ", ".join(f"{round(free[closest.node_id].get(k, 0.0), 3):g} {k}" for k in d.resources)
            return [], (f"the job does not fit on the cluster's nodes together: {what} needs {_short(d.resources)} "
                        f"on one node once the rest is placed; the closest is {closest.describe()} with {left} left")
        for k, v in d.resources.items():
            free[spot.node_id][k] = free[spot.node_id].get(k, 0.0) - v
        where.append((what, spot))
    return where, None


def cluster_yaml_nodes(spec: dict, source: str = "cluster.yaml") -> list[Node]:
    """The nodes a Ray cluster launcher config (`cluster.yaml`) can bring up: the head and
    `max_workers` of each worker type, with the resources and labels each type declares (a type must
    declare them: the planner cannot see what Ray would detect on the instance; the cluster-wide
    `max_workers` cap is not applied). ValueError names what is missing."""
    types = spec.get("available_node_types")
    if not isinstance(types, dict) or not types:
        raise ValueError(f"{source}: no available_node_types (a Ray cluster launcher config lists its node types)")
    head = spec.get("head_node_type")
    nodes = []
    for kind, t in types.items():
        if not isinstance(t, dict):
            raise ValueError(f"{source}: available_node_types.{kind} is not a mapping")
        count = 1 if kind == head else int(t.get("max_workers", spec.get("max_workers", 0)) or 0)
        if not t.get("resources") and count:
            raise ValueError(f"{source}: node type {kind} declares no resources (e.g. resources: {{CPU: 8, GPU: 1}}): "
                             f"the planner cannot see what Ray would detect on the instance")
        res = {k: float(v) for k, v in (t.get("resources") or {}).items()}
        for i in range(count):
            name = kind if kind == head else f"{kind}#{i}"
            nodes.append(Node(f"{source}:{name}", kind, res, dict(t.get("labels") or {}), name=name))
    return nodes
