"""On-policy distillation (`onpolicy`): the student samples completions of the records' prompts, the teachers -- one of
its tokenizer, one of another (SmolLM2's, aligned by characters) -- score what it wrote, and it trains on that;
in process (the production DistillRecipe and KVFeed over `InProcessSource`), then through Ray Train.
"""

from __future__ import annotations

import math

import pytest
import torch

from jobs import assert_same_curve, run_recipe, write_job
from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.kv import next_token_logprobs
from kava_ray.core.models import load_model
from kava_ray.core.plans import in_process_plans
from kava_ray.data import IGNORE_INDEX
from kava_ray.testing.sources import InProcessSource

ON = ["onpolicy.fraction=1", "onpolicy.max_new_tokens=12", "loss.logit_weight=1", "loss.logit_top_k=8",
      "loss.kv_weight=0.1"]


@pytest.fixture(scope="module")
def ojob(tmp_path_factory, tiny_qwen2_dir, smol_teacher_dir, tiny_student_dir):
    tmp = tmp_path_factory.mktemp("onpolicy")
    return write_job(tmp, tiny_qwen2_dir, smol_teacher_dir, tiny_student_dir,
                     teachers=[{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                               {"name": "smol", "model": str(smol_teacher_dir), "dtype": "float32"}],
                     data={"num_train": 32, "num_val": 4, "num_test": 4},
                     train={"steps": 6, "save_steps": 3, "eval_steps": 6, "batch_size": 2, "max_length": 320})


@pytest.fixture(scope="module")
def teachers(ojob):
    cfg = load_config(ojob)
    models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    return models, in_process_plans(cfg, models)


def _first_batch(cfg, plans, models):
    from kava_ray.recipes.distill import DistillRecipe

    recipe = DistillRecipe(cfg, plans)
    recipe.setup()
    feed = recipe.feed(InProcessSource(models), until=1)
    (_, _, _, batch), kv = next(feed)
    return recipe, batch, kv


def test_a_sampled_batch_is_the_prompt_and_the_students_completion_scored_by_both_teachers(ojob, teachers):
    models, plans = teachers
    cfg = load_config(ojob, ON + ["onpolicy.lag=0"])
    recipe, batch, kv = _first_batch(cfg, plans, models)
    assert batch.source == "student"
    # the prompt is the record's own (everything before its answer), the completion what the student sampled
    data = recipe.stream.split.items[0]
    for b in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[b].sum())
        loss = (batch.labels[b, :n] != IGNORE_INDEX).tolist()
        start = loss.index(True)
        assert all(loss[start:]) and 0 < n - start <= 12  # one run of sampled tokens, at most max_new_tokens
        assert batch.labels[b, start:n].tolist() == batch.input_ids[b, start:n].tolist()
    assert batch.input_ids.shape[1] <= len(data["input_ids"]) + 12
    # the sampling log-probs are the student's own at lag 0 (the same weights): an importance ratio of 1
    with torch.no_grad():
        logits = recipe.distiller.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    own = next_token_logprobs(logits, batch.input_ids)
    where = torch.nn.functional.pad(batch.labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False)
    torch.testing.assert_close(batch.sample_logp[where], own[where], atol=1e-4, rtol=1e-4)
    assert (batch.sample_logp[~where] == 0).all()
    # the teacher of the student's tokenizer scored every sampled token; SmolLM2's got the text in its tokens
    assert kv["qwen"].token_logp is not None and (kv["qwen"].token_logp[where] < 0).all()
    # ... aligned by characters about as well as the records' own rows are (causal: a byte takes a SmolLM2 token
    # where that token ends), the sampled completions included
    view = batch.teachers["smol"]
    real = batch.attention_mask != 0
    ok = view.align_hi > view.align_lo
    data_share = recipe.stream.split.views["smol"].stats["aligned_fraction"]
    assert abs(float(ok[real].float().mean()) - data_share) < 0.1, (float(ok[real].float().mean()), data_share)
    assert float(ok[where].float().mean()) > 0.5 * data_share  # the completions too


def test_every_divergence_trains_on_the_samples_and_resume_is_exact(ojob, teachers, tmp_path):
    """jsd at lag 1 (sampled one step ahead) and the sampled reverse KL at lag 0: from a step-3 checkpoint, steps
    4..6 repeat the uninterrupted run (the batch sampled ahead is kept in the checkpoint; sampling is seeded by
    batch and rank)."""
    models, plans = teachers
    for extra in (["loss.logit_divergence=jsd", "onpolicy.lag=1"],
                  ["loss.logit_divergence=reverse_kl_sampled", "onpolicy.lag=0"]):
        cfg = load_config(ojob, ON + extra)
        full, _, _ = run_recipe(cfg, plans, InProcessSource(models), 6, tmp_path / extra[1][-5:], save_at=3)
        assert all(full[s]["onpolicy/sampled_tokens"] > 0 and full[s]["ce"] > 0 for s in full)
        assert all(math.isfinite(full[s]["logit_kl"]) for s in full)
        resumed, recipe, _ = run_recipe(cfg, plans, InProcessSource(models), 6, resume=str(tmp_path / extra[1][-5:]))
        assert recipe.start_step == 3
        assert_same_curve(resumed, full, resumed, keys=("loss", "logit_kl", "onpolicy/sampled_tokens",
                                                        "onpolicy/reverse_kl_sum/qwen", "grad_norm"), tol=1e-6)


def test_text_records_and_a_typo_in_the_section_are_one_line(ojob):
    with pytest.raises(KavaError, match="text records have no prompt"):
        load_config(ojob, ["onpolicy.fraction=1", "data.format=text"])
    with pytest.raises(KavaError, match="onpolicy.fractoin"):
        load_config(ojob, ["onpolicy.fractoin=1"])
    with pytest.raises(KavaError, match="reverse_kl_sampled needs the student's samples"):
        load_config(ojob, ["loss.logit_divergence=reverse_kl_sampled"])
