"""Held-out evaluation: CE on the tokens that carry loss (and perplexity for text), greedy GSM8K
accuracy (gsm8k records only), and KV alignment against the teachers.

`heldout_ce`, `generate_answers`, `score_answers`, `answer_accuracy` (the one generate-and-score
route: `kava-ray eval`'s GSM8K accuracy and the task benches' exact match) and `gsm8k_accuracy` are
plain PyTorch + Hugging Face. `evaluate_heldout` reads teacher KV through a KVFeed (live actors or
the on-disk cache), and `evaluate_checkpoint` (`kava-ray eval`) sets up the job's teachers through
`kava_ray.runtime.job`, so this module belongs to the orchestration layer. Those two (Ray) are
imported where used: the recipe imports this module, and `kava-ray bench gpu` builds the recipe on
images without Ray. Accuracy on the tiny random test models is ~0 (they emit byte noise); it is
meaningful only for real instruction-tuned models (the demo's SmolLM2, Qwen2.5).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Optional, Sequence

import torch
from transformers import GenerationConfig

from kava_ray.common.config import LossConfig, derive, flatten
from kava_ray.common.errors import KavaError
from kava_ray.core.align.layers import heaviest_sources
from kava_ray.core.checkpoint import check_whole_student, checkpoint_config, held_checkpoint, load_into
from kava_ray.core.kv import student_forward_kv
from kava_ray.core.logit_kd import VocabTerms, logit_targets, next_labels
from kava_ray.core.losses import next_token_mask
from kava_ray.core.metric_names import (
    ALIGNED,
    CE,
    CONTRAST_GAP,
    COS,
    COS_RAW,
    COS_SIM,
    KV_TOKENS,
    LABEL_TOKENS,
    LOGIT_KL,
    LOGIT_PER_TEACHER,
    TOP1_AGREE,
    of,
)
from kava_ray.core.models import kv_geometry, load_model, load_tokenizer
from kava_ray.core.plans import (
    copied_layers,
    logit_specs,
    teacher_logits_top_k,
    teacher_tokenizers,
    vocab_maps,
    wants_hidden,
)
from kava_ray.core.probe import KVAlignment
from kava_ray.core.vocab_chunks import VocabReader
from kava_ray.data import Example, TokenizedSplit, collate, encode_prompt, final_answer
from kava_ray.data.answers import correct
from kava_ray.data.sources import source_path
from kava_ray.data.splits import carved, eval_stream, load_test_split, one_source
from kava_ray.recipes.build import build_distiller
from kava_ray.runtime.preflight import preflight

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


def heldout_ce(model, split: TokenizedSplit, batch_size: int = 8, device=None,
               vocab_chunk: int = LossConfig().vocab_chunk) -> float:
    """Token-weighted mean CE over the answer labels of every example (not a mean of batch means);
    the logits `vocab_chunk` positions at a time (`core.vocab_chunks`; 0: whole)."""
    device = torch.device(device) if device is not None else _device(model)
    total, count = 0.0, 0
    with _inference(model):
        for s in range(0, len(split), batch_size):
            batch = collate(split.items[s:s + batch_size], split.pad_id)
            reader = VocabReader(model, vocab_chunk, batch.input_ids.numel())
            with reader.capture():
                out = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                            **reader.forward_kwargs())
            n = int((batch.labels[:, 1:] != -100).sum())  # the tokens masked_ce averages over
            if n:
                total += float(student_ce(reader, out, batch.labels)) * n
                count += n
    if count == 0:
        raise KavaError("held-out split has no answer tokens to compute CE on")
    return total / count


def student_ce(reader: VocabReader, out, labels: torch.Tensor) -> torch.Tensor:
    """The forward's next-token CE over the label positions (`losses.masked_ce`), read whole or in chunks."""
    return reader.terms(out, VocabTerms(next_labels(labels, reader.device(out))))[1][CE].value


