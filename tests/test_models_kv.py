"""models.py + kv.py on tiny random models loaded through the real `load_model`."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2Config

from kava_ray.common.errors import KavaError
from kava_ray.core.gguf import gguf_cache_path, gguf_to_hf_dir
from kava_ray.core.kv import (
    KVBatch,
    extract_kv,
    kv_bytes_per_token,
    position_ids_from_mask,
    student_forward_kv,
    teacher_forward_kv,
    wire_nbytes,
)
from kava_ray.core.models import (
    KVGeometry,
    kv_geometry,
    load_model,
    load_tokenizer,
    resolve_dtype,
)
from tiny_models import build_tiny_model, write_tiny_gguf

TEXTS = ["Natalia sold 48 clips in April.", "2+2=4", "How many apples?"]


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir):
    return load_model(tiny_qwen2_dir, dtype="float32")


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return load_model(tiny_llama_dir, dtype="float32")


@pytest.fixture(scope="module", params=["left", "right"])
def batch(request, tiny_qwen2_dir):
    """A padded batch of 3 texts: input_ids, attention_mask [3, T]."""
    tok = load_tokenizer(tiny_qwen2_dir)
    tok.padding_side = request.param
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    assert (enc.attention_mask == 0).any()  # really padded
    return enc.input_ids, enc.attention_mask


def _capture(model, names=("k_proj", "v_proj")):
    """Forward hooks storing each layer's k_proj/v_proj output [B, T, H*D]; returns (store, handles)."""
    store, handles = {}, []
    for i, layer in enumerate(model.model.layers):
        for n in names:
            mod = getattr(layer.self_attn, n)
            handles.append(mod.register_forward_hook(lambda m, a, out, key=(i, n): store.__setitem__(key, out)))
    return store, handles


def _heads(x, head_dim):
    """[B, T, H*D] -> [B, H, T, D] (the cache layout)."""
    B, T, _ = x.shape
    return x.reshape(B, T, -1, head_dim).transpose(1, 2)


# ------------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("name,kv_heads,head_dim,layers", [("qwen2", 2, 16, 4), ("llama", 2, 32, 3)])
def test_kv_shapes_follow_gqa_and_head_dim(name, kv_heads, head_dim, layers, request, batch):
    model = request.getfixturevalue(name)
    geom = kv_geometry(model.config)
    assert (geom.num_layers, geom.num_kv_heads, geom.head_dim) == (layers, kv_heads, head_dim)
    assert geom.kv_dim == kv_heads * head_dim
    ids, mask = batch
    kv = teacher_forward_kv(model, ids, mask)
    assert kv.shape == (layers, ids.shape[0], kv_heads, ids.shape[1], head_dim)  # [L, B, H_kv, T, D]
    assert kv.values.shape == kv.keys.shape and kv.layer_ids == list(range(layers))
    assert kv.mask.dtype == torch.bool and torch.equal(kv.mask, mask.bool())
    assert not kv.keys.is_inference()  # usable in autograd code downstream
    assert KVGeometry.from_dict(geom.to_dict()) == geom


# ------------------------------------------------------------------------------------ de-rotation


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_pre_rope_keys_equal_k_proj_and_values_equal_v_proj(name, request, batch):
    """De-rotated cached keys recover the k_proj output exactly, also with padding (mask-derived positions)."""
    model = request.getfixturevalue(name)
    ids, mask = batch
    D = kv_geometry(model).head_dim
    store, handles = _capture(model)
    try:
        kv = teacher_forward_kv(model, ids, mask)  # the hooks see this very forward
    finally:
        for h in handles:
            h.remove()
    for j in kv.layer_ids:
        torch.testing.assert_close(kv.keys[j], _heads(store[(j, "k_proj")], D), atol=1e-5, rtol=0)
        torch.testing.assert_close(kv.values[j], _heads(store[(j, "v_proj")], D), atol=1e-5, rtol=0)


