"""KV caches as data: `KVBatch` (K and V of the selected layers, [L, B, H_kv, T, D]) and its wire
format, and the forwards that produce it. Keys are "pre_rope" (default: captured before rotation
where each family computes them, comparable across RoPE frequencies) or "post_rope" (as cached);
values are never rotated.

A padded forward must use `position_ids_from_mask(mask)`, the one position convention the rotation
uses (the forwards here do; pass it yourself if you run one). Modules: `batch`, `rope`, `capture`,
`forward`; the public names are re-exported here. See docs/internals/core.md#kv.
"""

from kava_ray.core.kv.batch import (
    KEY_SPACES,
    TOPK_ARRAYS,
    WIRE_VERSION,
    KVBatch,
    kv_bytes_per_token,
    logits_bytes_per_token,
    wire_logits_nbytes,
    wire_nbytes,
)
from kava_ray.core.kv.capture import attention_layers
from kava_ray.core.kv.forward import extract_kv, next_token_logprobs, student_forward_kv, teacher_forward_kv
from kava_ray.core.kv.rope import position_ids_from_mask, rotate_half

__all__ = ["KEY_SPACES", "TOPK_ARRAYS", "WIRE_VERSION", "KVBatch", "attention_layers", "extract_kv",
           "kv_bytes_per_token", "logits_bytes_per_token", "next_token_logprobs", "position_ids_from_mask",
           "rotate_half", "student_forward_kv", "teacher_forward_kv", "wire_logits_nbytes", "wire_nbytes"]
