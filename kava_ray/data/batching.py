"""Length-bucketed deterministic batching, DDP sharding, the `Batch` type and its collation, batch
keys and a resumable stream."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from kava_ray.common.errors import KavaError
from kava_ray.common.fingerprints import digest
from kava_ray.data.mmap_advice import cache_paths, release_mapped_pages
from kava_ray.data.tokenize import IGNORE_INDEX, TeacherView, TokenizedSplit

ROUTE = "teacher"  # a record column naming the teacher whose logits teach that record (NeMo-RL's MOPD)
RELEASE_EVERY = 16  # batches between releases of the Arrow cache's mapped pages (mmap_advice)


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(int(digest(*parts), 16))


def plan_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, bucket: bool = True,
                 drop_last: bool = True) -> np.ndarray:
    """One epoch's batches as an int64 array [n_batches, batch_size] of row indices, deterministic
    for (seed, epoch); numpy throughout, so millions of rows cost megabytes, not Python lists.

    bucket: shuffle, sort by length within chunks of 50 * batch_size so each batch holds similar
    lengths (little padding), then shuffle the batch order. drop_last=False keeps a short last batch
    (a list of arrays).
    """
    rng = _rng("plan", seed, epoch)
    n = len(lengths)
    order = rng.permutation(n)
    if bucket:
        lens = np.asarray(lengths)
        chunk = 50 * batch_size
        for s in range(0, n, chunk):
            part = order[s:s + chunk]
            order[s:s + chunk] = part[np.argsort(-lens[part], kind="stable")]
    n_batches = n // batch_size
    batches = order[:n_batches * batch_size].reshape(n_batches, batch_size)
    if not drop_last and n % batch_size:  # a ragged plan: a list of arrays, the last one short
        batches = [*batches, order[n_batches * batch_size:]]
        n_batches += 1
    if bucket:
        perm = rng.permutation(n_batches)
        batches = batches[perm] if isinstance(batches, np.ndarray) else [batches[i] for i in perm]
    return batches


def shard_batches(batches, rank: int, world_size: int):
    """Every world_size-th batch from `rank`, cut to the same count on every rank (DDP steps in lockstep)."""
    per_rank = len(batches) // world_size
    return batches[rank::world_size][:per_rank]


def _to(obj, device):
    """A copy of a dataclass of tensors with every tensor on `device`."""
    return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
                                       if isinstance(getattr(obj, f.name), torch.Tensor)})


@dataclass(eq=False)  # tensors: no elementwise ==
class TeacherInputs:
    """A teacher of another tokenizer's part of a batch: its own tokens, and how they meet the student's.

    Student token j reads teacher tokens align_lo[j]:align_hi[j] (equal: unaligned; KV);
    logit_pair[j] is the teacher position that predicts the same text (-1: none; logits). All long
    tensors.
    """

    input_ids: torch.Tensor  # [B, T_t], right-padded with the teacher's pad id
    attention_mask: torch.Tensor  # [B, T_t]
    align_lo: torch.Tensor  # [B, T_s], 0 on student padding
    align_hi: torch.Tensor  # [B, T_s], 0 on student padding
    logit_pair: torch.Tensor  # [B, T_s], -1 for none and on student padding

    def to(self, device) -> "TeacherInputs":
        return _to(self, device)


@dataclass(eq=False)
class Batch:
    """A batch of the student's examples (what the data layer yields and the Distiller reads); all long.

    teachers: {teacher: TeacherInputs} of the teachers of another tokenizer (a teacher sharing the
    student's tokenizer reads `input_ids` / `attention_mask` as they are). source: "data" (the
    records' own completions), "student" or "teacher" (completions sampled by it: on-policy
    distillation, `data.completions`); sample_logp [B, T] float: at position t the sampling log-prob
    of token t + 1 where it was sampled (0 elsewhere). route: per row, the teacher its record names
    (a `teacher` column: its logits alone teach that row; None or "" for every teacher), or None
    when the records name none.
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B, T], IGNORE_INDEX off the loss
    answer_mask: torch.Tensor  # [B, T]
    teachers: dict[str, TeacherInputs] = field(default_factory=dict)
    source: str = "data"
    sample_logp: Optional[torch.Tensor] = None
    route: Optional[list] = None
    group: Optional[torch.Tensor] = None  # [B] long: rows sampled from one prompt share an id (samples_per_prompt)

    def to(self, device) -> "Batch":
        """A copy with every tensor (the teachers' too) on `device`."""
        out = _to(self, device)
        out.teachers = {n: t.to(device) for n, t in self.teachers.items()}
        return out

    def repeated(self, k: int) -> "Batch":
        """Each row k times in a row (rows b * k .. b * k + k - 1 are row b), `group` naming the row
        each came from: a batch of prompts to sample k completions of each."""
        def rep(obj):
            return dataclasses.replace(obj, **{f.name: getattr(obj, f.name).repeat_interleave(k, 0)
                                               for f in dataclasses.fields(obj)
                                               if isinstance(getattr(obj, f.name), torch.Tensor)})

        out = rep(self)
        out.teachers = {n: rep(t) for n, t in self.teachers.items()}
        out.route = None if self.route is None else [r for r in self.route for _ in range(k)]
        out.group = torch.arange(self.input_ids.shape[0]).repeat_interleave(k)
        return out