def _eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's eos plus any eos the model's generation config lists (Qwen has two)."""
    ids = [tokenizer.eos_token_id]
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
    return list(dict.fromkeys(i for i in ids if i is not None))


def generate_answers(model, tokenizer, questions: Sequence[str], prompt_format: str = "auto",
                     max_new_tokens: int = 128, batch_size: int = 8) -> list[str]:
    """Greedy completions (without the prompt) of each question, batched with left padding, stop at eos."""
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


def score_answers(preds: Sequence[str], golds: Sequence[str], questions: Optional[Sequence[str]] = None,
                  checker: str = "number") -> dict:
    """Score predictions by `checker` (`data.answers.correct`: `number`, the final numbers equal;
    `exact`, the whole completion). {"accuracy", "n", "correct", "ok" (1 / 0 per row, in order: what
    a bootstrap over prompts resamples), "samples" (the first few: question, gold, predicted, ok;
    `number` adds pred_number and gives gold as its number)}."""
    if len(preds) != len(golds):
        raise KavaError(f"score_answers: {len(preds)} predictions for {len(golds)} gold answers")
    questions = questions if questions is not None else [""] * len(golds)
    ok = [int(correct(checker, pred, gold)) for pred, gold in zip(preds, golds)]
    samples = []
    for q, pred, gold, o in list(zip(questions, preds, golds, ok))[:NUM_SAMPLES]:
        if checker == "number":
            samples.append({"question": q, "gold": final_answer(gold), "predicted": pred,
                            "pred_number": final_answer(pred), "ok": bool(o)})
        else:
            samples.append({"question": q, "gold": gold, "predicted": pred, "ok": bool(o)})
    n = len(golds)
    return {"accuracy": sum(ok) / n if n else 0.0, "n": n, "correct": sum(ok), "ok": ok, "samples": samples}


def answer_accuracy(model, tokenizer, questions: Sequence[str], golds: Sequence[str], checker: str = "number",
                    prompt_format: str = "auto", max_new_tokens: int = 128, batch_size: int = 8) -> dict:
    """Greedy answers of `model` to `questions` (`generate_answers`), scored against `golds` by
    `checker` (`score_answers`, whose dict it returns)."""
    preds = generate_answers(model, tokenizer, questions, prompt_format, max_new_tokens, batch_size)
    return score_answers(preds, golds, questions, checker)


def gsm8k_accuracy(model, tokenizer, examples: Sequence[Example], prompt_format: str = "auto",
                   max_new_tokens: int = 128, batch_size: int = 8) -> dict:
    """Greedy GSM8K accuracy of `model` on `examples`: `answer_accuracy` with the `number` checker."""
    return answer_accuracy(model, tokenizer, [ex.question for ex in examples], [ex.answer for ex in examples],
                           "number", prompt_format, max_new_tokens, batch_size)


# ----------------------------------------------------------------------------- KV alignment, held out


@torch.no_grad()
def evaluate_heldout(distiller, source, plans: dict, split: TokenizedSplit, cfg, device, dtype,
                     prefix: str = "eval", autocast=contextlib.nullcontext, teacher_ce: bool = False) -> dict:
    """Held-out CE, KV cos (overall and per teacher) and contrast gap, token-weighted over the
    split, as `<prefix>/<metric>` (`eval/` for the validation split during training, `test/` for the
    test split).

    CE, logit KL and top-1 agreement are weighted by the next-token positions CE counts
    (`label_tokens`), the KV metrics by the tokens the KV loss counts (`loss.loss_tokens`). Sums
    stay float64 tensors until the end: one conversion, not one per batch. `autocast`: a context
    factory -- the training step's (`Precision.autocast`) during training; none (fp32, as
    `heldout_ce` and `kava-ray eval`) for the test split. teacher_ce: also
    `<prefix>/teacher_ce/<t>`, each teacher's own CE on the same next-token positions (the teachers
    sharing the student's tokenizer: from the log-prob they serve each next token), the figure the
    student's CE is read against.
    """
    from kava_ray.rollout.feed import KVFeed, feed_items  # Ray: see the module docstring

    was_training = distiller.training
    distiller.eval()
    stream = eval_stream(split, cfg.train, drop_last=False)  # every row: a split not a multiple of the batch too
    feed = KVFeed(source, feed_items(stream, stream.steps_per_epoch), {n: p.layers for n, p in plans.items()},
                  depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, device=device, dtype=dtype,
                  logits_top_k=teacher_logits_top_k(cfg.loss, plans), hidden=wants_hidden(cfg.loss),
                  token_logprobs=[n for n, p in plans.items() if not p.aligned] if teacher_ce else ())
    sums: dict = {}
    weights: dict = {KV_TOKENS: 0, LABEL_TOKENS: 0}
    free = direct_alignment(cfg, plans)
    for (_, _, _, batch), kv in feed:
        with autocast():
            out = distiller(batch.to(device), kv, output_student_kv=bool(free))
        m, skv = out.metrics, out.student_kv
        for t, kva in free.items():  # the student's own KV against its source layers, no projector
            kva.score_batch((skv.keys, skv.values), (kv[t].keys, kv[t].values), batch.attention_mask.to(device))
        for w in weights:
            weights[w] = weights[w] + m[w].double()
        # CE and the logit KD: per next-token position CE counts
        label_keys = [CE] + [k for k in m if k == LOGIT_KL or k.startswith(LOGIT_PER_TEACHER)]
        for k in label_keys:
            sums[k] = sums.get(k, 0) + m[k].double() * m[LABEL_TOKENS]
        if teacher_ce:  # each teacher's -log p of the next token, on the positions CE counts
            counted = next_labels(batch.labels, device) != -100
            for t, t_kv in kv.items():
                if t_kv.token_logp is not None:
                    k = of("teacher_ce", t)
                    sums[k] = sums.get(k, 0) - (t_kv.token_logp.to(device).double() * counted).sum()
        kv_keys = [COS_SIM, COS_RAW, CONTRAST_GAP] + [of(c, t) for c in (COS, COS_RAW) for t in plans]
        kv_keys += [k for k in m if k.startswith(of(ALIGNED, ""))]  # teachers of another tokenizer: share covered
        for k in (k for k in kv_keys if k in m):  # KV: per token the KV loss counts (none: no teacher ships KV)
            sums[k] = sums.get(k, 0) + m[k].double() * m[KV_TOKENS]
    distiller.train(was_training)
    by_label = {k for k in sums if k == CE or k == LOGIT_KL or k.startswith(LOGIT_PER_TEACHER)}
    by_label |= {k for k in sums if k.startswith("teacher_ce/")}  # already summed per position: divided alike
    out = {of(prefix, k): float(v / max(float(weights[LABEL_TOKENS if k in by_label else KV_TOKENS]), 1))
           for k, v in sums.items()}
    if split.format == "text":  # language modelling: per-token CE and its perplexity
        out[f"{prefix}/ppl"] = math.exp(min(out[f"{prefix}/ce"], 50.0))
    for t, kva in free.items():
        out.update({of(prefix, k): v for k, v in free_cos(t, kva).items()})
    return out


def direct_alignment(cfg, plans: dict) -> dict:
    """{teacher: `direct_kv_alignment`} for each teacher the student was copied from by `keep_layers`."""
    found = {t: direct_kv_alignment(p, copied_layers(cfg.student, cfg.teacher(t))) for t, p in plans.items()}
    return {t: kva for t, kva in found.items() if kva is not None}


def direct_kv_alignment(plan, src: Optional[list[int]]) -> Optional[KVAlignment]:
    """A direct (projector-free, no probe) `probe.KVAlignment` of the student against the teacher
    layers `src` it was copied from, when the teacher ships them all; None otherwise. A student
    layer 0 copied from teacher layer 0 reads the same embeddings (~1 by construction) and is left
    out of the mean."""
    if src is None or plan.aligned or not all(layer in plan.layers for layer in src):
        return None
    return KVAlignment([plan.layers.index(layer) for layer in src], exclude=[0] if src[0] == 0 else [])


def free_cos(teacher: str, kva: KVAlignment) -> dict:
    """`kv_cos_free/<t>` (the mean over student layers, a copied layer 0 left out) and `kv_cos_free/<t>/layer<i>`."""
    res = kva.result()
    return {f"kv_cos_free/{teacher}": res["kv_cos_free"],
            **{f"kv_cos_free/{teacher}/layer{i}": c for i, c in enumerate(res["per_layer"])}}


# ----------------------------------------------------------------------------- figures every recipe shares


@torch.no_grad()
def score_student(student, source, plans: dict, split: TokenizedSplit, cfg, device="cpu", logit_top_k: int = 0,
                  alignment: Optional[dict] = None) -> dict:
    """The held-out figures that do not depend on how a student was trained, computed the same way
    for every recipe (a `ce` run included): one pass over `split` with the teachers' outputs from
    `source`.

    - `ce`: next-token CE over the label positions, token-weighted, fp32 without autocast (as `heldout_ce`
      and `kava-ray eval`); `tokens`: how many positions it averages over;
    - with `logit_top_k` > 0, per teacher sharing the student's tokenizer: `kl/<t>`, the full-vocabulary
      top-k KL(teacher || student) with the tail bucket at T = 1 (`losses.topk_kl_loss`, the KD loss itself),
      and `top1_agree/<t>`, on the same positions;
    - `alignment` {teacher: `probe.KVAlignment`, already fit when it probes}: `kv_cos_free/<t>`, the
      projector-free centred KV cosine (see `kava_ray.core.probe`) over the real tokens, the mean over student
      layers with a copied layer 0 left out, and `kv_cos_free/<t>/layer<i>` per student layer.
    """
    from kava_ray.rollout.feed import KVFeed, feed_items  # Ray: see the module docstring

    stream = eval_stream(split, cfg.train)
    same = {n: p for n, p in plans.items() if not p.aligned}
    specs = logit_specs(cfg.loss, same) if logit_top_k else {}
    logit_names = list(specs)
    kd = derive(cfg, {"loss.logit_top_k": logit_top_k, "loss.logit_temperature": 1.0,
                      "loss.logit_tail": "bucket"}).loss if logit_names else None  # top-k 0: no logit figures
    feed = KVFeed(source, feed_items(stream, stream.steps_per_epoch), {n: p.layers for n, p in plans.items()},
                  depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, device=device,
                  logits_top_k={n: (logit_top_k if n in logit_names else 0) for n in plans})
    sums: dict = {}
    n_lab = 0
    with _inference(student):
        for (_, _, _, batch), kv in feed:
            ids, mask = batch.input_ids.to(device), batch.attention_mask.to(device)
            reader = VocabReader(student, cfg.loss.vocab_chunk, ids.numel())
            with reader.capture():
                out, skv = student_forward_kv(student, ids, mask, key_space=cfg.align.key_space,
                                              **reader.forward_kwargs())
            nxt = next_token_mask(batch.labels).to(device)
            n = int(nxt.sum())
            n_lab += n
            for k, v in _logit_figures(reader, out, batch, nxt, kv, specs, kd).items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
            for t, kva in (alignment or {}).items():
                kva.score_batch((skv.keys, skv.values), (kv[t].keys, kv[t].values), mask)
    out = {k: v / max(n_lab, 1) for k, v in sums.items()}
    out["tokens"] = n_lab
    for t, kva in (alignment or {}).items():
        out.update(free_cos(t, kva))
        out["kv_cos_free_method"] = kva.result()["method"]
    return out


def _logit_figures(reader: VocabReader, out, batch, nxt: torch.Tensor, kv: dict, specs: dict, kd) -> dict:
    """One batch's CE, kl/<t> and top1_agree/<t> (means over its next-token positions), read whole or in chunks."""
    dev, vocab = reader.device(out), reader.vocab(out)
    terms = VocabTerms(next_labels(batch.labels, dev), kd, shared_lse=True)  # (kd: temperature 1)
    for t, spec in specs.items():
        terms.add(t, spec.to(dev), logit_targets(spec.to(dev), kv[t], batch, nxt, kd, vocab, dev)[0])
    read = reader.terms(out, terms)[1]
    return {CE: read[CE].value, **{f"kl/{t}": read[of("kl", t)].value for t in specs},
            **{of(TOP1_AGREE, t): read[of(TOP1_AGREE, t)].value for t in specs}}


