"""The forwards that produce KV: the teacher's (no grad, stopped after the deepest served layer when
no logits are asked, top-k log-probs and their tail when they are) and the student's (with grad),
and `extract_kv` from a cache alone.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import Cache

from kava_ray.common.errors import KavaError
from kava_ray.core.kv.batch import KEY_SPACES, KVBatch
from kava_ray.core.kv.capture import HiddenCapture, KVCapture, attention_layers, cache_layers, check_against_cache
from kava_ray.core.kv.rope import position_ids_from_mask, rotate_outside_forward
from kava_ray.core.models import kv_geometry


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
    """Stack the selected layers of a cache into a KVBatch; de-rotate keys for key_space="pre_rope". Keeps autograd.

    position_ids: [B, T] or [T], those the forward used (default `position_ids_from_mask(mask)`,
    else arange(T)). pre_rope needs `model` and handles no rotary or Llama-style rotary only
    (KavaError for others; the forwards capture exact pre-RoPE keys for every family).
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    per_layer = cache_layers(cache_or_tuples)
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
        keys = rotate_outside_forward(keys, model, position_ids, inverse=True)
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
                       logits_top_k: int = 0, stop_early: bool = True, hidden: bool = False,
                       token_logprobs: bool = False) -> KVBatch:
    """Inference forward (input_ids, attention_mask [B, T]) -> KVBatch of the selected layers, as ordinary (not
    inference-mode) tensors on the model's device and dtype. pre_rope: K, V captured at the projections and
    checked against the cache; post_rope: the cache.

    logits_top_k k > 0 adds topk_ids / topk_logp [B, T, k] and topk_tail (fp32 log_softmax, padding
    included); a k past the vocabulary V serves all V ids (the whole distribution, tail -inf); k = 0
    skips the LM head, and `stop_early` ends the forward after the deepest selected layer's
    attention. hidden: also the selected layers' output hidden states (`KVBatch.hidden` [L, B, T,
    hidden]; the forward then runs every decoder layer). token_logprobs: also each next token's
    log-prob (`KVBatch.token_logp` [B, T]).
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    logits_top_k = int(logits_top_k)
    if logits_top_k < 0:
        raise KavaError(f"logits_top_k must be >= 0, got {logits_top_k}")
    input_ids, attention_mask, pos = _forward_inputs(model, input_ids, attention_mask)
    if layers is not None and not len(layers):  # no layers (a logits-only job: `JobConfig.ships_kv`)
        return _logits_only(model, input_ids, attention_mask, pos, key_space, logits_top_k, token_logprobs)
    # the decoder without the LM head when logits are not needed; the whole model when they are
    with_logits = bool(logits_top_k) or token_logprobs
    run = model if with_logits else getattr(model, "base_model", model)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=True)
    n_layers = kv_geometry(model).num_layers
    ids = _check_layers(layers, n_layers)
    early = stop_early and not with_logits and not hidden
    stop = _StopAfter.at(model, max(ids), n_layers) if early else contextlib.nullcontext()
    hid = HiddenCapture(model, ids) if hidden else contextlib.nullcontext()
    out = None  # stays None when the forward is stopped early
    if key_space == "post_rope":
        with hid, stop, torch.inference_mode():
            out = run(**kwargs)
        with torch.no_grad():  # outside inference mode, so the stacked copies are normal tensors
            kv = extract_kv(_cache_of(out, stop), model, pos, key_space=key_space, layers=ids, mask=attention_mask)
            return _with_hidden(_with_token_logp(_with_topk(kv, out, logits_top_k), out, input_ids, token_logprobs),
                                hid)
    with KVCapture(model, ids) as cap, hid, stop, torch.inference_mode():
        out = run(**kwargs)
    with torch.no_grad():
        kv = _stack(cap.pairs(*input_ids.shape), attention_mask, ids, key_space)
        check_against_cache(model, kv.keys, kv.values, ids, _cache_of(out, stop), kv.mask)
        return _with_hidden(_with_token_logp(_with_topk(kv, out, logits_top_k), out, input_ids, token_logprobs), hid)


def _logits_only(model, input_ids, attention_mask, pos, key_space: str, k: int, token_logprobs: bool) -> KVBatch:
    """`teacher_forward_kv` with no layers: K and V [0, B, H, T, D], the top-k / token log-probs of one forward."""
    with torch.inference_mode():
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, use_cache=False)
    with torch.no_grad():
        kv = _no_layers(model, attention_mask, key_space)
        return _with_token_logp(_with_topk(kv, out, k), out, input_ids, token_logprobs)


def _no_layers(model, attention_mask, key_space: str) -> KVBatch:
    """`KVBatch.empty` in `model`'s KV geometry."""
    g = kv_geometry(model)
    return KVBatch.empty(attention_mask, g.num_kv_heads, g.head_dim, key_space)


def _with_hidden(kv: KVBatch, hid) -> KVBatch:
    """kv with the captured hidden states (stacked outside inference mode: a normal tensor), if any were asked."""
    if isinstance(hid, HiddenCapture):
        kv.hidden = hid.stack()
    return kv


