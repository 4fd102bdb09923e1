"""Projector kind fit, before step 1: each teacher's student-side map starts as the ridge fit of the
student's KV to that teacher's (`probe.KVAlignment`'s ridge probe), so step 1 already compares the
student's best linear image with the teacher. A map restored from a checkpoint is kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kava_ray.common.errors import KavaError
from kava_ray.core.kv import student_forward_kv
from kava_ray.core.probe import KVAlignment
from kava_ray.data.splits import eval_stream


def unfitted(distiller) -> dict:
    """{teacher: its projector} of the student-side maps not fitted yet."""
    return {n: pr for n, pr in distiller.projectors.items() if pr.student_side and not pr.k_map.fitted}


def fit_maps(recipe, source, batches: int = 16) -> list[str]:
    """Fit a `DistillRecipe`'s unfitted maps over the first `batches` batches of its training split
    with their teachers' KV from `source` (on rank 0, broadcast to the other ranks). Returns the
    teachers fitted here."""
    todo = unfitted(recipe.distiller)
    if not todo:
        return []
    if recipe.rank == 0:  # fit once; the other ranks receive the maps (DDP broadcast only at its construction)
        from kava_ray.rollout.feed import KVFeed, feed_items  # Ray: see recipes/distill.py's docstring

        for n in todo:
            if recipe.plans[n].aligned:
                raise KavaError(f"align.projector.kind: fit needs teacher '{n}' to share the student's tokenizer "
                                f"(its KV is fit token by token); use linear or elastic for it")
        stream = eval_stream(recipe.train_split, recipe.cfg.train)
        feed = KVFeed(source, feed_items(stream, min(batches, stream.steps_per_epoch)),
                      {n: recipe.plans[n].layers for n in todo}, wire_dtype=recipe.cfg.align.wire_dtype,
                      device=recipe.device)
        fit_on(recipe.distiller, ((batch, kv) for (_, _, _, batch), kv in feed), recipe.cfg.align.key_space,
               recipe.device)
    if recipe.world > 1 and dist.is_available() and dist.is_initialized():
        for pr in todo.values():
            for t in (*pr.k_map.parameters(), *pr.v_map.parameters(), pr.k_map.fitted, pr.v_map.fitted):
                dist.broadcast(t.data, src=0)
    return list(todo)


def fit_on(distiller, micro, key_space: str, device) -> list[str]:
    """Fit `distiller`'s unfitted maps on the caller's own (Batch, {teacher: KVBatch}) pairs
    (benches bring their batches and no data source: `bench gpu`). Returns the teachers fitted
    here."""
    todo = unfitted(distiller)
    if not todo:
        return []
    probes = {n: KVAlignment(list(pr.target_pos), probe=True) for n, pr in todo.items()}
    student = distiller.student
    was_training = student.training
    student.eval()  # the student as it is, no dropout
    with torch.no_grad():
        for batch, kv in micro:
            mask = batch.attention_mask.to(device)
            _, skv = student_forward_kv(student, batch.input_ids.to(device), mask, key_space=key_space)
            for n, kva in probes.items():
                kva.fit_batch((skv.keys, skv.values), (kv[n].keys, kv[n].values), mask)
    student.train(was_training)
    for n, pr in todo.items():
        probes[n].fit()
        pr.k_map.load_fit(probes[n].maps["k"])
        pr.v_map.load_fit(probes[n].maps["v"])
    return list(todo)
