"""KV caches as data: extraction from HF caches, RoPE de-rotation, and a compact wire format.

A KVBatch holds K and V of the selected layers stacked as [L, B, H_kv, T, D]. Keys are "pre_rope"
(the k_proj output, comparable across models with different RoPE frequencies; default) or
"post_rope" (as cached). Values are never rotated.

Positions: a forward with a padded batch must use the same position ids the de-rotation uses.
`position_ids_from_mask` is that single convention (HF generation's: cumsum(mask) - 1, pads -> 0);
`teacher_forward_kv` / `student_forward_kv` pass it to the forward, and `extract_kv` derives it
from `mask` when no position_ids are given. If you run the forward yourself with a padded batch,
pass `position_ids=position_ids_from_mask(mask)` to it as well.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kava_ray.errors import KavaError
from kava_ray.models import KVGeometry, rotary_embedding

KEY_SPACES = ("pre_rope", "post_rope")
WIRE_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_ELEM_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "fp32": 4, "float32": 4}


@dataclass
class KVBatch:
    """K and V of selected layers. keys/values: [L, B, H_kv, T, D]; mask: [B, T], 1 = real token."""

    keys: torch.Tensor
    values: torch.Tensor
    layer_ids: list[int]
    mask: torch.Tensor | None
    key_space: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keys.shape)

    def to(self, device=None, dtype=None) -> "KVBatch":
        """Move K, V (and mask) to `device`; cast K, V to `dtype` if given (the mask keeps its dtype)."""
        mask = self.mask.to(device) if self.mask is not None and device is not None else self.mask
        return KVBatch(
            self.keys.to(device=device, dtype=dtype),
            self.values.to(device=device, dtype=dtype),
            list(self.layer_ids),
            mask,
            self.key_space,
        )

    def select_layers(self, ids) -> "KVBatch":
        """A KVBatch with exactly the layers `ids` (model layer ids, in that order)."""
        ids = [int(i) for i in ids]
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise KavaError(f"layers {missing} not in this KV batch (has {self.layer_ids})")
        idx = torch.tensor([self.layer_ids.index(i) for i in ids], device=self.keys.device)
        return KVBatch(self.keys.index_select(0, idx), self.values.index_select(0, idx), ids, self.mask, self.key_space)

    def num_bytes(self) -> int:
        """Bytes held by K and V (not the mask)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # ------------------------------------------------------------------------------------- wire

    def to_wire(self, dtype: str = "bf16") -> dict:
        """Compact, pickle-friendly payload of numpy arrays (zero-copy views where possible).

        bf16 -> uint16 view of the bf16 bits (numpy has no bfloat16); fp16 -> float16;
        fp8 -> uint8 view of float8_e4m3fn plus a float32 scale per (layer, head, head_dim) channel
        (amax over batch and time / 448). A CPU, contiguous tensor already in the wire dtype is not
        copied: the arrays share its memory.
        """
        dtype = _wire_dtype(dtype)
        payload = {
            "version": WIRE_VERSION,
            "dtype": dtype,
            "shape": list(self.keys.shape),
            "layer_ids": list(self.layer_ids),
            "key_space": self.key_space,
            "mask": None if self.mask is None else self.mask.detach().to("cpu", torch.bool).numpy(),
        }
        for name, t in (("k", self.keys), ("v", self.values)):
            t = t.detach()
            if dtype == "bf16":
                payload[name] = t.to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()
            elif dtype == "fp16":
                payload[name] = t.to("cpu", torch.float16).contiguous().numpy()
            else:  # fp8 e4m3 with per-channel scales
                x = t.float()  # [L, B, H, T, D]
                scale = x.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX  # [L, 1, H, 1, D]
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                q = (x / scale).to(torch.float8_e4m3fn)
                payload[name] = q.to("cpu").contiguous().view(torch.uint8).numpy()
                payload[name + "_scale"] = scale[:, 0, :, 0, :].to("cpu").contiguous().numpy()  # [L, H, D]
        return payload

    @classmethod
    def from_wire(cls, payload: dict, device=None, dtype: torch.dtype | None = torch.float32) -> "KVBatch":
        """Rebuild a KVBatch from `to_wire` output; the compact arrays move to `device` before the cast.

        dtype=None keeps the wire dtype (bf16/fp16; fp8 is always de-scaled to float32).
        """
        if payload.get("version") != WIRE_VERSION:
            raise KavaError(f"KV wire version {payload.get('version')!r} not supported (expected {WIRE_VERSION})")
        wire = payload["dtype"]
        tensors = []
        for name in ("k", "v"):
            with warnings.catch_warnings():  # arrays from the object store are read-only; we never write
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(payload[name])
            t = raw.to(device) if device is not None else raw
            if wire == "bf16":
                t = t.view(torch.bfloat16)
            elif wire == "fp8":
                scale = torch.from_numpy(np.ascontiguousarray(payload[name + "_scale"])).to(t.device)
                t = t.view(torch.float8_e4m3fn).float() * scale[:, None, :, None, :]
            if dtype is not None:
                t = t.to(dtype)
            if t.data_ptr() == raw.data_ptr():  # still aliasing a (maybe read-only) numpy buffer
                t = t.clone()
            tensors.append(t.reshape(payload["shape"]))
        mask = payload.get("mask")
        if mask is not None:
            mask = torch.from_numpy(np.array(mask, dtype=bool))
            mask = mask.to(device) if device is not None else mask
        return cls(tensors[0], tensors[1], list(payload["layer_ids"]), mask, payload["key_space"])


