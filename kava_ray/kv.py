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
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kava_ray.errors import KavaError
from kava_ray.models import KVGeometry, kv_geometry, rotary_embedding, uses_rotary

KEY_SPACES = ("pre_rope", "post_rope")
WIRE_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TOPK_ARRAYS = ("topk_ids", "topk_logp", "topk_tail")  # what a payload carries of the teacher's logits
_ELEM_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "fp32": 4, "float32": 4}


@dataclass
class KVBatch:
    """K and V of selected layers. keys/values: [L, B, H_kv, T, D]; mask: [B, T], 1 = real token.

    topk_ids / topk_logp: optionally, the teacher's top-k next-token log-probabilities from the same
    forward, [B, T, k] (ids int64; log-probs at temperature 1 over the full vocabulary, sorted descending),
    None when not asked for; topk_tail [B, T]: the log of the mass outside those k ids (the tail bucket of
    `losses.topk_kl_loss`), None in batches from before it was served.
    """

    keys: torch.Tensor
    values: torch.Tensor
    layer_ids: list[int]
    mask: torch.Tensor | None
    key_space: str
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    topk_tail: torch.Tensor | None = None

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
            None if self.topk_ids is None else self.topk_ids.to(device),  # top-k keeps its dtypes
            None if self.topk_logp is None else self.topk_logp.to(device),
            None if self.topk_tail is None else self.topk_tail.to(device),
        )

    def select_layers(self, ids) -> "KVBatch":
        """A KVBatch with exactly the layers `ids` (model layer ids, in that order)."""
        ids = [int(i) for i in ids]
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise KavaError(f"layers {missing} not in this KV batch (has {self.layer_ids})")
        idx = torch.tensor([self.layer_ids.index(i) for i in ids], device=self.keys.device)
        return KVBatch(self.keys.index_select(0, idx), self.values.index_select(0, idx), ids, self.mask, self.key_space,
                       self.topk_ids, self.topk_logp, self.topk_tail)

    def row(self, b: int) -> "KVBatch":
        """Sample `b` alone ([L, 1, H, n, D]), cut to its n real tokens (right padding: mask[b] is 1...1 0...0)."""
        n = int(self.mask[b].sum()) if self.mask is not None else self.keys.shape[3]

        def kv(x):  # [L, B, H, T, D]
            return x[:, b:b + 1, :, :n]

        def tok(x):  # [B, T, ...]
            return None if x is None else x[b:b + 1, :n]

        return KVBatch(kv(self.keys), kv(self.values), list(self.layer_ids), tok(self.mask), self.key_space,
                       tok(self.topk_ids), tok(self.topk_logp), tok(self.topk_tail))

    @classmethod
    def stack(cls, rows: list["KVBatch"], mask: torch.Tensor) -> "KVBatch":
        """Samples (`row` outputs, n_b real tokens each) as one right-padded batch for `mask` [B, T]: zeros
        past each sample's tokens. Every row must have exactly its mask row's count of tokens."""
        mask = torch.as_tensor(mask).bool()
        B, T = mask.shape
        first = rows[0]
        L, _, H, _, D = first.keys.shape
        for b, r in enumerate(rows):
            n = r.keys.shape[3]
            if n != int(mask[b].sum()) or not bool(mask[b, :n].all()):
                raise KavaError(f"KV row {b} has {n} tokens, the batch's mask row {int(mask[b].sum())} "
                                f"(rows are right-padded samples)")

        def fill(get, shape, dtype, time_dim):
            if get(first) is None:
                return None
            out = torch.zeros(shape, dtype=dtype)
            for b, r in enumerate(rows):
                x = get(r)
                n = x.shape[time_dim]
                if time_dim == 3:
                    out[:, b, :, :n] = x[:, 0]
                else:
                    out[b, :n] = x[0]
            return out

        k = first.topk_ids.shape[-1] if first.topk_ids is not None else 0
        return cls(fill(lambda r: r.keys, (L, B, H, T, D), first.keys.dtype, 3),
                   fill(lambda r: r.values, (L, B, H, T, D), first.values.dtype, 3),
                   list(first.layer_ids), mask, first.key_space,
                   fill(lambda r: r.topk_ids, (B, T, k), torch.int64, 1),
                   fill(lambda r: r.topk_logp, (B, T, k), torch.float32, 1),
                   fill(lambda r: r.topk_tail, (B, T), torch.float32, 1))

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

        Top-k log-probs, when the batch has them: `topk_ids` as int32 [B, T, k] and `topk_logp` in the
        wire dtype (bf16 as a uint16 view, fp16), named by `topk_dtype`; an fp8 wire sends them as fp16
        (log-probs span a range per-channel fp8 scales do not fit, and they are k values per token, not
        a KV stack); `topk_tail` [B, T] float32 (the log mass outside the k ids: small, and its precision
        decides the tail bucket). A batch without them yields a payload without these keys, as before.
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
        if self.topk_ids is not None and self.topk_logp is not None:
            lp_dtype = "bf16" if dtype == "bf16" else "fp16"  # fp8 wire: log-probs as fp16
            payload["topk_dtype"] = lp_dtype
            payload["topk_ids"] = self.topk_ids.detach().to("cpu", torch.int32).contiguous().numpy()
            lp = self.topk_logp.detach()
            if lp_dtype == "bf16":
                payload["topk_logp"] = lp.to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()
            else:
                payload["topk_logp"] = lp.to("cpu", torch.float16).contiguous().numpy()
            if self.topk_tail is not None:
                payload["topk_tail"] = self.topk_tail.detach().to("cpu", torch.float32).contiguous().numpy()
        return payload

    @classmethod
    def from_wire(cls, payload: dict, device=None, dtype: torch.dtype | None = torch.float32) -> "KVBatch":
        """Rebuild a KVBatch from `to_wire` output; the compact arrays move to `device` before the cast.

        dtype=None keeps the wire dtype (bf16/fp16; fp8 is always de-scaled to float32). Top-k log-probs,
        when the payload has them, come back as int64 ids and float32 log-probs (float64 if dtype is
        float64) on `device`, whatever `dtype` is: they keep at least fp32 precision after decode.
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
        topk_ids = topk_logp = topk_tail = None
        if payload.get("topk_ids") is not None and payload.get("topk_logp") is not None:
            topk_ids, topk_logp, topk_tail = _topk_from_wire(payload, device, dtype)
        return cls(tensors[0], tensors[1], list(payload["layer_ids"]), mask, payload["key_space"], topk_ids, topk_logp,
                   topk_tail)


def _topk_from_wire(payload: dict, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    with warnings.catch_warnings():  # read-only arrays from the object store: copied by the casts below
        warnings.simplefilter("ignore", UserWarning)
        ids, lp = torch.from_numpy(payload["topk_ids"]), torch.from_numpy(payload["topk_logp"])
    ids = ids.to(device) if device is not None else ids
    lp = lp.to(device) if device is not None else lp
    if payload.get("topk_dtype", "bf16" if lp.dtype == torch.uint16 else "fp16") == "bf16":
        lp = lp.view(torch.bfloat16)
    # int32 -> int64 and half -> float32/64 always copy: nothing aliases the (maybe read-only) buffers
    out = torch.float64 if dtype == torch.float64 else torch.float32
    tail = payload.get("topk_tail")
    if tail is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tail = torch.from_numpy(np.array(tail, dtype=np.float32)).to(device if device is not None else "cpu")
        tail = tail.to(out)
    return ids.to(torch.int64), lp.to(out), tail


def wire_nbytes(payload: dict) -> int:
    """Bytes of the K and V arrays of a wire payload, plus the top-k ids and log-probs when it has them
    (not the mask, fp8 scales or metadata)."""
    return int(payload["k"].nbytes + payload["v"].nbytes + wire_logits_nbytes(payload))


def wire_logits_nbytes(payload: dict) -> int:
    """Bytes of the top-k ids and log-probs of a wire payload (0 without them)."""
    return int(sum(payload[a].nbytes for a in TOPK_ARRAYS if payload.get(a) is not None))


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


def logits_bytes_per_token(top_k: int, dtype: str = "bf16") -> int:
    """Wire bytes of the top-k log-probs per token: k * (4 (int32 id) + bytes per log-prob in the wire
    dtype) + 4 (the float32 tail); an fp8 wire sends log-probs as fp16 (2 bytes). 0 for top_k 0."""
    d = str(dtype).lower().removeprefix("torch.")
    if d not in _ELEM_BYTES:
        raise KavaError(f"unknown KV dtype {dtype!r}; expected bf16, fp16, fp8 or fp32")
    if not top_k:
        return 0
    return int(top_k) * (4 + (2 if d == "fp8" else _ELEM_BYTES[d])) + 4


# ------------------------------------------------------------------------------------------- RoPE


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask (1 = real token) -> [B, T] positions: cumsum(mask) - 1, padding -> 0 (HF generate)."""
    mask = mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _family(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", "") or type(model).__name__


def _llama_rotary_problem(model) -> str | None:
    """None when the model rotates every layer's keys Llama-style (one rotary module, rotary over the full
    head_dim, rotate_half pairing), so `_rope` can (un)rotate cached keys exactly; else why not."""
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
    """Rotate (or un-rotate) keys [L, B, H, T, D] with the model's own rotary embedding, in float32.

    Only for Llama-style rotary (`_llama_rotary_problem` is None). HF applies k * cos + rotate_half(k) * sin
    with cos/sin already multiplied by attention_scaling s, so the inverse is
    (k * cos - rotate_half(k) * sin) / s**2 (s = 1 for default RoPE).
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


def _rotate_outside_forward(keys: torch.Tensor, model, position_ids: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Keys [L, B, H, T, D] between pre- and post-RoPE space without a forward: unchanged for a model
    without rotary, the model's own rotary for Llama-style rotary, KavaError for other rotary."""
    if not uses_rotary(model):
        return keys
    problem = _llama_rotary_problem(model)
    if problem is None:
        return _rope(keys, model, position_ids, inverse=inverse)
    if inverse:
        raise KavaError(
            f"{_family(model)}: cannot de-rotate cached keys ({problem}); teacher_forward_kv / student_forward_kv "
            "capture exact pre-RoPE keys for this family, or use key_space post_rope"
        )
    raise KavaError(
        f"{_family(model)}: post_rope keys under gradient checkpointing need Llama-style rotary ({problem}); "
        "turn gradient checkpointing off or use align.key_space: pre_rope"
    )


# ------------------------------------------------------------------------ capture at the projections
#
# Pre-RoPE keys are taken where the model computes them: forward hooks on the module whose output is the
# key before rotation -- the k-norm when the family has one (Qwen3, OLMo2, Gemma3, Cohere, Phi, StableLM,
# Persimmon), else k_proj, else the fused q/k/v projection split by the family's layout -- and on the
# value projection (or v-norm). That is exact for every rotary variant (full, partial, interleaved, per
# layer type, layers without RoPE) and for models without rotary, and it keeps autograd.

_FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn")
_K_NORMS = ("k_norm", "k_layernorm")
_V_NORMS = ("v_norm",)


def _child(module, name):
    m = getattr(module, name, None)
    return m if isinstance(m, torch.nn.Module) else None


def attention_layers(model) -> list[torch.nn.Module]:
    """The decoder's self-attention modules in layer order: modules with a `layer_idx` and a key
    projection (k_proj + v_proj, or a fused qkv_proj / query_key_value / c_attn)."""
    mods = [
        m for m in model.modules()
        if hasattr(m, "layer_idx")
        and (
            (_child(m, "k_proj") is not None and _child(m, "v_proj") is not None)
            or any(_child(m, n) is not None for n in _FUSED_QKV)
        )
    ]
    return sorted(mods, key=lambda m: m.layer_idx)


def _refuse(model, attn, why: str) -> KavaError:
    name = type(attn).__name__ if attn is not None else type(model).__name__
    return KavaError(
        f"{_family(model)} ({name}): cannot take pre-RoPE keys: {why}; use align.key_space: post_rope"
    )


def _split_concat(out, hq: int, hkv: int, d: int):
    """[q (hq*d) | k (hkv*d) | v (hkv*d)] (Phi3, GPT-2, multi-query GPT-BigCode and Falcon) -> k, v [B, T, hkv, d]."""
    B, T = out.shape[:2]
    q_end, k_end = hq * d, hq * d + hkv * d
    return out[..., q_end:k_end].reshape(B, T, hkv, d), out[..., k_end : k_end + hkv * d].reshape(B, T, hkv, d)


def _split_grouped(out, hq: int, hkv: int, d: int, broadcast: bool = False):
    """Per KV head [q_1 .. q_g | k | v], g = hq // hkv (GPT-NeoX, BLOOM, Persimmon, GPT-BigCode and Falcon
    with g = 1; Falcon-40B style with g > 1, which caches K, V broadcast to every query head)."""
    B, T = out.shape[:2]
    g = hq // hkv
    x = out.reshape(B, T, hkv, g + 2, d)
    k, v = x[..., g, :], x[..., g + 1, :]
    if broadcast and g > 1:
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    return k, v


def _fused_split(model, attn):
    """How the family lays K and V out in its fused q/k/v projection, or KavaError for an unknown one."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    family, hq, d = getattr(config, "model_type", ""), config.num_attention_heads, kv_geometry(config).head_dim
    if family == "phi3":
        return lambda out: _split_concat(out, hq, config.num_key_value_heads, d)
    if family == "gpt2":
        return lambda out: _split_concat(out, hq, hq, d)
    if family == "gpt_bigcode":
        if getattr(config, "multi_query", False):
            return lambda out: _split_concat(out, hq, 1, d)
        return lambda out: _split_grouped(out, hq, hq, d)
    if family in ("gpt_neox", "bloom", "persimmon"):
        return lambda out: _split_grouped(out, hq, hq, d)
    if family == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return lambda out: _split_grouped(out, hq, config.num_kv_heads, d, broadcast=True)
        if getattr(config, "multi_query", False):
            return lambda out: _split_concat(out, hq, 1, d)
        return lambda out: _split_grouped(out, hq, hq, d)
    raise _refuse(model, attn, "its fused q/k/v projection has no known layout")


@dataclass
class _Tap:
    """Where one attention layer's pre-RoPE K and V are read."""

    layer: int
    head_dim: int
    proj: torch.nn.Module  # k_proj, or the fused q/k/v projection
    v_proj: torch.nn.Module | None  # None when fused
    split: object  # fused: projection output -> (k, v) [B, T, H, D]; else None
    k_norm: torch.nn.Module | None
    v_norm: torch.nn.Module | None


def _taps(model, ids: list[int]) -> list[_Tap]:
    attn = attention_layers(model)
    geom = kv_geometry(model)
    if not attn:
        raise _refuse(model, None, "no attention layer with k_proj/v_proj or a fused q/k/v projection "
                                   "(e.g. multi-head latent attention)")
    if len(attn) != geom.num_layers or [m.layer_idx for m in attn] != list(range(len(attn))):
        raise _refuse(model, attn[0], f"found {len(attn)} attention layers for {geom.num_layers} decoder layers "
                                      "(hybrid or shared-attention architecture)")
    taps = []
    for i in ids:
        m = attn[i]
        fused = next((_child(m, n) for n in _FUSED_QKV if _child(m, n) is not None), None)
        separate = _child(m, "k_proj") is not None
        taps.append(_Tap(
            layer=i,
            head_dim=geom.head_dim,
            proj=m.k_proj if separate else fused,
            v_proj=m.v_proj if separate else None,
            split=None if separate else _fused_split(model, m),
            k_norm=next((_child(m, n) for n in _K_NORMS if _child(m, n) is not None), None),
            v_norm=next((_child(m, n) for n in _V_NORMS if _child(m, n) is not None), None),
        ))
    return taps


def _heads(t: torch.Tensor, B: int, T: int, D: int, transposed_input: bool) -> torch.Tensor:
    """A captured key/value tensor -> [B, H, T, D]. Accepts [B, T, H*D], [B, T, H, D] and [B, H, T, D]
    (a norm applied after the head transpose, as in Phi and StableLM). When T == H the shape cannot tell
    the last two apart; the norm's input then can: a transposed view of the projection output."""
    if t.dim() == 3 and tuple(t.shape[:2]) == (B, T) and t.shape[2] % D == 0:
        return t.reshape(B, T, -1, D).transpose(1, 2)
    if t.dim() == 4 and t.shape[0] == B and t.shape[3] == D:
        bthd, bhtd = t.shape[1] == T, t.shape[2] == T
        if bthd and (not bhtd or not transposed_input):
            return t.transpose(1, 2)
        if bhtd:
            return t
    raise KavaError(f"captured tensor of shape {tuple(t.shape)} is not [B, T, H*D], [B, T, H, D] or [B, H, T, D] "
                    f"(B={B}, T={T}, D={D}); use align.key_space: post_rope")


class _Capture:
    """Forward hooks that capture pre-RoPE K and V of the selected layers during one forward.

    Each hooked module must run once per forward; later calls (a shared module) fail loudly. Hooks are
    removed on exit, so a gradient-checkpointing recompute during backward captures nothing.
    """

    def __init__(self, model, ids: list[int]):
        self.model = model
        self.taps = _taps(model, ids)
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, bool]] = {}
        self.handles: list = []

    def _hook(self, key):
        def fn(_mod, inputs, out):
            if key in self.outputs:
                raise KavaError(f"{_family(self.model)}: layer {key[0]} {key[1]} ran twice in one forward "
                                "(shared module); cannot take pre-RoPE keys, use align.key_space: post_rope")
            x = inputs[0] if inputs and torch.is_tensor(inputs[0]) else None
            transposed = x is not None and x.dim() == 4 and x.stride(1) < x.stride(2)
            self.outputs[key] = (out, transposed)

        return fn

    def __enter__(self) -> "_Capture":
        try:
            for tap in self.taps:
                mods = {"proj": tap.proj, "v_proj": tap.v_proj, "k_norm": tap.k_norm, "v_norm": tap.v_norm}
                for name, mod in mods.items():
                    if mod is not None:
                        self.handles.append(mod.register_forward_hook(self._hook((tap.layer, name))))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _get(self, tap: _Tap, name: str):
        if (tap.layer, name) not in self.outputs:
            raise _refuse(self.model, None, f"layer {tap.layer}: its {name} did not run in the forward")
        out, transposed = self.outputs[(tap.layer, name)]
        if not torch.is_tensor(out):
            raise _refuse(self.model, None, f"layer {tap.layer}: its {name} returned {type(out).__name__}")
        return out, transposed

    def _norm_heads(self, tap: _Tap, name: str, B: int, T: int) -> torch.Tensor:
        out, transposed = self._get(tap, name)
        return _heads(out, B, T, tap.head_dim, transposed)

    def pairs(self, B: int, T: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per selected layer (K, V), each [B, H_kv, T, D]: K after the k-norm, V after the v-norm, if any."""
        result = []
        for tap in self.taps:
            D = tap.head_dim
            out, _ = self._get(tap, "proj")
            if tap.split is not None:
                k, v = (x.transpose(1, 2) for x in tap.split(out))
            else:
                k = _heads(out, B, T, D, False)
                v = _heads(self._get(tap, "v_proj")[0], B, T, D, False)
            if (tap.layer, "k_norm") in self.outputs:  # the norm ran: its output is what gets rotated
                k = self._norm_heads(tap, "k_norm", B, T)
            if (tap.layer, "v_norm") in self.outputs:
                v = self._norm_heads(tap, "v_norm", B, T)
            result.append((k, v))
        return result


def _check_against_cache(model, keys, values, ids: list[int], cache, mask) -> None:
    """Guard against a wrong capture: per selected layer, the captured V must equal the cached V and the
    captured K must have the cached K's norm per token and head up to one constant (a rotation keeps
    norms; rotary attention scaling multiplies them by one factor). Sliding-window layers cache only the
    last tokens: those are compared. KavaError (one line) on a mismatch."""
    try:
        per_layer = _cache_layers(cache)
    except TypeError:
        return  # the family returns no standard cache: nothing to compare with
    if len(per_layer) <= max(ids):
        return
    half = keys.dtype in (torch.float16, torch.bfloat16)
    tol = 3e-2 if half else 1e-3
    T = keys.shape[3]
    for j, i in enumerate(ids):
        kc, vc = per_layer[i]
        if kc is None or vc is None or kc.dim() != 4 or kc.shape[2] == 0:
            continue
        Tc = kc.shape[2]
        why = None
        if tuple(kc.shape[:2]) != tuple(keys.shape[1:3]) or kc.shape[3] != keys.shape[4] or Tc > T:
            why = f"cached K {tuple(kc.shape)} vs captured {tuple(keys.shape[1:])}"
        else:
            k, v = keys[j][:, :, T - Tc:].float(), values[j][:, :, T - Tc:].float()
            kc, vc = kc.to(k.device).float(), vc.to(k.device).float()
            real = torch.ones(k.shape[0], Tc, dtype=torch.bool, device=k.device) if mask is None else mask[:, T - Tc:]
            real = real.to(k.device).bool()[:, None, :].expand(k.shape[:3])  # [B, H, Tc]
            if v.shape != vc.shape:
                why = f"cached V {tuple(vc.shape)} vs captured {tuple(v.shape)}"
            elif real.any():
                v_err = (v - vc).abs().amax(-1)[real].max()
                if v_err > tol * (vc.abs().amax() + 1e-12):
                    why = f"values differ by {float(v_err):.3g}"
                else:
                    n_pre, n_post = k.norm(dim=-1)[real], kc.norm(dim=-1)[real]
                    ok = n_pre > 1e-6 * (n_pre.max() + 1e-30)
                    if ok.any():
                        ratio = n_post[ok] / n_pre[ok]
                        scale = ratio.median()
                        spread = float((ratio - scale).abs().max() / scale)
                        if spread > tol:
                            why = f"key norms differ from the cached keys' by up to {spread:.1%}"
        if why:
            raise KavaError(
                f"{_family(model)}: keys captured at the projection are not the cached keys of layer {i} before "
                f"rotation ({why}); pre-RoPE keys are not supported for this family, use align.key_space: post_rope"
            )


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
    arange(T) without a mask. pre_rope needs `model`: a model without rotary keeps its cached keys; a
    Llama-style rotary (full head_dim, rotate_half) is undone with the model's own rotary embedding;
    other rotary variants raise KavaError -- `teacher_forward_kv` / `student_forward_kv` capture exact
    pre-RoPE keys at the projections for every family. Keeps autograd.
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
        keys = _rotate_outside_forward(keys, model, position_ids, inverse=True)
    return KVBatch(keys, values, ids, mask, key_space)


def _forward_inputs(model, input_ids, attention_mask):
    dev = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(dev)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(dev)
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


def _stack(pairs, attention_mask, ids, key_space) -> KVBatch:
    dev = pairs[0][0].device  # with device_map="auto" layers may live on different GPUs
    keys = torch.stack([k.to(dev) for k, _ in pairs])  # [L, B, H, T, D]
    values = torch.stack([v.to(dev) for _, v in pairs])
    return KVBatch(keys, values, ids, attention_mask.to(dev).bool(), key_space)


def teacher_forward_kv(model, input_ids, attention_mask, layers=None, key_space: str = "pre_rope",
                       logits_top_k: int = 0, stop_early: bool = True) -> KVBatch:
    """Inference forward with explicit position ids -> KVBatch of the selected layers.

    pre_rope: K and V captured at the projections during the forward (exact on every family; checked
    against the cache the forward fills); post_rope: K and V as the cache holds them.
    input_ids, attention_mask: [B, T]. The returned tensors are ordinary (not inference-mode)
    tensors on the model's device, in the model's dtype.

    logits_top_k 0: the decoder runs without its LM head (no logits). logits_top_k k > 0: the same forward
    runs the LM head, and the batch carries topk_ids / topk_logp [B, T, k]: log_softmax of the logits in
    fp32 (temperature 1), then its top k, sorted descending (padding positions included; losses mask them).

    stop_early (with logits_top_k 0): the forward stops right after the attention of the deepest selected
    layer has filled the cache (`_StopAfter`): the layers below it, the final norm and the LM head never run.
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    logits_top_k = int(logits_top_k)
    if logits_top_k < 0:
        raise KavaError(f"logits_top_k must be >= 0, got {logits_top_k}")
    input_ids, attention_mask, pos = _forward_inputs(model, input_ids, attention_mask)
    # the decoder without the LM head when logits are not needed; the whole model when they are
    run = model if logits_top_k else getattr(model, "base_model", model)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=True)
    n_layers = kv_geometry(model).num_layers
    ids = _check_layers(layers, n_layers)
    stop = _StopAfter.at(model, max(ids), n_layers) if stop_early and not logits_top_k else contextlib.nullcontext()
    out = None  # stays None when the forward is stopped early
    if key_space == "post_rope":
        with stop, torch.inference_mode():
            out = run(**kwargs)
        with torch.no_grad():  # outside inference mode, so the stacked copies are normal tensors
            kv = extract_kv(_cache_of(out, stop), model, pos, key_space=key_space, layers=ids, mask=attention_mask)
            return _with_topk(kv, out, logits_top_k)
    with _Capture(model, ids) as cap, stop, torch.inference_mode():
        out = run(**kwargs)
    with torch.no_grad():
        kv = _stack(cap.pairs(*input_ids.shape), attention_mask, ids, key_space)
        _check_against_cache(model, kv.keys, kv.values, ids, _cache_of(out, stop), kv.mask)
        return _with_topk(kv, out, logits_top_k)


