"""`kava-ray bench gpu`: proof on a GPU -- the production step, the teacher forward, memory against
the planner and the 8 GB preset, on the real Qwen2.5 geometries, by one command on any CUDA machine.

The models are built from the real configs with random weights (memory and speed depend on the
geometry, not on the values) and everything runs in this process. Nothing here imports Ray: a GPU
image may have none (`scripts/gpu_check.sh`). On a CPU it runs at toy sizes (the test suite runs it,
so it cannot rot); on CUDA the same code at real sizes. The sections (`SECTIONS`) and what each
measures: docs/internals/runtime.md#bench-gpu.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import transformers

from kava_ray.bench.gpu_students import url_teacher_section, vllm_student_section
from kava_ray.bench.step_setup import random_batch, sync_device, timed_mean
from kava_ray.common.config import JobConfig, derive, load_config, validate_config
from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_write, format_table, write_json
from kava_ray.core.known_models import KNOWN
from kava_ray.core.kv import KVBatch, teacher_forward_kv
from kava_ray.core.models import load_model
from kava_ray.core.plans import student_geometry, teacher_logits_top_k
from kava_ray.data import Batch
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.recipes.fit_maps import fit_on
from kava_ray.rollout.vllm_engine import vllm_available
from kava_ray.runtime.planner import plan
from kava_ray.testing.inprocess_source import in_process_plans
from kava_ray.testing.tiny import build_tiny_model

GIB = 1024 ** 3
SECTIONS = ("device", "correctness", "precision", "memory", "fits_8gb", "speed", "wire", "chunked_loss", "fsdp",
            "engines", "vllm_student", "lora", "url_teacher")
LORA = {"student.lora.r": 16, "student.lora.target_modules": "all-linear"}  # the lora section's
TOP_K = 64
# toy geometries (a CPU run checks that every section works, not what it measures; the CUDA
# correctness check uses them too); the real ones come from `known_models.QWEN25`
TOY = {"toy-student": dict(family="qwen2", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                           intermediate_size=128, vocab_size=512),
       "toy-teacher": dict(family="qwen2", num_layers=3, hidden_size=96, num_heads=4, num_kv_heads=2,
                           intermediate_size=192, vocab_size=512)}


def qwen_geometry(name: str) -> dict:
    """build_tiny_model kwargs of a real Qwen2.5 config ('qwen2.5-0.5b', ...) from `known_models`."""
    c = KNOWN[name]
    return dict(family="qwen2", num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
                tie_word_embeddings=c["tie_word_embeddings"])


def sizes(cuda: bool) -> dict:
    """What each section runs: real geometries on CUDA, toy ones on a CPU."""
    if cuda:
        return {"small": ("toy-student", "toy-teacher"),
                "teachers": ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
                "students": ["qwen2.5-0.5b", "qwen2.5-1.5b"],
                "points": [(4, 512), (8, 1024)], "matmul": 8192, "wire_tokens": (8, 1024), "reps": 3}
    # a toy run checks that each section works, not what it measures: one timed call after the warm-up
    return {"small": ("toy-student", "toy-teacher"), "teachers": ["toy-teacher"], "students": ["toy-student"],
            "points": [(2, 128)], "matmul": 1024, "wire_tokens": (2, 128), "reps": 1}


def not_run(reason: str) -> dict:
    return {"not_run": reason}


class Models:
    """Random-weight models of the bench's geometries, each saved once to a temporary dir (the
    production step loads its student from a directory, as `kava-ray train` does)."""
    def __init__(self, root: Path, device=None):
        self.root, self.dirs, self.device = root, {}, device

    def dir(self, name: str) -> Path:
        if name not in self.dirs:
            kwargs = dict(TOY[name]) if name in TOY else \
                {**qwen_geometry(name), "dtype": torch.bfloat16, "max_position_embeddings": 32768}
            self.dirs[name] = build_tiny_model(self.root / name, **kwargs, seed=len(self.dirs), device=self.device)
        return self.dirs[name]

    def vocab(self, name: str) -> int:
        return (TOY[name] if name in TOY else qwen_geometry(name))["vocab_size"]


def job(models: Models, student: str, teacher: str, batch: int, tokens: int, preset: Optional[str] = None,
        teacher_kw: Optional[dict] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """A one-teacher job on the bench's models: `preset`'s settings (default: the production defaults)."""
    t = {"name": "t", "model": str(models.dir(teacher)), "dtype": "bfloat16" if torch.cuda.is_available()
         else "float32", "quantization": "none", **(teacher_kw or {})}
    base = {"name": "bench-gpu", "teachers": [t], "student": {"model": str(models.dir(student))},
            "data": {"num_train": 8, "num_test": 4, "num_val": 4},
            "optim": {"warmup_steps": 0, "schedule": "constant", "accumulation": 1},
            "train": {"batch_size": batch, "max_length": tokens},
            "ray": {"storage_path": str(models.root / "runs"), "num_workers": 1}}
    if preset is None:
        return load_config(validate_config(base), overrides or [])
    p = load_config(preset).to_dict()
    keep = ["align", "fusion", "loss"]
    d = {**base, **{k: p[k] for k in keep}, "student": {**p["student"], "model": str(models.dir(student))},
         "optim": {**p["optim"], "warmup_steps": 0, "schedule": "constant", "accumulation": 1}}
    if d["student"]["precision"] == "bf16-sr" and importlib.util.find_spec("torchao") is None:
        d["student"]["precision"], d["optim"]["optimizer"] = "bf16-mixed", "adamw"  # and `note` says so
    return load_config(validate_config(d), overrides or [])


def teacher_model(cfg: JobConfig, device):
    """The job's teacher on `device` (bitsandbytes places a quantized one on the GPU while loading)."""
    t = cfg.teachers[0]
    model = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
    return model if t.quantization != "none" else model.to(device)


