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


def test_sampling_keeps_only_the_chosen_tokens_log_probs_not_every_steps_scores(tiny_student_dir, monkeypatch):
    """HF sampling used to ask generate for every step's processed scores ([B, V] per new token: 16 rows x 1k tokens
    x 152k ids is ~10 GB in fp32) to read one log-prob each. Now generate returns no scores and holds one step's
    log-softmax at a time (`ChosenLogp`), and the log-probs are the same as that path's at T 0.7 / top-p 0.9 (the
    tempered, renormalised distribution the tokens were drawn from), EOS mid-row included."""
    from transformers import GenerationConfig

    model = load_model(tiny_student_dir, dtype="float32")
    returned, real = [], model.generate

    def spy(*a, **kw):
        returned.append(real(*a, **kw))
        return returned[-1]

    monkeypatch.setattr(model, "generate", spy)
    prompts = [[5, 9, 13, 5, 9], [7, 7, 8], [11, 3]]
    s = sample(model, prompts, 12, temperature=0.7, top_p=0.9, eos_ids=[4], pad_id=0, seed=5)
    assert returned[0].scores is None and returned[0].logits is None
    # the old path, side by side: generate's own warpers and every step's scores, same seed
    gc = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, pad_token_id=0,
                          eos_token_id=[4], output_scores=True, return_dict_in_generate=True)
    own, model.generation_config = model.generation_config, GenerationConfig()
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(5)
        old = real(input_ids=ids, attention_mask=(torch.arange(P) >= P - torch.tensor([[len(p)] for p in prompts])
                                                 ).long(), generation_config=gc)
    model.generation_config = own
    new = old.sequences[:, P:]
    logp = torch.stack([torch.log_softmax(x.float(), -1) for x in old.scores], 1).gather(-1, new[..., None])[..., 0]
    for b, (r, lp) in enumerate(zip(s.ids, s.logp)):
        assert r == new[b, :len(r)].tolist()
        assert torch.equal(torch.tensor(lp), logp[b, :len(r)])
