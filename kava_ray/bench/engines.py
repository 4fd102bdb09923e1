"""The two engines side by side on one model directory, no Ray: sampled tokens per second (Hugging
Face `generate` against a vLLM engine) and a logits-only teacher's scored positions per second
(`teacher_forward_kv` with no layers against `core.prompt_logprobs.topk_batch`). `bench onpolicy
--engine hf vllm` reports the scoring figure beside its on-policy steps (CPU); `bench gpu`'s
`engines` section both, at real sizes on CUDA.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from kava_ray.bench.step_setup import timed_mean
from kava_ray.core.kv import teacher_forward_kv
from kava_ray.core.models import load_model
from kava_ray.core.sampling import sample


def _rate(fn, units, reps: int) -> float:
    """`units(fn())` per second: one warm-up call counts the units (seeded: every call returns the
    same), then the mean of `reps` timed calls (`harness.timed_mean`, the device synchronised)."""
    n = units(fn())
    return n / timed_mean(fn, reps, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def scoring_rates(model_dir: Path, batch: int, length: int, k: int, dtype: str = "float32", reps: int = 3) -> dict:
    """Positions per second a logits-only teacher scores, each engine's actor forward on the same
    `batch` random sequences of `length` tokens (top-k, tail and token log-probs): {hf, vllm, batch,
    length, k}."""
    from kava_ray.core.prompt_logprobs import topk_batch
    from kava_ray.rollout.vllm_engine import VLLMEngine

    model = load_model(str(model_dir), dtype=dtype, device_map={"": 0} if torch.cuda.is_available() else None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    positions = lambda _: batch * length  # noqa: E731
    out = {"hf": _rate(lambda: teacher_forward_kv(model, ids, mask, layers=[], logits_top_k=k, token_logprobs=True),
                       positions, reps)}
    model = None  # (freed before the engine loads)
    engine = VLLMEngine(str(model_dir), dtype=dtype, max_model_len=length + 1, max_num_seqs=batch, max_logprobs=k)
    try:
        out["vllm"] = _rate(lambda: topk_batch(engine, ids, mask, k, "pre_rope", 1, 1), positions, reps)
    finally:
        engine.close()
    return out | {"batch": batch, "length": length, "k": k}


def sampling_rates(model_dir: Path, batch: int, prompt: int, new_tokens: int, dtype: str = "float32",
                   reps: int = 2) -> dict:
    """Sampled tokens per second of `batch` random prompts of `prompt` tokens, up to `new_tokens`
    each (no EOS id passed; the tokens counted are those returned), `core.sampling.sample` against
    `VLLMEngine.sample`: {hf, vllm, batch, prompt, new_tokens}."""
    from kava_ray.rollout.vllm_engine import VLLMEngine

    model = load_model(str(model_dir), dtype=dtype, device_map={"": 0} if torch.cuda.is_available() else None)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, model.config.vocab_size, (batch, prompt), generator=g).tolist()
    out = {"hf": _rate(lambda: sample(model, prompts, new_tokens, eos_ids=[]), lambda s: s.tokens, reps)}
    model = None  # (freed before the engine loads)
    engine = VLLMEngine(str(model_dir), dtype=dtype, max_model_len=prompt + new_tokens, max_num_seqs=batch)
    try:
        out["vllm"] = _rate(lambda: engine.sample(prompts, new_tokens, eos_ids=[]), lambda s: s.tokens, reps)
    finally:
        engine.close()
    return out | {"batch": batch, "prompt": prompt, "new_tokens": new_tokens}


def serve_openai(model_dir: str, dtype: str, max_model_len: int, max_logprobs: int, max_num_seqs: int, log,
                 gpu_memory_utilization: float = 0.3, ready_s: float = 600) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI-compatible server over `model_dir` on a free port of 127.0.0.1 (`python -m
    vllm.entrypoints.openai.api_server`: the `vllm` CLI does not start under the CPU build), its
    output in `log`; (the process, its URL) once `/v1/models` answers. It leads its own process
    group: stop it with `os.killpg(proc.pid, signal.SIGTERM)` (its engine core is a child)."""
    import requests

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
           "--host", "127.0.0.1", "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-logprobs", str(max_logprobs), "--max-num-seqs", str(max_num_seqs)]
    cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)] if torch.cuda.is_available() else \
        ["--enforce-eager"]
    with open(log, "w") as out:  # (the server keeps its own descriptor)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while time.time() - t0 < ready_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} (its output: {log})")
        try:
            if requests.get(url + "/v1/models", timeout=2).ok:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(1)
    os.killpg(proc.pid, 15)
    raise RuntimeError(f"the vLLM server did not answer within {ready_s:.0f} s (its output: {log})")