def teacher_kv(cfg: JobConfig, plans: dict, model, data: Batch, device):
    """The teacher's batch as a student worker receives it: forward, wire, decode on `device`."""
    dev = next(model.parameters()).device
    wire = teacher_forward_kv(model, data.input_ids.to(dev), data.attention_mask.to(dev),
                              layers=plans["t"].layers, key_space=cfg.align.key_space,
                              logits_top_k=teacher_logits_top_k(cfg.loss, plans)["t"])
    return {"t": KVBatch.from_wire(wire.to_wire(cfg.align.wire_dtype), device=device)}


def recipe_of(cfg: JobConfig, plans: dict, device, fit_batches: Optional[list] = None):
    """The production recipe on the bench's models; `fit_batches` [(batch, kv)]: what a student-side
    map (projector kind fit, `auto` for another geometry) is fitted on before step 1, as a Train
    worker fits it on its data."""
    recipe = DistillRecipe(cfg, plans, device=device)
    recipe.build_model()  # the bench feeds its own batches: no tokenizer, no `datasets`
    fit_on(recipe.distiller, fit_batches or [], cfg.align.key_space, device)
    return recipe


def _plans(cfg: JobConfig, model) -> dict:
    return in_process_plans(cfg, {"t": model})


def timed(fn: Callable, n: int, device) -> float:
    """Seconds per call: one warm-up call, then the mean of `n` (`bench.step`'s clock)."""
    fn()
    return timed_mean(fn, n, device)


# ------------------------------------------------------------------------------------------------ sections

