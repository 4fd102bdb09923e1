"""`kava-ray bench align`: layer maps, head projection and token alignment side by side, at equal steps.

Two parts, each a set of variants trained for the same number of steps from the same start: the same
tokenizer (layer map `ratio` vs `cka`, x `head_proj` shared vs per_head) and another tokenizer
(`align.token_align` mean vs last vs first). Every variant runs the production step and validation
in this process, with teacher KV from the production forward outside the timed step. The models, and
what is reported: docs/internals/runtime.md#bench-align.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from kava_ray.bench.inprocess import train_in_process
from kava_ray.common.config import JobConfig, derive, load_config
from kava_ray.common.files import format_table, write_json
from kava_ray.core.align.tokens import alignment_stats, apply_alignment
from kava_ray.core.metric_names import CE, CONTRAST_GAP, COS_SIM, of
from kava_ray.core.models import load_model, load_tokenizer
from kava_ray.data import BatchStream, load_examples, teacher_view, tokenize_split
from kava_ray.data.splits import data_seed
from kava_ray.recipes.cka import measure_cka
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans
from kava_ray.testing.tiny import build_tiny_model
from kava_ray.testing.tokenizers import real_tokenizer

CROSS_TOKENIZER = "llama3"  # the real tokenizer the cross-family teacher is built around


def run_variant(cfg: JobConfig, models: dict, steps: int) -> dict:
    """Train `steps` steps in this process and evaluate on the validation split; returns the figures."""
    plans = in_process_plans(cfg, models)
    source = InProcessSource(models, cfg.align.key_space)
    run = train_in_process(cfg, plans, source, steps)
    ev = run["recipe"].evaluate(source)
    out = {"eval_cos": ev[of("eval", COS_SIM)], "eval_gap": ev[of("eval", CONTRAST_GAP)],
           "eval_ce": ev[of("eval", CE)], "train_cos": float(run["last"][COS_SIM]), "step_s": run["step_s"]}
    out.update({k[len("eval/"):]: v for k, v in ev.items() if k.startswith("eval/aligned/")})
    return out


def alignment_figures(cfg: JobConfig, name: str, batches: int = 8) -> dict:
    """The aligned teacher's own figures over the training split: share of student tokens aligned,
    teacher tokens per student token, and time per batch to build the alignment from text and to
    apply it."""
    d = cfg.data
    s_tok, t_tok = load_tokenizer(cfg.student.model), load_tokenizer(cfg.teacher(name).model)
    examples = load_examples(d.source, d.train_split, batches * cfg.train.batch_size, d.seed, d.hub_config)
    split = tokenize_split(s_tok, examples, cfg.train.max_length, d.prompt_format, d.overlength, "bench-align")
    t0 = time.perf_counter()
    split.views[name] = teacher_view(split, t_tok, d.prompt_format, cfg.train.max_length)
    build_s = (time.perf_counter() - t0) / batches
    stream = BatchStream(split, cfg.train.batch_size, data_seed(cfg.train), bucket=False)
    sums = {"aligned": 0.0, "tokens": 0.0, "per": 0.0}
    apply_s = []
    for _ in range(batches):
        _, _, _, b = stream.next()
        view = b.teachers[name]
        lo, hi = view.align_lo, view.align_hi
        stats = alignment_stats(lo, hi, b.attention_mask)
        n_real = float(b.attention_mask.sum())
        sums["tokens"] += n_real
        sums["aligned"] += float(stats["aligned_fraction"]) * n_real
        sums["per"] += float(stats["teacher_per_student"]) * float(stats["aligned_fraction"]) * n_real
        kv = torch.randn(4, lo.shape[0], 2, view.input_ids.shape[1], 64)  # [L, B, H, T_t, D]
        t1 = time.perf_counter()
        apply_alignment(kv, lo, hi, cfg.align.token_align)
        apply_s.append(time.perf_counter() - t1)
    view = split.views[name].stats
    return {"aligned_fraction": sums["aligned"] / sums["tokens"],
            "teacher_per_student": sums["per"] / max(sums["aligned"], 1.0),
            "causal_unaligned": view["causal_unaligned"] / max(view["student_tokens"], 1),
            "build_ms_per_batch": 1000 * build_s, "apply_ms_per_batch": 1000 * statistics.median(apply_s)}


def cross_teacher_dir(out: Path, tokenizer: str = CROSS_TOKENIZER) -> Path:
    """A tiny random Llama (4 layers, 2 KV heads of 32) around a real tokenizer: another family's teacher."""
    path = out / f"teacher-{tokenizer}"
    if not (path / "config.json").is_file():
        build_tiny_model(path, family="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2,
                         head_dim=32, tokenizer=real_tokenizer(tokenizer), seed=11)
    return path


