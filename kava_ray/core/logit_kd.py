"""One teacher's logit distillation term against the student's logits, whatever its tokenizer.

Same tokenizer: the top-k forward KL (`losses.topk_kl_loss`) on every next-token position. Another
tokenizer (`loss.logit_cross_vocab`): the teacher's top-k are taken at the teacher positions paired
with the student's (`batch.teachers[t].logit_pair`, `data.alignment.pair_positions`: both have read
exactly the same text and predict what follows it), then compared by the hybrid loss (TRL GOLD: ids
with a student token of the same string by forward KL, the rest by the sorted ULD distance;
`losses.hybrid_logit_loss`) or by ULD alone (`losses.uld_loss`). Student positions without a pair do
not count. Pure PyTorch; the Distiller (training) and `evaluate` (held-out figures) share it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from kava_ray.common.errors import KavaError
from kava_ray.core.divergences import divergence_beta, sampled_reverse_kl_loss, topk_divergence
from kava_ray.core.kv import KVBatch
from kava_ray.core.losses import (
    hybrid_logit_loss,
    log_normalizer,
    masked_ce,
    top1_agreement,
    topk_kl_loss,
    topk_tail,
    uld_loss,
)
from kava_ray.core.metric_names import CE
from kava_ray.core.vocab_chunks import Term

if TYPE_CHECKING:  # the batch type is the data layer's; core does not import it at run time
    from kava_ray.data import Batch


@dataclass
class LogitTeacher:
    """How one teacher's logits meet the student's: `cross` None (same tokenizer), "hybrid" or
    "uld"; for a teacher of another tokenizer its vocabulary map (`align.vocab.VocabMap`) as
    tensors: t2s [V_t] (student id of each teacher id, -1 none), student_unmatched [U], and the
    matched part's weight (the map's coverage). `vocab_size`: the rows of the teacher's LM head (one
    tokenizer: may exceed the student's, padding rows; docs/internals/step.md)."""

    name: str
    cross: Optional[str] = None
    t2s: Optional[torch.Tensor] = None
    student_unmatched: Optional[torch.Tensor] = None
    matched_weight: Optional[float] = None
    vocab_size: Optional[int] = None

    @classmethod
    def across(cls, name: str, mode: str, vmap, matched_weight: Optional[float] = None) -> "LogitTeacher":
        """A teacher of another tokenizer with its map; the matched part's weight defaults to the map's coverage."""
        return cls(name, mode, torch.from_numpy(vmap.t2s), torch.from_numpy(vmap.student_unmatched()),
                   vmap.coverage if matched_weight is None else float(matched_weight))

    def wider_than(self, vocab: int) -> bool:
        """Whether the teacher's LM head has rows past a student head of `vocab` rows (same tokenizer, padding)."""
        return self.cross is None and self.vocab_size is not None and self.vocab_size > vocab

    def to(self, device) -> "LogitTeacher":
        if self.t2s is not None:
            self.t2s, self.student_unmatched = self.t2s.to(device), self.student_unmatched.to(device)
        return self


def at_student_positions(name: str, t: KVBatch, k: int, pair: Optional[torch.Tensor], device):
    """(ids [B, T_s, k], logp [B, T_s, k], tail [B, T_s]) of the teacher's first k top-k entries at
    the student's positions: as sent for one tokenizer (pair None), else gathered at the paired
    teacher positions (`pair` [B, T_s], -1: none; those rows are position 0's, and masked out by the
    caller)."""
    if t.topk_ids is None or t.topk_logp is None:
        raise KavaError(f"teacher '{name}' sent no top-k logits, but the job's logit KD (loss.logit_weight > 0) needs "
                        f"them (set loss.logit_weight=0 or have the teacher serve them)")
    ids, logp = t.topk_ids[..., :k].to(device), t.topk_logp[..., :k].to(device)
    tail = topk_tail(t.topk_logp, t.topk_tail, k).to(device)
    if pair is None:
        return ids, logp, tail
    idx = pair.to(device).clamp(min=0)  # [B, T_s]
    rows = idx[..., None].expand(-1, -1, ids.shape[-1])
    return ids.gather(1, rows), logp.gather(1, rows), tail.gather(1, idx)


