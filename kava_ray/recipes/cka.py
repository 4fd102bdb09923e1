"""`kava-ray align cka`: measure which teacher layers resemble which student layer, and write the map.

Real forwards of every teacher (the job's pool, through the production KVFeed) and of the student on
the first N examples of the job's training data give per layer the keys and/or values over real
tokens; linear CKA between every teacher and every student layer
(`kava_ray.core.align.layers.CKAStats`, streamed: memory does not grow with N) picks each student
layer's top-k teacher layers. One JSON holds every teacher's map, a heat map PNG per teacher lies
next to it. The JSON, and teachers of another tokenizer: docs/internals/core.md#align-cka.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from kava_ray.common.config import JobConfig, derive
from kava_ray.common.errors import KavaError
from kava_ray.common.files import write_json
from kava_ray.core.align.layers import CKAStats, layer_map_json, ratio_map, top_k_map
from kava_ray.core.align.tokens import aligned_mask, apply_alignment
from kava_ray.core.kv import student_forward_kv
from kava_ray.core.models import load_student
from kava_ray.core.plans import student_tokenizer, teacher_tokenizers
from kava_ray.data import Batch, BatchStream
from kava_ray.data.splits import data_seed, load_splits
from kava_ray.rollout.feed import KVFeed, feed_items
from kava_ray.runtime.job import job_teachers
from kava_ray.runtime.preflight import preflight

FEATURES = ("k", "v", "kv")


def default_out(cfg: JobConfig) -> Path:
    """`<ray.storage_path>/cka/<config name>.json`, absolute."""
    return Path(cfg.ray.storage_path).expanduser().resolve() / "cka" / f"{cfg.name}.json"


def calibration_config(cfg: JobConfig, samples: int) -> JobConfig:
    """The config the calibration runs under: live teachers, the first `samples` training examples,
    and a ratio layer plan (the map being measured need not exist yet; the layers asked for are set
    here)."""
    if samples > cfg.data.num_train:
        raise KavaError(f"--samples {samples} exceeds data.num_train={cfg.data.num_train}: calibration reads only "
                        f"the job's training examples")
    return derive(cfg, {"align.layer_map": "ratio", "data.kv_source": "live", "data.num_train": int(samples)})


def _layer_features(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[L, B, H, T, D] at the [B, T] positions in `keep` -> [L, n, H*D] (float32, CPU)."""
    L, B, H, T, D = x.shape
    flat = x.detach().permute(0, 1, 3, 2, 4).reshape(L, B * T, H * D)
    return flat[:, keep.reshape(-1).to(flat.device).bool()].float().cpu()


def _teacher_features(batch: Batch, kv, name: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, values) of teacher `name` in student time [L, B, H, T_s, D] and the [B, T_s] student
    positions to compare at: real student tokens, and, for a teacher of another tokenizer (in
    `batch.teachers`), only those with a teacher token, after `apply_alignment` with `mode`
    (align.token_align). A teacher sharing the student's tokenizer is used as it is."""
    mask = batch.attention_mask.bool()
    view = batch.teachers.get(name)
    if view is None:
        if kv.keys.shape[3] != mask.shape[1]:
            raise KavaError(f"teacher '{name}' returned {kv.keys.shape[3]} positions for a batch of "
                            f"{mask.shape[1]} student positions and the batch carries no alignment for it")
        return kv.keys, kv.values, mask
    lo, hi = view.align_lo, view.align_hi
    keys, values = (apply_alignment(x, lo.to(x.device), hi.to(x.device), mode) for x in (kv.keys, kv.values))
    return keys, values, mask & aligned_mask(lo, hi).bool().to(mask.device)


def _kinds(features: str) -> tuple[str, ...]:
    return {"k": ("k",), "v": ("v",), "kv": ("k", "v")}[features]


def _diagonality(layer_map, n_teacher_cols: int, teacher_layers: list[int]) -> int:
    """How many student layers pick (best first) the teacher layer the ratio map would give them."""
    ratio = ratio_map(n_teacher_cols, len(layer_map))
    return sum(pairs[0][0] == teacher_layers[r[1][0][0]] for (_, pairs), r in zip(layer_map, ratio))


