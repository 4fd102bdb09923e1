"""The vocabulary term: CE on the answer tokens and the logit KD of every logit teacher
(`logit_kd`), read from the student's logits whole or in chunks of positions (`core.vocab_chunks`,
`loss.vocab_chunk`)."""

from __future__ import annotations

import torch

from kava_ray.common.errors import KavaError
from kava_ray.core.logit_kd import TEACHER_LOSS, VocabTerms, logit_targets, loss_key, next_labels
from kava_ray.core.metric_names import CE, LOGIT_KL, TOP1_AGREE, of
from kava_ray.core.terms.base import StepView, TermParts


class CELogitsTerm:
    """ce_weight * CE + logit_weight * the logit teachers' terms (`logit_kd.targets_term`), each
    weighted by the fusion weights (`_weights`, or per record: `_routed`) on the next-token
    positions. One logsumexp per position serves CE and (at temperature 1) the logit terms. CE is
    off on the student's own samples (it would teach it what it already says; on a teacher's samples
    it is sequence-level KD). Figures: ce, logit_kl (the weighted loss), logit_kl/<t>,
    logit_uld/<t>, logit_aligned/<t>, top1_agree/<t>."""

    name = "ce_logits"

    def __init__(self, parts: TermParts):
        self.c, self.fusion, self.specs = parts.loss, parts.fusion, parts.logit_specs
        self.names = list(self.specs)

    @classmethod
    def build(cls, parts: TermParts) -> "CELogitsTerm":
        return cls(parts)  # always: CE's figure is measured at ce_weight 0 too

    def __call__(self, v: StepView) -> torch.Tensor:
        c, batch, reader, dev = self.c, v.batch, v.reader, v.reader.device(v.out)
        vocab, mask = reader.vocab(v.out), v.next_mask
        terms = VocabTerms(next_labels(batch.labels, dev), c, c.logit_weight > 0 and c.logit_temperature == 1.0,
                           ce_coef=0.0 if batch.source == "student" else c.ce_weight)
        shares, metrics = [], {}  # shares: (share of the logit loss, its term's key)
        # a teacher no record of the batch is routed to teaches nothing in it: its figures are not
        # measured (absent, not 0: `DistillRecipe.step` averages each over the micro-batches that
        # measured it)
        absent = set() if batch.route is None else {n for n in self.names
                                                    if not any(not r or r == n for r in batch.route)}
        if c.logit_weight > 0:
            self._check_top_k_ids(vocab, dev, v.teacher_kv, mask)
            for n, parts in self._routed(batch, mask).items():
                spec = self.specs[n].to(dev)  # its map's tensors (a no-op once there)
                whole = parts[0][1] if len(parts) == 1 else torch.stack([m for _, m, _ in parts]).any(0)
                tg, fixed = logit_targets(spec, v.teacher_kv[n], batch, whole, c, vocab, dev)
                if n not in absent:
                    metrics.update({of("logit_" + k, n): x for k, x in fixed.items()})
                if len(parts) == 1:
                    terms.add(n, spec, tg, coef=c.logit_weight * parts[0][0].to(dev))
                else:  # its figures over every position it teaches; its loss in parts of their own weight
                    terms.add(n, spec, tg)
                    for w, m, part in parts:
                        terms.add(n, spec, logit_targets(spec, v.teacher_kv[n], batch, m, c, vocab, dev)[0],
                                  coef=c.logit_weight * w.to(dev), part=part)
                shares += [(w.to(dev), of(loss_key(part if len(parts) > 1 else ""), n)) for w, _, part in parts]
        loss, read = reader.terms(v.out, terms)
        if shares:
            metrics.update({of(TOP1_AGREE if t.name == TOP1_AGREE else "logit_" + t.name, t.teacher): t.value
                            for t in read.values() if t.coef is None and t.teacher not in (None, *absent)
                            and not t.name.startswith(TEACHER_LOSS)})
            metrics[LOGIT_KL] = sum(w * read[key].value for w, key in shares).detach()
        v.ce = read[CE].value
        v.metrics[CE] = v.ce.detach()
        v.metrics.update(metrics)
        return loss

    def _routed(self, batch, mask: torch.Tensor) -> dict[str, list]:
        """{teacher: [(share of the logit loss, the positions [B, T] it teaches at that weight, the
        part's name)]}, so that the logit loss is the mean over `mask` of each position's teachers'
        terms at their weights: every position with the fusion weights; with records that name their
        teacher (`batch.route`, NeMo-RL's MOPD) a named row's positions are its teacher's alone
        (weight 1), an unnamed row's split by the fusion weights. A teacher with named and unnamed
        rows has a part for each (`named`, `free`), each with its share of positions."""
        weights = self._weights()
        if batch.route is None:
            return {n: [(w, mask, "")] for n, w in zip(self.names, weights)}
        unknown = sorted({r for r in batch.route if r and r not in self.names})
        if unknown:
            raise KavaError(f"a record names teacher {unknown[0]!r} (column 'teacher'), but the job's logit teachers "
                            f"are {', '.join(self.names)}")
        m = mask.to(torch.bool)
        # every named row names a logit teacher; free rows' weights sum to 1
        total = m.sum().to(torch.float32).clamp(min=1)
        free = torch.tensor([not r for r in batch.route], device=m.device)[:, None] & m
        out = {}
        for n, w in zip(self.names, weights):
            mine = torch.tensor([r == n for r in batch.route], device=m.device)[:, None] & m
            parts = [(mine.sum() / total, mine, "named")] if n in batch.route else []
            if not all(batch.route):
                parts.append((w.to(m.device) * free.sum() / total, free, "free"))
            if len(parts) < 2:  # one part (none: a teacher no row is routed to, its share 0 and its figures absent)
                parts = [(parts[0][0], parts[0][1], "")] if parts else [(total * 0, mine, "")]
            out[n] = parts
        return out

    def _check_top_k_ids(self, vocab: int, device, teacher_kv: dict, mask: torch.Tensor) -> None:
        """Refuse top-k ids past the student's vocabulary from a teacher of its tokenizer, in one
        host sync (a gather past the vocab would be a device-side assert on CUDA). A teacher that
        sent no top-k is named by `targets_term`; one whose head is wider than the student's may
        (`targets_term` counts those as tail mass)."""
        same = [n for n in self.names if self.specs[n].cross is None and teacher_kv[n].topk_ids is not None
                and not self.specs[n].wider_than(vocab)]
        if not same:
            return
        keep = mask.to(device)[..., None] != 0
        ids = [teacher_kv[n].topk_ids for n in same]
        top = torch.stack([torch.where(keep, i[..., :self.c.logit_top_k].to(device), 0).max() for i in ids])
        if int(top.max()) >= vocab:
            worst = same[int(top.argmax())]
            raise KavaError(f"teacher '{worst}' sent top-k token id {int(top.max())}, the student's vocab has "
                            f"{vocab} (logit KD needs one tokenizer: loss.logit_weight={self.c.logit_weight})")

    def _weights(self) -> list:
        """The teachers' shares of the logit loss, detached (the logit loss never trains the
        fusion): `Fusion.current_weights()` (fixed / sum: the normalised prior; gate: the softmax,
        mean over layers; router: the mean router weight of its last forward, which the KV term's
        fusion ran), renormalised over the logit teachers."""
        w = self.fusion.current_weights()
        total = sum(w[n] for n in self.names)
        return [w[n] / total for n in self.names]