@dataclass
class LogitTargets:
    """One teacher's logit targets at the student's next-token positions, each tensor [B, T, ...] on
    the student's device, so that a chunk of positions is a slice (`at`): ids / logp [B, T, k]
    (student ids for one tokenizer, the teacher's for another), tail [B, T], m [B, T] bool (the
    positions that count), valid [B, T, k] (one tokenizer, a wider teacher head: the ids inside the
    student's), top1 [B, T] (the teacher's top-1 as a student id, -1 none), and on a batch the
    student sampled: nxt (each next token's id), sample_logp and token_logp [B, T]."""

    ids: torch.Tensor
    logp: torch.Tensor
    tail: torch.Tensor
    m: torch.Tensor
    top1: torch.Tensor
    valid: Optional[torch.Tensor] = None
    nxt: Optional[torch.Tensor] = None
    sample_logp: Optional[torch.Tensor] = None
    token_logp: Optional[torch.Tensor] = None
    baseline: Optional[torch.Tensor] = None  # [B, T]: loss.rkl_baseline loo's, each row its group's other rows'

    def at(self, sl: slice) -> "LogitTargets":
        """The same targets on the positions `sl` of the time axis."""
        return LogitTargets(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[:, sl]
                               for f in fields(self)})

    def loss_mask(self, lt: "LogitTeacher", c) -> torch.Tensor:
        """The positions the loss averages over: `m`, less those with no id inside the student's
        head when the forward KL renormalises over the k (`losses.topk_kl_loss`, tail none)."""
        if (lt.cross is None and self.valid is not None and c.logit_divergence == "forward_kl"
                and c.logit_tail == "none"):
            return self.m & self.valid.any(-1)
        return self.m


def logit_targets(lt: LogitTeacher, t: KVBatch, batch: Batch, mask: torch.Tensor, loss_cfg, vocab: int, device
                  ) -> tuple[LogitTargets, dict]:
    """(the targets of teacher `lt` on the student's next-token positions `mask` [B, T_s], the
    metrics that need no student logits: {"aligned"} for another tokenizer, the share of `mask`'s
    positions with a paired teacher position). vocab: the student's head rows."""
    c, k = loss_cfg, loss_cfg.logit_top_k
    view = None if lt.cross is None else batch.teachers.get(lt.name)
    pair = None if view is None else view.logit_pair
    if lt.cross is not None and pair is None:
        raise KavaError(f"teacher '{lt.name}' uses another tokenizer than the student, but the batch carries no "
                        f"position pairs for it (splits must be built with its tokenizer: plans.teacher_tokenizers)")
    ids, logp, tail = at_student_positions(lt.name, t, k, pair, device)
    m = mask.to(device) != 0
    fixed, valid, sampled = {}, None, {}
    if lt.cross is None:
        if lt.wider_than(vocab):
            # padding rows of one tokenizer: an id past the student's head is mass the student
            # cannot place (the tail bucket's; tail none: it leaves the renormalised k), and a top-1
            # there never agrees
            valid = ids < vocab
            ids = torch.where(valid, ids, -1)
        top1 = ids[..., 0].long()
        if c.logit_divergence == "reverse_kl_sampled" and batch.source == "student" and batch.sample_logp is not None:
            if t.token_logp is None:
                raise KavaError("loss.logit_divergence reverse_kl_sampled: a teacher sent no token log-probs for the "
                                "student's samples")
            nxt = torch.nn.functional.pad(batch.input_ids[:, 1:].to(device), (0, 1))  # [B, T]: each next token
            sampled = dict(nxt=nxt, sample_logp=batch.sample_logp.to(device), token_logp=t.token_logp.to(device))
            if c.rkl_baseline == "loo":
                sampled["baseline"] = group_baseline(sampled["token_logp"] - sampled["sample_logp"], m,
                                                     batch.group.to(device))
    else:
        paired = pair.to(device) >= 0
        fixed["aligned"] = (m & paired).sum() / m.sum().clamp(min=1)
        m = m & paired
        top1 = ids[..., 0].long()  # in the teacher's vocabulary: through the map (-1, never the argmax, for none)
        t2s = lt.t2s.to(device) if lt.t2s is not None else top1.new_full((1,), -1)
        top1 = torch.where(top1 < len(t2s), t2s[top1.clamp(max=len(t2s) - 1)], -1)
    return LogitTargets(ids, logp, tail, m, top1, valid, **sampled), fixed


