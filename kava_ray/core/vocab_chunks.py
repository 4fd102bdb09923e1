"""The terms that read the student's logits (CE, logit KD, the divergences), over chunks of
positions, so that the logits [B, T, V] never exist at once (`loss.vocab_chunk` positions at a
time).

Each chunk's logits are made from the final hidden states by the LM head, its terms computed, and --
in training -- their gradients with respect to the chunk's hidden states and the head taken right
there, in the forward, before the chunk's logits are freed (Liger-Kernel's
`LigerFusedLinearCrossEntropyFunction`, liger_kernel/ops/ fused_linear_cross_entropy.py: the
gradient computed chunk by chunk in the forward and scaled by the incoming one in the backward).
Liger writes each loss's gradient by hand; here autograd takes it per chunk, so every term of
`core.logit_kd` works unchanged and nothing is recomputed (torchtune's `CEWithChunkedOutputLoss`
chunks the same way but keeps every chunk's logits for the backward). Each term is a masked mean
over positions: a chunk's mean counts with the weight (its positions) / (all positions), so the
result equals the whole-logits path exactly. Details and measurements:
docs/internals/step.md#vocab-chunks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from kava_ray.common.errors import KavaError
from kava_ray.core.metric_names import of

# config attributes of families whose logits are more than the head of the last hidden state (Gemma
# 2/3's soft cap, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier):
# they keep the whole-logits path; any other family is checked on its first forward
# (`VocabReader.terms`: the forward's last-position logits against the head of the captured hidden
# state)
_SCALED = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


@dataclass
class Term:
    """One term read from the student's logits, named `name` (CE, or of a logit `teacher`): `value`
    its mean over the positions that count and `count` how many (of a chunk's; in what the reader
    returns, the whole batch's mean and count); `coef` its weight in the loss (None: a figure, not
    in the loss) and `total` the positions it counts over the whole batch (set with a coef: a
    chunk's mean weighs count / total)."""

    name: str
    value: torch.Tensor
    count: torch.Tensor
    teacher: Optional[str] = None
    coef: Any = None
    total: Optional[torch.Tensor] = None

    @property
    def key(self) -> str:
        """Its name among a chunk's terms: `name`, or a teacher's `<name>/<teacher>` (`metric_names.of`)."""
        return self.name if self.teacher is None else of(self.name, self.teacher)


# what the reader calls on the logits [B, t, V] of the positions `sl` (all, or a chunk): {Term.key: Term}
TermsFn = Callable[[torch.Tensor, slice], dict[str, Term]]

def head_of(model) -> tuple[Optional[nn.Linear], str]:
    """(the LM head, "") when the model's logits are `head(last hidden state)` and its forward can
    skip them (`logits_to_keep`), else (None, why not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return None, "its LM head is not one Linear"
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg  # (multimodal configs nest it)
    scaled = [a for c in (cfg, text) for a in _SCALED if getattr(c, a, None) not in (None, 1, 1.0)]
    if scaled:
        return None, f"its logits are scaled after the head ({scaled[0]})"
    if not _keeps_logits(type(model)):
        return None, "its forward has no logits_to_keep"
    if not hasattr(model, "get_decoder"):
        return None, "it has no get_decoder()"
    return head, ""


@functools.lru_cache(maxsize=None)
def _keeps_logits(cls) -> bool:
    """Whether a model class's forward takes `logits_to_keep` (asked once per class)."""
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


class LastHidden:
    """Captures the decoder's final hidden state (after its last norm: what the LM head reads)
    during a forward: `.value` [B, T, hidden]. A forward hook on `model.get_decoder()`."""

    def __init__(self, model):
        self.decoder = model.get_decoder()
        self.value = None

    def _hook(self, _mod, _args, out):
        self.value = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def __enter__(self) -> "LastHidden":
        self.handle = self.decoder.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def chunk_slices(batch: int, time: int, chunk: int) -> list[slice]:
    """Slices of the time axis holding about `chunk` positions of a batch of `batch` rows each (one for chunk 0)."""
    if chunk <= 0:
        return [slice(None)]
    step = max(1, -(-chunk // max(batch, 1)))
    return [slice(t, min(t + step, time)) for t in range(0, time, step)]


def whole_terms(fn: TermsFn, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, Term]]:
    """The terms on whole logits [B, T, V]: (sum of coef * value over the terms with a coef, {key: Term, detached})."""
    terms = fn(logits, slice(None))
    loss = sum((t.coef * t.value for t in terms.values() if t.coef is not None),
               logits.new_zeros((), dtype=torch.float32))
    return loss, {k: replace(t, value=t.value.detach()) for k, t in terms.items()}


def chunked_terms(fn: TermsFn, hidden: torch.Tensor, head: nn.Linear, chunk: int) -> tuple[torch.Tensor, dict]:
    """The same as `whole_terms(fn, head(hidden))`, `chunk` positions at a time: hidden [B, T, h].

    fn(logits [B, t, V], the time slice) -> {key: Term} (each a mean over the chunk's positions; a term of the loss
    with its coef and its positions over the whole batch, `total`). Each chunk's logits, terms and (training) the
    gradients of its share of the loss are taken here, in one loop; the loss carries them to `hidden` and the head's
    parameters (`_FusedHead`). Returns (the loss; {key: Term of the whole batch's mean and count, detached})."""
    weight, bias = head.weight, head.bias
    train = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    grads = [torch.zeros_like(hidden), None, None] if train else None  # d hidden, d weight, d bias
    loss = hidden.new_zeros((), dtype=torch.float32)
    sums: dict[str, Term] = {}
    for sl in chunk_slices(hidden.shape[0], hidden.shape[1], chunk):
        with torch.enable_grad() if train else torch.no_grad():
            h = hidden[:, sl].detach().requires_grad_(train and hidden.requires_grad)
            w = weight.detach().requires_grad_(train and weight.requires_grad)
            b = None if bias is None else bias.detach().requires_grad_(train and bias.requires_grad)
            terms = fn(F.linear(h, w, b), sl)  # [B, t, V] logits live only in here
            share = sum((t.coef * t.value * (t.count / t.total.clamp(min=1)) for t in terms.values()
                         if t.coef is not None and not _zero(t.coef)), loss.new_zeros(()))
            if train and share.requires_grad:  # each chunk writes its own positions of d hidden; d weight and
                wrt = [x for x in (h, w, b) if x is not None and x.requires_grad]  # d bias sum over the chunks
                got = iter(torch.autograd.grad(share, wrt))
                if h.requires_grad:
                    grads[0][:, sl] = next(got)
                for i, x in ((1, w), (2, b)):
                    if x is not None and x.requires_grad:
                        g = next(got).float()  # summed over the chunks in fp32, cast once (`_FusedHead`)
                        grads[i] = g if grads[i] is None else grads[i].add_(g)
        loss = loss + share.detach()
        for k, t in terms.items():  # {key: Term whose value is the sum of mean * count so far}
            s0, n0 = (sums[k].value, sums[k].count) if k in sums else (0.0, 0)
            sums[k] = replace(t, value=s0 + t.value.detach().float() * t.count, count=n0 + t.count)
    if train:
        loss = _FusedHead.apply(hidden, weight, bias, loss, grads)
    return loss, {k: replace(t, value=(t.value / t.count.clamp(min=1)).detach()) for k, t in sums.items()}


def _zero(coef) -> bool:
    """A coefficient known to be 0 without a device sync (a python number): its term is left out of the loss."""
    return isinstance(coef, (int, float)) and coef == 0


class _FusedHead(torch.autograd.Function):
    """The chunked loss (`chunked_terms`) with the gradients its chunk loop took: scaled by the
    incoming gradient in the backward, each cast to its input's dtype.

    The head's gradient is a sum over the chunks, accumulated in fp32 and cast once: summed in a
    bf16 head's own dtype, each of the (chunks - 1) additions rounds to 8 bits of mantissa (a bf16
    head, 64 chunks: 3.7x the error of whole logits in bf16 against fp32,
    `tests/test_vocab_chunks.py`). Liger-Kernel's fused linear cross entropy does the same with
    `accum_dtype=torch.float32` (src/liger_kernel/ops/fused_linear_cross_entropy.py,
    `fused_linear_cross_entropy_forward`: grad_weight / grad_bias buffers in accum_dtype, cast to
    the weight's dtype at the end of its forward; its default, accum_dtype None, sums in the
    weight's dtype). The cost: an fp32 buffer of the head during the chunk loop (none extra for an
    fp32 head); what waits for the backward is in the head's dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, loss, grads):
        for i, x in ((1, weight), (2, bias)):  # every term's coefficient 0: zeros, as 0 * loss gives whole logits
            if grads[i] is None and x is not None and x.requires_grad:  # (DDP and FSDP2 expect every gradient)
                grads[i] = torch.zeros_like(x)
            elif grads[i] is not None:  # the fp32 sum over the chunks, rounded once to the parameter's dtype
                grads[i] = grads[i].to(x.dtype)
        ctx.save_for_backward(*(g if g is not None else torch.zeros(0) for g in grads))
        ctx.present = [g is not None for g in grads]
        ctx.dtypes = [hidden.dtype, weight.dtype, None if bias is None else bias.dtype]
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        dtypes = ctx.dtypes
        out = [(x * g).to(dt) if present else None for x, present, dt in zip(ctx.saved_tensors, ctx.present, dtypes)]
        return out[0], out[1], out[2], None, None


class VocabReader:
    """How a forward's logit terms are read: in chunks from the captured final hidden state
    (`loss.vocab_chunk` > 0 and `head_of` the model is a plain head), else from the forward's whole
    logits.

        reader = VocabReader(model, chunk)
        with reader.capture():
            out = model(..., **reader.forward_kwargs())   # chunked: logits of the last position only
        loss, terms = reader.terms(out, fn)   # fn(logits, positions) -> {key: Term}
    """

    def __init__(self, model, chunk: int, positions: Optional[int] = None):
        if chunk <= 0:
            self.head, self.why = None, "loss.vocab_chunk is 0"
        elif positions is not None and positions <= chunk:  # one chunk holds the batch: whole logits are the same
            self.head, self.why = None, f"the batch's {positions} positions fit one chunk"
        else:
            self.head, self.why = head_of(model)
        self.model, self.chunk, self.hidden = model, int(chunk), None

    @property
    def chunked(self) -> bool:
        return self.head is not None

    def forward_kwargs(self) -> dict:
        return {"logits_to_keep": 1} if self.chunked else {}

    @contextlib.contextmanager
    def capture(self):
        """A context in which the model's forward leaves its final hidden state in `self.hidden` (chunked only)."""
        if not self.chunked:
            yield self
            return
        with LastHidden(self.model) as last:
            yield self
        self.hidden = last.value

    def vocab(self, out) -> int:
        return self.head.out_features if self.chunked else out.logits.shape[-1]

    def device(self, out) -> torch.device:
        return self.hidden.device if self.chunked else out.logits.device

    def terms(self, out, fn: TermsFn) -> tuple[torch.Tensor, dict[str, Term]]:
        """(sum of coef * mean over the batch, {key: Term of the batch, detached}) of fn's terms (`chunked_terms`)."""
        if not self.chunked or self._kept_all(out):
            return whole_terms(fn, out.logits)
        self._check_head(out)
        return chunked_terms(fn, self.hidden, self.head, self.chunk)

    def _kept_all(self, out) -> bool:
        """Whether the forward returned every position's logits though asked for the last one's (a
        model whose forward takes `logits_to_keep` and ignores it): they are its own logits and
        exist already, so the terms read them whole -- the same loss, but `loss.vocab_chunk` saves
        no memory for this model (logged once per class)."""
        time = self.hidden.shape[1]
        if time == 1 or out.logits.shape[1] != time:
            return False
        cls = type(self.model)
        if cls not in _KEPT_ALL:
            _KEPT_ALL.add(cls)
            logging.getLogger(__name__).warning(
                "%s's forward ignores logits_to_keep (it returned the logits of all %d positions): the loss reads them "
                "whole, and loss.vocab_chunk saves no memory for this model", cls.__name__, time)
        return True

    def _check_head(self, out) -> None:
        """Once per model class: the forward's last-position logits are the head of the captured
        hidden state (a family that transforms its logits after the head, unknown to `head_of`,
        would train on a wrong loss)."""
        cls = type(self.model)
        if cls in _HEAD_CHECKED:
            return
        with torch.no_grad():
            mine = F.linear(self.hidden[:, -1:], self.head.weight, self.head.bias)
            same = out.logits.shape == mine.shape and torch.allclose(out.logits.float(), mine.float(), rtol=1e-3,
                                                                       atol=1e-3)
        if not same:
            raise KavaError(f"{cls.__name__}'s logits are not its LM head of the last hidden state (a transform after "
                            f"the head): set loss.vocab_chunk=0 for this student")
        _HEAD_CHECKED.add(cls)


_HEAD_CHECKED: set = set()  # model classes whose logits `VocabReader._check_head` found to be the head's
_KEPT_ALL: set = set()  # model classes whose forward returned every position's logits (`VocabReader._kept_all`)