def plot_cka(cka: torch.Tensor, layer_map, teacher_layers: list[int], title: str, path: Path) -> None:
    """Heat map of CKA [student layers x teacher layers]; the chosen cells framed (best first: white)."""
    import matplotlib  # heavy, loaded for plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    L_s, L_t = cka.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.32 * L_t + 2.0), max(3.0, 0.32 * L_s + 1.5)))
    im = ax.imshow(cka.numpy(), vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", origin="lower")
    col = {t: i for i, t in enumerate(teacher_layers)}
    for s, pairs in layer_map:
        for rank, (t, _w) in enumerate(pairs):
            ax.add_patch(Rectangle((col[t] - 0.5, s - 0.5), 1, 1, fill=False, lw=2.0 if rank == 0 else 1.0,
                                   edgecolor="white" if rank == 0 else "red"))
    step_t, step_s = max(1, L_t // 16), max(1, L_s // 16)
    ax.set_xticks(range(0, L_t, step_t), [str(teacher_layers[i]) for i in range(0, L_t, step_t)])
    ax.set_yticks(range(0, L_s, step_s))
    ax.set_xlabel("teacher layer")
    ax.set_ylabel("student layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="linear CKA")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_cka(cfg: JobConfig, samples: int = 64, top_k: int = 1, features: str = "kv",
                out: Optional[str | Path] = None, address: Optional[str] = None, progress: bool = True) -> dict:
    """Measure linear CKA between every teacher and the student, layer by layer, on the first
    `samples` training examples; write `out` (default `default_out(cfg)`) and one `<out
    stem>.<teacher>.png` per teacher. Returns the written JSON's content plus `path`, `plots` and
    `wall_s`."""
    preflight(cfg, "align cka", out=out, address=address)  # data, models, output dir: before Ray starts
    if features not in FEATURES:
        raise KavaError(f"--features {features!r}: expected one of {', '.join(FEATURES)}")
    if samples < 2:
        raise KavaError(f"--samples {samples}: CKA needs at least 2 examples")
    if top_k < 1:
        raise KavaError(f"--top-k {top_k}: must be >= 1")
    if not cfg.ships_kv:
        t = next(t.name for t in cfg.teachers if t.engine == "vllm")
        raise KavaError(f"align cka compares the teachers' KV, and teacher '{t}' is on vLLM (teachers[{t}].engine), "
                        f"which serves none")
    cal = calibration_config(cfg, samples)
    path = Path(out).expanduser().resolve() if out else default_out(cfg)
    t0 = time.time()
    with job_teachers(cal, address) as job:
        plans = job.plans
        layers = {}
        for t in cal.teachers:
            n_layers = plans[t.name].geometry.num_layers
            chosen = sorted(set(t.layers)) if t.layers else list(range(n_layers))
            if top_k > len(chosen):
                raise KavaError(f"--top-k {top_k} exceeds teacher '{t.name}''s {len(chosen)} candidate layers")
            layers[t.name] = chosen
        tok = student_tokenizer(cal.student)[0]
        # the first `samples` training examples (validation comes after), with the views of teachers
        # of another tokenizer: feed_items sends those their own ids, and the batches carry the
        # alignment
        split = load_splits(cal.data, cal.train, tok, teacher_tokenizers(plans))[0]
        batch_size = max(b for b in range(1, min(cal.train.batch_size, len(split)) + 1) if len(split) % b == 0)
        stream = BatchStream(split, batch_size, data_seed(cal.train), bucket=False)  # every example once
        steps = stream.steps_per_epoch
        student = load_student(cal.student.model, dtype="float32", keep=cal.student.keep_layers).eval()
        kinds = _kinds(features)
        stats = {(n, k): CKAStats() for n in layers for k in kinds}
        tokens = dict.fromkeys(layers, 0)
        feed = KVFeed(job.source(), feed_items(stream, steps), layers,
                      depth=cal.align.prefetch_depth, wire_dtype=cal.align.wire_dtype)
        with torch.no_grad():
            for (_, _, _, batch), kv in tqdm(feed, total=steps, desc="cka", unit="batch",
                                             disable=None if progress else True):
                _, s_kv = student_forward_kv(student, batch.input_ids, batch.attention_mask,
                                             key_space=cal.align.key_space)
                for name in layers:
                    t_keys, t_values, keep = _teacher_features(batch, kv[name], name, cal.align.token_align)
                    tokens[name] += int(keep.sum())
                    for k in kinds:
                        t_x, s_x = (t_keys, s_kv.keys) if k == "k" else (t_values, s_kv.values)
                        stats[(name, k)].update(_layer_features(t_x, keep), _layer_features(s_x, keep))
    result: dict = {"teachers": {}, "features": features, "samples": len(split), "config": cfg.name,
                    "key_space": cal.align.key_space, "student_layers": None, "top_k": top_k}
    for name, chosen in layers.items():
        per_kind = {k: stats[(name, k)].matrix() for k in kinds}
        cka = torch.stack(list(per_kind.values())).mean(0)  # [L_s, L_t]
        layer_map = top_k_map(cka, top_k, chosen)
        entry = {"layer_map": layer_map_json(layer_map), "cka": cka.tolist(), "teacher_layers": chosen,
                 "tokens": tokens[name], "ratio_agreement": _diagonality(layer_map, len(chosen), chosen)}
        if features == "kv":
            entry.update(cka_k=per_kind["k"].tolist(), cka_v=per_kind["v"].tolist())
        result["teachers"][name] = entry
        result["student_layers"] = cka.shape[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, result)
    plots = []
    for name, entry in result["teachers"].items():
        png = path.with_name(f"{path.stem}.{name}.png")
        plot_cka(torch.tensor(entry["cka"]), [(s, [tuple(p) for p in pairs]) for s, pairs in entry["layer_map"]],
                 entry["teacher_layers"], f"{cfg.name}: {name} vs student, linear CKA ({features}), "
                 f"{result['samples']} samples", png)
        plots.append(str(png))
    return {**result, "path": str(path), "plots": plots, "wall_s": time.time() - t0}


def format_cka(result: dict, cfg_arg: str) -> str:
    """The summary `kava-ray align cka` prints: where, per teacher the chosen layers, and the next command."""
    lines = [f"CKA layer maps ({result['features']}, {result['samples']} samples, {result['wall_s']:.0f} s): "
             f"{result['path']}"]
    for name, e in result["teachers"].items():
        cka = e["cka"]
        best = [pairs[0][0] for _, pairs in e["layer_map"]]
        mean_best = sum(cka[s][e["teacher_layers"].index(t)] for s, t in enumerate(best)) / len(best)
        lines.append(f"  {name}: student layers <- teacher layers {best} (mean CKA {mean_best:.2f}; the ratio map "
                     f"agrees on {e['ratio_agreement']}/{len(best)}; {e['tokens']} tokens)")
    lines.append(f"  plots: {', '.join(result['plots'])}")
    lines.append(f"next: kava-ray train --config {cfg_arg} align.layer_map=cka align.cka_path={result['path']}")
    return "\n".join(lines)