def kv_alignment(student, source, plans: dict, train_split: TokenizedSplit, cfg, copied: dict,
                 device="cpu", fit_batches: int = 16) -> dict:
    """{teacher: `probe.KVAlignment`} ready to score: direct for a teacher the student was copied
    from by `keep_layers` whose source layers it ships (`copied[t]`, `job.copied_layers`) and whose
    KV geometry it kept, else a linear probe from each student layer to the heaviest teacher layer
    of its layer map, fit on the first `fit_batches` batches of `train_split` (the frozen student's
    KV against the teacher's). A copy whose attention was width-pruned (`core.prune`) has the
    teacher's layers but not its heads: a probe."""
    from kava_ray.rollout.feed import KVFeed, feed_items  # Ray: see the module docstring

    out, probes = {}, {}
    s_geom = kv_geometry(student.config)
    for t, p in plans.items():
        same = (p.geometry.num_kv_heads, p.geometry.head_dim) == (s_geom.num_kv_heads, s_geom.head_dim)
        direct = direct_kv_alignment(p, copied.get(t)) if same else None
        if direct is not None:
            out[t] = direct
        elif not p.aligned and p.layers:  # a teacher of another tokenizer would need its KV in student time first
            out[t] = probes[t] = KVAlignment([p.layers.index(t_layer) for t_layer in heaviest_sources(p.layer_map)],
                                             probe=True)
    if probes:
        stream = eval_stream(train_split, cfg.train)
        n = min(fit_batches, stream.steps_per_epoch)
        feed = KVFeed(source, feed_items(stream, n), {t: plans[t].layers for t in probes},
                      depth=cfg.align.prefetch_depth, wire_dtype=cfg.align.wire_dtype, device=device)
        with _inference(student):
            for (_, _, _, batch), kv in feed:
                mask = batch.attention_mask.to(device)
                _, skv = student_forward_kv(student, batch.input_ids.to(device), mask, key_space=cfg.align.key_space)
                for t, kva in probes.items():
                    kva.fit_batch((skv.keys, skv.values), (kv[t].keys, kv[t].values), mask)
        for kva in probes.values():
            kva.fit()
    return out