class _Stopped(Exception):
    """Raised by `_StopAfter`'s hook to end a forward early (never escapes `_StopAfter`)."""


class _StopAfter:
    """Ends a forward right after attention layer `last` has run: its K/V are captured and cached, and nothing
    deeper runs (the rest of the decoder, the final norm, the LM head). A forward hook on that attention module
    keeps the cache it was handed (`cache`) and raises; `__exit__` swallows exactly that exception."""

    def __init__(self, module):
        self.module = module
        self.cache = None
        self.stopped = False

    @classmethod
    def at(cls, model, last: int, num_layers: int):
        """A stopper after attention layer `last`, or a no-op where the attention modules are not one per
        decoder layer of the model's `num_layers` (latent attention, hybrids: the forward then runs whole)."""
        attn = attention_layers(model)
        if len(attn) != num_layers:
            return contextlib.nullcontext()
        return cls(attn[last])

    def _hook(self, _mod, args, kwargs, _out):
        from transformers.cache_utils import Cache

        # families name the argument differently (past_key_values, layer_past, ...): take the Cache passed in
        self.cache = next((a for a in (*kwargs.values(), *args) if isinstance(a, Cache)), None)
        self.stopped = True
        raise _Stopped

    def __enter__(self) -> "_StopAfter":
        self.handle = self.module.register_forward_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        self.handle.remove()
        return exc_type is _Stopped