def run_align_bench(config: str = "demo_cpu", overrides: Optional[list[str]] = None, steps: int = 24,
                    out: Optional[str] = None, cka_samples: int = 32, progress: bool = True) -> dict:
    """Both parts; returns {"same_tokenizer": {variant: figures}, "cross_tokenizer": {...}, "alignment": {...}}."""
    base = load_config(config, overrides)
    first = base.teachers[0]
    out_dir = Path(out or Path(base.ray.storage_path).expanduser() / "bench-align").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    say = print if progress else (lambda *a, **k: None)

    one = derive(load_config(config, [*(overrides or []), f"train.steps={steps}"]), {"teachers": [first]})
    models = {first.name: load_model(first.model, dtype=first.dtype, quantization=first.quantization)}
    say(f"measuring a CKA layer map ({cka_samples} samples) ...")
    cka_path = out_dir / "cka.json"
    measure_cka(one, samples=cka_samples, top_k=1, features="kv", out=str(cka_path), progress=progress)
    same = {}
    for layer_map in ("ratio", "cka"):
        for head_proj in ("shared", "per_head"):
            name = f"{layer_map} / {head_proj}"
            say(f"same tokenizer: {name} ...")
            cfg = derive(one, {"align.layer_map": layer_map, "align.projector.head_proj": head_proj,
                               "align.cka_path": str(cka_path) if layer_map == "cka" else None})
            same[name] = run_variant(cfg, models, steps)

    teacher = cross_teacher_dir(out_dir)
    xname = f"random-llama-{CROSS_TOKENIZER}"
    cross_base = derive(one, {"teachers": [{"name": xname, "model": str(teacher), "dtype": "float32"}]})
    xmodels = {xname: load_model(str(teacher), dtype="float32")}
    cross = {}
    for mode in ("mean", "last", "first"):
        say(f"another tokenizer: token_align={mode} ...")
        cross[mode] = run_variant(derive(cross_base, {"align.token_align": mode}), xmodels, steps)
    result = {"config": config, "steps": steps, "same_tokenizer": same, "cross_tokenizer": cross,
              "alignment": alignment_figures(cross_base, xname), "teacher": first.name, "cross_teacher": xname,
              "cka_map": str(cka_path), "out": str(out_dir)}
    write_json(out_dir / "bench_align.json", result)
    return result



def format_align_bench(r: dict) -> str:
    def rows(part):
        return [[name, f"{f['eval_cos']:.3f}", f"{f['eval_gap']:.3f}", f"{f['eval_ce']:.3f}", f"{f['step_s']:.2f}"]
                for name, f in part.items()]

    head = ["variant", "val centred cos", "val gap", "val CE", "step s"]
    a = r["alignment"]
    return "\n".join([
        f"same tokenizer ({r['teacher']} -> student), {r['steps']} steps each: layer map / head projection",
        format_table(head, rows(r["same_tokenizer"])),
        "",
        f"another tokenizer ({r['cross_teacher']}, random weights -> student): align.token_align",
        format_table(head, rows(r["cross_tokenizer"])),
        "",
        f"alignment: {100 * a['aligned_fraction']:.1f} % of student tokens aligned, "
        f"{a['teacher_per_student']:.2f} teacher tokens per aligned student token, "
        f"{100 * a['causal_unaligned']:.1f} % left out by the causal rule "
        f"(every overlapping teacher token ends later), "
        f"{a['build_ms_per_batch']:.1f} ms/batch to build from text, {a['apply_ms_per_batch']:.2f} ms/batch to apply",
    ])
