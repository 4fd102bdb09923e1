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
from transformers import GenerationConfig


@dataclass
class Samples:
    """Per row: the sampled token ids (ending with an EOS id where one was drawn) and each one's
    sampling log-prob (None from an engine that gives none: a teacher's text)."""

    ids: list[list[int]]
    logp: Optional[list[list[float]]]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.ids)


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
    gc = GenerationConfig(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0,
                          max_new_tokens=int(max_new_tokens), pad_token_id=int(pad_id),
                          eos_token_id=eos or None, output_scores=True, return_dict_in_generate=True)
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
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    finally:
        model.generation_config = own
        model.train(was_training)
    new = out.sequences[:, ids.shape[1]:]  # [B, N]
    logp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in out.scores], dim=1)  # [B, N, V], processed
    picked = logp.gather(-1, new[..., None])[..., 0].cpu()  # [B, N]
    rows, lps = [], []
    for b in range(new.shape[0]):
        r = new[b].tolist()
        n = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        rows.append(r[:n])
        lps.append(picked[b, :n].tolist())
    return Samples(rows, lps)