def device_section(device) -> dict:
    out = {"type": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
           "bitsandbytes": importlib.util.find_spec("bitsandbytes") is not None,
           "torchao": importlib.util.find_spec("torchao") is not None, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out.update(name=p.name, memory_gib=p.total_memory / GIB, capability=f"{p.major}.{p.minor}",
                   bf16=torch.cuda.is_bf16_supported())
    return out


def correctness_section(models: Models, device, small: tuple) -> dict:
    """Teacher KV and top-k log-probs on CUDA in bf16 against the CPU in fp32, on the small geometry."""
    student, teacher = small
    data = random_batch(2, 64, models.vocab(teacher))
    cpu = load_model(str(models.dir(teacher)), dtype="float32")
    gpu = load_model(str(models.dir(teacher)), dtype="bfloat16").to(device)
    ref = teacher_forward_kv(cpu, data.input_ids, data.attention_mask, logits_top_k=8)
    got = teacher_forward_kv(gpu, data.input_ids.to(device), data.attention_mask.to(device),
                             logits_top_k=8).to("cpu", torch.float32)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    top1 = float((got.topk_ids.cpu()[..., 0] == ref.topk_ids[..., 0]).float().mean())
    out = {"keys_rel_err": rel(got.keys, ref.keys), "values_rel_err": rel(got.values, ref.values),
           "logp_top1_abs_err": float((got.topk_logp.cpu()[..., 0] - ref.topk_logp[..., 0]).abs().max()),
           "top1_id_agreement": top1, "tolerance": 0.02}
    out["ok"] = out["keys_rel_err"] < 0.02 and out["values_rel_err"] < 0.02 and top1 > 0.9
    return out


def precision_section(models: Models, device, small: tuple, steps: int = 3) -> dict:
    """The production step under each precision policy on one fixed batch: share of student weights
    that changed, loss before and after. fp32 master weights (fp32, bf16-mixed) change every element
    that gets an update; bf16-sr rounds each update stochastically, so small updates change a weight
    only sometimes."""
    student, teacher = small
    data = random_batch(2, 64, models.vocab(student))
    base = job(models, student, teacher, 2, 64, overrides=["optim.lr_student=1e-3"])
    t_model = load_model(base.teachers[0].model, dtype="float32").to(device)
    plans = _plans(base, t_model)
    kv = teacher_kv(base, plans, t_model, data, device)  # the teacher's batch does not depend on the policy
    t_model = None
    out = {}
    for policy in ("fp32", "bf16-mixed", "bf16-sr"):
        if policy == "bf16-sr" and importlib.util.find_spec("torchao") is None:
            out[policy] = not_run("torchao is not installed (pip install torchao)")
            continue
        recipe = recipe_of(load_config(base, [f"student.precision={policy}"]), plans, device, [(data, kv)])
        student_model = recipe.distiller.student
        embed = student_model.get_input_embeddings().weight
        # the input embedding's rows of tokens the batch lacks get no gradient: counted only when tied to the head
        params = [p for p in student_model.parameters() if p is not embed or student_model.config.tie_word_embeddings]
        before = [p.detach().clone() for p in params]
        losses = [float(recipe.step(i + 1, [(data, kv)])["loss"]) for i in range(steps)]
        changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
        total = sum(b.numel() for b in before)
        share = changed / total
        expected = 0.5 if policy == "bf16-sr" else 0.99
        out[policy] = {"changed_share": share, "expected_share": expected, "loss_first": losses[0],
                       "loss_last": losses[-1], "weight_dtype": str(before[0].dtype).replace("torch.", ""),
                       "ok": share >= expected and losses[-1] < losses[0]}
        recipe = None
    return out


def _peak(device, fn) -> tuple[int, int]:
    """(bytes allocated before, peak bytes allocated during `fn()`) on a CUDA device."""
    sync_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync_device(device)
    return before, torch.cuda.max_memory_allocated(device)


def _planned(cfg: JobConfig) -> dict:
    """The planner's items for the job on one GPU, grouped into the classes measured here."""
    items = {k: v for d in plan(cfg, gpu_mem_bytes=80 * GIB)["devices"].values() for k, v in d["items"].items()}
    t_weights = sum(v for k, v in items.items() if k.startswith("teacher:") and "weights" in k)
    t_forward = sum(v for k, v in items.items() if k.startswith("teacher:") and "weights" not in k)
    student = sum(v for k, v in items.items() if not k.startswith("teacher:") and "cuda runtime" not in k)
    return {"teacher weights": t_weights, "teacher forward": t_forward, "student step (all)": student}


def measure_job(cfg: JobConfig, device, steps: int = 2) -> dict:
    """Teacher weights, teacher forward peak and the student step's peak (CUDA bytes) of a one-teacher job."""
    data = random_batch(cfg.train.batch_size, cfg.train.max_length, cfg_vocab(cfg))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    model = teacher_model(cfg, device)
    t_weights = torch.cuda.memory_allocated(device) - base
    plans = _plans(cfg, model)
    box = {}
    before, peak = _peak(device, lambda: box.update(kv=teacher_kv(cfg, plans, model, data, device)))
    t_forward = peak - before
    kv = box["kv"]
    model = box = None  # free the teacher before the student step
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    box = {}
    _, peak = _peak(device, lambda: box.update(r=recipe_of(cfg, plans, device, [(data, kv)])))
    recipe = box["r"]
    for i in range(steps):
        torch.cuda.reset_peak_memory_stats(device)
        recipe.step(i + 1, [(data, kv)])
        sync_device(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device))
    measured = {"teacher weights": t_weights, "teacher forward": t_forward, "student step (all)": peak - start}
    del recipe
    torch.cuda.empty_cache()
    planned = _planned(cfg)
    return {k: {"measured_gib": measured[k] / GIB, "planned_gib": planned[k] / GIB,
                "error": planned[k] / max(measured[k], 1) - 1} for k in measured}


def cfg_vocab(cfg: JobConfig) -> int:
    return student_geometry(cfg.student).vocab_size


def _nf4() -> dict:
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"quantization": "none", "dtype": "bfloat16", "note": "bitsandbytes missing: a bf16 teacher"}
    return {"quantization": "4bit", "dtype": "bfloat16"}


def memory_section(models: Models, device) -> dict:
    nf4 = _nf4()
    out = {"single_gpu_8gb": measure_job(job(models, "qwen2.5-0.5b", "qwen2.5-1.5b", 2, 512, "single_gpu_8gb",
                                             {k: v for k, v in nf4.items() if k != "note"}), device),
           "qwen_multi student (1.5B, 7B teacher)": measure_job(
               job(models, "qwen2.5-1.5b", "qwen2.5-7b", 2, 512, "qwen_multi"), device)}
    if "note" in nf4:
        out["note"] = nf4["note"]
    return out


