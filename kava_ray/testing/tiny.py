"""Tiny random causal LMs and one shared byte-level tokenizer, built offline (tests, benches, docs).

Every tiny model uses the same tokenizer (same vocab, same ids), so a student and its
teachers can share tokenization. Nothing here touches the network.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """Byte-level tokenizer: 256 byte tokens + 4 specials = 260 ids; encodes any text, no merges."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    out_dir,
    family: str = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
    seed: int = 0,
    tokenizer=None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    dtype=None,
    device=None,
) -> Path:
    """Build a random tiny `family` ("qwen2" | "llama") causal LM + a tokenizer in `out_dir`; returns out_dir.

    tokenizer: the HF tokenizer to build around (vocab_size defaults to its length; its pad/eos/bos
    ids; saved beside), default the shared byte tokenizer. dtype: of the saved weights (default
    float32; bench gpu: bf16). device: where the random weights are drawn (bench gpu: CUDA, where a
    7B model's init takes seconds, not minutes).
    """
    tok = build_tokenizer() if tokenizer is None else tokenizer
    vocab_size = vocab_size or len(tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None if tokenizer is None else tok.bos_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    if family == "qwen2":
        if head_dim is not None and head_dim != hidden_size // num_heads:
            raise ValueError("Qwen2 derives head_dim from hidden_size // num_heads; use family='llama'")
        config = Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "llama":
        config = LlamaConfig(
            **common,
            head_dim=head_dim or hidden_size // num_heads,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        )
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
