"""What writes the completions of on-policy batches: a `CompletionEngine` is asked for one completion per prompt.

Three engines: `HFGenerate`, the student on this worker through Hugging Face `generate`
(`core.sampling.sample`: its KV cache, a seed per batch, each sampled token's log-prob under the
distribution it was drawn from); `VLLMGenerate`, the same student through a vLLM engine colocated on
this worker (`onpolicy.engine: vllm`, `rollout.vllm_engine`: the student's current weights pushed in
before each sampling round); `TeacherGenerate`, a teacher of the student's tokenizer writing through
its actor (`onpolicy.source: teacher`: sequence-level KD, no log-probs). `engine_for` picks the
job's.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

import ray
import torch

from kava_ray.common.config import JobConfig
from kava_ray.common.errors import KavaError
from kava_ray.core.models import load_named, plain_config, whole_copy
from kava_ray.core.plans import check_writer, onpolicy_writer
from kava_ray.core.sampling import Samples, sample
from kava_ray.rollout.student_weights import GatheredWeights, weights_of


class CompletionEngine(Protocol):
    """writer: whose samples these are ("student": CE is off on them, the reverse KL is measured; "teacher")."""

    writer: str

    def complete(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                 seed: int) -> Samples:
        """One completion per prompt (token ids of the student's tokenizer); `Samples.logp` None
        without log-probs."""
        ...


class HFGenerate:
    """The student samples on this worker with its current weights (`core.sampling.sample`).
    gathered: the weights of an FSDP2-sharded student (`rollout.student_weights.GatheredWeights`),
    loaded into `model`, its whole copy, before each round."""

    writer = "student"

    def __init__(self, model, eos_id: Optional[int], pad_id: int, autocast=None, gathered=None):
        self.model, self.eos, self.pad_id, self.autocast, self.gathered = model, [eos_id], pad_id, autocast, gathered
        self.push_s = 0.0

    def complete(self, prompts, max_new_tokens, temperature, top_p, seed) -> Samples:
        if self.gathered is not None:
            t0 = time.perf_counter()
            load_named(self.model, self.gathered.named())
            self.push_s += time.perf_counter() - t0
        return sample(self.model, prompts, max_new_tokens, temperature, top_p, eos_ids=self.eos, pad_id=self.pad_id,
                      seed=seed, autocast=self.autocast)


class VLLMGenerate:
    """The student samples through a vLLM engine on this worker (TRL's colocate mode). Before each
    round the student's weights are pushed into the engine when they changed since the last push (an
    optimizer step bumps the parameters' version counters), so a round samples with exactly the
    weights the HF path would: the current ones at lag 0, those of one step earlier at lag 1 (the
    round then runs before the step's update)."""

    writer = "student"

    def __init__(self, model, eos_id: Optional[int], engine):
        self.weights, self.eos, self.engine = weights_of(model), [eos_id], engine
        self._pushed: Optional[int] = None
        self.push_s = 0.0

    def sync(self) -> None:
        """Push the student's weights into the engine if they changed since the last push (a
        sharded student's: every round, gathered one tensor at a time)."""
        v = self.weights.version()
        if v is None or v != self._pushed or self.engine.needs_push:  # (a level-2 sleep dropped them)
            t0 = time.perf_counter()
            self.engine.push(self.weights.named())
            self.push_s += time.perf_counter() - t0
            self._pushed = v

    def complete(self, prompts, max_new_tokens, temperature, top_p, seed) -> Samples:
        self.sync()
        s = self.engine.sample(prompts, max_new_tokens, temperature, top_p, eos_ids=self.eos, seed=seed)
        self.engine.sleep()  # (CUDA sleep mode: its memory back to the step until the next round)
        return s

    def close(self) -> None:
        self.engine.close()


class TeacherGenerate:
    """A teacher writes (`fn(prompts, max_new_tokens, temperature, top_p, seed)` -> token ids): no log-probs."""

    writer = "teacher"

    def __init__(self, fn: Callable):
        self.fn = fn

    def complete(self, prompts, max_new_tokens, temperature, top_p, seed) -> Samples:
        return Samples(self.fn(prompts, max_new_tokens, temperature, top_p, seed), None)


def engine_for(cfg: JobConfig, plans: dict, kv_source, student, eos_id: Optional[int], pad_id: int,
               precision=None) -> CompletionEngine:
    """The job's engine: the student (`onpolicy.source: student`), or the named teacher
    (`onpolicy.teacher`, else the first) through its actor's `generate` -- or the source's own
    `generate` (teachers in process). The teacher must share the student's tokenizer (its ids are
    the student's). `precision` (`core.precision.Precision`): the student's forwards' autocast (HF)
    and compute dtype, which a vLLM engine takes (bf16 under bf16-mixed, not the fp32 master
    weights': half the memory, and q from the forward pi_S comes from)."""
    if cfg.onpolicy.source != "teacher":
        if cfg.onpolicy.engine == "vllm":
            from kava_ray.rollout.vllm_engine import VLLMEngine, engine_dtype

            o = cfg.onpolicy
            rows = cfg.train.batch_size * o.samples_per_prompt
            dtype = None if precision is None else engine_dtype(precision.compute_dtype)
            engine = VLLMEngine.for_model(student, dtype=dtype, max_model_len=cfg.train.max_length,
                                          max_num_seqs=max(rows, 1),
                                          seed=cfg.train.seed, kv_cache_bytes=o.vllm_kv_cache_mb << 20,
                                          gpu_memory_utilization=o.vllm_gpu_memory_utilization, sleep_mode=True)
            return VLLMGenerate(student, eos_id, engine)
        autocast = None if precision is None else precision.autocast
        weights = weights_of(student)
        if isinstance(weights, GatheredWeights):  # FSDP2: a whole copy in the forwards' dtype, loaded each round
            dtype = torch.float32 if precision is None else precision.compute_dtype
            device = next(student.parameters()).device
            return HFGenerate(whole_copy(student, dtype, device, plain_config(student)), eos_id, pad_id, autocast,
                              gathered=weights)
        return HFGenerate(student, eos_id, pad_id, autocast)
    name = onpolicy_writer(cfg.onpolicy, cfg.teachers)
    check_writer(cfg.onpolicy, cfg.teachers,
                 not plans[name].aligned)  # (the driver's preflight refused it already where it could tell)
    if hasattr(kv_source, "generate"):
        return TeacherGenerate(lambda *args: kv_source.generate(name, *args))
    handles = getattr(kv_source, "handles", None)
    if handles is None:
        raise KavaError("onpolicy.source: teacher needs live teachers (a KV cache cannot write completions)")
    h = handles[name].route("") if hasattr(handles[name], "route") else handles[name]
    return TeacherGenerate(lambda *args: ray.get(h.generate.remote(*args)))
