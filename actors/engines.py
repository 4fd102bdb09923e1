"""What writes the completions of on-policy batches: a `CompletionEngine` is asked for one completion per prompt.

Two engines: `HFGenerate`, the student on this worker through Hugging Face `generate` (`core.sampling.sample`: its KV
cache, a seed per batch, each sampled token's log-prob under the distribution it was drawn from); `TeacherGenerate`,
a teacher of the student's tokenizer writing through its actor (`onpolicy.source: teacher`: sequence-level KD, no
log-probs). `engine_for` picks the job's. Another engine (vLLM) is one more class with the same `complete`.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import ray

from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.plans import check_writer, onpolicy_writer
from kava_ray.core.sampling import Samples, sample


class CompletionEngine(Protocol):
    """writer: whose samples these are ("student": CE is off on them, the reverse KL is measured; "teacher")."""

    writer: str

    def complete(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                 seed: int) -> Samples:
        """One completion per prompt (token ids of the student's tokenizer); `Samples.logp` None without
        log-probs."""
        ...


class HFGenerate:
    """The student samples on this worker with its current weights (`core.sampling.sample`)."""

    writer = "student"

    def __init__(self, model, eos_id: Optional[int], pad_id: int, autocast=None):
        self.model, self.eos, self.pad_id, self.autocast = model, [eos_id], pad_id, autocast

    def complete(self, prompts, max_new_tokens, temperature, top_p, seed) -> Samples:
        return sample(self.model, prompts, max_new_tokens, temperature, top_p, eos_ids=self.eos, pad_id=self.pad_id,
                      seed=seed, autocast=self.autocast)


class TeacherGenerate:
    """A teacher writes (`fn(prompts, max_new_tokens, temperature, top_p, seed)` -> token ids): no log-probs."""

    writer = "teacher"

    def __init__(self, fn: Callable):
        self.fn = fn

    def complete(self, prompts, max_new_tokens, temperature, top_p, seed) -> Samples:
        return Samples(self.fn(prompts, max_new_tokens, temperature, top_p, seed), None)


def engine_for(cfg: JobConfig, plans: dict, kv_source, student, eos_id: Optional[int], pad_id: int,
               autocast=None) -> CompletionEngine:
    """The job's engine: the student (`onpolicy.source: student`), or the named teacher (`onpolicy.teacher`, else the
    first) through its actor's `generate` -- or the source's own `generate` (teachers in process). The teacher must
    share the student's tokenizer (its ids are the student's)."""
    if cfg.onpolicy.source != "teacher":
        return HFGenerate(student, eos_id, pad_id, autocast)
    name = onpolicy_writer(cfg)
    check_writer(cfg, not plans[name].aligned)  # (the driver's preflight refused it already where it could tell)
    if hasattr(kv_source, "generate"):
        return TeacherGenerate(lambda *args: kv_source.generate(name, *args))
    handles = getattr(kv_source, "handles", None)
    if handles is None:
        raise KavaError("onpolicy.source: teacher needs live teachers (a KV cache cannot write completions)")
    h = handles[name].route("") if hasattr(handles[name], "route") else handles[name]
    return TeacherGenerate(lambda *args: ray.get(h.generate.remote(*args)))
