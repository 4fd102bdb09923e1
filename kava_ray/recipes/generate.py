"""`kava-ray generate RUN --prompt TEXT`: sample from a run's student (its final/, a checkpoint, or
any Hugging Face model dir) with `transformers`' `generate` -- what a user does with the distilled
student, in one command.

The student is a plain Hugging Face model (`final/student`), so outside kava-ray the same is:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained("RUN/final/student")
    model = AutoModelForCausalLM.from_pretrained("RUN/final/student")
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.checkpoint import STATE, check_whole_student, find_checkpoint
from kava_ray.core.models import load_model, load_tokenizer
from kava_ray.data.records import use_chat


def student_dir(path) -> Path:
    """The student a run dir (its final/, else its latest checkpoint), a checkpoint or a model dir
    names; a sharded checkpoint's (FSDP2 mid-run: a config, no weights) is one line naming
    final/."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        if (p.parent / STATE).is_file():  # CKPT/student of a checkpoint (a sharded one: one line)
            check_whole_student(p.parent, "generate from")
        return p  # a Hugging Face model dir (e.g. RUN/final/student itself)
    ckpt = find_checkpoint(p)
    check_whole_student(ckpt, "generate from")
    return ckpt / "student"


def generate(path, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
             seed: int = 0, chat: Optional[bool] = None) -> dict:
    """The student's completion of `prompt`: greedy at temperature 0, else sampled (seeded). chat:
    wrap the prompt in the tokenizer's chat template (None: when it has one)."""
    if not prompt.strip():
        raise KavaError(f"--prompt {prompt!r}: empty; give the text the student should continue, e.g. "
                        f"--prompt \"Why is the sky blue?\"")
    if max_new_tokens < 1:
        raise KavaError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise KavaError(f"--temperature {temperature} / --top-p {top_p}: need temperature >= 0 and 0 < top_p <= 1")
    where = student_dir(path)
    tok = load_tokenizer(where)
    model = load_model(where, dtype="float32" if not torch.cuda.is_available() else "auto").eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    templated = use_chat(tok, "auto") if chat is None else chat
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                   add_generation_prompt=True) if templated else prompt
    ids = tok(text, return_tensors="pt", add_special_tokens=not templated).to(device)
    torch.manual_seed(seed)
    sample = temperature > 0
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=temperature if sample else None, top_p=top_p if sample else None,
                             top_k=None, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    new = out[0, ids["input_ids"].shape[1]:]
    return {"student": str(where), "prompt": prompt, "chat_template": templated,
            "completion": tok.decode(new, skip_special_tokens=True), "new_tokens": int(new.numel())}
