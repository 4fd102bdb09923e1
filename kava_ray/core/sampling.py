"""Sampling completions from a causal LM (the student on its own worker, or a teacher in its actor)
for on-policy distillation: Hugging Face `generate` with its KV cache, seeded per batch, and the
log-prob of every sampled token under the distribution it was drawn from (temperature and top-p
applied: what an importance ratio divides by). Pure PyTorch + transformers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper


@dataclass
class Samples:
    """Per row: the sampled token ids (ending with an EOS id where one was drawn) and each one's
    sampling log-prob (None from an engine that gives none: a teacher's text)."""

    ids: list[list[int]]
    logp: Optional[list[list[float]]]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.ids)


class ChosenLogp(LogitsProcessor):
    """The last processor of a sampling `generate`: keeps each sampled token's log-prob under the
    distribution it was drawn from, and nothing else. At step t it reads step t - 1's choice from
    the token generate appended and gathers its log-prob, then holds step t's log-softmax [B, V]
    until the next step: one step's [B, V] at a time, where `output_scores` keeps every step's
    (16 rows x 1k new tokens x 152k ids: ~10 GB in fp32)."""

    def __init__(self):
        self.last: Optional[torch.Tensor] = None  # [B, V] fp32, the step just processed
        self.picked: list[torch.Tensor] = []  # [B, 1] per step before it

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.picked.append(self.last.gather(-1, input_ids[:, -1:]))
        self.last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor, n: int) -> torch.Tensor:
        """[B, n] log-probs of the n sampled tokens, the last read from `sequences`' last column."""
        if n == 0:
            return torch.zeros((sequences.shape[0], 0))
        picked = self.picked + [self.last.gather(-1, sequences[:, -1:])]
        self.last = None
        return torch.cat(picked, dim=1)


def _left_padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] ids and mask, each prompt right-aligned (generation appends after the last column)."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for b, p in enumerate(prompts):
        if p:
            ids[b, P - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, P - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
           eos_ids: list[int] | None = None, pad_id: int = 0, seed: int = 0, autocast=None) -> Samples:
    """Sample one completion per prompt (token id lists) with `model.generate` (do_sample, top_k
    off, the given temperature and top_p; nothing of the model's own generation config, whose fields
    generate() would otherwise fill in), under `torch.manual_seed(seed)` in a forked RNG (the
    caller's RNG state is untouched, and one seed gives one sample). The model is put in eval mode
    for the call (no dropout while sampling) and back. Returns `Samples`, each row cut after its
    first EOS."""
    device = model.get_input_embeddings().weight.device
    ids, mask = _left_padded(prompts, pad_id, device)
    eos = [int(e) for e in (eos_ids or []) if e is not None]
    # temperature and top-p as generate's own warpers, in its order, with the recorder after them (generate puts
    # processors passed in before the warpers it makes itself: left at 1, it makes none)
    gc = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=int(max_new_tokens),
                          pad_token_id=int(pad_id), eos_token_id=eos or None, return_dict_in_generate=True)
    chosen = ChosenLogp()
    warpers = [TemperatureLogitsWarper(float(temperature))] if float(temperature) != 1.0 else []
    warpers += [TopPLogitsWarper(top_p=float(top_p))] if float(top_p) < 1.0 else []
    was_training, own = model.training, model.generation_config
    model.eval()
    # generate() fills every field `gc` leaves unset from model.generation_config (a checkpoint's
    # repetition_penalty, min_p, no_repeat_ngram_size, ...): q would not be the student's
    # distribution. A blank one for the call leaves the global defaults, no processor but the ones
    # set here (TRL pins its kwargs likewise, transformers#42762)
    model.generation_config = GenerationConfig()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), (autocast() if autocast else contextlib.nullcontext()):
            torch.manual_seed(int(seed))
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                                 logits_processor=LogitsProcessorList([*warpers, chosen]))
    finally:
        model.generation_config = own
        model.train(was_training)
    new = out.sequences[:, ids.shape[1]:]  # [B, N]
    picked = chosen.finish(out.sequences, new.shape[1]).cpu()  # [B, N]
    rows, lps = [], []
    for b in range(new.shape[0]):
        r = new[b].tolist()
        n = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        rows.append(r[:n])
        lps.append(picked[b, :n].tolist())
    return Samples(rows, lps)
