"""A tiny Qwen2 model written as a .gguf file: exercises the GGUF load path without downloads."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from kava_ray.testing.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer


def write_tiny_gguf(hf_dir, gguf_path, quantize: bool = True) -> Path:
    """Write a tiny Qwen2 HF dir (from build_tiny_model) as a .gguf file, Q8_0 where possible:
    exercises the GGUF load path (de-quantization, tokenizer from GGUF metadata) in ~1 s."""
    import gguf  # optional (the dev and demo extras)

    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg["model_type"] != "qwen2":
        raise ValueError("write_tiny_gguf supports qwen2 (llama GGUF permutes q/k weights)")
    w = gguf.GGUFWriter(str(gguf_path), "qwen2")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    tok = build_tokenizer()
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_scores([0.0] * len(tokens))  # no merges: transformers derives (none) from scores
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg["num_hidden_layers"])
    for key, t in load_file(hf_dir / "model.safetensors").items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        arr = t.float().numpy()
        if quantize and arr.ndim == 2 and arr.shape[-1] % 32 == 0:
            w.add_tensor(name, gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_path
