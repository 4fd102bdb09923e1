"""KV caches as data: extraction (pre-RoPE keys exact on every family), and a compact wire format.

A KVBatch holds K and V of the selected layers stacked as [L, B, H_kv, T, D]. Keys are "pre_rope"
(the key before rotation, comparable across models with different RoPE frequencies; default) or
"post_rope" (as cached). Values are never rotated.

Pre-RoPE keys are captured where the model computes them: forward hooks on the module whose output
is the key before rotation (the k-norm when the family has one, else k_proj, else the fused q/k/v
projection split by the family's layout) and on the value projection. That is exact for full,
partial, interleaved and per-layer-type rotary, for layers without RoPE and for models without
rotary (whose keys are served as they are); `teacher_forward_kv` checks the capture against the
cache it fills. A family whose keys cannot be read this way is refused with one KavaError line.

Positions: a forward with a padded batch must use the same position ids the rotation uses.
`position_ids_from_mask` is that single convention (HF generation's: cumsum(mask) - 1, pads -> 0);
`teacher_forward_kv` / `student_forward_kv` pass it to the forward, and `extract_kv` derives it
from `mask` when no position_ids are given. If you run the forward yourself with a padded batch,
pass `position_ids=position_ids_from_mask(mask)` to it as well.

Modules: `batch` (KVBatch and its wire format), `rope` (positions and rotation), `capture` (hooks per family
and the check against the cache), `forward` (the teacher and student forwards, `extract_kv`). The public
names are re-exported here: `from kava_ray.core.kv import X`.
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
from kava_ray.core.kv.forward import extract_kv, student_forward_kv, teacher_forward_kv
from kava_ray.core.kv.rope import position_ids_from_mask, rotate_half

__all__ = ["KEY_SPACES", "TOPK_ARRAYS", "WIRE_VERSION", "KVBatch", "attention_layers", "extract_kv",
           "kv_bytes_per_token", "logits_bytes_per_token", "position_ids_from_mask", "rotate_half",
           "student_forward_kv", "teacher_forward_kv", "wire_logits_nbytes", "wire_nbytes"]
