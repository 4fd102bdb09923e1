"""Every metric of a set of in-process training runs, to compare a refactor against the tree before it, to the bit.

    python scripts/golden_metrics.py OUT.json            # run the cases, write each step's metrics
    python scripts/golden_metrics.py OUT.json --compare GOLDEN.json

The cases are the production step (`bench.inprocess`: DistillRecipe, the KV feed, the optimizer) on tiny random
models built here, one per way the Distiller's terms combine: the KV term under each fusion, the logit terms
(same and another tokenizer), relation, hidden, and on-policy runs (sampled GKD and the sampled reverse KL). Each
records every step's metrics, the validation metrics at the end (`DistillRecipe.evaluate`) and a hash of the
student's final weights, with floats written exactly (`float.hex`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import yaml

STEPS = 4


def _models(root: Path) -> dict:
    from kava_ray.testing.tiny import build_tiny_model
    from kava_ray.testing.tokenizers import real_tokenizer

    return {"qwen": build_tiny_model(root / "qwen", family="qwen2", num_layers=3, hidden_size=64, seed=1),
            "llama": build_tiny_model(root / "llama", family="llama", num_layers=2, hidden_size=48, num_heads=2,
                                      num_kv_heads=1, head_dim=24, seed=2),
            "student": build_tiny_model(root / "student", family="qwen2", num_layers=2, hidden_size=64, seed=3),
            "qtok": build_tiny_model(root / "qtok", family="llama", num_layers=3, hidden_size=48, num_heads=2,
                                     num_kv_heads=1, head_dim=24, tokenizer=real_tokenizer("qwen2", fetch=False),
                                     seed=5)}


def _job(root: Path, models: dict, teachers=("qwen", "llama"), **sets) -> dict:
    d = {"name": "golden",
         "teachers": [{"name": t, "model": str(models[t]), "dtype": "float32"} for t in teachers],
         "student": {"model": str(models["student"]), "dtype": "float32"},
         "data": {"source": "synthetic", "num_train": 32, "num_test": 4, "num_val": 4},
         "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}},
         "loss": {"kind": "mercator", "beta": 0.01},
         "optim": {"lr_student": 1e-3, "lr_projector": 3e-3, "warmup_steps": 0},
         "train": {"steps": STEPS, "batch_size": 2, "max_length": 160, "log_steps": 1, "eval_steps": STEPS,
                   "save_steps": STEPS, "seed": 0},
         "ray": {"namespace": "golden", "storage_path": str(root / "runs"), "num_workers": 1, "use_gpu": False}}
    for key, value in sets.items():
        section, _, field = key.partition(".")
        node = d.setdefault(section, {})
        for part in field.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[field.split(".")[-1]] = value
    return d


CASES = {
    "kv-fixed-relation-hidden": {"loss.relation_weight": 0.3, "loss.hidden_weight": 0.2},
    "kv-logits-gate-elastic-chunked": {"fusion.kind": "gate", "align.projector.kind": "elastic",
                                       "loss.kind": "hybrid", "loss.logit_weight": 0.5, "loss.logit_top_k": 8,
                                       "loss.vocab_chunk": 64},
    "kv-logits-sum": {"fusion.kind": "sum", "loss.logit_weight": 1.0, "loss.logit_top_k": 8, "loss.vocab_chunk": 0},
    "kv-logits-router-jsd": {"fusion.kind": "router", "loss.logit_weight": 0.7, "loss.logit_top_k": 8,
                             "loss.logit_divergence": "jsd"},
    "cross-tokenizer": {"teachers": ("qwen", "qtok"), "loss.logit_weight": 0.5, "loss.logit_top_k": 8},
    "onpolicy-gkd": {"teachers": ("qwen",), "loss.kv_weight": 0.0, "loss.ce_weight": 0.0, "loss.logit_weight": 1.0,
                     "loss.logit_top_k": 8, "loss.logit_divergence": "jsd", "onpolicy.fraction": 0.5,
                     "onpolicy.max_new_tokens": 6, "onpolicy.lag": 0},
    "onpolicy-rkl-sampled": {"teachers": ("qwen",), "loss.kv_weight": 0.0, "loss.logit_weight": 1.0,
                             "loss.logit_top_k": 8, "loss.logit_divergence": "reverse_kl_sampled",
                             "loss.rkl_baseline": "loo", "onpolicy.fraction": 1.0, "onpolicy.samples_per_prompt": 2,
                             "onpolicy.max_new_tokens": 6},
}


def _hex(v) -> str:
    return float(v).hex()


def run_case(root: Path, models: dict, name: str, sets: dict) -> dict:
    from kava_ray.bench.inprocess import train_in_process
    from kava_ray.common.config import load_config
    from kava_ray.core.models import load_model
    from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

    sets = dict(sets)
    teachers = sets.pop("teachers", ("qwen", "llama"))
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_job(root / name, models, teachers, **sets), sort_keys=False))
    cfg = load_config(str(path))
    torch.manual_seed(0)
    teacher_models = {t.name: load_model(t.model, dtype=t.dtype) for t in cfg.teachers}
    source = InProcessSource(teacher_models)
    steps = []
    run = train_in_process(cfg, in_process_plans(cfg, teacher_models), source, STEPS,
                           stop=None, evaluate=None)
    recipe = run["recipe"]
    steps = [_hex(x) for x in run["losses"]]
    sums = {k: _hex(v) for k, v in sorted(run["sums"].items())}
    last = {k: _hex(v) for k, v in sorted(run["last"].items())}
    evaluation = {k: _hex(v) for k, v in sorted(recipe.evaluate(source).items())}
    h = hashlib.sha256()
    for key, p in sorted(recipe.distiller.state_dict().items()):
        h.update(key.split("projectors.")[-1].encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return {"losses": steps, "sums": sums, "last": last, "eval": evaluation, "weights": h.hexdigest()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare", default=None, help="a golden JSON: exit 1 on any difference")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        models = _models(root)
        got = {name: run_case(root, models, name, CASES[name]) for name in args.cases}
    Path(args.out).write_text(json.dumps(got, indent=1, sort_keys=True))
    if args.compare is None:
        print(f"{len(got)} cases -> {args.out}")
        return 0
    golden = json.loads(Path(args.compare).read_text())
    bad, added = [], set()
    for case in got:
        for part, new in got[case].items():
            old = golden[case][part]
            if isinstance(old, dict):  # a metric the golden run had must be there, equal; a new one is listed
                bad += [f"{case}: {part}/{k}" for k in old if new.get(k) != old[k]]
                added |= set(new) - set(old)
            elif new != old:
                bad.append(f"{case}: {part}")
    print("identical to the bit" if not bad else "DIFFERENT: " + "; ".join(bad))
    if added:
        print("metrics the golden run did not have: " + ", ".join(sorted(added)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
