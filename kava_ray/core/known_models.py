"""Configs of well-known models (Qwen2.5; base and -Instruct share one config), the values of their
published `config.json`, so geometry and sizes are known without a download. `model_geometry`
answers from this table first, else from `core.models.load_model_config` (a local dir, a .gguf, or a
cached hub id).
"""

from __future__ import annotations

from typing import Optional

from kava_ray.common.errors import KavaError
from kava_ray.core.models import KVGeometry, kv_geometry, load_model_config

_QWEN25_COMMON = dict(model_type="qwen2", rope_theta=1000000.0, attention_bias=True)

# name (lower case, no org, no "-instruct") -> config.json values
QWEN25 = {
    "qwen2.5-0.5b": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(num_hidden_layers=36, hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(num_hidden_layers=48, hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                        num_key_value_heads=8, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(num_hidden_layers=64, hidden_size=5120, intermediate_size=27648, num_attention_heads=40,
                        num_key_value_heads=8, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": dict(num_hidden_layers=80, hidden_size=8192, intermediate_size=29568, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
}
KNOWN = {name: {**_QWEN25_COMMON, **cfg} for name, cfg in QWEN25.items()}


def _key(spec) -> Optional[str]:
    """'Qwen/Qwen2.5-1.5B-Instruct' -> 'qwen2.5-1.5b'; None for paths and other orgs."""
    s = str(spec).strip()
    org, _, name = s.rpartition("/")
    if org and org.lower() != "qwen":
        return None
    name = name.lower().removesuffix("-instruct")
    return name if name in KNOWN else None


def known_config(spec) -> dict | None:
    """The table's config.json values for `spec` (a copy), or None when the model is not in the table."""
    key = _key(spec)
    return dict(KNOWN[key]) if key else None


def _geometry_from_table(c: dict, n_layers: int) -> KVGeometry:
    return KVGeometry(
        num_layers=n_layers, num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
        num_attention_heads=c["num_attention_heads"], hidden_size=c["hidden_size"], vocab_size=c["vocab_size"],
        rope_theta=c["rope_theta"], model_type=c["model_type"])


def model_geometry(spec, keep_layers=None) -> KVGeometry:
    """KV geometry of `spec` (table first, else its config via load_model_config); keep_layers drops layers."""
    c = known_config(spec)
    if c is None:
        return kv_geometry(load_model_config(spec, keep=keep_layers))
    n = c["num_hidden_layers"]
    if keep_layers:
        if max(keep_layers) >= n or min(keep_layers) < 0:
            raise KavaError(f"student.keep_layers {list(keep_layers)}: need layer indices in [0, {n - 1}]")
        n = len(keep_layers)
    return _geometry_from_table(c, n)


def param_breakdown(c: dict, n_layers: Optional[int] = None) -> dict[str, int]:
    """Parameters of a Qwen2/Llama-style decoder from its config values, by kind: embed
    (vocab*hidden), lm_head (vocab*hidden when untied, else 0), linear (Linear weights + the q/k/v
    biases when attention_bias), other (RMSNorm weights: 2 per layer + the final norm)."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim = c["num_attention_heads"] * c["head_dim"]
    kv_dim = c["num_key_value_heads"] * c["head_dim"]
    bias = c.get("attention_bias", False)
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h + (q_dim + 2 * kv_dim if bias else 0)
    mlp = 3 * h * i
    n = c["num_hidden_layers"] if n_layers is None else n_layers
    return dict(embed=v * h, lm_head=0 if c["tie_word_embeddings"] else v * h, linear=n * (attn + mlp),
                other=n * 2 * h + h)


def param_count(spec, keep_layers=None) -> int:
    """Total parameters of a table model (e.g. Qwen2.5-0.5B: 494M); KavaError for models not in the table."""
    c = known_config(spec)
    if c is None:
        raise KavaError(f"model '{spec}' is not in the known-models table (Qwen2.5 0.5B..72B)")
    n = len(keep_layers) if keep_layers else None
    return sum(param_breakdown(c, n).values())