def _cache_of(out, stop):
    """The cache a forward filled: the one the stopped forward's hook kept, else the output's."""
    if getattr(stop, "stopped", False):
        if stop.cache is None:
            raise KavaError("the teacher forward was stopped early but its attention got no cache; "
                            "pass stop_early=False")
        return stop.cache
    return out.past_key_values


def _with_topk(kv: KVBatch, out, k: int) -> KVBatch:
    """kv with the top-k fp32 log-probs of the forward's logits (unchanged for k = 0)."""
    if not k:
        return kv
    logits = getattr(out, "logits", None)
    if logits is None:
        raise KavaError("the teacher forward returned no logits: cannot serve top-k log-probs")
    if k > logits.shape[-1]:
        raise KavaError(f"logits_top_k {k} exceeds the teacher's vocabulary ({logits.shape[-1]})")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V] in fp32
    kv.topk_logp, kv.topk_ids = torch.topk(logp, k, dim=-1, sorted=True)
    # the mass outside the k ids, exactly (1 - sum p would lose a small tail to rounding): the tail bucket
    kv.topk_tail = logp.scatter(-1, kv.topk_ids, float("-inf")).logsumexp(-1)  # [B, T]
    return kv


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

    pre_rope: K and V captured at the projections, as in `teacher_forward_kv` (checked against the cache
    when there is one). post_rope: the cache; with gradient checkpointing in training mode HF disables the
    cache, so the captured keys are rotated with the model's own rotary (Llama-style rotary, or none).
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    input_ids, attention_mask, pos = _forward_inputs(model, input_ids, attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, **forward_kwargs)
    if labels is not None:
        kwargs["labels"] = labels.to(input_ids.device)
    cached = not (model.training and _checkpointing(model))
    if key_space == "post_rope" and cached:
        out = model(**kwargs, use_cache=True)
        return out, extract_kv(out.past_key_values, model, pos, key_space=key_space, layers=layers, mask=attention_mask)
    ids = _check_layers(layers, kv_geometry(model).num_layers)
    with _Capture(model, ids) as cap:
        out = model(**kwargs, use_cache=cached)
    kv = _stack(cap.pairs(*input_ids.shape), attention_mask, ids, key_space)
    if cached:
        with torch.no_grad():
            _check_against_cache(model, kv.keys, kv.values, ids, out.past_key_values, kv.mask)
    if key_space == "post_rope":
        kv.keys = _rotate_outside_forward(kv.keys, model, pos, inverse=False)
    return out, kv
