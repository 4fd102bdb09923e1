"""A KVFeed source that runs teacher models in this process: what a TeacherActor serves, without Ray.

For tests and notebooks that want the real feed, Distiller and training step on tiny models without
starting a cluster. Same protocol as `actors.feed.ActorSource`: `submit` then `result`.
"""

from __future__ import annotations

import torch

from kava_ray.kv import teacher_forward_kv


class InProcessSource:
    def __init__(self, models: dict, key_space: str = "pre_rope"):
        self.models = models  # {teacher name: loaded model}
        self.key_space = key_space

    def submit(self, name: str, request: tuple):
        return request  # computed when asked for: nothing runs ahead

    def result(self, name: str, request: tuple, _future) -> dict:
        _key, ids, mask, layers, wire_dtype, logits_top_k = request
        kv = teacher_forward_kv(self.models[name], torch.as_tensor(ids), torch.as_tensor(mask), layers=layers,
                                key_space=self.key_space, logits_top_k=logits_top_k)
        return kv.to_wire(wire_dtype)
