"""A teacher's logits-only `KVBatch` from prompt log-probs: what a vLLM engine in the actor
(`teachers[].engine: vllm`) or a server behind a URL (`engine: openai`) returns for a batch's rows,
laid out as `teacher_forward_kv` lays out a Hugging Face forward's top-k."""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kava_ray.core.kv import KVBatch
from kava_ray.core.losses import TAIL_FLOOR


class PromptScorer(Protocol):
    def prompt_topk(self, seqs: list[list[int]], k: int, last: bool = False
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per sequence of n tokens: top-k ids [n, k], their log-probs [n, k] (descending), each next
        token's log-prob [n]; position t predicts token t + 1, at temperature 1."""
        ...


def topk_batch(engine: PromptScorer, ids: torch.Tensor, mask: torch.Tensor, k: int, key_space: str, heads: int,
               head_dim: int) -> KVBatch:
    """`teacher_forward_kv`'s logits-only KVBatch of a padded batch (ids, mask [B, T]) from prompt
    log-probs: topk_ids (int64) / topk_logp (fp32, descending) [B, T, k], topk_tail [B, T] (log of
    the mass outside the k ids, from their sum in float64, floored at 1e-6 as the loss floors it),
    token_logp [B, T] (each next token's; 0 at the last real position); K and V with no layers ([0,
    B, heads, T, head_dim]). Position t predicts token t + 1, every figure at temperature 1; padded
    positions are 0, as `KVBatch.stack` leaves them."""
    B, T = ids.shape  # `engine`: a vLLM engine in this process, or a server (`rollout.openai_server`)
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
