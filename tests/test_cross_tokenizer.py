"""Teachers of another tokenizer and geometry: the Distiller step, resume and the KV cache (the 2-worker Ray Train
run with one: tests/test_train.py's end-to-end run).

The student and teacher `qwen` share the tiny byte-level tokenizer; teacher `qtok` is a tiny random Llama
(other layers, heads and head_dim) built around the real Qwen2 tokenizer (from the llama-cpp-python source
distribution, fetched at install: `kava_ray.testing.tokenizers`). Its KV reaches the student through the
character alignment of `kava_ray.align.tokens`.
"""

import json

import pytest
import torch

from jobs import assert_same_curve, run_recipe, write_job
from kava_ray.config import load_config
from kava_ray.data import BatchStream
from kava_ray.distill import Distiller
from kava_ray.errors import KavaError
from kava_ray.models import kv_geometry, load_model, load_student
from kava_ray.plans import in_process_plans, load_splits, student_tokenizer, teacher_tokenizers
from kava_ray.testing.sources import InProcessSource
from kava_ray.testing.tokenizers import real_tokenizer
from tiny_models import train_on_one_batch


@pytest.fixture(scope="module")
def xjob(tmp_path_factory, tiny_qwen2_dir, qtok_teacher_dir, tiny_student_dir):
    tmp = tmp_path_factory.mktemp("xtok")
    return write_job(tmp, tiny_qwen2_dir, qtok_teacher_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                               {"name": "qtok", "model": str(qtok_teacher_dir), "dtype": "float32"}],
                     data={"num_train": 48, "num_val": 8, "num_test": 8},
                     train={"steps": 12, "save_steps": 4, "eval_steps": 6, "batch_size": 2, "max_length": 320,
                            "num_to_keep": 3},
                     ray={"num_workers": 2})


def in_process(cfg):
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    return models, in_process_plans(cfg, models)


def test_plans_align_only_the_teacher_of_another_tokenizer(xjob):
    cfg = load_config(xjob)
    _, plans = in_process(cfg)
    assert not plans["qwen"].aligned and plans["qtok"].aligned
    toks = teacher_tokenizers(plans)
    assert list(toks) == ["qtok"] and len(toks["qtok"]) > 150_000
    train, _ = load_splits(cfg, student_tokenizer(cfg)[0], toks)
    _, _, _, batch = BatchStream(train, 2, 0).next()
    T = batch["input_ids"].shape[1]
    assert batch["align_lo/qtok"].shape == batch["align_hi/qtok"].shape == (2, T)
    assert batch["teacher_input_ids/qtok"].shape[1] < T  # Qwen2's BPE needs fewer tokens than bytes
    assert "align_lo/qwen" not in batch  # the same-tokenizer teacher keeps one-to-one positions


def test_distiller_step_with_a_teacher_of_another_tokenizer(xjob):
    """5 steps on one batch: both teachers' centred cos rise; `aligned/qtok` is the share of student tokens it
    covers; a batch without the alignment is refused in one line."""
    from actors.feed import KVFeed, feed_items

    cfg = load_config(xjob)
    models, plans = in_process(cfg)
    train, _ = load_splits(cfg, student_tokenizer(cfg)[0], teacher_tokenizers(plans))
    feed = KVFeed(InProcessSource(models), feed_items(BatchStream(train, 4, 0), 1),
                  {n: p.layers for n, p in plans.items()}, depth=1)
    (_, _, _, batch), kv = next(feed)
    assert kv["qtok"].keys.shape[3] == batch["teacher_input_ids/qtok"].shape[1]  # teacher time, not student time
    student = load_student(cfg.student.model, dtype="float32")
    distiller = Distiller(student, plans, kv_geometry(student), cfg)
    history = [{k: float(v) for k, v in m.items()}
               for m in train_on_one_batch(distiller, cfg.optim, batch, kv, steps=6)]
    for n in ("qwen", "qtok"):
        assert history[-1][f"cos/{n}"] > history[0][f"cos/{n}"] + 0.05, n
    # causal: a byte of the student takes a Qwen2 token only where that token ends (its last byte), ~1/3 here
    assert 0.25 < history[0]["aligned/qtok"] < 0.6
    real = int(batch["attention_mask"].sum())
    assert history[0]["kv_tokens"] <= real  # the fused target exists only where both teachers have one
    with pytest.raises(KavaError, match="carries no token alignment") as info:
        distiller({k: v for k, v in batch.items() if not k.startswith("align_")}, kv)
    assert "\n" not in str(info.value)