class _Stopped(Exception):
    """Raised by `_StopAfter`'s hook to end a forward early (never escapes `_StopAfter`)."""


class _StopAfter:
    """Ends a forward right after attention layer `last` has run: its K/V are captured and cached,
    and nothing deeper runs (the rest of the decoder, the final norm, the LM head). A forward hook
    on that attention module keeps the cache it was handed (`cache`) and raises; `__exit__` swallows
    exactly that exception."""

    def __init__(self, module):
        self.module = module
        self.cache = None
        self.stopped = False

    @classmethod
    def at(cls, model, last: int, num_layers: int):
        """A stopper after attention layer `last`, or a no-op where the attention modules are not
        one per decoder layer of the model's `num_layers` (latent attention, hybrids: the forward
        then runs whole)."""
        attn = attention_layers(model)
        if len(attn) != num_layers:
            return contextlib.nullcontext()
        return cls(attn[last])

    def _hook(self, _mod, args, kwargs, _out):
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
    return output_cache(out)


def output_cache(out):
    """The Cache a forward returned: `out.cache` (transformers >= 5.24), else `out.past_key_values`."""
    cache = getattr(out, "cache", None)  # >= 5.24: past_key_values is a deprecated alias that warns
    return cache if cache is not None else out.past_key_values


def _with_topk(kv: KVBatch, out, k: int) -> KVBatch:
    """kv with the top-k fp32 log-probs of the forward's logits (unchanged for k = 0); k at most the
    vocabulary (`loss.logit_top_k` >= V: every id)."""
    if not k:
        return kv
    logits = getattr(out, "logits", None)
    if logits is None:
        raise KavaError("the teacher forward returned no logits: cannot serve top-k log-probs")
    k = min(k, logits.shape[-1])
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V] in fp32
    kv.topk_logp, kv.topk_ids = torch.topk(logp, k, dim=-1, sorted=True)
    # the mass outside the k ids, exactly (1 - sum p would lose a small tail to rounding): the tail bucket
    kv.topk_tail = logp.scatter(-1, kv.topk_ids, float("-inf")).logsumexp(-1)  # [B, T]
    return kv


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(input_ids[:, t + 1] | ..t) at position t [B, T] (float32 at least; the last position
    0): the form in which samples, the student and the teachers' scores of one sequence are
    compared."""
    z = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(z if temperature == 1.0 else z / temperature, dim=-1)
    nxt = logp.gather(-1, input_ids[:, 1:].to(logp.device)[..., None])[..., 0]
    return torch.nn.functional.pad(nxt, (0, 1), value=0.0)


def _with_token_logp(kv: KVBatch, out, input_ids, on: bool) -> KVBatch:
    """kv with each next token's log-prob under the forward's logits (`next_token_logprobs`), if asked."""
    if on:
        kv.token_logp = next_token_logprobs(out.logits, input_ids)
    return kv


def _checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on (transformers 5 renamed the flag)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def student_forward_kv(
    model, input_ids, attention_mask, labels=None, layers=None, key_space: str = "pre_rope", hidden: bool = False,
    **forward_kwargs
) -> tuple:
    """Training forward that keeps the autograd graph -> (model outputs incl. loss/logits, KVBatch); extra keyword
    arguments go to the model's forward. pre_rope: captured as in `teacher_forward_kv`. post_rope: the cache, or,
    under gradient checkpointing in training (HF then has no cache), captured keys rotated Llama-style.
    hidden: also the layers' output hidden states (`KVBatch.hidden`, with grad).
    """
    if key_space not in KEY_SPACES:
        raise KavaError(f"unknown key_space {key_space!r}; expected pre_rope or post_rope")
    input_ids, attention_mask, pos = _forward_inputs(model, input_ids, attention_mask)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos, **forward_kwargs)
    if labels is not None:
        kwargs["labels"] = labels.to(input_ids.device)
    if layers is not None and not len(layers):  # a logits-only job (`JobConfig.ships_kv`): no capture, no cache
        return model(**kwargs, use_cache=False), _no_layers(model, attention_mask, key_space)
    cached = not (model.training and _checkpointing(model))
    ids = _check_layers(layers, kv_geometry(model).num_layers)
    hid = HiddenCapture(model, ids) if hidden else contextlib.nullcontext()
    if key_space == "post_rope" and cached:
        with hid:
            out = model(**kwargs, use_cache=True)
        kv = extract_kv(output_cache(out), model, pos, key_space=key_space, layers=layers, mask=attention_mask)
        if hidden:
            kv.hidden = hid.stack()
        return out, kv
    with KVCapture(model, ids) as cap, hid:
        out = model(**kwargs, use_cache=cached)
    kv = _stack(cap.pairs(*input_ids.shape), attention_mask, ids, key_space)
    if cached:
        with torch.no_grad():
            check_against_cache(model, kv.keys, kv.values, ids, output_cache(out), kv.mask)
    if key_space == "post_rope":
        kv.keys = rotate_outside_forward(kv.keys, model, pos, inverse=False)
    if hidden:
        kv.hidden = hid.stack()
    return out, kv
