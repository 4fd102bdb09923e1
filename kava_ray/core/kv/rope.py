"""Rotary positions: the one position-id convention, rotate_half, and rotating keys outside a
forward (post-RoPE students under gradient checkpointing; `extract_kv`'s de-rotation of Llama-style
caches).
"""

from __future__ import annotations

import sys

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.kv.capture import attention_layers, model_family
from kava_ray.core.models import kv_geometry, rotary_embedding, uses_rotary


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask (1 = real token) -> [B, T] positions: cumsum(mask) - 1, padding -> 0 (HF generate)."""
    mask = mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _llama_rotary_problem(model) -> str | None:
    """None when the model rotates every layer's keys Llama-style (one rotary module, rotary over
    the full head_dim, rotate_half pairing), so `_rope` can (un)rotate cached keys exactly; else why
    not."""
    rotary = rotary_embedding(model, required=False)
    if rotary is None:
        return "no rotary module"
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    if any(getattr(config, k, None) for k in ("no_rope_layers", "no_rope_layer_interval")):
        return "layers without RoPE"
    attn = attention_layers(model)
    family_module = sys.modules.get(type(attn[0]).__module__) if attn else None
    theirs = getattr(family_module, "rotate_half", None)
    probe = torch.arange(8, dtype=torch.float32)
    if theirs is None or not torch.equal(theirs(probe), rotate_half(probe)):
        return "rotary that is not rotate_half (e.g. interleaved pairs)"
    dev = getattr(rotary, "inv_freq", probe).device
    try:
        cos, _ = rotary(torch.zeros(1, device=dev), torch.zeros(1, 1, dtype=torch.long, device=dev))
    except TypeError:
        return "rotary parameters per layer type"
    if cos.shape[-1] != kv_geometry(model).head_dim:
        return f"partial rotary ({cos.shape[-1]} of {kv_geometry(model).head_dim} dims)"
    return None


def _rope(keys: torch.Tensor, model, position_ids: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rotate (or un-rotate) keys [L, B, H, T, D] with the model's own rotary embedding, in float32;
    only for Llama-style rotary (`_llama_rotary_problem` is None)."""
    rotary = rotary_embedding(model)
    x = keys.float()
    dev = getattr(rotary, "inv_freq", x).device
    probe = torch.zeros(1, device=dev)  # the rotary module only reads device and dtype from x
    cos, sin = rotary(probe, position_ids.to(dev))  # [B or 1, T, D]
    cos, sin = cos.to(x.device, torch.float32)[None, :, None], sin.to(x.device, torch.float32)[None, :, None]
    if inverse:
        # HF rotates k * cos + rotate_half(k) * sin with cos, sin already scaled by attention_scaling s
        s = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)  # 1 for default RoPE
        out = (x * cos - rotate_half(x) * sin) / (s * s)
    else:
        out = x * cos + rotate_half(x) * sin
    return out.to(keys.dtype)


def rotate_outside_forward(keys: torch.Tensor, model, position_ids: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Keys [L, B, H, T, D] between pre- and post-RoPE space without a forward: unchanged for a
    model without rotary, the model's own rotary for Llama-style rotary, KavaError for other
    rotary."""
    if not uses_rotary(model):
        return keys
    problem = _llama_rotary_problem(model)
    if problem is None:
        return _rope(keys, model, position_ids, inverse=inverse)
    if inverse:
        raise KavaError(
            f"{model_family(model)}: cannot de-rotate cached keys ({problem}); teacher_forward_kv / student_forward_kv "
            "capture exact pre-RoPE keys for this family, or use key_space post_rope"
        )
    raise KavaError(
        f"{model_family(model)}: post_rope keys under gradient checkpointing need Llama-style rotary ({problem}); "
        "turn gradient checkpointing off or use align.key_space: pre_rope"
    )


