"""Held-out CE and GSM8K accuracy (greedy decoding, "####" answers, numeric normalisation).

Pure PyTorch + Hugging Face, no Ray. Accuracy on the tiny random test models is ~0 (they emit byte
noise); it is meaningful only for real instruction-tuned models, e.g. the demo's SmolLM2 or Qwen2.5.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from kava_ray.data import Example, TokenizedSplit, collate, encode_prompt, final_answer, normalize_number
from kava_ray.errors import KavaError
from kava_ray.losses import masked_ce

NUM_SAMPLES = 5  # predictions kept in the accuracy result for a human to look at


def _device(model) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def _inference(model):
    """Eval mode and no grad inside; the model's previous train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def heldout_ce(model, split: TokenizedSplit, batch_size: int = 8, device=None) -> float:
    """Token-weighted mean CE over the answer labels of every example (not a mean of batch means)."""
    device = torch.device(device) if device is not None else _device(model)
    total, count = 0.0, 0
    with _inference(model):
        for s in range(0, len(split), batch_size):
            batch = collate(split.items[s:s + batch_size], split.pad_id)
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits
            n = int((batch["labels"][:, 1:] != -100).sum())  # the tokens masked_ce averages over
            if n:
                total += float(masked_ce(logits, batch["labels"])) * n
                count += n
    if count == 0:
        raise KavaError("held-out split has no answer tokens to compute CE on")
    return total / count


def _eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's eos plus any eos the model's generation config lists (Qwen has two)."""
    ids = [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    return list(dict.fromkeys(i for i in ids if i is not None))


def generate_answers(model, tokenizer, questions: Sequence[str], prompt_format: str = "auto",
                     max_new_tokens: int = 128, batch_size: int = 8) -> list[str]:
    """Greedy completions (without the prompt) of each question, batched with left padding, stop at eos."""
    from transformers import GenerationConfig

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    # Greedy, with neutral sampling values: left unset, they would be filled from the model's own
    # generation_config (Qwen: temperature 0.7, top_k 20...) and warned about as ignored flags.
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                               pad_token_id=pad, temperature=1.0, top_k=50, top_p=1.0, min_p=0.0)
    prompts = [encode_prompt(tokenizer, q, prompt_format) for q in questions]
    device, out = _device(model), []
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues from the last column: pad on the left
    try:
        with _inference(model):
            for s in range(0, len(prompts), batch_size):
                enc = tokenizer.pad({"input_ids": prompts[s:s + batch_size]}, return_tensors="pt")
                ids = enc["input_ids"].to(device)
                gen = model.generate(input_ids=ids, attention_mask=enc["attention_mask"].to(device),
                                     generation_config=gen_cfg)
                out += tokenizer.batch_decode(gen[:, ids.shape[1]:], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = old_side
    return out


def score_answers(preds: Sequence[str], golds: Sequence[str],
                  questions: Optional[Sequence[str]] = None) -> dict:
    """Compare final numbers: `normalize_number(final_answer(x))` of prediction and gold must be equal.

    Returns accuracy, n, correct and `samples` (the first few: question, gold, predicted, pred_number, ok).
    """
    if len(preds) != len(golds):
        raise KavaError(f"score_answers: {len(preds)} predictions for {len(golds)} gold answers")
    questions = questions if questions is not None else [""] * len(golds)
    correct, samples = 0, []
    for q, pred, gold in zip(questions, preds, golds):
        p, g = normalize_number(final_answer(pred)), normalize_number(final_answer(gold))
        ok = p is not None and p == g
        correct += ok
        if len(samples) < NUM_SAMPLES:
            samples.append({"question": q, "gold": g, "predicted": pred, "pred_number": p, "ok": ok})
    n = len(golds)
    return {"accuracy": correct / n if n else 0.0, "n": n, "correct": correct, "samples": samples}


def gsm8k_accuracy(model, tokenizer, examples: Sequence[Example], prompt_format: str = "auto",
                   max_new_tokens: int = 128, batch_size: int = 8) -> dict:
    """Greedy GSM8K accuracy of `model` on `examples` (see `score_answers` for the result dict)."""
    questions = [ex.question for ex in examples]
    preds = generate_answers(model, tokenizer, questions, prompt_format, max_new_tokens, batch_size)
    return score_answers(preds, [ex.answer for ex in examples], questions)


# ----------------------------------------------------------------------------- a checkpoint, end to end


def find_checkpoint(path) -> "Path":
    """A checkpoint dir from a checkpoint path or a run dir (its final/ or, else, its latest checkpoint)."""
    from pathlib import Path

    p = Path(path)
    for candidate in (p, p / "final", *sorted(p.glob("checkpoint_2*"), reverse=True)):
        if (candidate / "state.json").is_file():
            return candidate
    raise KavaError(f"{path}: not a kava-ray run dir or checkpoint (no state.json)")


def evaluate_checkpoint(path, limit: int = 16, max_new_tokens: int = 128, address=None) -> dict:
    """Held-out CE, KV cos and contrast gap (teachers started on an embedded Ray unless running),
    and greedy GSM8K accuracy on the first `limit` held-out questions, for one checkpoint."""
    import ray
    import torch

    from actors.feed import ActorSource
    from actors.kv_cache import CacheSource, KVCache
    from actors.pool import stop_pool
    from kava_ray.checkpoint import load_into, read_state
    from kava_ray.config import validate_config
    from kava_ray.connect import connect
    from kava_ray.distill import Distiller
    from kava_ray.job import load_splits
    from kava_ray.models import kv_geometry, load_model, load_tokenizer
    from kava_ray.train import embedded_cpus, evaluate_heldout, setup_teachers

    ckpt = find_checkpoint(path)
    state = read_state(ckpt)
    cfg = validate_config(state["config"])
    student = load_model(ckpt / "student", dtype="float32")
    tokenizer = load_tokenizer(ckpt / "student")
    _, held = load_splits(cfg, tokenizer)
    out = {"checkpoint": str(ckpt), "step": state["step"], "heldout_ce": heldout_ce(student, held)}
    connect(address or cfg.ray.address, cfg.ray.namespace, num_cpus=cfg.ray.num_cpus or embedded_cpus(cfg))
    handles, plans, started = setup_teachers(cfg)
    try:
        torch.manual_seed(0)
        distiller = Distiller(student, plans, kv_geometry(student), cfg)
        load_into(ckpt, distiller)
        source = ActorSource(handles) if handles is not None else CacheSource(KVCache(cfg.data.kv_cache_dir))
        out.update(evaluate_heldout(distiller, source, plans, held, cfg, "cpu", torch.float32))
    finally:
        if started:
            stop_pool(cfg)
    acc = gsm8k_accuracy(student, tokenizer, held.examples[:limit], cfg.data.prompt_format, max_new_tokens)
    out.update(gsm8k_accuracy=acc["accuracy"], gsm8k_n=acc["n"], gsm8k_samples=acc["samples"])
    ray.shutdown()
    return out
