"""`kava-ray bench gpu`'s sections for what only a GPU decides about the students and teachers users bring
(issue 66): the student's vLLM engine (its dtype, q against pi_S, level-2 sleep) and a teacher behind a URL against
the same model in process (positions/s); `bench.gpu.lora_section` has the LoRA student. CUDA only.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from kava_ray.bench.engines import serve_openai

GIB = 1024 ** 3


def vllm_student_section(student_dir: Path, device) -> dict:
    """The student's engine as `onpolicy.engine: vllm` builds it under bf16-mixed: fp32 master weights, the engine
    in bf16 (`engine_for`); the largest |q - pi_S| over 8 x 64 sampled tokens (pi_S from the student's bf16 autocast
    forward); the GPU memory a level-2 sleep frees; the same samples after a sleep (the weights pushed again)."""
    from kava_ray.core.kv import next_token_logprobs
    from kava_ray.core.models import load_student
    from kava_ray.rollout.engines import VLLMGenerate
    from kava_ray.rollout.vllm_engine import VLLMEngine

    student = load_student(str(student_dir), dtype="float32").to(device)
    engine = VLLMEngine.for_model(student, dtype="bfloat16", max_model_len=256, max_num_seqs=8, sleep_mode=True,
                                  gpu_memory_utilization=0.3)
    gen = VLLMGenerate(student, None, engine)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, student.config.vocab_size, (8, 128), generator=g).tolist()
    try:
        first = gen.complete(prompts, 64, 1.0, 1.0, seed=1)  # push, sample, sleep
        asleep = torch.cuda.mem_get_info(device)[0]
        engine._wake()
        awake = torch.cuda.mem_get_info(device)[0]
        engine.sleep()
        again = gen.complete(prompts, 64, 1.0, 1.0, seed=1)  # the dropped weights pushed again first
        gap = 0.0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for p, ids, lp in zip(prompts, first.ids, first.logp):
                seq = torch.tensor([p + ids], device=device)
                own = next_token_logprobs(student(input_ids=seq).logits.float(), seq)[0, len(p) - 1:len(seq[0]) - 1]
                gap = max(gap, float((own.cpu() - torch.tensor(lp)).abs().max()))
        return {"engine_dtype": str(engine.llm.llm_engine.model_config.dtype), "master_dtype": "torch.float32",
                "max_abs_q_minus_pi_s": gap, "sleep_frees_gib": (asleep - awake) / GIB,
                "same_samples_after_sleep": first.ids == again.ids, "pushes": engine.pushes}
    finally:
        gen.close()


def url_teacher_section(model_dir: Path, reps: int = 3) -> dict:
    """A logits-only teacher's positions/s: the model in process (`VLLMEngine`) against the same model behind a vLLM
    OpenAI server on this machine (`teachers[].engine: openai`), 8 rows x 1024 tokens, top-64, bf16; and the
    largest difference of their log-probs."""
    from kava_ray.core.prompt_logprobs import topk_batch
    from kava_ray.rollout.openai_server import OpenAIServer
    from kava_ray.rollout.vllm_engine import VLLMEngine

    k, rows, length = 64, 8, 1024
    g = torch.Generator().manual_seed(0)
    engine = VLLMEngine(str(model_dir), dtype="bfloat16", max_model_len=length + 1, max_num_seqs=rows,
                        max_logprobs=k, gpu_memory_utilization=0.3)
    vocab = engine.llm.llm_engine.model_config.get_vocab_size()
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    proc, url = serve_openai(str(model_dir), "bfloat16", length + 1, k, rows, Path(model_dir).parent / "serve.log",
                             gpu_memory_utilization=0.3)
    rates, out = {}, {}
    try:
        for name, src in (("in_process", engine), ("url", OpenAIServer(url, str(model_dir), "t"))):
            topk_batch(src, ids, mask, k, "pre_rope", 1, rows)  # warm
            t0 = time.perf_counter()
            for _ in range(reps):
                out[name] = topk_batch(src, ids, mask, k, "pre_rope", 1, rows)
            rates[name] = reps * rows * length / (time.perf_counter() - t0)
    finally:
        engine.close()
        os.killpg(proc.pid, signal.SIGTERM)  # (the server and its engine core)
        proc.wait(timeout=60)
    a, b = out["in_process"], out["url"]
    return {"positions_per_s": rates, "ratio": rates["url"] / rates["in_process"],
            "max_abs_logp_diff": float((a.topk_logp - b.topk_logp).abs().max()),
            "same_topk_ids": bool(torch.equal(a.topk_ids, b.topk_ids)), "rows": rows, "length": length, "k": k}
