"""Teachers of another tokenizer and geometry: the Distiller step, resume and the KV cache (the 2-worker Ray Train
run with one, SmolLM2's: tests/test_train.py's end-to-end run).

The student and teacher `qwen` share the tiny byte-level tokenizer; teacher `qtok` is a tiny random Llama
(other layers, heads and head_dim) built around the real Qwen2 tokenizer (from the llama-cpp-python source
distribution, fetched at install: `kava_ray.testing.tokenizers`). Its KV reaches the student through the
character alignment of `kava_ray.core.align.tokens`.
"""

import dataclasses
import json

import pytest
import torch

from jobs import assert_same_curve, pool_beside, run_recipe, write_job
from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.models import kv_geometry, load_model, load_student
from kava_ray.core.plans import student_tokenizer, teacher_tokenizers
from kava_ray.data import BatchStream
from kava_ray.data.splits import load_splits
from kava_ray.recipes.build import build_distiller
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans
from kava_ray.testing.tokenizers import real_tokenizer
from tiny_models import logit_term, train_on_one_batch


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


LOGITS = ["loss.logit_weight=0.5", "loss.logit_top_k=8"]  # both teachers' logits: qtok's by the hybrid loss


def in_process(cfg):
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    return models, in_process_plans(cfg, models)


def test_plans_align_only_the_teacher_of_another_tokenizer(xjob):
    cfg = load_config(xjob)
    _, plans = in_process(cfg)
    assert not plans["qwen"].aligned and plans["qtok"].aligned
    toks = teacher_tokenizers(plans)
    assert list(toks) == ["qtok"] and len(toks["qtok"]) > 150_000
    train, _ = load_splits(cfg.data, cfg.train, student_tokenizer(cfg.student)[0], toks)
    _, _, _, batch = BatchStream(train, 2, 0).next()
    T = batch.input_ids.shape[1]
    view = batch.teachers["qtok"]
    assert view.align_lo.shape == view.align_hi.shape == view.logit_pair.shape == (2, T)
    assert view.input_ids.shape[1] < T  # Qwen2's BPE needs fewer tokens than bytes
    assert list(batch.teachers) == ["qtok"]  # the same-tokenizer teacher keeps one-to-one positions


def test_distiller_step_with_a_teacher_of_another_tokenizer(xjob):
    """5 steps on one batch: both teachers' centred cos rise; `aligned/qtok` is the share of student tokens it
    covers; a batch without the alignment is refused in one line."""
    from kava_ray.rollout.feed import KVFeed, feed_items

    cfg = load_config(xjob)
    models, plans = in_process(cfg)
    train, _ = load_splits(cfg.data, cfg.train, student_tokenizer(cfg.student)[0], teacher_tokenizers(plans))
    feed = KVFeed(InProcessSource(models), feed_items(BatchStream(train, 4, 0), 1),
                  {n: p.layers for n, p in plans.items()}, depth=1)
    (_, _, _, batch), kv = next(feed)
    assert kv["qtok"].keys.shape[3] == batch.teachers["qtok"].input_ids.shape[1]  # teacher time, not student time
    student = load_student(cfg.student.model, dtype="float32")
    distiller = build_distiller(student, plans, kv_geometry(student), cfg)
    history = [{k: float(v) for k, v in m.items()}
               for m in train_on_one_batch(distiller, cfg.optim, batch, kv, steps=6)]
    for n in ("qwen", "qtok"):
        assert history[-1][f"cos/{n}"] > history[0][f"cos/{n}"] + 0.05, n
    # causal: a byte of the student takes a Qwen2 token only where that token ends (its last byte), ~1/3 here
    assert 0.25 < history[0]["aligned/qtok"] < 0.6
    real = int(batch.attention_mask.sum())
    assert history[0]["kv_tokens"] <= real  # the fused target exists only where both teachers have one
    with pytest.raises(KavaError, match="carries no token alignment") as info:
        distiller(dataclasses.replace(batch, teachers={}), kv)
    assert "\n" not in str(info.value)


