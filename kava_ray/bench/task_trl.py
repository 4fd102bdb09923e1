"""`bench task`'s `trl-gkd` arm: TRL's GKDTrainer (`trl.experimental.gkd`, TRL 1.16) on the same
work as kava-ray's `onpolicy-gkd`: the same warm start, teacher, seeds, steps, learning rate grid, λ
(the share of steps on the student's own samples), β (the generalized JSD), sampling temperature,
maximum completion length, a constant rate after 2 warm-up steps of transformers' semantics (lr 0 at
step 0: `optim.warmup_from_zero` on kava-ray's side), gradients clipped at 1, and **the same batches
in the same order**: kava-ray's batch stream for the seed (`kava_batches`: its tokenization, its
record order, right-padded rows), served to the trainer as they are (`_KavaBatches`, a sequential
sampler), the prompts left-padded for `generate` as TRL's `DataCollatorForChatML` pads them.

What still differs, by TRL's design: the steps that sample are drawn by `random.random() <= lmbda`
on the trainer's seeded Python RNG (kava-ray: a hash of the batch key, `rollout.onpolicy_source`),
so the same λ picks other steps; and on a sampled step GKDTrainer divides the JSD sum by the *gold*
completions' token count (`num_items_in_batch`, counted by `Trainer` before `training_step` replaces
the batch), kava-ray by the sampled tokens' (tests/test_gkd_twin.py shows both, and that the sums
agree).

TRL's `DistillationTrainer` (stable in 1.16) has no λ (it is always on-policy), so the arm that
matches a λ below 1 is GKDTrainer. Its generation config is pinned: GKDTrainer sets max_new_tokens,
temperature, top_k 0, top_p 1 and leaves every other sampling field unset, and transformers 5 fills
an unset field from the model's own `generation_config` (a checkpoint's `repetition_penalty`,
`min_p`, ...: q would not be the student's distribution). The student's `generation_config` is
replaced by one holding only its eos / bos / pad ids before the trainer is built
(`pin_generation_config`), so there is nothing to fill from.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Callable, Optional

import torch
from transformers import GenerationConfig

from kava_ray.bench.task_records import ArmSizes
from kava_ray.data import Batch, BatchStream
from kava_ray.data.completions import prompts_of
from kava_ray.data.splits import data_seed, load_splits

TRL_LMBDA, TRL_BETA = 0.5, 0.5


def pin_generation_config(model) -> GenerationConfig:
    """Replace `model.generation_config` by one with only its eos / bos / pad token ids (module docstring)."""
    old = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=old.eos_token_id, bos_token_id=old.bos_token_id,
                                               pad_token_id=old.pad_token_id)
    return model.generation_config


def kava_batches(cfg, tok, steps: int) -> list[Batch]:
    """The first `steps` batches kava-ray's training stream gives job `cfg` (its training split,
    batch size and data seed): what its steps 1 .. `steps` train on (one rank, no accumulation)."""
    stream = BatchStream(load_splits(cfg.data, cfg.train, tok)[0], cfg.train.batch_size, data_seed(cfg.train))
    return [stream.next()[3] for _ in range(steps)]


def trl_inputs(batch: Batch, pad_id: int) -> dict:
    """One kava-ray batch as GKDTrainer's collator hands it on: input_ids / attention_mask / labels
    as they are (labels -100 off the completion, shifted inside `compute_loss`), and each row's
    prompt left-padded (`prompts`, `prompt_attention_mask`: what `generate_on_policy_outputs`
    completes)."""
    prompts = prompts_of(batch)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p):] = 1
    return {"input_ids": batch.input_ids.long(), "attention_mask": batch.attention_mask.long(),
            "labels": batch.labels.long(), "prompts": ids, "prompt_attention_mask": mask}


def _gkd_config(out: str, steps: int, size: int, lr: float, p: ArmSizes, lmbda: float, beta: float, seed: int):
    """TRL's GKDConfig for `steps` steps of `size` rows: transformers' constant schedule after
    `p.warmup_steps` (default 2) steps of warm-up, clip 1.0, no weight decay, fp32 on the CPU, no
    logging or saving."""
    from trl.experimental.gkd import GKDConfig

    return GKDConfig(
        output_dir=out, max_steps=steps, per_device_train_batch_size=size, learning_rate=lr,
        lr_scheduler_type="constant_with_warmup", warmup_steps=getattr(p, "warmup_steps", 2), weight_decay=0.0,
        max_grad_norm=1.0, lmbda=lmbda, beta=beta, seq_kd=False, temperature=p.temperature,
        max_new_tokens=p.max_new, max_length=p.max_length, seed=seed, data_seed=seed, bf16=False,
        use_cpu=True, gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch")


def _step_clock(times: list):
    """A trainer callback that appends each step's wall seconds (sampling and the teacher included) to `times`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    return Clock()


def run_trl_gkd(student, teacher, tok, batches: list[Batch], seed: int, lr: float, p: ArmSizes,
                lmbda: float = TRL_LMBDA, beta: float = TRL_BETA,
                on_policy: Optional[Callable] = None) -> dict:
    """Train `student` (a loaded model, changed in place) with TRL's GKDTrainer against `teacher`, one step per batch
    of `batches` (`kava_batches`), in order; p: the bench's sizes (temperature, max_new, max_length; warmup_steps,
    default 2). `on_policy(inputs) -> (ids, mask, labels)`: replaces the trainer's sampling (a test's injected
    completions). Returns {"student", "step_s" (median wall per step, sampling and teacher included), "train_s",
    "teacher_rows_per_sample", "generated_per_sample", "loss" (the last step's), "losses" (each step's, as
    `compute_loss` returned it), "gold_tokens" (each step's `num_items_in_batch`)}."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import PrinterCallback
    from trl.experimental.gkd import GKDTrainer

    size = int(batches[0].input_ids.shape[0])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    served = [trl_inputs(b, pad) for b in batches]
    losses: list = []
    gold: list = []

    class Kava(GKDTrainer):
        """GKDTrainer on kava-ray's batches in order, counting the teacher's scoring rows and the
        completion tokens the student wrote."""
        teacher_rows = generated = 0

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def generate_on_policy_outputs(self, model, inputs, generation_config):
            if on_policy is not None:
                ids, mask, labels = on_policy(inputs)
            else:
                ids, mask, labels = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            self.generated += int((labels != -100).sum())
            return ids, mask, labels

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.teacher_rows += int(inputs["input_ids"].shape[0])
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((out[0] if return_outputs else out).detach()))
            gold.append(None if num_items_in_batch is None else int(num_items_in_batch))
            return out

    times: list = []
    pin_generation_config(student)
    data = Dataset.from_dict({"row": list(range(len(batches) * size))})
    with tempfile.TemporaryDirectory(prefix="kava-trl-") as out:
        args = _gkd_config(out, len(batches), size, lr, p, lmbda, beta, seed)
        trainer = Kava(model=student, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok,
                       callbacks=[_step_clock(times)], data_collator=lambda rows: dict(served[rows[0]["row"] // size]))
        trainer.remove_callback(PrinterCallback)  # its per-step log dicts on stdout: the losses are kept above
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    samples = len(batches) * size
    return {"student": trainer.model, "step_s": statistics.median(times) if times else None, "train_s": train_s,
            "teacher_rows_per_sample": trainer.teacher_rows / samples, "generated_per_sample":
            trainer.generated / samples, "loss": losses[-1] if losses else None, "losses": losses,
            "gold_tokens": gold}
