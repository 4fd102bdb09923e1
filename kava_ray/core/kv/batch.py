"""KVBatch: K and V of selected layers as [L, B, H_kv, T, D] (+ the teacher's top-k log-probs), and
its wire format -- compact, pickle-friendly numpy payloads (zero-copy views where possible: bf16 as
a uint16 view, fp16, fp8 e4m3 with per-channel scales) that travel through Ray's object store and
the on-disk KV cache.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.models import KVGeometry

KEY_SPACES = ("pre_rope", "post_rope")
WIRE_VERSION = 1
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TOPK_ARRAYS = ("topk_ids", "topk_logp", "topk_tail")  # what a payload carries of the teacher's logits
_ELEM_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "fp32": 4, "float32": 4}


@dataclass
class KVBatch:
    """K and V of selected layers. keys/values: [L, B, H_kv, T, D]; mask: [B, T], 1 = real token.

    topk_ids (int64) / topk_logp [B, T, k]: the teacher's top-k next-token log-probs from the same
    forward (temperature 1, full vocabulary, sorted descending), or None; topk_tail [B, T]: log of
    the mass outside those k ids (`losses.topk_kl_loss`'s tail bucket), None in batches from before
    it was served. hidden [L, B, T, hidden_size]: the same layers' output hidden states (the
    residual stream after each layer), served for `loss.hidden_weight`, else None. token_logp [B,
    T]: the log-prob the teacher gives each next token of the batch (at position t, that of token t
    + 1; 0 at the last), float32, served for on-policy distillation's sampled reverse KL, else None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    layer_ids: list[int]
    mask: torch.Tensor | None
    key_space: str
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    topk_tail: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    token_logp: torch.Tensor | None = None

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
            None if self.hidden is None else self.hidden.to(device=device, dtype=dtype),
            None if self.token_logp is None else self.token_logp.to(device),
        )

    def select_layers(self, ids) -> "KVBatch":
        """A KVBatch with exactly the layers `ids` (model layer ids, in that order)."""
        ids = [int(i) for i in ids]
        missing = [i for i in ids if i not in self.layer_ids]
        if missing:
            raise KavaError(f"layers {missing} not in this KV batch (has {self.layer_ids})")
        idx = torch.tensor([self.layer_ids.index(i) for i in ids], device=self.keys.device)
        return KVBatch(self.keys.index_select(0, idx), self.values.index_select(0, idx), ids, self.mask, self.key_space,
                       self.topk_ids, self.topk_logp, self.topk_tail,
                       None if self.hidden is None else self.hidden.index_select(0, idx), self.token_logp)

    def row(self, b: int) -> "KVBatch":
        """Sample `b` alone ([L, 1, H, n, D]), cut to its n real tokens (right padding: mask[b] is 1...1 0...0)."""
        n = int(self.mask[b].sum()) if self.mask is not None else self.keys.shape[3]

        def kv(x):  # [L, B, H, T, D]
            return x[:, b:b + 1, :, :n]

        def tok(x):  # [B, T, ...]
            return None if x is None else x[b:b + 1, :n]

        return KVBatch(kv(self.keys), kv(self.values), list(self.layer_ids), tok(self.mask), self.key_space,
                       tok(self.topk_ids), tok(self.topk_logp), tok(self.topk_tail),
                       None if self.hidden is None else self.hidden[:, b:b + 1, :n], tok(self.token_logp))

    @classmethod
    def empty(cls, mask: torch.Tensor, heads: int, head_dim: int, key_space: str) -> "KVBatch":
        """No layers: K and V [0, B, heads, T, head_dim] on mask's device, for mask [B, T] (a
        logits-only job's batch, `JobConfig.ships_kv`); top-k and token log-probs are set by whoever
        serves them."""
        B, T = mask.shape
        keys = torch.zeros((0, B, int(heads), T, int(head_dim)), device=mask.device)
        return cls(keys, keys.clone(), [], mask.bool(), key_space)

    @classmethod
    def stack(cls, rows: list["KVBatch"], mask: torch.Tensor) -> "KVBatch":
        """Samples (`row` outputs, n_b real tokens each) as one right-padded batch for `mask` [B,
        T]: zeros past each sample's tokens. Every row must have exactly its mask row's count of
        tokens."""
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
                elif time_dim == 2:  # hidden [L, 1, n, hidden]
                    out[:, b, :n] = x[:, 0]
                else:
                    out[b, :n] = x[0]
            return out

        k = first.topk_ids.shape[-1] if first.topk_ids is not None else 0
        return cls(fill(lambda r: r.keys, (L, B, H, T, D), first.keys.dtype, 3),
                   fill(lambda r: r.values, (L, B, H, T, D), first.values.dtype, 3),
                   list(first.layer_ids), mask, first.key_space,
                   fill(lambda r: r.topk_ids, (B, T, k), torch.int64, 1),
                   fill(lambda r: r.topk_logp, (B, T, k), torch.float32, 1),
                   fill(lambda r: r.topk_tail, (B, T), torch.float32, 1),
                   fill(lambda r: r.hidden, (L, B, T, first.hidden.shape[-1]) if first.hidden is not None else None,
                        first.hidden.dtype if first.hidden is not None else None, 2),
                   fill(lambda r: r.token_logp, (B, T), torch.float32, 1))

    def num_bytes(self) -> int:
        """Bytes held by K and V (not the mask)."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # ------------------------------------------------------------------------------------- wire

    def to_wire(self, dtype: str = "bf16") -> dict:
        """Compact, pickle-friendly payload of numpy arrays (zero-copy views of CPU tensors already in `dtype`).

        K, V: bf16 (as a uint16 view), fp16, fp8 e4m3 (a uint8 view + `k_scale`/`v_scale` [L, H, D]
        float32), or fp32 (as computed: an exact logit term at twice bf16's bytes). Top-k, when the
        batch has them: ids int32 [B, T, k], log-probs in the wire's dtype (`topk_dtype`; fp16 on an
        fp8 wire), tail float32 [B, T]. Layout and reasons: docs/internals/core.md#kv.
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
            lp_dtype = dtype if dtype in ("bf16", "fp32") else "fp16"  # fp8 wire: log-probs as fp16
            payload["topk_dtype"] = lp_dtype
            payload["topk_ids"] = self.topk_ids.detach().to("cpu", torch.int32).contiguous().numpy()
            lp = self.topk_logp.detach()
            if lp_dtype == "bf16":
                payload["topk_logp"] = lp.to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()
            elif lp_dtype == "fp32":
                payload["topk_logp"] = lp.to("cpu", torch.float32).contiguous().numpy()
            else:
                payload["topk_logp"] = lp.to("cpu", torch.float16).contiguous().numpy()
            if self.topk_tail is not None:
                payload["topk_tail"] = self.topk_tail.detach().to("cpu", torch.float32).contiguous().numpy()
        if self.token_logp is not None:  # float32: a log-prob's difference to the student's is the signal
            payload["tl"] = self.token_logp.detach().to("cpu", torch.float32).contiguous().numpy()
        if self.hidden is not None:  # bf16 / fp32 as the wire, else fp16 (no per-channel fp8 for activations)
            payload["hidden_dtype"] = dtype if dtype in ("bf16", "fp32") else "fp16"
            h = self.hidden.detach()
            payload["h"] = (h.to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy() if dtype == "bf16"
                            else h.to("cpu", torch.float32 if dtype == "fp32" else torch.float16).contiguous().numpy())
        return payload

    @classmethod
    def from_wire(cls, payload: dict, device=None, dtype: torch.dtype | None = torch.float32) -> "KVBatch":
        """Rebuild a KVBatch from `to_wire` output; the compact arrays move to `device` before the cast.

        dtype=None keeps the wire dtype (bf16/fp16; fp8 always de-scales to float32). Top-k come
        back as int64 ids and float32 log-probs (float64 when dtype is), whatever `dtype` is.
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
        hidden = None
        if payload.get("h") is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.ascontiguousarray(payload["h"]))
            h = raw.to(device) if device is not None else raw
            h = h.view(torch.bfloat16) if payload.get("hidden_dtype", "bf16") == "bf16" else h
            hidden = h.to(dtype) if dtype is not None else h.clone()
            if hidden.data_ptr() == raw.data_ptr():
                hidden = hidden.clone()
        token_logp = None
        if payload.get("tl") is not None:
            token_logp = torch.from_numpy(np.array(payload["tl"], dtype=np.float32))
            token_logp = token_logp.to(device) if device is not None else token_logp
        return cls(tensors[0], tensors[1], list(payload["layer_ids"]), mask, payload["key_space"], topk_ids, topk_logp,
                   topk_tail, hidden, token_logp)


def _topk_from_wire(payload: dict, device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    with warnings.catch_warnings():  # read-only arrays from the object store: copied by the casts below
        warnings.simplefilter("ignore", UserWarning)
        ids, lp = torch.from_numpy(payload["topk_ids"]), torch.from_numpy(payload["topk_logp"])
    ids = ids.to(device) if device is not None else ids
    lp = lp.to(device) if device is not None else lp
    if payload.get("topk_dtype", "bf16" if lp.dtype == torch.uint16 else "fp16") == "bf16":
        lp = lp.view(torch.bfloat16)
    # int32 -> int64 and half -> float32/64 copy; an fp32 wire's log-probs are cloned: nothing
    # aliases the (maybe read-only) buffers
    out = torch.float64 if dtype == torch.float64 else torch.float32
    lp = lp.clone() if lp.dtype == out else lp
    tail = payload.get("topk_tail")
    if tail is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tail = torch.from_numpy(np.array(tail, dtype=np.float32)).to(device if device is not None else "cpu")
        tail = tail.to(out)
    return ids.to(torch.int64), lp.to(out), tail


def wire_nbytes(payload: dict) -> int:
    """Bytes of a wire payload's K, V, top-k, token log-prob and hidden-state arrays (not the mask,
    fp8 scales or metadata)."""
    extra = sum(payload[a].nbytes for a in ("h", "tl") if payload.get(a) is not None)
    return int(payload["k"].nbytes + payload["v"].nbytes + wire_logits_nbytes(payload) + extra)


def wire_logits_nbytes(payload: dict) -> int:
    """Bytes of the top-k ids and log-probs of a wire payload (0 without them)."""
    return int(sum(payload[a].nbytes for a in TOPK_ARRAYS if payload.get(a) is not None))


def _wire_dtype(dtype) -> str:
    d = str(dtype).lower().removeprefix("torch.")
    d = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "fp8_e4m3": "fp8", "float32": "fp32"}.get(d, d)
    if d not in ("bf16", "fp16", "fp8", "fp32"):
        raise KavaError(f"unknown KV wire dtype {dtype!r}; expected bf16, fp16, fp8 or fp32")
    return d


def kv_bytes_per_token(geometry: KVGeometry, dtype: str = "bf16", layers=None) -> int:
    """Bytes of K and V per token: 2 * n_layers * num_kv_heads * head_dim * bytes per element."""
    d = str(dtype).lower().removeprefix("torch.")
    if d not in _ELEM_BYTES:
        raise KavaError(f"unknown KV dtype {dtype!r}; expected bf16, fp16, fp8 or fp32")
    n_layers = geometry.num_layers if layers is None else len(list(layers))
    return 2 * n_layers * geometry.num_kv_heads * geometry.head_dim * _ELEM_BYTES[d]


def logits_bytes_per_token(top_k: int, dtype: str = "bf16") -> int:
    """Wire bytes of the top-k log-probs per token: k * (4 (int32 id) + bytes per log-prob in the
    wire dtype) + 4 (the float32 tail); an fp8 wire sends log-probs as fp16 (2 bytes). 0 for top_k
    0."""
    d = str(dtype).lower().removeprefix("torch.")
    if d not in _ELEM_BYTES:
        raise KavaError(f"unknown KV dtype {dtype!r}; expected bf16, fp16, fp8 or fp32")
    if not top_k:
        return 0
    return int(top_k) * (4 + (2 if d == "fp8" else _ELEM_BYTES[d])) + 4


