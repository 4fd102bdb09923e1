"""A KVFeed source that runs teacher models in this process: what a TeacherActor serves, without Ray.

For tests and notebooks that want the real feed, Distiller and training step on tiny models without
starting a cluster. Same protocol as `kava_ray.rollout.feed.ActorSource`: `submit` then `result`.
"""

from __future__ import annotations

import torch

from kava_ray.common.config import JobConfig
from kava_ray.common.fingerprints import tokenizer_fingerprint
from kava_ray.core.kv import teacher_forward_kv
from kava_ray.core.models import kv_geometry, load_tokenizer
from kava_ray.core.plans import TeacherPlan, student_geometry, teacher_plans


class InProcessSource:
    def __init__(self, models: dict, key_space: str = "pre_rope"):
        self.models = models  # {teacher name: loaded model}
        self.key_space = key_space

    def submit(self, name: str, request):
        return request  # computed when asked for: nothing runs ahead

    def generate(self, name: str, prompts: list, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0) -> list:
        """Completions written by teacher `name` (on-policy `source: teacher`), as `TeacherActor.generate`."""
        from kava_ray.core.sampling import sample

        model = self.models[name]
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if isinstance(eos, list) else [eos]
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else (eos[0] or 0)
        return sample(model, prompts, max_new_tokens, temperature, top_p, eos_ids=eos, pad_id=pad, seed=seed).ids

    def result(self, name: str, request, _future) -> dict:
        r = request  # an `kava_ray.rollout.feed.KVRequest`
        kv = teacher_forward_kv(self.models[name], torch.as_tensor(r.input_ids), torch.as_tensor(r.attention_mask),
                                layers=r.layers, key_space=self.key_space, logits_top_k=r.logits_top_k,
                                hidden=r.hidden, token_logprobs=getattr(r, "token_logprobs", False))
        return kv.to_wire(r.wire_dtype)


def in_process_plans(cfg: JobConfig, models: dict) -> dict[str, TeacherPlan]:
    """Plans for teachers loaded in this process ({teacher: model}, an `InProcessSource`'s): the
    geometry and tokenizer fingerprint each would report as an actor."""
    geoms = {t.name: dict(kv_geometry(models[t.name]).to_dict(),
                          tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer(t.model)))
             for t in cfg.teachers}
    return teacher_plans(cfg.student, cfg.teachers, cfg.align, geoms, student_geometry(cfg.student))