def test_positions_from_mask_matter_with_left_padding(qwen2, batch):
    """With padding, de-rotating with arange(T) instead of the forward's positions gives wrong keys."""
    ids, mask = batch
    pos = position_ids_from_mask(mask)  # [B, T]
    assert pos.min() == 0 and torch.equal(pos[mask.bool()].max(), mask.sum(1).max() - 1)
    with torch.no_grad():
        out = qwen2(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    right = extract_kv(out.past_key_values, qwen2, mask=mask)  # derives the same positions from mask
    torch.testing.assert_close(right.keys, teacher_forward_kv(qwen2, ids, mask).keys, atol=1e-6, rtol=0)
    wrong = extract_kv(out.past_key_values, qwen2, position_ids=torch.arange(ids.shape[1]))
    shifted = (pos != torch.arange(ids.shape[1])) & mask.bool()  # [B, T] real tokens not at their index
    err = (wrong.keys - right.keys).abs().amax(dim=(0, 2, 4))  # [B, T] worst error per token
    if shifted.any():  # left padding shifts real tokens; right padding does not
        assert err[shifted].min() > 1e-3
    else:
        assert err[mask.bool()].max() < 1e-6


def test_post_rope_keys_equal_cache_and_layer_selection(llama, batch):
    ids, mask = batch
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        cache = llama(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True).past_key_values
    post = extract_kv(cache, key_space="post_rope", mask=mask)  # no model needed
    assert torch.equal(post.keys, torch.stack([layer.keys for layer in cache.layers]))
    assert torch.equal(post.values, torch.stack([layer.values for layer in cache.layers]))

    sel = extract_kv(cache, llama, key_space="pre_rope", layers=[2, 0], mask=mask)
    full = extract_kv(cache, llama, mask=mask)
    assert sel.layer_ids == [2, 0] and sel.keys.shape[0] == 2
    assert torch.equal(sel.keys[0], full.keys[2]) and torch.equal(sel.values[1], full.values[0])
    again = full.select_layers([2, 0])
    assert torch.equal(again.keys, sel.keys) and again.layer_ids == [2, 0]

    legacy = tuple((layer.keys, layer.values) for layer in cache.layers)  # pre-Cache format
    from_tuples = extract_kv(legacy, llama, mask=mask)
    assert torch.equal(from_tuples.keys, full.keys) and torch.equal(from_tuples.values, full.values)

    for bad_layers in ([3], [-1], [0, 0]):
        with pytest.raises(KavaError):
            extract_kv(cache, llama, layers=bad_layers)
    with pytest.raises(KavaError):
        full.select_layers([1, 5])
    with pytest.raises(TypeError):
        extract_kv(torch.zeros(2, 3), llama)
    with pytest.raises(TypeError):
        extract_kv({"keys": cache.layers[0].keys}, llama)


def test_student_forward_keeps_graph_also_with_checkpointing(tiny_student_dir, batch):
    """Student KV carries gradients; with gradient checkpointing (cache disabled) it is the same KV."""
    ids, mask = batch
    model = load_model(tiny_student_dir, dtype="float32")
    model.train()
    out, kv = student_forward_kv(model, ids, mask, labels=ids.masked_fill(mask == 0, -100), layers=[1])
    assert out.loss.requires_grad and kv.keys.requires_grad and kv.layer_ids == [1]
    (kv.keys.square().mean() + kv.values.square().mean()).backward()
    assert model.model.layers[1].self_attn.k_proj.weight.grad.abs().sum() > 0

    # (transformers 5.20 renamed it; vLLM's CPU build pins transformers < 5.20)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    out2, kv2 = student_forward_kv(model, ids, mask, labels=ids.masked_fill(mask == 0, -100), layers=[1])
    torch.testing.assert_close(kv2.keys, kv.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(kv2.values, kv.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(out2.loss, out.loss)
    model.zero_grad()
    kv2.keys.square().mean().backward()
    assert model.model.layers[1].self_attn.k_proj.weight.grad.abs().sum() > 0
    _, post = student_forward_kv(model, ids, mask, layers=[1], key_space="post_rope")
    model.eval()
    _, post_cache = student_forward_kv(model, ids, mask, layers=[1], key_space="post_rope")
    torch.testing.assert_close(post.keys, post_cache.keys, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ quantization


def test_nf4_and_int8_teachers_on_cpu(tiny_qwen2_dir, qwen2, batch):
    """bitsandbytes 0.50 runs NF4 and LLM.int8 on CPU; KV stays finite and close to full precision."""
    import bitsandbytes as bnb

    ids, mask = batch
    ref = teacher_forward_kv(qwen2, ids, mask)
    for quant, linear in (("4bit", bnb.nn.Linear4bit), ("8bit", bnb.nn.Linear8bitLt)):
        model = load_model(tiny_qwen2_dir, quantization=quant, dtype="float32")
        assert isinstance(model.model.layers[0].self_attn.k_proj, linear)
        kv = teacher_forward_kv(model, ids, mask)
        assert kv.shape == ref.shape and torch.isfinite(kv.keys).all() and torch.isfinite(kv.values).all()
        rel = (kv.keys - ref.keys).norm() / ref.keys.norm()
        assert rel < 0.5, f"{quant}: relative key error {rel:.3f}"


# -------------------------------------------------------------------------------------------- wire


def test_wire_round_trip_and_byte_count(llama, batch):
    ids, mask = batch
    B, T = ids.shape
    geom = kv_geometry(llama)
    kv = teacher_forward_kv(llama, ids, mask, layers=[0, 2])
    for dtype in ("bf16", "fp16"):
        payload = kv.to_wire(dtype)
        assert wire_nbytes(payload) == kv_bytes_per_token(geom, dtype, layers=[0, 2]) * B * T
        assert wire_nbytes(payload) == kv.to(dtype=resolve_dtype(dtype)).num_bytes()
        back = KVBatch.from_wire(payload)
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        assert back.keys.dtype == torch.float32 and back.layer_ids == [0, 2] and back.key_space == "pre_rope"
        assert torch.equal(back.keys, kv.keys.to(torch_dtype).float())  # exact
        assert torch.equal(back.values, kv.values.to(torch_dtype).float())
        assert torch.equal(back.mask, mask.bool())

    payload = kv.to_wire("fp8")
    assert wire_nbytes(payload) == kv_bytes_per_token(geom, "fp8", layers=[0, 2]) * B * T
    assert payload["k_scale"].shape == (2, geom.num_kv_heads, geom.head_dim)
    back = KVBatch.from_wire(payload)
    for x, y in ((kv.keys, back.keys), (kv.values, back.values)):
        # e4m3 keeps 3 mantissa bits: <= 1/16 relative rounding error above the smallest normal
        # (2**-6 * scale); 3% bounds the relative Frobenius error.
        assert (y - x).norm() / x.norm() < 0.03
        scale = x.abs().amax(dim=(1, 3), keepdim=True) / 448
        normal = x.abs() > scale * 2**-6
        assert ((y - x).abs() / x.abs())[normal].max() <= 1 / 16 + 1e-6


def test_wire_bf16_is_zero_copy_and_read_only_safe(tiny_student_dir, batch):
    ids, mask = batch
    model = load_model(tiny_student_dir, dtype="bf16")
    kv = teacher_forward_kv(model, ids, mask)
    assert kv.keys.dtype == torch.bfloat16 and kv.keys.is_contiguous()
    payload = kv.to_wire("bf16")
    assert payload["k"].dtype == np.uint16
    assert payload["k"].ctypes.data == kv.keys.data_ptr() and payload["v"].ctypes.data == kv.values.data_ptr()
    for name in ("k", "v"):  # what Ray's object store hands back: read-only arrays
        payload[name] = payload[name].copy()
        payload[name].flags.writeable = False
    back = KVBatch.from_wire(payload, dtype=None)  # keep bf16: must not alias the read-only buffer
    assert back.keys.dtype == torch.bfloat16 and torch.equal(back.keys, kv.keys)
    assert back.keys.data_ptr() != payload["k"].ctypes.data
    back.keys.add_(1)  # writable
    with pytest.raises(KavaError):
        kv.to_wire("int4")


# ---------------------------------------------------------------------------------------- geometry


def test_geometry_and_kv_volume_match_design():
    """Qwen2.5-1.5B: 28 x 2 x 128 -> 28 KiB bf16 per token; Qwen2.5-0.5B: 24 x 2 x 64 -> 12 KiB."""
    rope = {"rope_type": "default", "rope_theta": 1e6}
    dims = dict(num_key_value_heads=2, vocab_size=151936, rope_parameters=rope)  # no weights are built
    big = kv_geometry(Qwen2Config(hidden_size=1536, num_attention_heads=12, num_hidden_layers=28, **dims))
    small = kv_geometry(Qwen2Config(hidden_size=896, num_attention_heads=14, num_hidden_layers=24, **dims))
    assert (big.num_layers, big.num_kv_heads, big.head_dim, big.kv_dim) == (28, 2, 128, 256)
    assert big.kv_dim * big.num_layers == 7168 and big.rope_theta == 1e6 and big.model_type == "qwen2"
    assert (small.head_dim, small.kv_dim * small.num_layers) == (64, 3072)
    assert kv_bytes_per_token(big) == 28 * 1024 and kv_bytes_per_token(small) == 12 * 1024
    assert kv_bytes_per_token(big, "fp8") == 14 * 1024
    assert kv_bytes_per_token(small, "fp32", layers=range(12)) == 12 * 1024
    # transformers-4 style: rope_theta attribute, head_dim None, no num_key_value_heads (MHA)
    old = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=None, head_dim=None,
                          hidden_size=64, vocab_size=10, rope_theta=500.0, model_type="old")
    assert kv_geometry(old) == KVGeometry(2, 4, 16, 4, 64, 10, 500.0, "old")


def test_resolve_dtype():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float16") is torch.float16
    assert resolve_dtype("auto") is torch.float32  # no CUDA here
    with pytest.raises(KavaError):
        resolve_dtype("float8")


# ------------------------------------------------------------------------------------------ errors


def test_load_errors_are_one_line_kava_errors(tmp_path, tiny_qwen2_dir):
    def error(fn, *args, **kw) -> str:
        with pytest.raises(KavaError) as e:
            fn(*args, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "does not exist" in error(load_model, tmp_path / "missing")
    assert "does not exist" in error(load_model, str(tmp_path / "x.gguf"))
    assert "does not exist" in error(load_tokenizer, "./nope/model")
    assert "no config.json" in error(load_model, tmp_path)
    assert "unknown quantization" in error(load_model, tiny_qwen2_dir, quantization="3bit")
    (tmp_path / "config.json").write_text("{not json")
    assert f"model '{tmp_path}': cannot load" in error(load_model, tmp_path)  # HF exception, wrapped
    assert "model 'no-such-org/no-such-model': cannot load" in error(load_model, "no-such-org/no-such-model")


# -------------------------------------------------------------------------------------------- GGUF


def test_gguf_converts_once_to_a_plain_hf_dir(tmp_path):
    """A tiny Q8_0 GGUF loads via a cached plain HF dir: no GGUF quantization_config, same tokenizer."""
    src = build_tiny_model(tmp_path / "src", family="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    gguf_path = write_tiny_gguf(src, tmp_path / "tiny.Q8_0.gguf")
    model = load_model(gguf_path, cache_dir=tmp_path / "cache")  # converts
    assert getattr(model.config, "quantization_config", None) is None
    ref = load_model(src)
    ids = torch.arange(20).reshape(2, 10)
    with torch.no_grad():
        a, b = ref(ids).logits, model(ids).logits
    assert (a - b).norm() / a.norm() < 0.03  # Q8_0 rounding only
    (out,) = [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.startswith(".")]
    assert gguf_to_hf_dir(gguf_path, out) == out  # cached: marker present, nothing rebuilt
    # keyed by content: a copy elsewhere (another venv's package) shares the conversion; other bytes do not
    (tmp_path / "venv2").mkdir()
    copy = Path(shutil.copy2(gguf_path, tmp_path / "venv2" / gguf_path.name))
    os.utime(copy, ns=(1, 1))
    assert gguf_cache_path(copy, tmp_path / "cache") == out
    data = bytearray(gguf_path.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    (tmp_path / "venv2" / "other").mkdir()
    (tmp_path / "venv2" / "other" / gguf_path.name).write_bytes(data)
    assert gguf_cache_path(tmp_path / "venv2" / "other" / gguf_path.name, tmp_path / "cache") != out
    (out / ".kava-gguf-complete").unlink()  # an incomplete leftover (crashed conversion) is replaced whole
    (out / "junk").write_text("x")
    assert gguf_to_hf_dir(gguf_path, out) == out and not (out / "junk").exists()
    assert (out / ".kava-gguf-complete").is_file() and (out / "config.json").is_file()
    tok = load_tokenizer(gguf_path, cache_dir=tmp_path / "cache")
    assert tok("hi 12 é").input_ids == load_tokenizer(src)("hi 12 é").input_ids
    nf4 = load_model(gguf_path, quantization="4bit", cache_dir=tmp_path / "cache")
    assert type(nf4.model.layers[0].mlp.up_proj).__name__ == "Linear4bit"


# ------------------------------------------------------------------------------- teacher logits (top-k)


@pytest.mark.parametrize("name,key_space", [("qwen2", "pre_rope"), ("llama", "post_rope")])
def test_teacher_topk_logits_equal_log_softmax_of_the_forward(name, key_space, request, batch):
    model = request.getfixturevalue(name)
    ids, mask = batch
    kv = teacher_forward_kv(model, ids, mask, layers=[0, 1], key_space=key_space, logits_top_k=5)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    ref_logp, ref_ids = torch.log_softmax(logits.float(), dim=-1).topk(5, dim=-1)
    assert kv.topk_ids.dtype == torch.int64 and kv.topk_logp.dtype == torch.float32
    assert kv.topk_ids.shape == (*ids.shape, 5) and torch.equal(kv.topk_ids, ref_ids)  # same ids, same order
    assert torch.allclose(kv.topk_logp, ref_logp, atol=1e-5, rtol=0)
    assert (kv.topk_logp[..., :-1] >= kv.topk_logp[..., 1:]).all()  # sorted descending
    # the tail: the exact log mass outside the k ids (the log-probs plus it sum to one)
    assert kv.topk_tail.shape == ids.shape
    torch.testing.assert_close(torch.logaddexp(kv.topk_logp.logsumexp(-1), kv.topk_tail), torch.zeros(ids.shape),
                               atol=1e-5, rtol=0)
    plain = teacher_forward_kv(model, ids, mask, layers=[0, 1], key_space=key_space)  # k = 0: today's batch
    assert plain.topk_ids is None and plain.topk_logp is None
    assert torch.equal(plain.keys, kv.keys) and torch.equal(plain.values, kv.values)
    # the top-k travels with .to() and select_layers()
    moved = kv.to(dtype=torch.bfloat16)
    assert torch.equal(moved.topk_ids, kv.topk_ids) and moved.topk_logp.dtype == torch.float32
    assert torch.equal(kv.select_layers([1]).topk_logp, kv.topk_logp)
    # a k past the vocabulary (`loss.logit_top_k` >= V) is every id: the whole distribution, nothing in the tail
    V = logits.shape[-1]
    every = teacher_forward_kv(model, ids, mask, layers=[0], logits_top_k=10**6)
    assert every.topk_ids.shape == (*ids.shape, V)
    assert torch.equal(every.topk_ids.sort(-1).values, torch.arange(V).expand(*ids.shape, V))
    assert torch.isneginf(every.topk_tail).all()
    torch.testing.assert_close(every.topk_logp.logsumexp(-1), torch.zeros(ids.shape), atol=1e-5, rtol=0)


def test_wire_topk_round_trip_byte_count_and_no_topk_payload_unchanged(llama, batch):
    from kava_ray.core.kv import logits_bytes_per_token, wire_logits_nbytes

    ids, mask = batch
    B, T = ids.shape
    geom = kv_geometry(llama)
    kv = teacher_forward_kv(llama, ids, mask, layers=[0, 2], logits_top_k=7)
    plain = teacher_forward_kv(llama, ids, mask, layers=[0, 2])
    for dtype, np_dtype, half in (("bf16", np.uint16, torch.bfloat16), ("fp16", np.float16, torch.float16),
                                  ("fp8", np.float16, torch.float16)):  # fp8 wire: log-probs as fp16
        payload = kv.to_wire(dtype)
        assert payload["topk_ids"].dtype == np.int32 and payload["topk_logp"].dtype == np_dtype
        assert payload["topk_ids"].shape == payload["topk_logp"].shape == (B, T, 7)
        assert payload["topk_tail"].dtype == np.float32 and payload["topk_tail"].shape == (B, T)
        # k ids (int32) and log-probs (2 bytes) plus the float32 tail, per token
        assert wire_logits_nbytes(payload) == logits_bytes_per_token(7, dtype) * B * T == (7 * (4 + 2) + 4) * B * T
        assert wire_nbytes(payload) == (kv_bytes_per_token(geom, dtype, layers=[0, 2])
                                        + logits_bytes_per_token(7, dtype)) * B * T
        for arr in ("topk_ids", "topk_logp", "topk_tail"):  # read-only, as Ray's object store hands them back
            payload[arr] = payload[arr].copy()
            payload[arr].flags.writeable = False
        for out_dtype in (torch.float32, None, torch.bfloat16):
            back = KVBatch.from_wire(payload, dtype=out_dtype)
            assert back.topk_ids.dtype == torch.int64 and torch.equal(back.topk_ids, kv.topk_ids)
            assert back.topk_logp.dtype == torch.float32  # at least fp32 after decode
            assert torch.equal(back.topk_logp, kv.topk_logp.to(half).float())  # exact: one rounding
            assert torch.equal(back.topk_tail, kv.topk_tail)  # the tail travels in float32: exact
        back.topk_logp.add_(1)  # writable, not aliasing the payload
        bare = plain.to_wire(dtype)  # without top-k: exactly the payload it always was
        assert set(bare) == set(payload) - {"topk_ids", "topk_logp", "topk_tail", "topk_dtype"}
        assert wire_nbytes(bare) == kv_bytes_per_token(geom, dtype, layers=[0, 2]) * B * T
        back = KVBatch.from_wire(bare)
        assert back.topk_ids is None and back.topk_logp is None
    assert logits_bytes_per_token(0) == 0 and logits_bytes_per_token(64, "fp32") == 64 * 8 + 4


def test_hidden_states_are_the_layers_outputs_and_travel_the_wire(qwen2, batch):
    """`hidden=True`: each selected layer's output hidden state, what HF's output_hidden_states[i + 1] holds for a
    layer before the last (the last one HF returns after the final norm), for the teacher and the student alike;
    on the wire (bf16 / fp16) and through an example-indexed cache's row / stack."""
    ids, mask = batch
    with torch.no_grad():
        ref = qwen2(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                    output_hidden_states=True).hidden_states
    kv = teacher_forward_kv(qwen2, ids, mask, layers=[0, 2], hidden=True)
    assert kv.hidden.shape == (2, ids.shape[0], ids.shape[1], qwen2.config.hidden_size)
    for j, i in enumerate([0, 2]):
        assert torch.allclose(kv.hidden[j], ref[i + 1], atol=1e-5)
    assert teacher_forward_kv(qwen2, ids, mask, layers=[0, 2]).hidden is None  # not asked: not served
    _, skv = student_forward_kv(qwen2, ids, mask, hidden=True)
    assert torch.allclose(skv.hidden[:3], torch.stack(ref[1:4]), atol=1e-5)
    for dtype, tol in (("bf16", 2e-2), ("fp16", 2e-3)):
        back = KVBatch.from_wire(kv.to_wire(dtype))
        assert back.hidden.dtype == torch.float32
        assert torch.allclose(back.hidden, kv.hidden, atol=tol * kv.hidden.abs().max())
    real = mask.bool()
    if bool(real[:, 0].all()):  # right padding: what a cache's rows are
        again = KVBatch.stack([kv.row(b) for b in range(ids.shape[0])], mask)
        assert torch.equal(again.hidden[:, real], kv.hidden[:, real]) and not again.hidden[:, ~real].any()
    assert torch.equal(kv.select_layers([2]).hidden[0], kv.hidden[1])