def wire_nbytes(payload: dict) -> int:
    """Bytes of the K and V arrays of a wire payload only (not the mask, fp8 scales or metadata)."""
    return int(payload["k"].nbytes + payload["v"].nbytes)


def _wire_dtype(dtype) -> str:
    d = str(dtype).lower().removeprefix("torch.")
    d = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8"}.get(d, d)
    if d not in ("bf16", "fp16", "fp8"):
        raise KavaError(f"unknown KV wire dtype {dtype!r}; expected bf16, fp16 or fp8")
    return d


def kv_bytes_per_token(geometry: KVGeometry, dtype: str = "bf16", layers=None) -> int:
    """Bytes of K and V per token: 2 * n_layers * num_kv_heads * head_dim * bytes per element."""
    d = str(dtype).lower().removeprefix("torch.")
    if d not in _ELEM_BYTES:
        raise KavaError(f"unknown KV dtype {dtype!r}; expected bf16, fp16, fp8 or fp32")
    n_layers = geometry.num_layers if layers is None else len(list(layers))
    return 2 * n_layers * geometry.num_kv_heads * geometry.head_dim * _ELEM_BYTES[d]


# ------------------------------------------------------------------------------------------- RoPE


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask (1 = real token) -> [B, T] positions: cumsum(mask) - 1, padding -> 0 (HF generate)."""
    mask = mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(keys: torch.Tensor, model, position_ids: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rotate (or un-rotate) keys [L, B, H, T, D] with the model's own rotary embedding, in float32.

    HF applies k * cos + rotate_half(k) * sin with cos/sin already multiplied by attention_scaling s,
    so the inverse is (k * cos - rotate_half(k) * sin) / s**2 (s = 1 for default RoPE).
    """
    rotary = rotary_embedding(model)
    x = keys.float()
    dev = getattr(rotary, "inv_freq", x).device
    probe = torch.zeros(1, device=dev)  # the rotary module only reads device and dtype from x
    cos, sin = rotary(probe, position_ids.to(dev))  # [B or 1, T, D]
    cos, sin = cos.to(x.device, torch.float32)[None, :, None], sin.to(x.device, torch.float32)[None, :, None]
    if inverse:
        s = float(getattr(rotary, "attention_scaling", 1.0) or 1.0)
        out = (x * cos - rotate_half(x) * sin) / (s * s)
    else:
        out = x * cos + rotate_half(x) * sin
    return out.to(keys.dtype)


# ------------------------------------------------------------------------------------- extraction


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) [B, H, T, D] from a transformers Cache (cache.layers) or legacy ((k, v), ...)."""
    from transformers.cache_utils import Cache

    if isinstance(cache, Cache):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if isinstance(cache, (tuple, list)) and all(
        isinstance(p, (tuple, list)) and len(p) >= 2 and torch.is_tensor(p[0]) and torch.is_tensor(p[1]) for p in cache
    ):
        return [(p[0], p[1]) for p in cache]
    raise TypeError(f"expected a transformers Cache or legacy ((k, v), ...) tuples, got {type(cache).__name__}")


def _check_layers(layers, n: int) -> list[int]:
    if layers is None:
        return list(range(n))
    ids = [int(i) for i in layers]
    bad = [i for i in ids if not 0 <= i < n]
    if bad or not ids:
        raise KavaError(f"layer ids {bad or ids} out of range: the model has {n} layers (0..{n - 1})")
    if len(set(ids)) != len(ids):
        raise KavaError(f"duplicate layer ids in {ids}")
    return ids


def extract_kv(
    cache_or_tuples,
    model=None,
    position_ids=None,
    key_space: str = "pre_rope",
    layers=None,
    mask=None,
) -> KVBatch:
    """Stack the selected layers of a cache into a KVBatch; de-rotate keys for key_space="pre_rope".

    position_ids: [B, T] or [T] positions the forward used; default position_ids_from_mask(mask), or
    arange(T) without a mask. pre_rope needs `model` (for its rotary embedding). Keeps autograd.
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    per_layer = _cache_layers(cache_or_tuples)
    if not per_layer:
        raise KavaError("the cache holds no layers (was the forward run with use_cache=True?)")
    ids = _check_layers(layers, len(per_layer))
    ks, vs = [], []
    for i in ids:
        k, v = per_layer[i]
        if k is None or k.dim() != 4:
            raise KavaError(f"layer {i} has no cached keys (was the forward run with use_cache=True?)")
        ks.append(k)
        vs.append(v)
    if len({k.shape for k in ks}) != 1:
        raise KavaError(f"cached layers differ in shape {sorted({tuple(k.shape) for k in ks})} (sliding window?)")
    dev = ks[0].device  # with device_map="auto" layers may live on different GPUs
    keys = torch.stack([k.to(dev) for k in ks])  # [L, B, H, T, D]
    values = torch.stack([v.to(dev) for v in vs])
    T = keys.shape[3]
    if mask is not None:
        mask = mask.to(dev).bool()
        if mask.shape != keys.shape[1:2] + (T,):
            raise KavaError(f"mask shape {tuple(mask.shape)} does not match cached [B, T] = {(keys.shape[1], T)}")
    if key_space == "pre_rope":
        if model is None:
            raise KavaError("key_space pre_rope needs the model (its rotary embedding) to de-rotate keys")
        if position_ids is None:
            position_ids = position_ids_from_mask(mask) if mask is not None else torch.arange(T, device=dev)
        position_ids = position_ids.reshape(-1, T)  # [B or 1, T]
        keys = _rope(keys, model, position_ids, inverse=True)
    return KVBatch(keys, values, ids, mask, key_space)


