"""`bench task`'s `trl-gkd` arm: TRL's GKDTrainer (`trl.experimental.gkd`, TRL 1.16) on the same work as kava-ray's
`onpolicy-jsd`: the same warm start, teacher, training records, seeds, steps, batch, learning rate grid, λ 0.5
(the share of steps on the student's own samples), β 0.5 (the generalized JSD), sampling temperature and maximum
completion length, a constant rate after 2 warm-up steps, gradients clipped at 1.

TRL's `DistillationTrainer` (stable in 1.16) has no λ (it is always on-policy), so the arm that matches
`onpolicy-jsd`'s λ 0.5 is GKDTrainer. Its generation config is pinned: GKDTrainer sets max_new_tokens,
temperature, top_k 0, top_p 1 and leaves every other sampling field unset, and transformers 5 fills an unset
field from the model's own `generation_config` (a checkpoint's `repetition_penalty`, `min_p`, ...: q would not be
the student's distribution). The student's `generation_config` is replaced by one holding only its eos / bos / pad
ids before the trainer is built (`pin_generation_config`), so there is nothing to fill from.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from transformers import GenerationConfig

TRL_LMBDA, TRL_BETA = 0.5, 0.5


def pin_generation_config(model) -> GenerationConfig:
    """Replace `model.generation_config` by one with only its eos / bos / pad token ids (module docstring)."""
    old = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=old.eos_token_id, bos_token_id=old.bos_token_id,
                                               pad_token_id=old.pad_token_id)
    return model.generation_config


def run_trl_gkd(student, teacher, tok, rows: list, seed: int, steps: int, batch_size: int, lr: float, p: dict) -> dict:
    """Train `student` (a loaded model, changed in place) with TRL's GKDTrainer against `teacher` on `rows`
    ({question, answer}); returns {"student", "step_s" (median wall per step, sampling and teacher included),
    "train_s", "teacher_rows_per_sample", "generated_per_sample", "loss" (the last step's)}."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    class Counting(GKDTrainer):
        """GKDTrainer counting the teacher's scoring rows and the completion tokens the student wrote."""
        teacher_rows = generated = 0

        def generate_on_policy_outputs(self, model, inputs, generation_config):
            ids, mask, labels = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            self.generated += int((labels != -100).sum())
            return ids, mask, labels

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.teacher_rows += int(inputs["input_ids"].shape[0])
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    times: list = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    pin_generation_config(student)
    data = Dataset.from_list([{"messages": [{"role": "user", "content": r["question"]},
                                            {"role": "assistant", "content": r["answer"]}]} for r in rows])
    with tempfile.TemporaryDirectory(prefix="kava-trl-") as out:
        args = GKDConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=lr,
            lr_scheduler_type="constant_with_warmup", warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0,
            lmbda=TRL_LMBDA, beta=TRL_BETA, seq_kd=False, temperature=p["temperature"], max_new_tokens=p["max_new"],
            max_length=p["max_length"], seed=seed, data_seed=seed, bf16=False, use_cpu=True,
            gradient_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = Counting(model=student, teacher_model=teacher, args=args, train_dataset=data,
                           processing_class=tok, callbacks=[Clock()])
        trainer.remove_callback(PrinterCallback)  # its per-step log dicts on stdout: the loss is kept below
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
    samples = steps * batch_size
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"student": trainer.model, "step_s": statistics.median(times) if times else None, "train_s": train_s,
            "teacher_rows_per_sample": trainer.teacher_rows / samples, "generated_per_sample":
            trainer.generated / samples, "loss": losses[-1] if losses else None}