def collate(items: Sequence[dict], pad_id: int, padding_side: str = "right") -> Batch:
    """Pad encoded examples to the longest: input_ids / attention_mask / labels / answer_mask, all [B, T]."""
    T = max(len(it["input_ids"]) for it in items)
    out = {k: torch.full((len(items), T), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX), ("answer_mask", 0))}
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        sl = slice(0, n) if padding_side == "right" else slice(T - n, T)
        out["input_ids"][b, sl] = torch.tensor(it["input_ids"])
        out["attention_mask"][b, sl] = 1
        out["labels"][b, sl] = torch.tensor(it["labels"])
        out["answer_mask"][b, sl] = torch.tensor(it["answer_mask"])
    return Batch(**out)


def collate_view(view: TeacherView, indices: Sequence[int], T_s: int) -> TeacherInputs:
    """A teacher view's part of a batch of examples `indices` (the student batch padded to T_s), right-padded."""
    items = view.items.many(indices) if hasattr(view.items, "many") else [view.items[i] for i in indices]
    B = len(items)
    T_t = max((len(it["input_ids"]) for it in items), default=0)
    out = TeacherInputs(input_ids=torch.full((B, T_t), view.pad_id, dtype=torch.long),
                        attention_mask=torch.zeros((B, T_t), dtype=torch.long),
                        align_lo=torch.zeros((B, T_s), dtype=torch.long),
                        align_hi=torch.zeros((B, T_s), dtype=torch.long),
                        logit_pair=torch.full((B, T_s), -1, dtype=torch.long))
    for b, it in enumerate(items):
        n, m = len(it["input_ids"]), len(it["align_lo"])
        if m > T_s:
            raise KavaError(f"teacher view item {indices[b]} aligns {m} student tokens > the batch's {T_s}")
        out.input_ids[b, :n] = torch.tensor(it["input_ids"], dtype=torch.long)
        out.attention_mask[b, :n] = 1
        out.align_lo[b, :m] = torch.tensor(it["align_lo"], dtype=torch.long)
        out.align_hi[b, :m] = torch.tensor(it["align_hi"], dtype=torch.long)
        out.logit_pair[b, :m] = torch.tensor(it["logit_pair"], dtype=torch.long)
    return out


def collate_split(split: TokenizedSplit, indices: Sequence[int]) -> Batch:
    """`collate` of the split's examples `indices`, with every teacher view's `collate_view` in `teachers`."""
    batch = collate(split.items.many(indices), split.pad_id)
    T_s = batch.input_ids.shape[1]
    batch.teachers = {name: collate_view(view, indices, T_s) for name, view in split.views.items()}
    if split.records is not None and ROUTE in split.records.column_names:
        batch.route = split.records.select_columns([ROUTE])[[int(i) for i in indices]][ROUTE]
    return batch