def _forward_inputs(model, input_ids, attention_mask):
    dev = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(dev)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(dev)
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


def teacher_forward_kv(model, input_ids, attention_mask, layers=None, key_space: str = "pre_rope") -> KVBatch:
    """Inference forward (no LM head) with explicit position ids -> KVBatch of the selected layers.

    input_ids, attention_mask: [B, T]. The returned tensors are ordinary (not inference-mode)
    tensors on the model's device, in the model's dtype.
    """
    input_ids, attention_mask, pos = _forward_inputs(model, input_ids, attention_mask)
    base = getattr(model, "base_model", model)  # the decoder without the LM head: logits are not needed
    with torch.inference_mode():
        out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=True)
    with torch.no_grad():  # outside inference mode, so the stacked copies are normal tensors
        return extract_kv(out.past_key_values, model, pos, key_space=key_space, layers=layers, mask=attention_mask)


def _attention_modules(model) -> list:
    """Attention modules in layer order (modules with k_proj, v_proj and layer_idx)."""
    mods = [m for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")]
    return sorted(mods, key=lambda m: m.layer_idx)


def _hooked_forward(model, ids, **kwargs):
    """Forward capturing pre-RoPE K (k_proj, or k_norm when present) and V per selected layer.

    Used when gradient checkpointing is on in training: HF then disables the cache. Hooks are
    removed before backward, so the checkpoint recompute does not capture twice.
    """
    attn = _attention_modules(model)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def hook(key, head_dim):
        def fn(_mod, _inp, out):
            B, T = out.shape[0], out.shape[1]
            captured.setdefault(key, out.reshape(B, T, -1, head_dim).transpose(1, 2))  # [B, H, T, D]

        return fn

    try:
        for i in ids:
            m = attn[i]
            k_mod = m.k_norm if getattr(m, "k_norm", None) is not None else m.k_proj  # Qwen3: norm before RoPE
            v_mod = m.v_norm if getattr(m, "v_norm", None) is not None else m.v_proj
            handles.append(k_mod.register_forward_hook(hook((i, "k"), m.head_dim)))
            handles.append(v_mod.register_forward_hook(hook((i, "v"), m.head_dim)))
        out = model(**kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, [(captured[(i, "k")], captured[(i, "v")]) for i in ids]


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on (transformers 5 renamed the flag)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def student_forward_kv(
    model, input_ids, attention_mask, labels=None, layers=None, key_space: str = "pre_rope", **forward_kwargs
) -> tuple:
    """Training forward that keeps the autograd graph -> (model outputs incl. loss/logits, KVBatch).

    Extra keyword arguments go to the model's forward (e.g. output_hidden_states=True).

    Normally K, V come from the cache. With gradient checkpointing in training mode HF disables the
    cache, so pre-RoPE K and V are captured from the attention projections instead (same values).
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    input_ids, attention_mask, pos = _forward_inputs(model, input_ids, attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, **forward_kwargs)
    if labels is not None:
        kwargs["labels"] = labels.to(input_ids.device)
    if not (model.training and _checkpointing(model)):
        out = model(**kwargs, use_cache=True)
        return out, extract_kv(out.past_key_values, model, pos, key_space=key_space, layers=layers, mask=attention_mask)
    ids = _check_layers(layers, len(_attention_modules(model)))
    out, pairs = _hooked_forward(model, ids, use_cache=False, **kwargs)
    dev = pairs[0][0].device
    keys = torch.stack([k.to(dev) for k, _ in pairs])  # [L, B, H, T, D], pre-RoPE
    values = torch.stack([v.to(dev) for _, v in pairs])
    if key_space == "post_rope":
        keys = _rope(keys, model, pos, inverse=False)
    return out, KVBatch(keys, values, ids, attention_mask.to(dev).bool(), key_space)