def test_logits_come_only_from_the_teacher_sharing_the_tokenizer(xjob):
    cfg = load_config(xjob, ["loss.logit_weight=0.5", "loss.logit_top_k=4"])
    models, plans = in_process(cfg)
    from kava_ray.plans import teacher_logits_top_k

    assert teacher_logits_top_k(cfg, plans) == {"qwen": 4, "qtok": 0}
    student = load_student(cfg.student.model, dtype="float32")
    distiller = Distiller(student, plans, kv_geometry(student), cfg)
    assert distiller.logit_names == ["qwen"]
    solo = {"qtok": plans["qtok"]}
    from kava_ray.plans import check_vocab

    with pytest.raises(KavaError, match="no teacher shares the student's tokenizer"):  # refused by the plans
        check_vocab(cfg, solo, kv_geometry(student))


@pytest.fixture(scope="module")
def xpool(tiny_pool, xjob):
    """qtok beside the session's pool for this module (the run and the precompute below find both)."""
    from actors.pool import start_missing, stop_pool

    cfg = load_config(xjob)
    handles, started = start_missing(cfg)
    yield handles  # held: Ray ends a non-detached actor once no handle to it is left
    stop_pool(cfg, only=started)


def test_resume_with_a_teacher_of_another_tokenizer_is_exact(xjob, tmp_path):
    """From a step-8 checkpoint, steps 9..12 repeat the uninterrupted run's numbers, aligned share included.
    In process (the recipe holds everything a resume must restore; test_train.py's worker-failure case checks
    the same across Ray Train's process boundary and DDP)."""
    cfg = load_config(xjob)
    models, plans = in_process(cfg)
    full, _, _ = run_recipe(cfg, plans, InProcessSource(models), 12, tmp_path / "ck", save_at=8)
    resumed, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 12, resume=str(tmp_path / "ck"))
    assert recipe.start_step == 8 and sorted(resumed) == [9, 10, 11, 12]
    assert_same_curve(resumed, full, resumed, keys=("loss", "ce", "kv_loss", "cos_sim", "cos/qtok", "aligned/qtok",
                                                    "grad_norm"), tol=1e-6)


def test_kv_cache_keeps_the_teacher_tokenizer(xpool, xjob, tmp_path):
    """`teachers precompute` stores the tokenizer of the teacher of another tokenizer; a job reading the cache
    aligns with it and never needs the teacher's model."""
    from kava_ray.job import precompute, setup_teachers

    cfg = load_config(xjob)
    cache = tmp_path / "cache"
    precompute(cfg, cache, progress=False)
    meta = json.loads((cache / "manifest.json").read_text())["meta"]["teachers"]
    assert "tokenizer" not in meta["qwen"] and meta["qtok"]["tokenizer"] == "tokenizers/qtok"
    cached = load_config(xjob, ["data.kv_source=cache", f"data.kv_cache_dir={cache}"])
    _, plans, _ = setup_teachers(cached)
    assert plans["qtok"].tokenizer == str(cache / "tokenizers" / "qtok") and not plans["qwen"].aligned
    assert len(teacher_tokenizers(plans)["qtok"]) == len(real_tokenizer("qwen2"))
    # batches of another seed, assembled from the examples: each teacher's rows padded to its own tokens
    from actors.feed import KVFeed, feed_items
    from kava_ray.job import kv_source

    models, _ = in_process(cfg)
    train, _ = load_splits(cached, student_tokenizer(cached)[0], teacher_tokenizers(plans))
    layers = {n: p.layers for n, p in plans.items()}
    for (item, kc), (_, kl) in zip(
            KVFeed(kv_source(cached, plans, train.fingerprint), feed_items(BatchStream(train, 3, 5), 2), layers),
            KVFeed(InProcessSource(models), feed_items(BatchStream(train, 3, 5), 2), layers)):
        batch = item[3]
        for n, mask in (("qwen", batch["attention_mask"]), ("qtok", batch["teacher_attention_mask/qtok"])):
            m = mask.bool()[None, :, None, :, None]
            assert kc[n].keys.shape == kl[n].keys.shape
            assert torch.allclose(kc[n].keys * m, kl[n].keys * m, rtol=2 ** -7, atol=1e-3), n
