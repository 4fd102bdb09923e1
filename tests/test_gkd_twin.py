"""kava-ray's `onpolicy-gkd` against TRL's `GKDTrainer`, twin runs on the same tiny models, batches (kava-ray's
stream for the seed, served to the trainer in order: `bench.task_trl.kava_batches`), schedule and seed:

- λ 0 (every step on the data's completions): the two end with the same weights;
- λ 1 on injected completions (each row's sampled completion fixed, so both sides train on the same tokens): the
  per-step losses are equal, and with completions of another length than the gold ones, each side's loss times its
  token count agrees (TRL divides a sampled step's JSD sum by the *gold* completions' token count: its quirk).

The reference is TRL 1.16's `trl/experimental/gkd/gkd_trainer.py` (`generalized_jsd_loss`, `compute_loss`,
`generate_on_policy_outputs`, `training_step`); kava-ray runs its production step (`bench.inprocess`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from kava_ray.bench.inprocess import train_in_process
from kava_ray.bench.task import GKD
from kava_ray.bench.task_finetune import records_job
from kava_ray.bench.task_trl import kava_batches, run_trl_gkd
from kava_ray.common.config import derive, load_config
from kava_ray.core.models import load_model, load_tokenizer
from kava_ray.rollout.engines import HFGenerate, Samples
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans
from kava_ray.testing.tiny import build_tiny_model

pytestmark = pytest.mark.unit

P = SimpleNamespace(max_length=96, max_new=24, batch_size=4, temperature=1.0)  # the bench sizes TRL reads
STEPS, LR, SEED = 4, 3e-3, 3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(teacher dir, student dir, records dir, tokenizer): two random tiny llamas of one byte tokenizer, and
    question / answer records of varied lengths."""
    root = tmp_path_factory.mktemp("twin")
    teacher = build_tiny_model(root / "teacher", family="llama", num_layers=2, hidden_size=48, seed=1)
    student = build_tiny_model(root / "student", family="llama", num_layers=1, hidden_size=48, seed=2)
    records = root / "records"
    records.mkdir()
    for split, n in (("train", 24), ("validation", 4), ("test", 4)):
        rows = [{"question": f"What is {i} plus {3 * i % 7}?" + " Think." * (i % 3),
                 "answer": f"{i} + {3 * i % 7} = {i + 3 * i % 7}\n#### {i + 3 * i % 7}"} for i in range(n)]
        (records / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return teacher, student, records, load_tokenizer(str(teacher))


def _job(pair, tmp_path, lmbda: float):
    teacher, student, records, _ = pair
    cfg = records_job(load_config("demo_cpu"), records, [("teacher", teacher)], student, None, P, tmp_path)
    vocab = load_model(str(teacher), dtype="float32").config.vocab_size
    sets = {**GKD, "loss.logit_top_k": vocab, "onpolicy.fraction": lmbda, "onpolicy.max_new_tokens": P.max_new}
    return derive(cfg, {**sets, "train.seed": SEED, "train.data_seed": SEED, "train.steps": STEPS,
                        "optim.lr_student": LR})


def _kava(pair, cfg):
    teacher = {"teacher": load_model(str(pair[0]), dtype="float32")}
    run = train_in_process(cfg, in_process_plans(cfg, teacher), InProcessSource(teacher), STEPS)
    return run["recipe"].distiller.student, run["losses"]


def _trl(pair, cfg, lmbda: float):
    tok = pair[3]
    return run_trl_gkd(load_model(str(pair[1]), dtype="float32"), load_model(str(pair[0]), dtype="float32"), tok,
                       kava_batches(cfg, tok, STEPS), SEED, LR, P, lmbda=lmbda)


def _max_weight_diff(a, b) -> float:
    sb = dict(b.named_parameters())
    return max(float((p.detach() - sb[n].detach()).abs().max()) for n, p in a.named_parameters())


def test_at_lambda_0_kava_rays_gkd_and_trls_end_with_the_same_weights(pair, tmp_path):
    """Four AdamW steps at lr 3e-3 (one step of warm-up at lr 0, then constant: transformers' semantics on both
    sides) on the data's completions, JSD β 0.5 over the whole vocabulary in float32: the same losses at every step
    (rel 1e-6; measured 1e-7) and the same weights at the end (abs 1e-6, measured 1.2e-7, where the steps moved
    them by 7.5e-3)."""
    cfg = _job(pair, tmp_path, 0.0)
    start = load_model(str(pair[1]), dtype="float32")
    kava, kava_losses = _kava(pair, cfg)
    trl = _trl(pair, cfg, 0.0)
    assert trl["generated_per_sample"] == 0 and len(trl["losses"]) == STEPS
    assert kava_losses == pytest.approx(trl["losses"], rel=1e-6)
    assert _max_weight_diff(kava, start) > 5e-3  # the runs trained
    assert _max_weight_diff(kava, trl["student"]) < 1e-6


def _completion(prompt: list, n: int, eos: int) -> list:
    """A fixed 'sample' of `n` tokens for `prompt` (ending in eos where it stops early), the same on both sides."""
    body = [(sum(prompt) * 7 + 13 * j) % 200 + 40 for j in range(n)]
    return body if n >= P.max_new else body[:-1] + [eos]


def _inject(monkeypatch, pair, length):
    """Both sides' samplers return `_completion(prompt, length(prompt))`: kava-ray's engine (`HFGenerate.complete`)
    and TRL's `generate` (whose output `generate_on_policy_outputs` masks after the first eos, as it would a real
    sample's)."""
    tok = pair[3]
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def complete(self, prompts, max_new_tokens, temperature, top_p, seed):
        ids = [_completion(p, length(p), eos) for p in prompts]
        return Samples(ids, [[0.0] * len(c) for c in ids])

    monkeypatch.setattr(HFGenerate, "complete", complete)

    def generate(input_ids, attention_mask, **kwargs):
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]
        comps = [_completion(p, length(p), eos) for p in prompts]
        width = max(len(c) for c in comps)
        tail = torch.tensor([c + [pad] * (width - len(c)) for c in comps], dtype=torch.long)
        return SimpleNamespace(sequences=torch.cat([input_ids, tail], dim=1))

    return generate