# ----------------------------------------------------------------------------- a checkpoint, end to end


# what `kava-ray eval RUN KEY=VALUE ...` may change: what it is evaluated on and how, not what was trained
EVAL_OVERRIDABLE = ("data.", "train.batch_size", "train.max_length", "loss.vocab_chunk", "ray.")


# where a carved run (`splits.carved`) cut its test rows from its one file: eval of that file keeps them
CARVE_KEYS = ("data.num_train", "data.num_val", "data.num_test", "data.train_split", "data.test_split",
              "data.allow_overlap")


def same_source(a, b) -> bool:
    """Whether two jobs read the same data: the same local file or directory (resolved: `./x.jsonl`,
    its absolute path and a symlink to it are one), or the same hub dataset and config."""
    pa, pb = (source_path(c.data.source, "{split}") for c in (a, b))
    if pa is None or pb is None:
        return (a.data.source, a.data.hub_config) == (b.data.source, b.data.hub_config)
    return os.path.realpath(pa) == os.path.realpath(pb)


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def eval_config(cfg, overrides: Optional[Sequence[str]]):
    """The checkpoint's job with `overrides` (another test file, split or size); a key the
    checkpoint fixes (its models, projectors, losses) is one line.

    Another `data.source` (`same_source`: not the run's own) is the data to test on: its test split
    whole (the job's `num_test` capped its own test split, not this one; give `data.num_test` to cap
    it), and a file or directory without `{split}` is all test split: nothing trains here, so
    nothing is carved from it (`data.allow_overlap`: one file is every split). The run's own source
    is its own test split; where the run carved it from one file, a change of where the carve falls
    (`CARVE_KEYS`) is one line: its test rows would move onto rows it trained on."""
    from kava_ray.common.config import load_config, parse_override

    keys = []
    for line in overrides or []:
        key = ".".join(parse_override(line)[0])
        if not key.startswith(EVAL_OVERRIDABLE):
            may = ", ".join(k.rstrip(".") + (".*" if k.endswith(".") else "") for k in EVAL_OVERRIDABLE)
            raise KavaError(f"eval override {line!r}: {key} is the checkpoint's own (eval may change {may})")
        keys.append(key)
    run, cfg = cfg, load_config(cfg, list(overrides or []))
    own = same_source(run, cfg)
    if "data.source" in keys and not own and cfg.data.source != "synthetic":
        return derive(cfg, {**({} if "data.num_test" in keys else {"data.num_test": None}),
                            **({"data.allow_overlap": True} if one_source(cfg.data) else {})})
    if own and carved(run.data):
        was, now = flatten(run.to_dict()), flatten(cfg.to_dict())
        moved = [f"{k}={_value(now[k])}" for k in CARVE_KEYS if now[k] != was[k]]
        if moved:
            raise KavaError(f"eval {', '.join(moved)}: this run carved its test split from its one file "
                            f"{run.data.source} ({', '.join(f'{k}={_value(was[k])}' for k in CARVE_KEYS[:3])}); "
                            f"another carve would test on rows it trained on (keep the run's, or test on another "
                            f"file: data.source=...)")
    return cfg


