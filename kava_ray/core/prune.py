"""Width pruning of attention, Minitron's way (Muralidharan et al. 2024, "Compact Language Models
via Pruning and Knowledge Distillation"; NVIDIA ModelOpt's Minitron pruning): a student whose KV
geometry differs from its teacher's while its weights start from the teacher's.

`kv_group_importance` scores each KV group (one KV head and the query heads that read it) by its
activations on a calibration batch: per query head, the L2 norm of its attention output (the head's
slice of `o_proj`'s input) at each real token, averaged over the tokens; a group's importance is the
sum over its query heads (Minitron's head importance, aggregated over the GQA group that must stay
together). `prune_kv_groups` keeps, in every layer, the `n` groups of the highest importance: the q
/ k / v rows and the o_proj columns of those heads, so the model's KV is [n, head_dim] per layer
where the teacher's is [H_kv, head_dim]. Llama / Qwen2 / Mistral attention (`self_attn` with q_proj,
k_proj, v_proj, o_proj); the config records the new head counts and head_dim, so the result saves
and reloads as an ordinary model.
"""

from __future__ import annotations

import torch
from torch import nn

from kava_ray.common.errors import KavaError
from kava_ray.core.models import decoder_layers


def _attn(layer) -> nn.Module:
    attn = getattr(layer, "self_attn", None)
    if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise KavaError(f"{type(layer).__name__}: width pruning needs self_attn with q_proj, k_proj, v_proj and "
                        "o_proj (Llama / Qwen2 / Mistral attention)")
    return attn


def _geometry(model) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of the model's attention."""
    c = model.config
    heads, kv = int(c.num_attention_heads), int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    return heads, kv, int(getattr(c, "head_dim", None) or c.hidden_size // heads)


@torch.no_grad()
def kv_group_importance(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[L, H_kv]: each layer's KV groups scored on a calibration batch (module docstring).
    input_ids, attention_mask: [B, T]."""
    heads, kv, dim = _geometry(model)
    real = attention_mask.bool()
    scores: list = []

    def hook(_module, args):
        x = args[0].reshape(*args[0].shape[:2], heads, dim).float()  # [B, T, H, D]: each head's output
        per_head = x.norm(dim=-1)[real].mean(0)  # [H]: mean over the real tokens
        scores.append(per_head.reshape(kv, heads // kv).sum(-1))

    handles = [_attn(layer).o_proj.register_forward_pre_hook(hook) for layer in decoder_layers(model)]
    try:
        was = model.training
        model.eval()
        model(input_ids=input_ids, attention_mask=attention_mask)
        model.train(was)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(scores)


def _rows(linear: nn.Linear, idx: torch.Tensor, dim: int) -> nn.Linear:
    """A Linear keeping output rows `idx` (a tensor of kept rows, or of kept input columns with dim=1)."""
    w = linear.weight.index_select(dim, idx)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias if dim == 1 else linear.bias.index_select(0, idx))
    return out


@torch.no_grad()
def prune_kv_groups(model, n: int, importance: torch.Tensor) -> list[list[int]]:
    """Keep the `n` most important KV groups of every layer (`importance` [L, H_kv],
    `kv_group_importance`), in place; returns the kept groups per layer (ascending). The config then
    has n KV heads, n x (H / H_kv) query heads and an explicit head_dim."""
    heads, kv, dim = _geometry(model)
    layers = decoder_layers(model)
    if not 1 <= n <= kv:
        raise KavaError(f"width pruning: keep between 1 and {kv} KV groups, not {n}")
    if tuple(importance.shape) != (len(layers), kv):
        raise KavaError(f"width pruning: importance of shape {tuple(importance.shape)}, expected {(len(layers), kv)}")
    per = heads // kv
    kept = []
    for layer, score in zip(layers, importance):
        groups = sorted(torch.topk(score, n).indices.tolist())
        q_heads = [g * per + j for g in groups for j in range(per)]
        q_idx = torch.tensor([h * dim + d for h in q_heads for d in range(dim)], device=score.device)
        kv_idx = torch.tensor([g * dim + d for g in groups for d in range(dim)], device=score.device)
        attn = _attn(layer)
        dev = attn.q_proj.weight.device
        attn.q_proj = _rows(attn.q_proj, q_idx.to(dev), 0)
        attn.k_proj = _rows(attn.k_proj, kv_idx.to(dev), 0)
        attn.v_proj = _rows(attn.v_proj, kv_idx.to(dev), 0)
        attn.o_proj = _rows(attn.o_proj, q_idx.to(dev), 1)
        attn.head_dim = dim
        kept.append(groups)
    c = model.config
    c.num_attention_heads, c.num_key_value_heads, c.head_dim = n * per, n, dim
    return kept