def fits_8gb_section(models: Models, device, steps: int = 3) -> dict:
    """The single_gpu_8gb job (batch 2 x 512, its precision and optimizer) with the process capped at 8 GiB."""
    nf4 = _nf4()
    total = torch.cuda.get_device_properties(device).total_memory
    index = device.index if device.index is not None else torch.cuda.current_device()  # the cap needs an index
    torch.cuda.set_per_process_memory_fraction(min(1.0, 8 * GIB / total), index)
    try:
        cfg = job(models, "qwen2.5-0.5b", "qwen2.5-1.5b", 2, 512, "single_gpu_8gb",
                  {k: v for k, v in nf4.items() if k != "note"})
        data = random_batch(2, 512, cfg_vocab(cfg))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        model = teacher_model(cfg, device)  # teacher and student share the card, as the preset plans
        plans = _plans(cfg, model)
        recipe = recipe_of(cfg, plans, device, [(data, teacher_kv(cfg, plans, model, data, device))])
        losses = []
        try:
            for i in range(steps):
                losses.append(float(recipe.step(i + 1, [(data, teacher_kv(cfg, plans, model, data, device))])["loss"]))
            ok, err = True, None
        except torch.OutOfMemoryError as e:
            ok, err = False, str(e).splitlines()[0]
        return {"teacher": nf4, "steps": len(losses), "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
                "cap_gib": 8.0, "fits": ok, "oom": err, "losses": losses}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
        torch.cuda.empty_cache()


def matmul_peak(device, n: int) -> float:
    """Measured FLOP/s of an n x n matmul in the compute dtype (bf16 on CUDA, fp32 on a CPU): the MFU base."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    s = timed(lambda: a @ b, 10 if device.type == "cuda" else 3, device)
    return 2 * n ** 3 / s


def flops_per_token(model, tokens: int) -> float:
    """Forward FLOPs per token: 2 x the matmul parameters (everything but the input embedding) plus
    attention (2 x 2 x layers x tokens x q_dim for QK^T and AV, causal halves it)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    if c.tie_word_embeddings:
        n += model.get_input_embeddings().weight.numel()  # the LM head's matmul reads the shared matrix
    q_dim = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    return 2 * n + 2 * c.num_hidden_layers * tokens * q_dim


def speed_section(models: Models, device, sz: dict) -> dict:
    """Tokens/s and MFU of the teacher forward (with KV capture and top-k logits; the capture's
    share against a plain forward) and of the production student step, at each (batch, tokens)
    point."""
    reps = sz["reps"]
    peak = matmul_peak(device, sz["matmul"])
    rows = []
    for name in sz["teachers"]:
        model = teacher_model(job(models, sz["students"][0], name, 1, 64), device)
        for b, t in sz["points"]:
            data = random_batch(b, t, models.vocab(name))
            ids, mask = data.input_ids.to(device), data.attention_mask.to(device)

            def plain():
                with torch.inference_mode():
                    model(input_ids=ids, attention_mask=mask)

            s_kv = timed(lambda: teacher_forward_kv(model, ids, mask, logits_top_k=TOP_K), reps, device)
            s_plain = timed(plain, reps, device)
            tps = b * t / s_kv
            rows.append({"what": "teacher forward + KV", "model": name, "batch": b, "tokens": t,
                         "tokens_per_s": tps, "capture_share": 1 - s_plain / s_kv,
                         "mfu": flops_per_token(model, t) * tps / peak})
        model = None
    for name in sz["students"]:
        for b, t in sz["points"]:
            cfg = job(models, name, sz["teachers"][0], b, t, overrides=["student.gradient_checkpointing=true"]
                      if device.type == "cuda" else [])
            t_model = teacher_model(cfg, device)
            plans = _plans(cfg, t_model)
            data = random_batch(b, t, min(models.vocab(name), models.vocab(sz["teachers"][0])))
            kv = teacher_kv(cfg, plans, t_model, data, device)
            del t_model
            recipe = recipe_of(cfg, plans, device, [(data, kv)])
            counter = iter(range(1, 10 ** 9))
            s = timed(lambda: recipe.step(next(counter), [(data, kv)]), reps, device)
            tps = b * t / s
            student = recipe.distiller.student
            ckpt = 4 if cfg.student.gradient_checkpointing else 3  # forward + backward (x2) (+ recompute)
            rows.append({"what": f"student step ({recipe.precision.policy})", "model": name, "batch": b,
                         "tokens": t, "tokens_per_s": tps, "capture_share": None,
                         "mfu": ckpt * flops_per_token(student, t) * tps / peak})
            recipe = None
    return {"matmul_peak_tflops": peak / 1e12, "rows": rows}


