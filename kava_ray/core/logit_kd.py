"""One teacher's logit distillation term against the student's logits, whatever its tokenizer.

Same tokenizer: the top-k forward KL (`losses.topk_kl_loss`) on every next-token position. Another tokenizer
(`loss.logit_cross_vocab`): the teacher's top-k are taken at the teacher positions paired with the student's
(`batch.teachers[t].logit_pair`, `align.tokens.pair_positions`: both have read exactly the same text and predict
what follows it), then compared by the hybrid loss (TRL GOLD: ids with a student token of the same string by
forward KL, the rest by the sorted ULD distance; `losses.hybrid_logit_loss`) or by ULD alone
(`losses.uld_loss`). Student positions without a pair do not count. Pure PyTorch; the Distiller (training) and
`evaluate` (held-out figures) share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.divergences import divergence_beta, sampled_reverse_kl_loss, topk_divergence
from kava_ray.core.kv import KVBatch
from kava_ray.core.losses import hybrid_logit_loss, log_normalizer, top1_agreement, topk_kl_loss, topk_tail, uld_loss

if TYPE_CHECKING:  # the batch type is the data layer's; core does not import it at run time
    from kava_ray.data import Batch


@dataclass
class LogitTeacher:
    """How one teacher's logits meet the student's: `cross` None (same tokenizer), "hybrid" or "uld"; for a
    teacher of another tokenizer its vocabulary map (`align.vocab.VocabMap`) as tensors: t2s [V_t] (student id
    of each teacher id, -1 none), student_unmatched [U], and the matched part's weight (the map's coverage).
    `vocab_size`: the rows of the teacher's LM head (one tokenizer: may exceed the student's, padding rows;
    docs/internals/step.md)."""

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
    """(ids [B, T_s, k], logp [B, T_s, k], tail [B, T_s]) of the teacher's first k top-k entries at the student's
    positions: as sent for one tokenizer (pair None), else gathered at the paired teacher positions (`pair`
    [B, T_s], -1: none; those rows are position 0's, and masked out by the caller)."""
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


def same_vocab_term(logits: torch.Tensor, ids: torch.Tensor, logp: torch.Tensor, tail: torch.Tensor, m: torch.Tensor,
                    valid: Optional[torch.Tensor], t: KVBatch, batch: Batch, c, lse: Optional[torch.Tensor],
                    metrics: dict) -> torch.Tensor:
    """A teacher of the student's tokenizer, by `loss.logit_divergence`: forward_kl the top-k KD
    (`losses.topk_kl_loss`); reverse_kl / jsd the generalized JSD on the top-k with its tail
    (`divergences.topk_divergence`); reverse_kl_sampled on a batch the student sampled, the sampled form
    (`divergences.sampled_reverse_kl_loss`, the teacher's `token_logp`; its reverse KL of the samples goes to
    metrics["sampled_rkl"]), on other batches reverse_kl."""
    div = c.logit_divergence
    if div == "forward_kl":
        return topk_kl_loss(logits, ids.clamp(min=0), logp, m, temperature=c.logit_temperature, tail=c.logit_tail,
                            teacher_tail=tail if c.logit_tail == "bucket" else None, lse=lse, valid=valid)
    if div == "reverse_kl_sampled" and batch.source == "student" and batch.sample_logp is not None:
        if t.token_logp is None:
            raise KavaError("loss.logit_divergence reverse_kl_sampled: a teacher sent no token log-probs for the "
                            "student's samples")
        nxt = batch.input_ids[:, 1:].to(logits.device)
        full = lse if lse is not None else log_normalizer(logits)
        student = logits[:, :-1].gather(-1, nxt[..., None])[..., 0].float() - full[:, :-1]
        student = torch.nn.functional.pad(student, (0, 1))  # [B, T]: log pi_S of each next token
        loss, rkl = sampled_reverse_kl_loss(student, batch.sample_logp, t.token_logp, m)
        metrics["sampled_rkl"] = rkl
        return loss
    return topk_divergence(logits, ids.clamp(min=0), logp, m, beta=divergence_beta(div, c.jsd_beta),
                           temperature=c.logit_temperature, teacher_tail=tail, lse=lse, valid=valid)


def logit_term(lt: LogitTeacher, logits: torch.Tensor, t: KVBatch, batch: Batch, mask: torch.Tensor, loss_cfg,
               lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of teacher `lt` on the student's next-token positions `mask` [B, T_s]; `batch` a
    `kava_ray.data.Batch` (for another tokenizer, `batch.teachers[lt.name].logit_pair` [B, T_s]).

    metrics (detached 0-d tensors): `kl` (same tokenizer: the KD loss; hybrid: its matched part), `uld` (hybrid:
    the unmatched part; uld: the loss), `top1_agree` (student argmax == the teacher's top-1, through the map for
    another tokenizer: a top-1 without a student token of its string disagrees), and for another tokenizer
    `aligned` (the share of `mask`'s positions with a paired teacher position)."""
    c, k = loss_cfg, loss_cfg.logit_top_k
    view = None if lt.cross is None else batch.teachers.get(lt.name)
    pair = None if view is None else view.logit_pair
    if lt.cross is not None and pair is None:
        raise KavaError(f"teacher '{lt.name}' uses another tokenizer than the student, but the batch carries no "
                        f"position pairs for it (splits must be built with its tokenizer: plans.teacher_tokenizers)")
    ids, logp, tail = at_student_positions(lt.name, t, k, pair, logits.device)
    m = mask.to(logits.device) != 0
    metrics = {}
    if lt.cross is None:
        valid = None
        if lt.wider_than(logits.shape[-1]):
            # padding rows of one tokenizer: an id past the student's head is mass the student cannot place (the
            # tail bucket's; tail none: it leaves the renormalised k), and a top-1 there never agrees
            valid = ids < logits.shape[-1]
            ids = torch.where(valid, ids, -1)
        loss = same_vocab_term(logits, ids, logp, tail, m, valid, t, batch, loss_cfg, lse, metrics)
        metrics["kl"] = loss.detach()
        top1 = ids[..., 0].long()
    else:
        paired = pair.to(logits.device) >= 0
        metrics["aligned"] = (m & paired).sum() / m.sum().clamp(min=1)
        m = m & paired
        if lt.cross == "hybrid":
            loss, parts = hybrid_logit_loss(logits, ids, logp, lt.t2s, lt.student_unmatched, m, teacher_tail=tail,
                                            lse=lse, temperature=c.logit_temperature,
                                            matched_weight=lt.matched_weight)
            metrics.update(parts)
        else:
            loss = uld_loss(logits, logp, m, teacher_tail=tail, lse=lse if c.logit_temperature == 1.0 else None)
            metrics["uld"] = loss.detach()
        top1 = ids[..., 0].long()  # in the teacher's vocabulary: through the map (-1, never the argmax, for none)
        t2s = lt.t2s if lt.t2s is not None else top1.new_full((1,), -1)
        top1 = torch.where(top1 < len(t2s), t2s[top1.clamp(max=len(t2s) - 1)], -1)
    metrics["top1_agree"] = top1_agreement(logits, top1[..., None], m)
    return loss, metrics