def test_cross_vocab_off_takes_logits_only_from_the_teacher_sharing_the_tokenizer(xjob):
    cfg = load_config(xjob, ["loss.logit_weight=0.5", "loss.logit_top_k=4", "loss.logit_cross_vocab=off"])
    models, plans = in_process(cfg)
    from kava_ray.core.plans import check_vocab, teacher_logits_top_k

    assert teacher_logits_top_k(cfg.loss, plans) == {"qwen": 4, "qtok": 0}
    student = load_student(cfg.student.model, dtype="float32")
    distiller = build_distiller(student, plans, kv_geometry(student), cfg)
    assert distiller.logit_names == ["qwen"]
    with pytest.raises(KavaError, match="no teacher shares the student's tokenizer and loss.logit_cross_vocab=off"):
        check_vocab(cfg.loss, {"qtok": plans["qtok"]})  # refused by the plans
    on = load_config(xjob, ["loss.logit_weight=0.5", "loss.logit_top_k=4"])  # default: hybrid
    assert teacher_logits_top_k(on.loss, plans) == {"qwen": 4, "qtok": 4}
    check_vocab(on.loss, {"qtok": plans["qtok"]})
    from kava_ray.core.plans import cross_vocab_lines  # what `kava-ray train` prints once its teachers are up

    assert cross_vocab_lines(cfg.loss, cfg.student, plans) == []
    (line,) = cross_vocab_lines(on.loss, on.student, plans)
    assert line.startswith("logits: teacher 'qtok' (another tokenizer) by hybrid at the positions where both have "
                           "read the same text; ") and "of the teacher's 151,936 tokens" in line, line


@pytest.mark.parametrize("mode", ["hybrid", "uld"])
def test_a_teacher_of_another_tokenizer_trains_the_student_s_logits(xjob, mode):
    """Both teachers' logits train the student: qtok's top-k (over Qwen2's 151k ids) at the teacher positions
    paired with the student's (`batch.teachers["qtok"].logit_pair`: both have read the same text), by the hybrid or
    ULD loss; `logit_aligned/qtok` is the share of next-token positions paired. Trained on qtok's logit term alone
    (no CE, KV or other teacher pulling elsewhere: the random teacher is near uniform over 151k ids), 6 steps on one
    batch lower it."""
    from kava_ray.core.plans import teacher_logits_top_k, vocab_maps
    from kava_ray.rollout.feed import KVFeed, feed_items

    cfg = load_config(xjob, ["loss.logit_weight=1.0", "loss.logit_top_k=8", f"loss.logit_cross_vocab={mode}"])
    models, plans = in_process(cfg)
    s_tok, toks = student_tokenizer(cfg.student)[0], teacher_tokenizers(plans)
    train, _ = load_splits(cfg.data, cfg.train, s_tok, toks)
    feed = KVFeed(InProcessSource(models), feed_items(BatchStream(train, 4, 0), 1),
                  {n: p.layers for n, p in plans.items()}, depth=1, logits_top_k=teacher_logits_top_k(cfg.loss, plans))
    (_, _, _, batch), kv = next(feed)
    pair = batch.teachers["qtok"].logit_pair
    assert pair.shape == batch.input_ids.shape and int(pair.max()) < kv["qtok"].topk_ids.shape[1]
    maps = vocab_maps(cfg.loss, cfg.student, plans, s_tok, toks)
    assert list(maps) == ["qtok"] and maps["qtok"].matched >= 256  # every byte of the byte-level student
    student = load_student(cfg.student.model, dtype="float32")
    distiller = build_distiller(student, plans, kv_geometry(student), cfg, maps)
    assert distiller.logit_names == ["qwen", "qtok"]
    m = distiller(batch, kv).metrics
    # a byte of the student pairs where a Qwen2 token ends inside the same segment, followed by more of it
    assert 0.15 < float(m["logit_aligned/qtok"]) < 0.6 and "logit_aligned/qwen" not in m
    assert {"logit_kl/qwen", "top1_agree/qwen", "top1_agree/qtok"} <= set(m)
    parts = {"logit_kl/qtok", "logit_uld/qtok"} if mode == "hybrid" else {"logit_uld/qtok"}  # KL: matched ids
    assert {k for k in m if k.startswith(("logit_kl/", "logit_uld/")) and k.endswith("/qtok")} == parts
    with pytest.raises(KavaError, match="carries no position pairs") as info:  # the KV term would refuse it first
        logit_term(distiller.logit_specs["qtok"], torch.zeros(*pair.shape, 8), kv["qtok"],
                   dataclasses.replace(batch, teachers={}), pair >= 0, cfg.loss)
    assert "\n" not in str(info.value)
    alone = load_config(xjob, ["loss.logit_weight=1.0", "loss.logit_top_k=8", f"loss.logit_cross_vocab={mode}",
                               "loss.ce_weight=0", "loss.kv_weight=0"])
    student = load_student(cfg.student.model, dtype="float32")
    distiller = build_distiller(student, {"qtok": plans["qtok"]}, kv_geometry(student), alone, maps)
    history = [{k: float(v) for k, v in m.items()}
               for m in train_on_one_batch(distiller, cfg.optim, batch, {"qtok": kv["qtok"]}, steps=6)]
    part = "logit_kl/qtok" if mode == "hybrid" else "logit_uld/qtok"
    assert history[-1][part] < 0.95 * history[0][part], [h[part] for h in history]
    assert history[-1]["loss"] < history[0]["loss"]