def wire_section(models: Models, device, sz: dict) -> dict:
    """Encode (device -> wire arrays) and decode (wire -> fp32 on the device) of one teacher batch."""
    reps = sz["reps"]
    name = sz["teachers"][-1] if device.type == "cuda" else sz["small"][1]
    b, t = sz["wire_tokens"]
    model = load_model(str(models.dir(name)), dtype="bfloat16" if device.type == "cuda" else "float32").to(device)
    data = random_batch(b, t, models.vocab(name))
    kv = teacher_forward_kv(model, data.input_ids.to(device), data.attention_mask.to(device),
                            logits_top_k=TOP_K)
    del model
    nbytes = (kv.keys.numel() + kv.values.numel()) * kv.keys.element_size()
    out = {"model": name, "batch": b, "tokens": t, "kv_mib": nbytes / 2 ** 20, "source_dtype": str(kv.keys.dtype)}
    for dtype in ("bf16", "fp8"):
        payload = kv.to_wire(dtype)
        enc = timed(lambda: kv.to_wire(dtype), reps, device)
        dec = timed(lambda: KVBatch.from_wire(payload, device=device), reps, device)
        out[dtype] = {"encode_gb_s": nbytes / enc / 1e9, "decode_gb_s": nbytes / dec / 1e9}
    return out


def chunked_loss_section(models: Models, device, sz: dict) -> dict:
    """The chunked vocabulary loss (`loss.vocab_chunk`) against whole logits on the smallest student
    (Qwen2.5's 152k-id vocabulary on CUDA), for CE and logit KD: the first step's loss of each (the
    same weights), the step time, and on CUDA the step's peak memory."""
    reps = sz["reps"]
    name, teacher = sz["students"][0], sz["teachers"][0]
    b, t = (4, 1024) if device.type == "cuda" else sz["points"][0]
    chunk = 512 if device.type == "cuda" else 64  # (toy sizes: still several chunks)
    rows = []
    for recipe_name, extra in (("ce", ["loss.kv_weight=0"]),
                               ("ce+logits", ["loss.kv_weight=0", "loss.logit_weight=1"])):
        got = {}
        for path, size in (("whole", 0), ("chunked", chunk)):
            cfg = job(models, name, teacher, b, t, overrides=[*extra, f"loss.vocab_chunk={size}"])
            t_model = teacher_model(cfg, device)
            plans = _plans(cfg, t_model)
            data = random_batch(b, t, min(models.vocab(name), models.vocab(teacher)))
            kv = teacher_kv(cfg, plans, t_model, data, device)
            del t_model
            recipe = recipe_of(cfg, plans, device, [(data, kv)])
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            loss = float(recipe.step(1, [(data, kv)])["loss"])
            sync_device(device)
            peak = torch.cuda.max_memory_allocated(device) - start if device.type == "cuda" else None
            counter = iter(range(2, 10 ** 9))
            got[path] = {"loss": loss, "peak_gib": None if peak is None else peak / GIB,
                         "step_s": timed(lambda: recipe.step(next(counter), [(data, kv)]), reps, device)}
            recipe = kv = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        w, c = got["whole"], got["chunked"]
        rows.append({"recipe": recipe_name, "model": name, "batch": b, "tokens": t, "chunk": chunk,
                     "whole": w, "chunked": c,
                     "loss_rel_diff": abs(c["loss"] - w["loss"]) / max(abs(w["loss"]), 1e-12),
                     "time_ratio": c["step_s"] / w["step_s"],
                     "memory_ratio": None if w["peak_gib"] is None else c["peak_gib"] / w["peak_gib"]})
    return {"rows": rows}


