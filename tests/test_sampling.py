"""`core.sampling.sample`: the log-prob it reports for each sampled token is the model's own distribution (q = pi_S
at temperature 1, top_p 1), whatever the checkpoint's generation config says."""

from __future__ import annotations

import torch

from kava_ray.core.models import load_model
from kava_ray.core.sampling import sample


def test_the_sampling_log_probs_are_the_models_own_whatever_its_generation_config(tiny_student_dir):
    """A checkpoint whose generation_config sets a repetition penalty, no_repeat_ngram_size and min_p (the presets'
    Qwen2.5-Instruct students ship a repetition penalty): generate() used to fill them in, so q was not pi_S even at
    lag 0. Now each sampled token's log-prob equals the model's own log-softmax, and the model's config is kept."""
    model = load_model(tiny_student_dir, dtype="float32")
    model.generation_config.repetition_penalty = 1.8
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.min_p = 0.2
    prompts = [[5, 9, 13, 5, 9], [7, 7, 8], [11, 3, 11, 3, 11, 3]]
    s = sample(model, prompts, 16, eos_ids=[], pad_id=0, seed=3)
    assert [len(r) for r in s.ids] == [16, 16, 16]
    for prompt, ids, logp in zip(prompts, s.ids, s.logp):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
        own = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(logp), own, atol=1e-4, rtol=1e-4)
    # the repetition the penalty / ngram rule forbids is sampled (this model repeats itself freely)
    assert any(len(set(r)) < len(r) for r in s.ids)
    assert model.generation_config.repetition_penalty == 1.8 and model.generation_config.min_p == 0.2