def _gold_lengths(batches) -> dict:
    """{prompt ids: its gold completion's token count} over kava-ray's batches (TRL counts these labels)."""
    gold = {}
    for b in batches:
        for row, lab in zip(b.input_ids, b.labels):
            keep = lab != -100
            gold[tuple(row[:int(keep.nonzero()[0])].tolist())] = int(keep.sum())
    return gold


def _both_injected(pair, tmp_path, monkeypatch, length):
    """kava-ray's and TRL's λ 1 runs with each prompt's sample `_completion(prompt, length[prompt])`."""
    cfg = _job(pair, tmp_path, 1.0)
    batches = kava_batches(cfg, pair[3], STEPS)
    student = load_model(str(pair[1]), dtype="float32")
    student.generate = _inject(monkeypatch, pair, lambda p: length(tuple(p)))
    trl = run_trl_gkd(student, load_model(str(pair[0]), dtype="float32"), pair[3], batches, SEED, LR, P, lmbda=1.0)
    kava, kava_losses = _kava(pair, cfg)
    return batches, kava, kava_losses, trl


def test_at_lambda_1_on_the_same_injected_completions_the_per_step_losses_are_equal(pair, tmp_path, monkeypatch):
    """Every step on the student's 'samples' (injected; λ 1, kava-ray at lag 0), each as long as its row's gold
    completion (what TRL divides by): the per-step losses agree at every step (rel 1e-6) and so do the final
    weights (abs 5e-6, measured 1.1e-6: TRL's sequences keep its prompts left-padded, kava-ray's rows are
    right-padded, so their positions differ by a shift RoPE cancels up to rounding)."""
    gold = _gold_lengths(kava_batches(_job(pair, tmp_path, 1.0), pair[3], STEPS))
    assert max(gold.values()) <= P.max_new  # (a sample stops at max_new: every gold length can be matched)
    _, kava, kava_losses, trl = _both_injected(pair, tmp_path, monkeypatch, gold.__getitem__)
    assert trl["generated_per_sample"] > 0 and kava_losses == pytest.approx(trl["losses"], rel=1e-6)
    assert _max_weight_diff(kava, trl["student"]) < 5e-6


def test_on_a_sampled_step_trl_divides_by_the_gold_token_count_and_kava_ray_by_the_sampled_one(pair, tmp_path,
                                                                                               monkeypatch):
    """Samples 3 tokens shorter than each gold completion: on step 1 (the same weights on both sides) TRL's loss is
    the JSD sum over the gold completions' token count (`num_items_in_batch`, counted before `training_step`
    swaps the batch for the samples), kava-ray's over the sampled tokens': their losses times those counts agree
    (rel 1e-6), and the losses themselves differ by that ratio."""
    gold = _gold_lengths(kava_batches(_job(pair, tmp_path, 1.0), pair[3], STEPS))
    batches, _, kava_losses, trl = _both_injected(pair, tmp_path, monkeypatch, lambda p: gold[p] - 3)
    first = [tuple(row[:int((lab != -100).nonzero()[0])].tolist()) for row, lab in zip(batches[0].input_ids,
                                                                                      batches[0].labels)]
    n_gold, n_sampled = sum(gold[p] for p in first), sum(gold[p] - 3 for p in first)
    assert trl["gold_tokens"][0] == n_gold != n_sampled
    assert kava_losses[0] * n_sampled == pytest.approx(trl["losses"][0] * n_gold, rel=1e-6)
    assert kava_losses[0] / trl["losses"][0] == pytest.approx(n_gold / n_sampled, rel=1e-6)
