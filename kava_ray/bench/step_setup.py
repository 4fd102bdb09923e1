"""What the step benches share: their base job, a random batch, the device clock, and a KV variant's
step function (a production `DistillRecipe` stepping on the bench's batch, the teacher's KV computed
beforehand).

`bench step` (`bench.step`), its chunked-loss part (`bench.chunked_loss`) and `bench gpu` use it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from kava_ray.common.config import JobConfig, validate_config
from kava_ray.core.align.vocab import VocabMap
from kava_ray.core.kv import KVBatch, teacher_forward_kv
from kava_ray.core.plans import teacher_logits_top_k
from kava_ray.data import Batch, TeacherInputs
from kava_ray.recipes.distill import DistillRecipe
from kava_ray.recipes.fit_maps import fit_on
from kava_ray.testing.inprocess_source import in_process_plans

CROSS_COVERAGE = 0.8  # the share of the student's ids the teacher of another vocabulary reaches (`_cross_vocab`)


def bench_job(t_dir: Path, s_dir: Path, storage: Path, batch: int, tokens: int) -> JobConfig:
    """The bench's base job: production defaults (structured mode, projector kind auto: fit for this
    student, of the teacher's KV geometry but trained apart from it; Mercator + CE, AdamW)."""
    return validate_config({
        "name": "bench-step",
        "teachers": [{"name": "t", "model": str(t_dir), "dtype": "float32"}],
        "student": {"model": str(s_dir)},
        "data": {"num_train": 8, "num_test": 4, "num_val": 4},
        "optim": {"warmup_steps": 0, "schedule": "constant"},
        # the recipe loads the synthetic split (its setup needs one) at a length its prompts fit, so
        # rows carry loss tokens; the step itself is timed on random batches of `tokens`
        # (`random_batch`)
        "train": {"batch_size": batch, "max_length": max(tokens, 256)},
        "ray": {"storage_path": str(storage), "num_workers": 1},
    })


def _cross_vocab(plans: dict, data: Batch, s_vocab: int):
    """The bench's teacher of another vocabulary: its plan marked aligned, the batch with a
    one-to-one alignment and pairing (`batch.teachers["t"]`), and a vocabulary map reaching
    CROSS_COVERAGE of the student's ids from random teacher ids (the cost of the loss depends on the
    sizes, not on which ids)."""
    plan = plans["t"]
    plans = {"t": dataclasses.replace(plan, tokenizer="(bench: another tokenizer)", tokenizer_fingerprint=None)}
    B, T = data.input_ids.shape
    pos = torch.arange(T).expand(B, T)
    one_to_one = TeacherInputs(data.input_ids, data.attention_mask, align_lo=pos, align_hi=pos + 1, logit_pair=pos)
    batch = dataclasses.replace(data, teachers={"t": one_to_one})
    rng = np.random.default_rng(0)
    v_t = int(plan.geometry.vocab_size)
    t2s = np.full(v_t, -1, dtype=np.int64)
    hit = rng.choice(v_t, int(CROSS_COVERAGE * s_vocab), replace=False)
    t2s[hit] = rng.permutation(s_vocab)[:len(hit)]
    return plans, batch, {"t": VocabMap(t2s, s_vocab)}


def random_batch(batch: int, tokens: int, vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, tokens), generator=g)
    mask = torch.ones_like(ids)
    return Batch(ids, mask, labels=ids.clone(), answer_mask=mask)


def sync_device(device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a clock reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_mean(fn, n: int, device) -> float:
    """Mean seconds of `fn()` over `n` back-to-back calls, the device synchronised before and after."""
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync_device(device)
    return (time.perf_counter() - t0) / n


def kv_stepper(cfg: JobConfig, t_model, which: str, data: Batch, payloads: dict, s_vocab: int, device):
    """A KV variant's step function: a DistillRecipe of `cfg` stepping on the bench's batch with the
    teacher's KV computed beforehand; which: "x" for the teacher of another vocabulary (aligned one
    to one)."""
    plans = in_process_plans(cfg, {"t": t_model})
    kv = {"t": _teacher_kv(cfg, plans, t_model, which, data, payloads, device)}
    feed, maps = data, None
    if which == "x":  # the other vocabulary, aligned one to one (every position aligned and paired)
        plans, feed, maps = _cross_vocab(plans, data, s_vocab)
    recipe = DistillRecipe(cfg, plans, device=device)
    if maps is None:
        recipe.setup()
    else:  # the bench's own batch: no tokenizer of the other vocabulary to load
        recipe.build_model(maps)
    # projector kind auto (the bench's student is of the teacher's KV geometry but not copied from
    # it): fit, whose student-side map a Train worker fits before step 1
    # (`recipes.fit_maps.fit_maps`); here on the bench's batch
    fit_on(recipe.distiller, [(feed, kv)], cfg.align.key_space, device)
    counter = iter(range(1, 10**9))
    return lambda: recipe.step(next(counter), [(feed, kv)])


def _teacher_kv(cfg: JobConfig, plans: dict, t_model, which: str, data: Batch, payloads: dict, device) -> KVBatch:
    """The teacher's KV (and top-k logits) for the batch on `device`: the teacher runs once per
    distinct (teacher, layers, k) request, its wire payload kept in `payloads` for the variants that
    share it."""
    layers, k = plans["t"].layers, teacher_logits_top_k(cfg.loss, plans)["t"]
    key = (which, tuple(layers), k)
    if key not in payloads:
        wire = teacher_forward_kv(t_model, data.input_ids, data.attention_mask,
                                  layers=layers, key_space=cfg.align.key_space, logits_top_k=k)
        payloads[key] = wire.to_wire(cfg.align.wire_dtype)
    return KVBatch.from_wire(payloads[key], device=device)