def evaluate_checkpoint(path, limit: int = 16, max_new_tokens: int = 128, address=None,
                        restart_teachers: bool = False, overrides: Optional[Sequence[str]] = None) -> dict:
    """Test-split CE, KV cos and contrast gap (the job's teachers: running, started here, or its KV
    cache), each teacher's own test CE beside the student's, and greedy GSM8K accuracy on the first
    `limit` test questions, for one checkpoint. overrides: KEY=VALUE on the checkpoint's job
    (`eval_config`), e.g. another test file."""
    from kava_ray.runtime.console import status  # Ray: see the module docstring

    with held_checkpoint(path) as (ckpt, real, live):  # a live run's checkpoint stays while it is read
        if live:
            status(f"eval: {live}")
        return _evaluate(ckpt, real, limit, max_new_tokens, address, restart_teachers, overrides)


def _evaluate(ckpt: Path, real: Path, limit: int, max_new_tokens: int, address, restart_teachers: bool,
              overrides: Optional[Sequence[str]]) -> dict:
    from kava_ray.runtime.console import status  # Ray: see the module docstring
    from kava_ray.runtime.job import job_teachers

    ckpt, state, cfg = checkpoint_config(ckpt)  # one line for a missing or corrupt checkpoint
    cfg = eval_config(cfg, overrides)
    check_whole_student(ckpt, "evaluate")
    preflight(cfg, "eval", resume=ckpt, address=address)  # before Ray or any teacher starts
    student = load_model(ckpt / "student", dtype="float32")
    tokenizer = load_tokenizer(ckpt / "student")
    with job_teachers(cfg, address, restart=restart_teachers) as job:
        teacher_toks = teacher_tokenizers(job.plans)
        test = load_test_split(cfg.data, cfg.train, tokenizer, teacher_toks)  # what a run reports once at its end
        status(f"eval: step {state['step']} of {real.parent.name} on {len(test)} test rows ({cfg.data.source})")
        out = {"checkpoint": str(real), "step": state["step"], "test_rows": len(test)}
        torch.manual_seed(0)
        distiller = build_distiller(student, job.plans, kv_geometry(student), cfg,
                              vocab_maps(cfg.loss, cfg.student, job.plans, tokenizer,
                                         teacher_toks), sharded=cfg.ray.sharded)
        load_into(ckpt, distiller)
        out.update(evaluate_heldout(distiller, job.source(), job.plans, test, cfg, "cpu", torch.float32,
                                    prefix="test", teacher_ce=cfg.data.kv_source == "live"))
    if test.format == "gsm8k" and limit > 0:  # exact match needs a final answer to compare
        status(f"eval: greedy answers to {min(limit, len(test))} test questions")
        acc = gsm8k_accuracy(student, tokenizer, test.examples[:limit], cfg.data.prompt_format, max_new_tokens)
        out.update(gsm8k_accuracy=acc["accuracy"], gsm8k_n=acc["n"], gsm8k_samples=acc["samples"])
    return out
