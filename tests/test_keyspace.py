"""Pre-RoPE keys on every architecture (issue 10, item 5).

Tiny random models of 19 decoder families, built from their transformers configs, saved with
save_pretrained and loaded with the project's own `load_model` / `load_student`. For each family the
keys a teacher serves (`teacher_forward_kv`, key_space pre_rope) must be

  * the keys captured at the projection (after the k-norm where there is one), reshaped per head,
    read here with this file's own per-family hooks;
  * exactly what the model rotates: rotating them with the family's own `apply_rotary_pos_emb` and
    the (cos, sin) its attention received gives the cached keys (the cache holds post-RoPE keys);
    without rotary they are the cached keys;

and the values the value projection -- all within 1e-5 in fp32, on real tokens of a batch with left
or right padding. The differentiable student path (`student_forward_kv`, also under gradient
checkpointing) serves the same K, V. Unsupported attention fails with one KavaError line.
"""

from __future__ import annotations

import re
import sys

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from kava_ray.common.errors import KavaError
from kava_ray.core.kv import (
    attention_layers,
    extract_kv,
    position_ids_from_mask,
    student_forward_kv,
    teacher_forward_kv,
)
from kava_ray.core.kv.capture import cache_layers
from kava_ray.core.models import decoder_layers, keep_layers, kv_geometry, load_model, load_student

V, B, T = 96, 3, 9
TOKENS = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2)
DIMS = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _cfg(name: str, **kw):
    config = getattr(tf, name)(**TOKENS, **kw)
    for key in list(config.to_dict()):  # train-mode forwards must equal eval-mode ones: no dropout
        if key.endswith(("dropout", "pdrop")) and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return config


def _rope(theta: float, **kw) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **kw}