def _fsdp_rank(rank: int, world: int, cfg_yaml: str, steps: int, out: str) -> None:
    """One rank of `fsdp_section` (a spawned process): the production recipe sharded with FSDP2 over NCCL."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    cfg = load_config(cfg_yaml)
    t_model = teacher_model(cfg, device)
    plans = _plans(cfg, t_model)
    data = random_batch(cfg.train.batch_size, cfg.train.max_length, student_geometry(cfg.student).vocab_size)
    kv = teacher_kv(cfg, plans, t_model, data, device)
    del t_model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    recipe = DistillRecipe(cfg, plans, rank, world, device)
    recipe.build_model()
    losses = [float(recipe.step(i + 1, [(data, kv)])["loss"]) for i in range(steps)]
    peak = torch.cuda.max_memory_allocated(device) / GIB
    write_json(Path(out) / f"rank{rank}.json", {"losses": losses, "peak_gib": peak})
    dist.destroy_process_group()


def fsdp_section(models: Models, device, sz: dict, steps: int = 3) -> dict:
    """`ray.strategy: fsdp` without Ray: the smallest student's production step sharded over 2 GPUs
    (NCCL) beside the same step on one GPU unsharded: each rank's peak memory and the losses of
    both."""
    import torch.multiprocessing as mp

    n = torch.cuda.device_count() if device.type == "cuda" else 0
    if n < 2:
        return not_run(f"needs 2 CUDA devices or more (this machine has {n})")
    name, teacher = sz["students"][0], sz["teachers"][0]
    one = job(models, name, teacher, 2, 512)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(load_config(one, ["ray.strategy=fsdp", "ray.num_workers=2"]).to_yaml())
        mp.spawn(_fsdp_rank, args=(2, str(path), steps, tmp), nprocs=2)
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    t_model = teacher_model(one, device)
    plans = _plans(one, t_model)
    data = random_batch(2, 512, cfg_vocab(one))
    kv = teacher_kv(one, plans, t_model, data, device)
    del t_model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    recipe = recipe_of(one, plans, device, [(data, kv)])
    whole = [float(recipe.step(i + 1, [(data, kv)])["loss"]) for i in range(steps)]
    return {"model": name, "ranks": ranks, "unsharded": {"losses": whole,
                                                         "peak_gib": torch.cuda.max_memory_allocated(device) / GIB},
            "max_loss_rel_diff": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ranks[0]["losses"], whole))}


def engines_section(models: Models, device, sz: dict) -> dict:
    """`onpolicy.engine` and `teachers[].engine`, hf against vllm on the smallest student's real
    geometry in bf16: sampled tokens/s (8 prompts of 128 tokens, 256 new) and a logits-only
    teacher's scored positions/s (8 x 1024, top-64) (`bench.engines`). On a CPU `kava-ray bench
    onpolicy --engine hf vllm` measures the same at toy size."""
    from kava_ray.rollout.vllm_engine import vllm_available

    if device.type != "cuda":
        return not_run("CUDA only here; on a CPU: kava-ray bench onpolicy --engine hf vllm")
    if not vllm_available():
        return not_run("vLLM is not installed here (pip install 'kava-ray[vllm]')")
    from kava_ray.bench.engines import sampling_rates, scoring_rates

    name = sz["students"][0]
    d = models.dir(name)
    return {"model": name, "sampling": sampling_rates(d, 8, 128, 256, dtype="bfloat16"),
            "scoring": scoring_rates(d, 8, 1024, TOP_K, dtype="bfloat16")}


def _step_arm(cfg, device, steps: int) -> dict:
    """One arm of `lora_section`: the student step's peak CUDA bytes over its start and s/step."""
    data = random_batch(cfg.train.batch_size, cfg.train.max_length, cfg_vocab(cfg))
    model = teacher_model(cfg, device)
    plans = _plans(cfg, model)
    kv = teacher_kv(cfg, plans, model, data, device)
    model = None
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    recipe = recipe_of(cfg, plans, device, [(data, kv)])
    step_s = timed(lambda: recipe.step(1, [(data, kv)]), steps, device)
    sync_device(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    recipe = None  # (freed before the next arm)
    torch.cuda.empty_cache()
    return {"step_s": step_s, "peak_gib": peak / GIB, "planned_gib": _planned(cfg)["student step (all)"] / GIB}


def lora_section(base_cfg, device, steps: int = 3) -> dict:
    """`student.lora` (r 16, every Linear but the head) against the full student of the same job: the step's peak
    memory beside the plan and s/step, side by side in one process."""
    full = _step_arm(base_cfg, device, steps)
    lora = _step_arm(derive(base_cfg, LORA), device, steps)
    return {"full": full, "lora": lora, "memory_ratio": lora["peak_gib"] / full["peak_gib"],
            "time_ratio": lora["step_s"] / full["step_s"], "settings": LORA}


def _section(fn: Callable, *args) -> dict:
    """One section's result; a section that fails is reported (its error's first line) and the
    others still run: on a machine nobody has tried, a partial table is worth more than a
    traceback."""
    try:
        return fn(*args)
    except torch.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    except Exception as e:  # noqa: BLE001 -- reported in the table and the JSON, with where it was raised
        where = traceback.extract_tb(e.__traceback__)[-1]
        return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]} "
                         f"(at {Path(where.filename).name}:{where.lineno})"}


def run_gpu_bench(out: Optional[str] = None, toy: Optional[bool] = None, steps: int = 3,
                  sections: Optional[list[str]] = None) -> dict:
    """Every section (see the module docstring), or those named in `sections`; real geometries on
    CUDA unless `toy`. With `out`, the JSON is rewritten after each section (a run cut short by a
    time limit keeps what it measured) and each section's end is one line on stderr."""
    if steps < 1:
        raise KavaError(f"bench gpu: steps must be >= 1, got {steps}")
    unknown = sorted(set(sections or ()) - set(SECTIONS[1:]))
    if unknown:
        raise KavaError(f"bench gpu: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS[1:])}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sz = sizes(cuda and not toy)
    no_cuda = "needs a CUDA device (torch.cuda.is_available() is False)"
    real = cuda and not toy
    reason = no_cuda if not cuda else "--toy: real geometries only"
    path = Path(out).expanduser() if out else None
    t0 = time.time()
    result = {"device": device_section(device), "sizes": {k: v for k, v in sz.items()}}

    def record(name: str, run: Callable[[], dict]) -> None:
        result[name] = run() if sections is None or name in sections else not_run("not selected (--sections)")
        if path is not None:
            path.mkdir(parents=True, exist_ok=True)
            write_json(path / "bench_gpu.json", {**result, "wall_s": time.time() - t0})
            print(f"bench gpu: {name} at {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="kava-bench-gpu-") as tmp:
        models = Models(Path(tmp), device if cuda else None)  # random weights drawn on the GPU: seconds for a 7B
        record("correctness", lambda: _section(correctness_section, models, device, sz["small"]) if cuda
               else not_run(no_cuda))
        record("precision", lambda: _section(precision_section, models, device, sz["small"], steps))
        record("memory", lambda: _section(memory_section, models, device) if real
               else not_run(reason + " (torch.cuda.max_memory_allocated)"))
        record("fits_8gb", lambda: _section(fits_8gb_section, models, device, steps) if real
               else not_run(reason + " (torch.cuda.set_per_process_memory_fraction)"))
        record("speed", lambda: _section(speed_section, models, device, sz))
        record("wire", lambda: _section(wire_section, models, device, sz))
        record("chunked_loss", lambda: _section(chunked_loss_section, models, device, sz))
        record("fsdp", lambda: _section(fsdp_section, models, device, sz))
        record("engines", lambda: _section(engines_section, models, device, sz))
        vllm = cuda and vllm_available()
        no_vllm = no_cuda if not cuda else "vLLM is not installed here (pip install 'kava-ray[vllm]')"
        record("vllm_student", lambda: _section(vllm_student_section, models.dir(sz["students"][0]), device) if vllm
               else not_run(no_vllm + "; on a CPU: tests/test_vllm.py checks the engine's dtype"))
        record("lora", lambda: _section(lora_section, job(models, sz["students"][-1], sz["teachers"][0], 4, 512,
                                                          "qwen_multi"), device, steps) if real
               else not_run(reason + " (torch.cuda.max_memory_allocated); on a CPU: kava-ray bench step --memory"))
        record("url_teacher", lambda: _section(url_teacher_section, models.dir(sz["students"][0])) if vllm
               else not_run(no_vllm + "; on a CPU: scripts/teacher_scoring_rates.py"))
    result["wall_s"] = time.time() - t0
    if path is not None:
        write_json(path / "bench_gpu.json", result)
        atomic_write(path / "bench_gpu.md", format_gpu(result) + "\n")
    return result


def _f(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_gpu(r: dict) -> str:
    d = r["device"]
    lines = [f"device: {d.get('name', d['type'])} (torch {d['torch']}, transformers {d['transformers']}, "
             f"bitsandbytes {'yes' if d['bitsandbytes'] else 'no'}, torchao {'yes' if d['torchao'] else 'no'})"]
    for name in SECTIONS[1:]:
        s = r[name]
        if "not_run" in s or "error" in s:
            lines.append(f"{name}: not run: {s['not_run']}" if "not_run" in s else f"{name}: {s['error']}")
            continue
        if name == "correctness":
            lines.append(f"correctness: CUDA bf16 vs CPU fp32 teacher: K rel err {s['keys_rel_err']:.4f}, "
                         f"V {s['values_rel_err']:.4f}, top-1 id agreement {100 * s['top1_id_agreement']:.1f} % "
                         f"-> {'ok' if s['ok'] else 'FAILED'}")
        elif name == "precision":
            rows = [[p, "not run: " + v["not_run"], "", "", ""] if "not_run" in v else
                    [p, v["weight_dtype"], f"{100 * v['changed_share']:.1f} % (>= {100 * v['expected_share']:.0f})",
                     f"{v['loss_first']:.3f} -> {v['loss_last']:.3f}", "ok" if v["ok"] else "FAILED"]
                    for p, v in s.items()]
            lines.append(format_table(["precision", "weights", "changed", "loss", ""], rows))
        elif name == "memory":
            rows = [[job_name, k, _f(v["measured_gib"]), _f(v["planned_gib"]), f"{100 * v['error']:+.0f} %"]
                    for job_name, items in s.items() if isinstance(items, dict) for k, v in items.items()]
            lines.append(format_table(["memory (GiB)", "item", "measured", "planned", "plan error"], rows))
        elif name == "fits_8gb":
            lines.append(f"fits_8gb: single_gpu_8gb under an 8 GiB cap: {s['steps']} steps, peak "
                         f"{s['peak_gib']:.2f} GiB -> {'fits' if s['fits'] else 'OUT OF MEMORY: ' + str(s['oom'])}")
        elif name == "speed":
            rows = [[x["what"], x["model"], f"{x['batch']} x {x['tokens']}", f"{x['tokens_per_s']:,.0f}",
                     "-" if x["capture_share"] is None else f"{100 * x['capture_share']:.0f} %",
                     f"{100 * x['mfu']:.1f} %"] for x in s["rows"]]
            lines.append(format_table(["speed", "model", "batch", "tokens/s", "KV capture", "MFU"], rows)
                         + f"\nMFU: of the measured matmul peak, {s['matmul_peak_tflops']:.3g} TFLOP/s")
        elif name == "wire":
            lines.append(f"wire ({s['model']}, {s['batch']} x {s['tokens']}, {s['kv_mib']:.3g} MiB of K+V): "
                         + ", ".join(f"{w} encode {s[w]['encode_gb_s']:.2f} GB/s, decode {s[w]['decode_gb_s']:.2f} GB/s"
                                     for w in ("bf16", "fp8")))
        elif name == "chunked_loss":
            rows = [[x["recipe"], x["model"], f"{x['batch']} x {x['tokens']}", f"{x['loss_rel_diff']:.1e}",
                     f"{x['time_ratio']:.2f}", "-" if x["memory_ratio"] is None else
                     f"{x['chunked']['peak_gib']:.2f} / {x['whole']['peak_gib']:.2f} = {x['memory_ratio']:.2f}"]
                    for x in s["rows"]]
            lines.append(format_table(["chunked loss", "model", "batch", "loss rel diff", "time ratio",
                                       "peak GiB chunked / whole"], rows))
        elif name == "engines":
            a, b = s["sampling"], s["scoring"]
            lines.append(f"engines ({s['model']}): sampled tokens/s hf {a['hf']:,.0f}, vllm {a['vllm']:,.0f} "
                         f"({a['vllm'] / a['hf']:.2f}x; {a['batch']} prompts x {a['new_tokens']} new tokens); "
                         f"teacher positions/s hf {b['hf']:,.0f}, vllm {b['vllm']:,.0f} ({b['vllm'] / b['hf']:.2f}x; "
                         f"{b['batch']} x {b['length']}, top-{b['k']})")
        elif name == "fsdp":
            lines.append(f"fsdp ({s['model']}, 2 GPUs): peak per rank " +
                         ", ".join(f"{x['peak_gib']:.2f}" for x in s["ranks"]) +
                         f" GiB vs {s['unsharded']['peak_gib']:.2f} unsharded; losses rel diff "
                         f"{s['max_loss_rel_diff']:.1e}")
        elif name == "vllm_student":
            lines.append(f"vllm_student: engine {s['engine_dtype']} (master {s['master_dtype']}), max |q - pi_S| "
                         f"{s['max_abs_q_minus_pi_s']:.3g}; a level-2 sleep frees {s['sleep_frees_gib']:.2f} GiB; "
                         f"same samples after it: {s['same_samples_after_sleep']}")
        elif name == "lora":
            f, lo = s["full"], s["lora"]
            lines.append(f"lora (r 16, all-linear): peak {lo['peak_gib']:.2f} GiB (plan {lo['planned_gib']:.2f}) vs "
                         f"full {f['peak_gib']:.2f} (plan {f['planned_gib']:.2f}) = {s['memory_ratio']:.2f}x; "
                         f"{lo['step_s']:.3f} vs {f['step_s']:.3f} s/step = {s['time_ratio']:.2f}x")
        elif name == "url_teacher":
            p = s["positions_per_s"]
            lines.append(f"url_teacher ({s['rows']} x {s['length']}, top-{s['k']}): {p['url']:,.0f} positions/s "
                         f"through the server vs {p['in_process']:,.0f} in process ({s['ratio']:.2f}x); max |d "
                         f"log-prob| {s['max_abs_logp_diff']:.2g}, same top-k ids: {s['same_topk_ids']}")
    lines.append(f"wall: {r['wall_s']:.0f} s")
    return "\n".join(lines)