@pytest.fixture(scope="module")
def xpool(tiny_pool, xjob):
    """qtok beside the session's pool for this module (the run and the precompute below find both)."""
    yield from pool_beside(xjob)


def test_resume_with_a_teacher_of_another_tokenizer_is_exact(xjob, tmp_path):
    """From a step-8 checkpoint, steps 9..12 repeat the uninterrupted run's numbers, aligned shares and both
    teachers' logit terms included.
    In process (the recipe holds everything a resume must restore; test_multinode.py's node-loss run and
    test_faults.py's SIGINT run check the same across Ray Train's process boundary)."""
    cfg = load_config(xjob, LOGITS)
    models, plans = in_process(cfg)
    full, _, _ = run_recipe(cfg, plans, InProcessSource(models), 12, tmp_path / "ck", save_at=8)
    resumed, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 12, resume=str(tmp_path / "ck"))
    assert recipe.start_step == 8 and sorted(resumed) == [9, 10, 11, 12]
    assert_same_curve(resumed, full, resumed, keys=("loss", "ce", "kv_loss", "cos_sim", "cos/qtok", "aligned/qtok",
                                                    "logit_kl/qtok", "logit_uld/qtok", "logit_aligned/qtok",
                                                    "grad_norm"), tol=1e-6)


def test_kv_cache_keeps_the_teacher_tokenizer(xpool, xjob, tmp_path):
    """`teachers precompute` stores the tokenizer of the teacher of another tokenizer, and its vocabulary map to the
    student's (the job takes its logits); a job reading the cache aligns and maps with them, never needs the
    teacher's model, and reads both teachers' top-k as the live teachers send them."""
    from kava_ray.core.align import vocab
    from kava_ray.core.plans import teacher_logits_top_k, vocab_maps
    from kava_ray.runtime.job import precompute, setup_teachers

    small = LOGITS + ["data.num_train=12", "data.num_val=4", "data.num_test=4"]  # every example: a 151k-id softmax
    cfg = load_config(xjob, small)
    cache = tmp_path / "cache"
    precompute(cfg, cache, progress=False)
    meta = json.loads((cache / "manifest.json").read_text())["meta"]["teachers"]
    assert "tokenizer" not in meta["qwen"] and meta["qtok"]["tokenizer"] == "tokenizers/qtok"
    assert len(list((cache / "tokenizers" / "qtok").glob("vocab_map-*.npz"))) == 1
    cached = load_config(xjob, small + ["data.kv_source=cache", f"data.kv_cache_dir={cache}"])
    _, plans, _ = setup_teachers(cached)
    assert plans["qtok"].tokenizer == str(cache / "tokenizers" / "qtok") and not plans["qwen"].aligned
    toks = teacher_tokenizers(plans)
    assert len(toks["qtok"]) == len(real_tokenizer("qwen2"))
    with pytest.MonkeyPatch.context() as mp:  # the cache's copy of the map is read, not built again
        mp.setattr(vocab, "build_vocab_map", lambda *a, **k: pytest.fail("map built again"))
        mp.setenv("KAVA_RAY_CACHE", str(tmp_path / "empty_user_cache"))
        assert vocab_maps(cached.loss, cached.student, plans, student_tokenizer(cached.student)[0],
                          toks)["qtok"].matched >= 256
    # batches of another seed, assembled from the examples: each teacher's rows padded to its own tokens
    from kava_ray.rollout.feed import KVFeed, feed_items
    from kava_ray.runtime.job import kv_source

    models, _ = in_process(cfg)
    train, _ = load_splits(cached.data, cached.train, student_tokenizer(cached.student)[0], teacher_tokenizers(plans))
    layers = {n: p.layers for n, p in plans.items()}
    k = teacher_logits_top_k(cached.loss, plans)
    assert k == {"qwen": 8, "qtok": 8}
    for (item, kc), (_, kl) in zip(
            KVFeed(kv_source(cached, plans, train.fingerprint), feed_items(BatchStream(train, 3, 5), 2), layers,
                   logits_top_k=k),
            KVFeed(InProcessSource(models), feed_items(BatchStream(train, 3, 5), 2), layers, logits_top_k=k)):
        batch = item[3]
        for n, mask in (("qwen", batch.attention_mask), ("qtok", batch.teachers["qtok"].attention_mask)):
            m = mask.bool()[None, :, None, :, None]
            assert kc[n].keys.shape == kl[n].keys.shape
            assert torch.allclose(kc[n].keys * m, kl[n].keys * m, rtol=2 ** -7, atol=1e-3), n
            real = mask.bool()
            assert torch.equal(kc[n].topk_ids[real][:, 0], kl[n].topk_ids[real][:, 0]), n  # top-1, in its vocabulary
            assert torch.allclose(kc[n].topk_logp[real].float(), kl[n].topk_logp[real].float(), atol=0.05), n