def group_baseline(adv: torch.Tensor, m: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """[B, T]: each row's leave-one-out baseline, the mean of the per-token advantage `adv` [B, T]
    (log pi_T - log q, known before the student's logits) over the sampled positions `m` [B, T] of
    the OTHER rows of its group (`Batch.group` [B]: the rows sampled from one prompt); 0 for a row
    with no other sampled tokens. RLOO (Ahmadian et al. 2024; TRL `RLOOTrainer`), per token: a
    baseline that does not depend on the row's own samples leaves the expected gradient exact, where
    GRPO's group mean with the row's own tokens in it scales it by about 1 - 1/k (exact enumeration:
    tests/test_divergences.py). Detached."""
    n = int(group.max()) + 1
    w = m.to(adv.dtype)
    own, own_n = torch.where(m, adv, 0.0).sum(-1), w.sum(-1)  # [B]
    sums = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, group, own)
    counts = torch.zeros(n, dtype=adv.dtype, device=adv.device).index_add_(0, group, own_n)
    others = (sums[group] - own) / (counts[group] - own_n).clamp(min=1)
    return others[:, None].expand_as(adv).detach()


def targets_term(lt: LogitTeacher, logits: torch.Tensor, tg: LogitTargets, loss_cfg,
                 lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of teacher `lt` against the student's logits [B, T, V] on the targets'
    positions, each a mean over `tg.m` (the loss and `kl` of one tokenizer: over `tg.loss_mask`):
    `kl` (one tokenizer: the loss; hybrid: its matched part), `uld` (hybrid: the unmatched part;
    uld: the loss), `top1_agree`, `sampled_rkl` (reverse_kl_sampled on the student's samples: their
    teacher-scored reverse KL).

    The loss: another tokenizer, the hybrid loss (`losses.hybrid_logit_loss`) or ULD
    (`losses.uld_loss`); one tokenizer, by `loss.logit_divergence`: forward_kl the top-k KD
    (`losses.topk_kl_loss`); reverse_kl_sampled on a batch the student sampled, the sampled form
    (`divergences.sampled_reverse_kl_loss`, the teacher's `token_logp`); reverse_kl / jsd (and
    reverse_kl_sampled on other batches) the generalized JSD on the top-k with its tail
    (`divergences.topk_divergence`)."""
    c, metrics, ids = loss_cfg, {}, tg.ids.clamp(min=0)
    if lt.cross == "hybrid":
        loss, parts = hybrid_logit_loss(logits, tg.ids, tg.logp, lt.t2s, lt.student_unmatched, tg.m,
                                        teacher_tail=tg.tail, lse=lse, temperature=c.logit_temperature,
                                        matched_weight=lt.matched_weight)
        metrics.update(parts)
    elif lt.cross is not None:
        loss = uld_loss(logits, tg.logp, tg.m, teacher_tail=tg.tail, lse=lse if c.logit_temperature == 1.0 else None)
        metrics["uld"] = loss.detach()
    elif c.logit_divergence == "forward_kl":
        loss = topk_kl_loss(logits, ids, tg.logp, tg.m, temperature=c.logit_temperature, tail=c.logit_tail,
                            teacher_tail=tg.tail if c.logit_tail == "bucket" else None, lse=lse, valid=tg.valid)
    elif tg.nxt is not None:
        full = lse if lse is not None else log_normalizer(logits)
        student = logits.gather(-1, tg.nxt[..., None])[..., 0].float() - full  # [B, T]: log pi_S of each next token
        loss, metrics["sampled_rkl"] = sampled_reverse_kl_loss(student, tg.sample_logp, tg.token_logp, tg.m,
                                                               baseline=tg.baseline, clip=c.rkl_clip)
    else:
        loss = topk_divergence(logits, ids, tg.logp, tg.m, beta=divergence_beta(c.logit_divergence, c.jsd_beta),
                               temperature=c.logit_temperature, teacher_tail=tg.tail, lse=lse, valid=tg.valid)
    if lt.cross is None:
        metrics["kl"] = loss.detach()
    metrics["top1_agree"] = top1_agreement(logits, tg.top1[..., None], tg.m)
    return loss, metrics


TEACHER_LOSS = "loss"  # a logit teacher's term among `VocabTerms`' (its metrics: `targets_term`'s names)


def loss_key(part: str = "") -> str:
    """The name of a logit teacher's loss term among `VocabTerms`': `TEACHER_LOSS`, or one part's `loss:<part>`."""
    return f"{TEACHER_LOSS}:{part}" if part else TEACHER_LOSS


def next_labels(labels: torch.Tensor, device) -> torch.Tensor:
    """[B, T]: the label position t predicts (the labels shifted by one, -100 where none counts)."""
    return F.pad(labels[:, 1:], (0, 1), value=-100).to(device)


@dataclass
class VocabTerms:
    """The terms read from the student's logits, called by `core.vocab_chunks` on the logits [B, t, V] of the
    positions `sl` (all of them, or a chunk) -> {key: `Term`}, each a mean over the positions: CE on `labels`
    (`next_labels`, [B, T]) counted over the labels that count; for every logit teacher (`add`), its term "loss"
    (`targets_term`) counted over its `loss_mask` positions and its metrics (`targets_term`'s: kl over the same
    positions, the rest over `m`). A coef (CE's `ce_coef`, a teacher's) puts a term in the loss; None: a figure only.
    shared_lse: the teachers' terms take CE's normaliser (temperature 1), else CE is F.cross_entropy's fused kernel.
    Training (`Distiller._vocab_terms`) and evaluation (`recipes.evaluate`) read the logits through it."""

    labels: torch.Tensor
    loss_cfg: object = None
    shared_lse: bool = False
    ce_coef: object = None
    teachers: dict = field(default_factory=dict)  # {name: (LogitTeacher, LogitTargets, coef, total)}
    ce_total: Optional[torch.Tensor] = field(init=False, default=None)  # the labels that count (with a ce_coef)

    def __post_init__(self):
        if self.ce_coef is not None:
            self.ce_total = (self.labels != -100).sum()

    def add(self, name: str, spec: LogitTeacher, targets: LogitTargets, coef=None, part: str = "") -> None:
        """Teacher `name`'s targets; coef: its term's weight in the loss (None: its figures only).
        part: one of several parts of its loss (positions of another weight: `Distiller._routed`),
        its loss term alone, named `loss:<part>` (its figures come from an entry without a part)."""
        total = None if coef is None else targets.loss_mask(spec, self.loss_cfg).sum()
        self.teachers[(name, part)] = (spec, targets, coef, total)

    def __call__(self, logits: torch.Tensor, sl: slice) -> dict[str, Term]:
        lse = log_normalizer(logits) if self.shared_lse else None  # [B, t]
        lab = self.labels[:, sl]
        terms = [Term(CE, masked_ce(logits, lab, shift=False, lse=lse), (lab != -100).sum(), coef=self.ce_coef,
                      total=self.ce_total)]
        for (n, part), (spec, tg, coef, total) in self.teachers.items():
            at = tg.at(sl)
            loss_n, m = targets_term(spec, logits, at, self.loss_cfg, lse)
            n_loss, n_m = at.loss_mask(spec, self.loss_cfg).sum(), at.m.sum()
            terms.append(Term(loss_key(part), loss_n, n_loss, n, coef, total))
            if not part:
                terms += [Term(k, v, n_loss if k == "kl" else n_m, n) for k, v in m.items()]
        return {t.key: t for t in terms}
