"""Keys before rotation, captured where each family computes them: forward hooks on the k-norm (when
the family has one), else k_proj, else the fused q/k/v projection split by the family's layout, and
on the value projection; and the check of a capture against the cache the same forward filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from kava_ray.common.errors import KavaError
from kava_ray.core.models import decoder_layers, kv_geometry

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


def model_family(model) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", "") or type(model).__name__


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) [B, H, T, D] from a transformers Cache (cache.layers) or legacy ((k, v), ...)."""
    if isinstance(cache, Cache):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if isinstance(cache, (tuple, list)) and all(
        isinstance(p, (tuple, list)) and len(p) >= 2 and torch.is_tensor(p[0]) and torch.is_tensor(p[1]) for p in cache
    ):
        return [(p[0], p[1]) for p in cache]
    raise TypeError(f"expected a transformers Cache or legacy ((k, v), ...) tuples, got {type(cache).__name__}")


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
        f"{model_family(model)} ({name}): cannot take pre-RoPE keys: {why}; use align.key_space: post_rope"
    )


def _split_concat(out, hq: int, hkv: int, d: int):
    """[q (hq*d) | k (hkv*d) | v (hkv*d)] (Phi3, GPT-2, multi-query GPT-BigCode and Falcon) -> k, v [B, T, hkv, d]."""
    B, T = out.shape[:2]
    q_end, k_end = hq * d, hq * d + hkv * d
    return out[..., q_end:k_end].reshape(B, T, hkv, d), out[..., k_end : k_end + hkv * d].reshape(B, T, hkv, d)


def _split_grouped(out, hq: int, hkv: int, d: int, broadcast: bool = False):
    """Per KV head [q_1 .. q_g | k | v], g = hq // hkv (GPT-NeoX, BLOOM, Persimmon, GPT-BigCode and
    Falcon with g = 1; Falcon-40B style with g > 1, which caches K, V broadcast to every query
    head)."""
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


class KVCapture:
    """Forward hooks that capture pre-RoPE K and V of the selected layers during one forward.

    Each hooked module must run once per forward; later calls (a shared module) fail loudly. Hooks
    are removed on exit, so a gradient-checkpointing recompute during backward captures nothing.
    """

    def __init__(self, model, ids: list[int]):
        self.model = model
        self.taps = _taps(model, ids)
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, bool]] = {}
        self.handles: list = []

    def _hook(self, key):
        def fn(_mod, inputs, out):
            if key in self.outputs:
                raise KavaError(f"{model_family(self.model)}: layer {key[0]} {key[1]} ran twice in one forward "
                                "(shared module); cannot take pre-RoPE keys, use align.key_space: post_rope")
            x = inputs[0] if inputs and torch.is_tensor(inputs[0]) else None
            transposed = x is not None and x.dim() == 4 and x.stride(1) < x.stride(2)
            self.outputs[key] = (out, transposed)

        return fn

    def __enter__(self) -> "KVCapture":
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


def layer_mismatch(k, v, kc, vc, real, tol: float) -> str | None:
    """What differs between one layer's captured K, V [B, H, T, D] and the cached kc, vc [B, H, Tc,
    D] (the cache may hold only the last Tc tokens: a sliding window), over the real tokens real [B,
    Tc]; None if they agree: V equal, K's per-token-and-head norms equal up to one constant (a
    rotation keeps norms; rotary attention scaling multiplies them by one factor)."""
    T, Tc = k.shape[2], kc.shape[2]
    if tuple(kc.shape[:2]) != tuple(k.shape[:2]) or kc.shape[3] != k.shape[3] or Tc > T:
        return f"cached K {tuple(kc.shape)} vs captured {tuple(k.shape)}"
    k, v = k[:, :, T - Tc:].float(), v[:, :, T - Tc:].float()
    kc, vc = kc.to(k.device).float(), vc.to(k.device).float()
    if v.shape != vc.shape:
        return f"cached V {tuple(vc.shape)} vs captured {tuple(v.shape)}"
    real = real.to(k.device).bool()[:, None, :].expand(k.shape[:3])  # [B, H, Tc]
    if not real.any():
        return None
    v_err = (v - vc).abs().amax(-1)[real].max()
    if v_err > tol * (vc.abs().amax() + 1e-12):
        return f"values differ by {float(v_err):.3g}"
    n_pre, n_post = k.norm(dim=-1)[real], kc.norm(dim=-1)[real]
    ok = n_pre > 1e-6 * (n_pre.max() + 1e-30)
    if not ok.any():
        return None
    ratio = n_post[ok] / n_pre[ok]
    scale = ratio.median()
    spread = float((ratio - scale).abs().max() / scale)
    return f"key norms differ from the cached keys' by up to {spread:.1%}" if spread > tol else None


def check_against_cache(model, keys, values, ids: list[int], cache, mask) -> None:
    """Guard against a wrong capture: every selected layer's `layer_mismatch` against the cache the
    same forward filled; KavaError (one line) on the first mismatch."""
    try:
        per_layer = cache_layers(cache)
    except TypeError:
        return  # the family returns no standard cache: nothing to compare with
    if len(per_layer) <= max(ids):
        return
    tol = 3e-2 if keys.dtype in (torch.float16, torch.bfloat16) else 1e-3
    B, T = keys.shape[1], keys.shape[3]
    for j, i in enumerate(ids):
        kc, vc = per_layer[i]
        if kc is None or vc is None or kc.dim() != 4 or kc.shape[2] == 0:
            continue
        Tc = kc.shape[2]
        real = torch.ones(B, Tc, dtype=torch.bool) if mask is None else mask[:, max(T - Tc, 0):]
        why = layer_mismatch(keys[j], values[j], kc, vc, real, tol)
        if why:
            raise KavaError(
                f"{model_family(model)}: keys captured at the projection are not the cached keys of layer {i} before "
                f"rotation ({why}); pre-RoPE keys are not supported for this family, use align.key_space: post_rope"
            )




class HiddenCapture:
    """Forward hooks that capture the output hidden state (the residual stream after the layer) of the selected
    decoder layers during one forward; `stack()` -> [L, B, T, hidden]. Autograd is kept (the student's)."""

    def __init__(self, model, ids: list[int]):
        layers = decoder_layers(model)
        self.ids, self.mods = list(ids), [layers[i] for i in ids]
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def _hook(self, i: int):
        def fn(_mod, _inputs, out):
            self.outputs[i] = out[0] if isinstance(out, (tuple, list)) else out
        return fn

    def __enter__(self) -> "HiddenCapture":
        self.handles = [m.register_forward_hook(self._hook(i)) for i, m in zip(self.ids, self.mods)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def stack(self) -> torch.Tensor:
        missing = [i for i in self.ids if i not in self.outputs]
        if missing:
            raise KavaError(f"decoder layers {missing} did not run in the forward: no hidden state to serve")
        dev = self.outputs[self.ids[0]].device
        return torch.stack([self.outputs[i].to(dev) for i in self.ids])  # [L, B, T, hidden]