# family -> (config, what it exercises). Key/value readers for the oracle are in ORACLE below.
FAMILIES = {
    "llama": (lambda: _cfg("LlamaConfig", num_key_value_heads=2, rope_parameters=_rope(5e4), **DIMS),
              "Llama-style full rotary (SmolLM2's architecture), GQA"),
    "qwen2": (lambda: _cfg("Qwen2Config", num_key_value_heads=2, **DIMS), "GQA with k/v bias"),
    "cohere": (lambda: _cfg("CohereConfig", num_key_value_heads=2, use_qk_norm=True, **DIMS),
               "interleaved rotary + per-head q/k LayerNorm"),
    "gemma3_text": (lambda: _cfg("Gemma3TextConfig", num_key_value_heads=2, head_dim=8, sliding_window=4,
                                 layer_types=["sliding_attention", "full_attention"], **DIMS),
                    "rotary per layer type (local/global theta), q/k RMSNorm, sliding-window cache"),
    "gemma2": (lambda: _cfg("Gemma2Config", num_key_value_heads=2, head_dim=8, sliding_window=4, **DIMS),
               "local + global attention, sliding-window cache"),
    "qwen3": (lambda: _cfg("Qwen3Config", num_key_value_heads=2, head_dim=8, **DIMS), "per-head q/k RMSNorm"),
    "olmo2": (lambda: _cfg("Olmo2Config", num_key_value_heads=2, **DIMS), "k-norm over the whole projection"),
    "phi": (lambda: _cfg("PhiConfig", qk_layernorm=True, rope_parameters=_rope(1e4, partial_rotary_factor=0.5),
                         **DIMS),
            "partial rotary (1/2), k LayerNorm after the head transpose"),
    "stablelm": (lambda: _cfg("StableLmConfig", num_key_value_heads=2, qk_layernorm=True,
                              rope_parameters=_rope(1e4, partial_rotary_factor=0.25), **DIMS),
                 "partial rotary (1/4), per-head k LayerNorm on [B, H, T, D]"),
    "gpt_neox": (lambda: _cfg("GPTNeoXConfig", rope_parameters=_rope(1e4, partial_rotary_factor=0.25), **DIMS),
                 "fused per-head q/k/v projection, partial rotary (1/4)"),
    "phi3": (lambda: _cfg("Phi3Config", num_key_value_heads=2, **DIMS), "fused [q | k | v] projection, GQA"),
    "persimmon": (lambda: _cfg("PersimmonConfig", qk_layernorm=True, **DIMS),
                  "fused per-head projection + k LayerNorm, partial rotary"),
    "falcon": (lambda: _cfg("FalconConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            new_decoder_architecture=True, num_kv_heads=2),
               "fused grouped projection, K/V broadcast to every head in the cache"),
    "gptj": (lambda: _cfg("GPTJConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4),
             "interleaved partial rotary inside the attention, no rotary module"),
    "smollm3": (lambda: _cfg("SmolLM3Config", num_key_value_heads=2, no_rope_layer_interval=2, **DIMS),
                "a layer without RoPE (NoPE) next to a rotary one"),
    "gpt2": (lambda: _cfg("GPT2Config", n_embd=32, n_layer=2, n_head=4), "no rotary (learned positions), fused Conv1D"),
    "opt": (lambda: _cfg("OPTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                         word_embed_proj_dim=32), "no rotary, separate k_proj/v_proj"),
    "bloom": (lambda: _cfg("BloomConfig", hidden_size=32, n_layer=2, n_head=4), "ALiBi, fused per-head projection"),
    "gpt_bigcode": (lambda: _cfg("GPTBigCodeConfig", n_embd=32, n_layer=2, n_head=4, multi_query=True),
                    "no rotary, multi-query (1 KV head), fused [q | k | v]"),
}
NO_ROTARY = {"gpt2", "opt", "bloom", "gpt_bigcode"}


# ---------------------------------------------------------------------------------------- oracle
# Per family: (module to hook for K, how its output becomes [B, H, T, D]); the same for V.
# Written from each family's modeling code, independently of kava_ray.core.kv.

def _flat(out, h, d):  # [B, T, H*D]
    return out.reshape(B, T, h, d).transpose(1, 2)


def _bthd(out, h, d):  # [B, T, H, D]
    return out.transpose(1, 2)


def _bhtd(out, h, d):  # [B, H, T, D]
    return out


def _per_head(slot):  # fused [B, T, H * 3 * D] laid out per head as (q, k, v)
    return lambda out, h, d: out.reshape(B, T, h, 3, d)[..., slot, :].transpose(1, 2)


def _concat(slot, hq):  # fused [q (hq*d) | k (h*d) | v (h*d)]
    def read(out, h, d):
        start = hq * d + slot * h * d
        return out[..., start : start + h * d].reshape(B, T, h, d).transpose(1, 2)
    return read


def _falcon(slot, hq):  # fused per KV group (q_1 .. q_g, k, v), broadcast to every query head
    def read(out, h, d):
        hkv = 2
        g = hq // hkv
        x = out.reshape(B, T, hkv, g + 2, d)[..., g + slot, :]
        return x.repeat_interleave(g, dim=2).transpose(1, 2)
    return read


SEPARATE = (("k_proj", _flat), ("v_proj", _flat))
ORACLE = {
    "llama": SEPARATE, "qwen2": SEPARATE, "gemma2": SEPARATE, "gptj": SEPARATE, "smollm3": SEPARATE,
    "opt": SEPARATE, "cohere": (("k_norm", _bthd), ("v_proj", _flat)),
    "gemma3_text": (("k_norm", _bhtd), ("v_proj", _flat)), "qwen3": (("k_norm", _bthd), ("v_proj", _flat)),
    "olmo2": (("k_norm", _flat), ("v_proj", _flat)),
    "phi": (("k_layernorm", _bhtd), ("v_proj", _flat)), "stablelm": (("k_layernorm", _bhtd), ("v_proj", _flat)),
    "gpt_neox": (("query_key_value", _per_head(1)), ("query_key_value", _per_head(2))),
    "bloom": (("query_key_value", _per_head(1)), ("query_key_value", _per_head(2))),
    "persimmon": (("k_layernorm", _bthd), ("query_key_value", _per_head(2))),
    "phi3": (("qkv_proj", _concat(0, 4)), ("qkv_proj", _concat(1, 4))),
    "gpt2": (("c_attn", _concat(0, 4)), ("c_attn", _concat(1, 4))),
    "gpt_bigcode": (("c_attn", _concat(0, 4)), ("c_attn", _concat(1, 4))),
    "falcon": (("query_key_value", _falcon(0, 4)), ("query_key_value", _falcon(1, 4))),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> saved tiny model dir (built on first use)."""
    dirs = {}

    def get(family):
        if family not in dirs:
            torch.manual_seed(sorted(FAMILIES).index(family))
            model = AutoModelForCausalLM.from_config(FAMILIES[family][0](), dtype=torch.float32)
            dirs[family] = tmp_path_factory.mktemp(family)
            model.save_pretrained(dirs[family])
        return dirs[family]

    return get


@pytest.fixture(scope="module")
def teachers(family_dirs):
    models = {}

    def get(family):
        if family not in models:
            models[family] = load_model(family_dirs(family), dtype="float32")
        return models[family]

    return get


def _batch(padding: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, T - 5])
    real = torch.arange(T)[None, :] < lengths[:, None]  # right padding
    if padding == "left":
        real = real.flip(-1)
    return ids.masked_fill(~real, 0), real.long()


def _real(mask):  # [B, T] -> [B, 1, T, 1] for masking [B, H, T, D]
    return mask.bool()[:, None, :, None]


def _assert_close_real(a, b, mask, what):
    m = _real(mask).expand_as(a)
    torch.testing.assert_close(a[m], b[m], atol=1e-5, rtol=0, msg=lambda s: f"{what}: {s}")


class _Hooks:
    """This file's own capture: outputs of named modules of every attention layer, and the kwargs the
    attention modules were called with (their position_embeddings)."""

    def __init__(self, model, names):
        self.out, self.kwargs, self.handles = {}, {}, []
        for i, attn in enumerate(attention_layers(model)):
            for name in set(names):
                mod = getattr(attn, name)
                self.handles.append(mod.register_forward_hook(
                    lambda m, a, o, key=(i, name): self._keep(self.out, key, o)))
            self.handles.append(attn.register_forward_pre_hook(
                lambda m, a, kw, i=i: self._keep(self.kwargs, i, kw), with_kwargs=True))

    @staticmethod
    def _keep(store, key, value) -> None:  # a hook returning None leaves the forward untouched
        store.setdefault(key, value)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _rotate(attn, k, kwargs, mask):
    """k [B, H, T, D] rotated the way the family rotates keys: its own apply_rotary_pos_emb with the
    (cos, sin) its attention received, on the first cos.shape[-1] dims only (partial rotary); GPT-J
    with the sin/cos table inside its attention."""
    family = sys.modules[type(attn).__module__]
    if "use_rope" in vars(attn) and not attn.use_rope:  # SmolLM3's NoPE layers
        return k
    if "rotate_every_two" in vars(family):  # GPT-J: interleaved pairs, [B, T, H, D] layout
        if "position_embeddings" in kwargs:  # transformers >= 5.24: (sin, cos) from GPTJRotaryEmbedding
            sin, cos = kwargs["position_embeddings"]
        else:  # before: the sin/cos table inside the attention
            sincos = attn.embed_positions[position_ids_from_mask(mask)]  # [B, T, rotary_dim]
            sin, cos = sincos.split(sincos.shape[-1] // 2, dim=-1)
        d = attn.rotary_dim
        x = k.transpose(1, 2)
        return torch.cat([family.apply_rotary_pos_emb(x[..., :d], sin, cos), x[..., d:]], -1).transpose(1, 2)
    cos, sin = kwargs["position_embeddings"]
    d = cos.shape[-1]
    k_rot, _ = family.apply_rotary_pos_emb(k[..., :d], k[..., :d], cos, sin)
    return torch.cat([k_rot, k[..., d:]], dim=-1)


# ------------------------------------------------------------------------------------------ tests


def test_at_least_ten_families_and_every_kind_is_covered():
    assert len(FAMILIES) >= 10 and set(ORACLE) == set(FAMILIES)
    for kind in ("interleaved", "partial", "per layer type", "norm", "fused", "no rotary", "ALiBi", "NoPE"):
        assert any(kind.lower() in what.lower() for _, what in FAMILIES.values()), kind
    # KV heads as the cache holds them, for layouts the tiny families above do not cover
    assert kv_geometry(_cfg("FalconConfig", hidden_size=32, num_attention_heads=4, multi_query=True)).num_kv_heads == 1
    assert kv_geometry(_cfg("FalconConfig", hidden_size=32, num_attention_heads=4, multi_query=False)).num_kv_heads == 4
    assert kv_geometry(_cfg("GPTBigCodeConfig", n_embd=32, n_head=4, multi_query=False)).num_kv_heads == 4


def test_decoder_layers_of_every_family_hold_its_attention_and_a_layer_drop_keeps_them():
    """`models.decoder_layers`, the one rule of the layer drop, FSDP2's per-layer units and the hidden-state hooks:
    for each family its blocks in order, each the parent of that layer's attention module; `keep_layers` on any
    layout leaves a model whose cache has the kept depth."""
    for family in sorted(FAMILIES):
        model = AutoModelForCausalLM.from_config(FAMILIES[family][0](), dtype=torch.float32).eval()
        names = {id(m): n for n, m in model.named_modules()}
        blocks = [model.get_submodule(names[id(a)].rpartition(".")[0]) for a in attention_layers(model)]
        assert len(blocks) == 2 and list(decoder_layers(model)) == blocks, family
        keep_layers(model, [1])
        assert list(decoder_layers(model)) == blocks[1:] and attention_layers(model)[0].layer_idx == 0, family
        with torch.no_grad():
            out = model(torch.randint(3, V, (B, T)), use_cache=True)
        assert kv_geometry(model.config).num_layers == 1 and len(cache_layers(out.past_key_values)) == 1, family
    with pytest.raises(KavaError, match="cannot find its decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_served_pre_rope_keys_are_the_projection_keys(family, padding, teachers):
    model = teachers(family)
    ids, mask = _batch(padding)
    (k_name, k_read), (v_name, v_read) = ORACLE[family]
    geom = kv_geometry(model)
    H, D = geom.num_kv_heads, geom.head_dim
    with _Hooks(model, [k_name, v_name]) as hooks:
        kv = teacher_forward_kv(model, ids, mask)  # what a teacher actor serves; the hooks see this forward
    assert kv.shape == (geom.num_layers, B, H, T, D) and kv.key_space == "pre_rope"
    assert torch.equal(kv.mask, mask.bool()) and not kv.keys.is_inference()
    with torch.no_grad():  # the cache holds post-RoPE keys (sliding-window layers: the last tokens only)
        cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                      use_cache=True).past_key_values
    for i, attn in enumerate(attention_layers(model)):
        k_ref = k_read(hooks.out[(i, k_name)], H, D)
        v_ref = v_read(hooks.out[(i, v_name)], H, D)
        _assert_close_real(kv.keys[i], k_ref, mask, f"{family} layer {i} keys vs {k_name}")
        _assert_close_real(kv.values[i], v_ref, mask, f"{family} layer {i} values vs {v_name}")
        # rotating the served keys the family's way gives the cache; without rotary they are the cache
        rotated = kv.keys[i] if family in NO_ROTARY else _rotate(attn, kv.keys[i], hooks.kwargs[i], mask)
        cached = cache.layers[i].keys
        Tc = cached.shape[2]
        assert 0 < Tc <= T and (Tc == T or family.startswith("gemma"))
        tail = mask[:, T - Tc:]
        _assert_close_real(rotated[:, :, T - Tc:], cached, tail, f"{family} layer {i} re-rotated keys vs cache")
        _assert_close_real(kv.values[i][:, :, T - Tc:], cache.layers[i].values, tail, f"{family} layer {i} V vs cache")
        diff = (kv.keys[i][:, :, T - Tc:] - cached)[_real(tail).expand_as(cached)].abs().max()
        if family in NO_ROTARY or not getattr(attn, "use_rope", True):
            assert diff == 0  # no rotation: pre_rope serves the keys as they are
        else:
            assert diff > 1e-3  # the served keys really are de-rotated


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_student_path_serves_the_teacher_keys_and_trains(family, family_dirs, teachers):
    ids, mask = _batch("left", seed=1)
    ref = teacher_forward_kv(teachers(family), ids, mask)
    student = load_student(family_dirs(family), dtype="float32")
    assert student.training
    last = kv_geometry(student).num_layers - 1
    for checkpointing in (False, True):
        if checkpointing:
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        student.zero_grad()
        out, kv = student_forward_kv(student, ids, mask, labels=ids.masked_fill(mask == 0, -100))
        assert kv.keys.requires_grad and kv.values.requires_grad and out.loss.requires_grad
        for name, a, b in (("keys", kv.keys, ref.keys), ("values", kv.values, ref.values)):
            for i in range(last + 1):
                _assert_close_real(a[i], b[i], mask, f"{family} {name} layer {i} (checkpointing={checkpointing})")
        (kv.keys[last] * _real(mask)).square().sum().backward()
        attn = attention_layers(student)[last]
        grads = [p.grad for n, p in attn.named_parameters() if n.endswith("weight") and p.grad is not None]
        assert grads and max(float(g.abs().sum()) for g in grads) > 0, f"{family}: no gradient reached the projection"


def test_llama_and_qwen2_keys_match_the_old_de_rotation(teachers):
    """SmolLM2 is Llama: capture changes its served keys by float rounding only (the de-rotated cache)."""
    for family in ("llama", "qwen2"):
        model = teachers(family)
        for padding in ("left", "right"):
            ids, mask = _batch(padding)
            kv = teacher_forward_kv(model, ids, mask)
            with torch.no_grad():
                cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                              use_cache=True).past_key_values
            old = extract_kv(cache, model, mask=mask)  # k * cos - rotate_half(k) * sin
            torch.testing.assert_close(kv.keys, old.keys, atol=1e-5, rtol=0)
            assert torch.equal(kv.values, old.values)


def test_norm_layout_when_sequence_length_equals_kv_heads(teachers):
    """Phi's k LayerNorm runs on [B, H, T, D], Qwen3's on [B, T, H, D]: with T == H the shapes agree."""
    for family in ("phi", "stablelm", "qwen3", "persimmon"):
        model = teachers(family)
        h = kv_geometry(model).num_kv_heads
        ids = torch.randint(3, V, (2, h))
        mask = torch.ones(2, h, dtype=torch.long)
        mask[1, 0] = 0
        (k_name, _), _ = ORACLE[family]
        with _Hooks(model, [k_name]) as hooks:
            kv = teacher_forward_kv(model, ids, mask)
        norm_out = hooks.out[(0, k_name)]
        ref = norm_out if family in ("phi", "stablelm") else norm_out.transpose(1, 2)
        assert ref.shape == kv.keys[0].shape
        torch.testing.assert_close(kv.keys[0], ref, atol=1e-6, rtol=0)


def test_extract_kv_from_a_cache(teachers):
    """The cache-only path: keys as they are without rotary; Llama-style rotary is undone; other rotary
    variants are refused in one line (the forward paths capture them)."""
    ids, mask = _batch("left")
    pos = position_ids_from_mask(mask)
    gpt2 = teachers("gpt2")
    with torch.no_grad():
        cache = gpt2(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True).past_key_values
    assert torch.equal(extract_kv(cache, gpt2, mask=mask).keys, extract_kv(cache, key_space="post_rope").keys)
    for family, why in (("cohere", "interleaved"), ("gemma3_text", "per layer type"), ("phi", "partial"),
                        ("gptj", "rotary module|interleaved"), ("smollm3", "without RoPE")):
        model = teachers(family)
        with torch.no_grad():
            cache = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True).past_key_values
        with pytest.raises(KavaError) as e:
            extract_kv(cache, model, mask=mask, layers=[1])
        # GPT-J: no rotary module before transformers 5.24, an interleaved one since
        assert "\n" not in str(e.value) and re.search(why, str(e.value)) and "teacher_forward_kv" in str(e.value)


def _one_line_error(fn) -> str:
    with pytest.raises(KavaError) as e:
        fn()
    assert "\n" not in str(e.value) and "align.key_space: post_rope" in str(e.value)
    return str(e.value)


def test_unsupported_attention_is_refused_in_one_line(tmp_path):
    ids, mask = _batch("right")

    def saved(config, name):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / name)
        return load_model(tmp_path / name, dtype="float32")

    # multi-head latent attention: keys are assembled from a latent, there is no key projection to read
    mla = saved(_cfg("DeepseekV3Config", num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                     q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                     moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1, **DIMS), "mla")
    assert "deepseek_v3" in _one_line_error(lambda: teacher_forward_kv(mla, ids, mask))
    assert "deepseek_v3" in _one_line_error(lambda: student_forward_kv(mla, ids, mask))
    post = teacher_forward_kv(mla, ids, mask, key_space="post_rope")  # the cache keeps working
    assert post.key_space == "post_rope"

    # Llama 4 normalises keys after RoPE: the projection keys are not what the cache rotates, and the
    # check against the cache says so instead of serving wrong keys
    l4 = saved(_cfg("Llama4TextConfig", num_key_value_heads=2, head_dim=8, use_qk_norm=True,
                    intermediate_size_mlp=64, num_local_experts=2, **DIMS), "llama4")
    msg = _one_line_error(lambda: teacher_forward_kv(l4, ids, mask))
    assert "llama4_text" in msg and "not the cached keys" in msg

    # a fused q/k/v projection whose layout is not known (CodeGen's model-parallel blocks)
    codegen = saved(_cfg("CodeGenConfig", n_embd=32, n_layer=2, n_head=4, rotary_dim=4), "codegen")
    assert "codegen" in _one_line_error(lambda: teacher_forward_kv(codegen, ids, mask))


def test_post_rope_keeps_serving_the_cache(teachers, family_dirs):
    """post_rope: keys and values as the cache holds them, on every family (the full-length last layer);
    the student's checkpointing path rotates captured keys itself where it can, and says where not."""
    ids, mask = _batch("right")
    for family in sorted(FAMILIES):
        model = teachers(family)
        last = kv_geometry(model).num_layers - 1
        kv = teacher_forward_kv(model, ids, mask, key_space="post_rope", layers=[last])
        with torch.no_grad():
            cache = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                          use_cache=True).past_key_values
        assert kv.key_space == "post_rope" and kv.layer_ids == [last]
        assert torch.equal(kv.keys[0], cache.layers[last].keys), family
        assert torch.equal(kv.values[0], cache.layers[last].values), family
    for family in ("llama", "gpt2", "cohere"):
        student = load_student(family_dirs(family), dtype="float32", gradient_checkpointing=True)
        ref = teacher_forward_kv(teachers(family), ids, mask, key_space="post_rope", layers=[1])
        if family == "cohere":  # interleaved rotary: only the forward itself knows how to rotate
            with pytest.raises(KavaError) as e:
                student_forward_kv(student, ids, mask, layers=[1], key_space="post_rope")
            assert "\n" not in str(e.value) and "cohere" in str(e.value) and "pre_rope" in str(e.value)
            continue
        _, kv = student_forward_kv(student, ids, mask, layers=[1], key_space="post_rope")
        assert kv.keys.requires_grad and kv.key_space == "post_rope"
        _assert_close_real(kv.keys[0], ref.keys[0], mask, f"{family} post_rope under checkpointing")


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_teacher_forward_stops_at_the_deepest_served_layer(key_space, teachers):
    """Serving the first half of the layers runs only those: nothing deeper (no later attention, no final norm,
    no LM head) runs, and K/V equal the full forward's exactly, on every family (with padding)."""
    ids, mask = _batch("left")
    # post_rope serves only full-length cache layers: Gemma's first layers are sliding-window ones
    for family in sorted(f for f in FAMILIES if key_space == "pre_rope" or not f.startswith("gemma")):
        model = teachers(family)
        n = kv_geometry(model).num_layers
        served = list(range(max(1, n // 2)))
        attn = attention_layers(model)
        ran = []
        hooks = [m.register_forward_hook(lambda *_, i=i: ran.append(i)) for i, m in enumerate(attn)]
        hooks.append(model.get_output_embeddings().register_forward_hook(lambda *_: ran.append("lm_head")))
        try:
            full = teacher_forward_kv(model, ids, mask, layers=served, key_space=key_space, stop_early=False)
            assert ran == list(range(n)) + ["lm_head"] or ran == list(range(n)), (family, ran)
            ran.clear()
            early = teacher_forward_kv(model, ids, mask, layers=served, key_space=key_space)
            assert ran == served, (family, ran)
        finally:
            for h in hooks:
                h.remove()
        assert torch.equal(early.keys, full.keys) and torch.equal(early.values, full.values), family
        assert torch.equal(early.mask, full.mask) and early.layer_ids == full.layer_ids == served
