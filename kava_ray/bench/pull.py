"""`kava-ray bench pull`: does the KV loss pull the student toward its teacher? (issue 39's KV control)

From the same start, two KV-only runs (loss.ce_weight 0) of the job's first teacher: the old default
(`OLD`: the demo's recipe before issue 39, a learned `linear` projector, randomly initialised, at
kv_weight 1 and lr_projector 5e-3) and the new one (the job's own weights with
`align.projector.kind: auto`, identity where the geometry allows). Each reports the projector-free
centred KV cosine per student layer on the validation split at step 0 and every `eval_every` steps,
and the through-projector cosine of its first step. Then a few steps of each arm's CE + KV recipe
give `grad/kv_share` and `grad/kv_ratio`. In process, no Ray: the teacher runs here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from kava_ray.bench.inprocess import train_in_process
from kava_ray.common.config import derive, load_config
from kava_ray.common.files import format_table, write_json
from kava_ray.core.models import load_model
from kava_ray.core.plans import copied_layers
from kava_ray.recipes.evaluate import kv_alignment, score_student
from kava_ray.runtime.console import status
from kava_ray.runtime.preflight import check_model_files
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

OLD = {"align.projector.kind": "linear", "loss.kv_weight": 1.0, "optim.lr_projector": 5e-3}
ARMS = {"old: linear projector": OLD, "new: auto": {"align.projector.kind": "auto"}}


def projector_free(recipe, cfg, plans, source, teacher: str) -> dict:
    """The student's projector-free centred KV cosine to `teacher` on the validation split, scored
    the way every bench scores a student (`score_student`): `probe.KVAlignment.result()`
    (`kv_cos_free`, `per_layer`, ...)."""
    student = recipe.distiller.student
    copied = {teacher: copied_layers(cfg.student, cfg.teacher(teacher))}
    align = kv_alignment(student, source, plans, recipe.train_split, cfg, copied)
    score_student(student, source, plans, recipe.val, cfg, alignment=align)
    return align[teacher].result()


def _arm(base, overrides: dict, source, plans, teacher: str, steps: int, eval_every: int, share_steps: int) -> dict:
    """One arm: the KV-only trajectory, then its CE + KV recipe for `share_steps` steps (grad/kv_share, _ratio)."""
    recipe = derive(base, overrides)
    cfg = derive(recipe, {"loss.ce_weight": 0.0})
    run = train_in_process(cfg, plans, source, steps, eval_every,
                           lambda r: projector_free(r, cfg, plans, source, teacher)["per_layer"], grad_share=True)
    first = run["first"]
    own = train_in_process(recipe, plans, source, share_steps, grad_share=True)
    return {"kind": recipe.align.projector.kind, "kv_weight": recipe.loss.kv_weight, "trajectory": run["curve"],
            "step1_cos_through_projector": first["cos_sim"], "grad_kv_share": own["shares"],
            "grad_kv_ratio": own["ratios"], "step_s": run["step_s"]}


def run_pull_bench(config: str = "demo_cpu", overrides: Optional[list[str]] = None, steps: int = 30,
                   eval_every: int = 5, share_steps: int = 4, out: Optional[str] = None) -> dict:
    """Both arms from the same start; writes `bench_pull.json` under `out`."""
    base = load_config(config, overrides)
    check_model_files(base)
    t = base.teachers[0]
    base = derive(base, {"teachers": [t], "data.kv_source": "live", "train.steps": steps})
    root = Path(out or Path(base.ray.storage_path) / "bench-pull").expanduser().resolve()
    t0 = time.time()
    models = {t.name: load_model(t.model, dtype=t.dtype, quantization=t.quantization)}
    source, plans = InProcessSource(models), in_process_plans(base, models)
    arms = {}
    for name, overrides in ARMS.items():
        status(f"[bench pull] {name}: {steps} KV-only steps ...")
        arms[name] = _arm(base, overrides, source, plans, t.name, steps, eval_every, share_steps)
    result = {"config": str(config), "teacher": t.name, "steps": steps,
              "student_layers": copied_layers(base.student, base.teacher(t.name)), "arms": arms,
              "wall_s": time.time() - t0, "out": str(root)}
    write_json(root / "bench_pull.json", result)
    return result


def format_pull(out: dict) -> str:
    """Per arm: the projector-free cosine per student layer at each evaluated step, the mean without
    a copied layer 0, the first step's through-projector cosine and grad/kv_share of the job's
    recipe."""
    lines = []
    for name, arm in out["arms"].items():
        n = len(arm["trajectory"][0][1])
        rows = [[step, *[f"{c:.3f}" for c in cos], f"{sum(cos[1:]) / max(1, n - 1):.3f}"]
                for step, cos in arm["trajectory"]]
        lines += [f"{name} (projector kind {arm['kind']}, kv_weight {arm['kv_weight']:g}): projector-free centred KV "
                  f"cos, validation, vs teacher {out['teacher']} layers {out['student_layers']}",
                  format_table(["step", *[f"L{i}" for i in range(n)], "mean (L1..)"], rows),
                  f"  step 1 cos through the projector {arm['step1_cos_through_projector']:.3f}; its CE + KV recipe, "
                  f"steps 1..{len(arm['grad_kv_share'])}: grad/kv_share "
                  + " ".join(f"{s:.3f}" for s in arm["grad_kv_share"]) + ", grad/kv_ratio "
                  + " ".join(f"{s:.3f}" for s in arm.get("grad_kv_ratio", [])), ""]
    return "\n".join(lines + [f"wall time {out['wall_s']:.0f} s"])