def batch_key(fingerprint: str, epoch: int, batch_index: int, layers: Optional[Iterable[int]] = None) -> str:
    """Key teachers de-duplicate a batch by: same data plan, epoch and batch (and layer set) -> same KV."""
    key = f"{fingerprint}/e{epoch}/b{batch_index}"
    return with_layers(key, layers) if layers is not None else key


def with_layers(key: str, layers: Iterable[int]) -> str:
    """Append a teacher's layer set to a batch key: `with_layers(batch_key(f, e, i), L) == batch_key(f, e, i, L)`."""
    return key + "/L" + ",".join(str(i) for i in sorted(set(layers)))


class BatchStream:
    """A worker's batches forever across epochs, resumable exactly from `state()`.

    Epoch e's batches are `shard_batches(plan_batches(lengths, batch_size, seed, e), rank,
    world_size)`; keys use the global batch index, so they do not depend on the rank.
    drop_last=False (held-out evaluation: every row counts) keeps a short last batch.
    """

    def __init__(self, split: TokenizedSplit, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0, state: Optional[dict] = None, bucket: bool = True, drop_last: bool = True):
        self.split, self.batch_size, self.seed, self.bucket = split, batch_size, seed, bucket
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.plan_fingerprint = digest(split.fingerprint, batch_size, seed, bucket, *(() if drop_last else ("all",)))
        n_global = len(split) // batch_size if drop_last else -(-len(split) // batch_size)
        self.steps_per_epoch = n_global // world_size
        if self.steps_per_epoch == 0:
            raise KavaError(f"{len(split)} examples are too few for batch_size={batch_size} x {world_size} workers")
        if state is not None:
            if state.get("fingerprint") not in (None, self.plan_fingerprint):
                warnings.warn("resuming a BatchStream whose data, batch size or seed changed", stacklevel=2)
            self.epoch, self.position, self.step = int(state["epoch"]), int(state["position"]), int(state["step"])
        else:
            self.epoch, self.position = divmod(start_step, self.steps_per_epoch)
            self.step = start_step
        self._cached: tuple = (-1, None)
        self._mapped = cache_paths([split.dataset, *(getattr(v.items, "dataset", None) for v in split.views.values())])
        release_mapped_pages(self._mapped)  # what loading the split (its lengths) mapped

    def _epoch_batches(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(global batch indices [n], example indices [n, B]) of this rank's batches in `epoch`."""
        if self._cached[0] != epoch:
            plan = plan_batches(self.split.lengths, self.batch_size, self.seed, epoch, bucket=self.bucket,
                                drop_last=self.drop_last)
            ids = shard_batches(np.arange(len(plan)), self.rank, self.world_size)
            self._cached = (epoch, (ids, plan[ids] if isinstance(plan, np.ndarray) else [plan[i] for i in ids]))
        return self._cached[1]

    def next(self) -> tuple[str, int, int, Batch]:
        """(key, step, epoch, batch) for the next batch; advances the stream."""
        return self.next_indexed()[:4]

    def next_indexed(self) -> tuple[str, int, int, Batch, list[int]]:
        """`next()` plus the batch's example indices into the split (what an example-indexed KV cache reads)."""
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        ids, rows = self._epoch_batches(self.epoch)
        global_index, idx = int(ids[self.position]), rows[self.position].tolist()
        batch = collate_split(self.split, idx)
        out = (batch_key(self.plan_fingerprint, self.epoch, global_index), self.step, self.epoch, batch, idx)
        self.position += 1
        self.step += 1
        if self.step % RELEASE_EVERY == 0:
            release_mapped_pages(self._mapped)  # random row reads map pages around them: drop them (mmap_advice)
        return out

    __next__ = next

    def __iter__(self):
        return self

    def state(self) -> dict:
        """JSON-able position: `BatchStream(..., state=s)` continues with the identical batches."""
        return {"epoch": self.epoch, "position": self.position, "step": self.step,
                "fingerprint": self.plan_fingerprint}
