"""URLTeacherActor: a teacher behind a URL (`teachers[].engine: openai`), read through its server's
prompt log-probs (`rollout.openai_server.OpenAIServer`).

The same actor as `TeacherActor` (LRU, counters, object-store payloads, replicas, content keys) with
no weights: it loads the served model's config and tokenizer here (`teachers[].tokenizer`, default
the model name), checks at start that the server answers, serves that model and tokenizes as that
tokenizer, and serves what a vLLM teacher serves: the top-k log-probs with the tail mass and each
next token's log-prob, no KV or hidden states (a logits-only job: `JobConfig._check_logits_only_teachers`).
"""

from __future__ import annotations

from typing import Optional

import torch

from actors.teacher import TeacherActor
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import KVBatch
from kava_ray.core.models import kv_geometry, load_model_config
from kava_ray.core.prompt_logprobs import topk_batch
from kava_ray.rollout.openai_server import OpenAIServer


class URLTeacherActor(TeacherActor):
    """`TeacherActor` whose forward is a server's prompt log-probs."""

    def _load(self, device_map) -> None:
        c = self.cfg
        self.server = OpenAIServer(c.url, c.model, c.name, c.api_key_env, c.timeout_s, c.retries, c.concurrency)
        self.config = load_model_config(c.served_from())
        self.geom = kv_geometry(self.config)
        self.card: dict = {}
        self.device = "url"

    def _check(self) -> None:
        self.card = self.server.check(self.tokenizer)

    def _served(self) -> dict:
        return dict(revision=None, dtype="server", url=self.server.url, max_model_len=self.card.get("max_model_len"))

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, layers: Optional[list[int]], logits_top_k: int,
                 hidden: bool, token_logprobs: bool) -> KVBatch:
        if layers or hidden:
            raise KavaError(f"teacher '{self.cfg.name}' is served behind a URL, which gives no KV or hidden states "
                            f"(asked for layers {layers}, hidden {hidden})")
        logits_top_k = min(logits_top_k, self.geom.vocab_size or logits_top_k)
        return topk_batch(self.server, ids, mask, logits_top_k, self.key_space, self.geom.num_kv_heads,
                          self.geom.head_dim)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[int]]:
        """Sampled completions of `prompts` through the server (on-policy's `source: teacher`)."""
        ids = self.server.sample(prompts, max_new_tokens, temperature, top_p, seed)
        self.counters["generated"] = self.counters.get("generated", 0) + sum(map(len, ids))
        return ids

    def stats(self) -> dict:
        return dict(super().stats(), server_requests=self.server.requests, server_retries=self.server.retried)
