"""`kava-ray bench heal --onpolicy`: on-policy distillation against its off-policy control on the heal bench's corpus.

The heal bench's gate, teacher and shared CE warm start (`bench.heal`), then prompt/completion
records cut from the same Python-docs splits (`records_corpus`: a window's first `prompt` tokens are
the prompt, the next `completion` tokens its completion) and four arms from that warm start, paired
over seeds (each seed draws the record order and the samples), the same number of student steps, the
teacher live in this process (sampled sequences exist only once sampled, so nothing is cached):

- `ce+logits`: CE + top-k forward KL on the records' own completions (off-policy: today's recipe, the base);
- `onpolicy-jsd`: the student's own completions, TRL GKD's generalized JSD (beta 0.5) on the teacher's top-k;
- `onpolicy-rkl`: the student's own completions, the sampled reverse KL (tinker-cookbook's policy gradient);
- `seq_kd`: the teacher's completions (TRL's seq_kd), CE + forward KL on them.

Scored on held-out prompts (the test split's): the teacher-scored per-token reverse KL of the
student's own samples (log q - log pi_T, what on-policy distillation lowers; tinker's teacher_kl),
the teacher's NLL of those samples, and the test CE of the records' completions. The warm start is
scored the same way: the harness's positive control is that the off-policy arm moves the sample
metric from there.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from kava_ray.bench.inprocess import run_key, train_in_process
from kava_ray.bench.stats import fmt_interval, guarded_verdict, mean_sd, paired
from kava_ray.common.config import JobConfig, derive
from kava_ray.common.files import atomic_write, format_table, write_json
from kava_ray.core.kv import next_token_logprobs
from kava_ray.core.losses import next_token_mask
from kava_ray.core.models import load_model, load_student
from kava_ray.core.sampling import sample
from kava_ray.data.batching import collate_split
from kava_ray.data.completions import prompts_of, sampled_batch
from kava_ray.data.splits import load_splits, load_test_split
from kava_ray.recipes.evaluate import heldout_ce
from kava_ray.testing.inprocess_source import InProcessSource, in_process_plans

OP_BASE = "ce+logits"
OP_ARMS = {  # the config of each arm on top of the records job (logit weight 1, no KV)
    "ce+logits": {"onpolicy.fraction": 0.0, "loss.logit_divergence": "forward_kl"},
    "onpolicy-jsd": {"onpolicy.fraction": 1.0, "loss.logit_divergence": "jsd", "loss.jsd_beta": 0.5},
    "onpolicy-rkl": {"onpolicy.fraction": 1.0, "loss.logit_divergence": "reverse_kl_sampled"},
    "seq_kd": {"onpolicy.fraction": 1.0, "onpolicy.source": "teacher", "loss.logit_divergence": "forward_kl"},
}
MIN_RKL = 0.05  # an arm helps: its paired reverse-KL difference excludes 0 and is at least this many nats/token lower
CE_MARGIN = 0.10  # ... and its test CE is not worse than the base's by more than this (the interval's upper end)
ENTROPY_FLOOR = 0.5  # ... and its samples' entropy stays above this share of the warm start's (else: "collapsed")
OP_DEFAULTS = {"prompt": 32, "completion": 32, "records": (512, 32, 64), "eval_prompts": 64}
OP_QUICK = {"prompt": 8, "completion": 6, "records": (64, 4, 8), "eval_prompts": 8}


def op_decision_rule() -> str:
    return (f"an on-policy arm helps when its paired difference against {OP_BASE} in the teacher-scored reverse KL "
            f"of the student's own held-out samples has a 95 % interval that excludes 0 and is at least {MIN_RKL} "
            f"nats/token lower, AND its paired test-CE difference's 95 % upper end is at most +{CE_MARGIN} nats, AND "
            f"its samples' entropy stays above {ENTROPY_FLOOR:.0%} of the warm start's (below it: collapsed, "
            f"whatever else)")


def records_corpus(corpus: Path, tok, out: Path, prompt: int, completion: int, caps: tuple) -> Path:
    """prompt/completion JSONL per split from the text corpus: each document cut into consecutive
    windows of `prompt` + `completion` student tokens, decoded; at most caps (train, validation,
    test) records per split."""
    out.mkdir(parents=True, exist_ok=True)
    w = prompt + completion
    for split, cap in zip(("train", "validation", "test"), caps):
        rows = []
        for line in (corpus / f"{split}.jsonl").read_text().splitlines():
            ids = tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            for s in range(0, len(ids) - w + 1, w):
                rows.append({"prompt": tok.decode(ids[s:s + prompt]), "completion": tok.decode(ids[s + prompt:s + w])})
                if len(rows) >= cap:
                    break
            if len(rows) >= cap:
                break
        atomic_write(out / f"{split}.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n", keep_same=True)
    return out


def op_job(job: JobConfig, records: Path, root: Path, p: dict) -> JobConfig:
    """The records job: the heal bench's teacher and settings on the prompt/completion records, teachers live."""
    n_train, n_val, n_test = p["records"]
    return derive(job, {
        "data.source": f"{records}/{{split}}.jsonl", "data.format": "prompt_completion", "data.packing": None,
        "data.num_train": n_train, "data.num_val": n_val, "data.num_test": n_test, "data.kv_source": "live",
        "data.kv_cache_dir": None, "train.max_length": 2 * (p["prompt"] + p["completion"]),
        "onpolicy.max_new_tokens": p["completion"], "onpolicy.temperature": 1.0, "onpolicy.top_p": 1.0,
        "loss.kv_weight": 0.0, "loss.logit_weight": 1.0, "loss.relation_weight": 0.0, "loss.hidden_weight": 0.0,
        "loss.ce_weight": 1.0, "ray.storage_path": str(root / "runs")})


class CountingSource(InProcessSource):
    """The teacher in this process, counting its scoring forwards (rows) and the completions it wrote."""

    def __init__(self, models: dict):
        super().__init__(models)
        self.rows = self.written = 0

    def result(self, name, request, future):
        self.rows += int(request.input_ids.shape[0])
        return super().result(name, request, future)

    def generate(self, name, prompts, *args):
        self.written += len(prompts)
        return super().generate(name, prompts, *args)


@torch.no_grad()
def sample_scores(student, teacher, split, tok, max_new: int, n_prompts: int, batch: int = 8, seed: int = 0) -> dict:
    """The student's own samples of the first `n_prompts` held-out prompts (temperature 1, seeded), scored by the
    teacher: the per-token reverse KL log q - log pi_T (q: the student's sampling log-prob), the teacher's NLL
    -log pi_T, over every sampled token (`tokens`)."""
    rkl = nll = 0.0
    n = 0
    for s in range(0, min(n_prompts, len(split)), batch):
        idx = list(range(s, min(s + batch, n_prompts, len(split))))
        b = collate_split(split, idx)
        smp = sample(student, prompts_of(b), max_new, eos_ids=[tok.eos_token_id], pad_id=split.pad_id, seed=seed + s)
        sb = sampled_batch(b, idx, split, smp.ids, smp.logp, tok, {}, 1 << 20)
        t = next_token_logprobs(teacher(input_ids=sb.input_ids, attention_mask=sb.attention_mask).logits, sb.input_ids)
        m = next_token_mask(sb.labels)
        rkl += float((sb.sample_logp - t)[m].sum())
        nll += float((-t)[m].sum())
        n += int(m.sum())
    return {"rkl": rkl / max(n, 1), "teacher_nll": nll / max(n, 1), "tokens": n}


def run_onpolicy_arms(job: JobConfig, corpus: Path, root: Path, warm: str, tok, steps: int, seeds: int, lr: float,
                      quick: bool, say: Callable[[str], None], arms: Optional[list] = None) -> dict:
    """Every on-policy arm from the warm start over `seeds` (module docstring); finished runs kept
    under root/onpolicy_runs and read back by a re-run."""
    p = dict(OP_QUICK if quick else OP_DEFAULTS)
    names = arms or list(OP_ARMS)
    say(f"on-policy decision rule, fixed before the run: {op_decision_rule()}")
    records = records_corpus(corpus, tok, root / "records", p["prompt"], p["completion"], p["records"])
    cfg0 = op_job(job, records, root, p)
    t = cfg0.teachers[0]
    teacher = load_model(t.model, dtype=t.dtype, quantization=t.quantization)
    models = {t.name: teacher}
    plans = in_process_plans(cfg0, models)
    test = load_test_split(cfg0.data, cfg0.train, tok)
    score = {"prompts": min(p["eval_prompts"], len(test)), "max_new": p["completion"]}

    def evaluate(student) -> dict:
        return {"test_ce": heldout_ce(student, test),
                **sample_scores(student, teacher, test, tok, p["completion"], p["eval_prompts"])}

    start = evaluate(load_student(warm, dtype="float32"))
    say(f"on-policy warm start: test CE {start['test_ce']:.4f}, reverse KL of its samples {start['rkl']:.4f}, "
        f"teacher NLL {start['teacher_nll']:.4f} ({start['tokens']} sampled tokens)")
    runs, done = {}, root / "onpolicy_runs"
    for arm in names:
        runs[arm] = []
        for seed in range(seeds):
            cfg = derive(cfg0, {**OP_ARMS[arm], "train.seed": seed, "train.data_seed": seed, "train.steps": steps,
                                "student.model": warm, "student.keep_layers": None, "optim.lr_student": lr})
            path = done / arm / f"seed{seed}-{run_key(cfg.model_dump(mode='json', exclude_defaults=True))}.json"
            if path.is_file():
                runs[arm].append(json.loads(path.read_text()))
                continue
            source = CountingSource(models)
            t0 = time.time()
            run = train_in_process(cfg, plans, source, steps)
            figs = evaluate(run["recipe"].distiller.student)
            samples = steps * cfg.train.batch_size
            out = {"seed": seed, "figures": figs, "wall_s": time.time() - t0, "step_s": run["step_s"],
                   "teacher_rows_per_sample": source.rows / samples, "teacher_written_per_sample":
                   source.written / samples, "sampled_tokens": float(run["last"].get("onpolicy/sampled_tokens", 0))}
            write_json(path, out)
            runs[arm].append(out)
            say(f"{arm} seed {seed}: test CE {figs['test_ce']:.4f}, reverse KL {figs['rkl']:.4f}, teacher NLL "
                f"{figs['teacher_nll']:.4f} ({out['wall_s']:.0f} s)")
    summary = op_summarize(runs, start)
    return {"arms": names, "base": OP_BASE, "decision_rule": op_decision_rule(), "params": p, "steps": steps,
            "seeds": seeds, "lr": lr, "start": start, "score": score, "runs": runs, "summary": summary,
            "records": str(records), "train_records": len(load_splits(cfg0.data, cfg0.train, tok)[0]),
            "control": summary.get(OP_BASE, {}).get("vs_start")}


def sample_entropy(f: dict) -> float:
    """The student's samples' own per-token entropy estimate, -E log q = teacher NLL - reverse KL:
    near 0, the student has collapsed onto a few sequences (whatever the teacher thinks of them)."""
    return f["teacher_nll"] - f["rkl"]


def op_summarize(runs: dict, start: dict) -> dict:
    """Per arm: mean ± sd of each figure, the wall and teacher work per arm; paired differences
    against the base (arm - base) and the decision; for the base, its paired move from the warm
    start (the harness control)."""
    out = {}
    base = [r["figures"] for r in runs.get(OP_BASE, [])]
    for arm, rs in runs.items():
        figs = [dict(r["figures"], entropy=sample_entropy(r["figures"])) for r in rs]
        s = {"mean": {k: mean_sd([f[k] for f in figs]) for k in ("test_ce", "rkl", "teacher_nll", "entropy")},
             "wall_s": sum(r["wall_s"] for r in rs), "step_s": mean_sd([r["step_s"] for r in rs]),
             "teacher_rows_per_sample": mean_sd([r["teacher_rows_per_sample"] for r in rs]),
             "teacher_written_per_sample": mean_sd([r["teacher_written_per_sample"] for r in rs])}
        if arm == OP_BASE:
            s["vs_start"] = {k: paired([f[k] for f in figs], [start[k]] * len(figs)) for k in ("rkl", "test_ce")}
        elif base:
            s["vs_base"] = {k: paired([f[k] for f in figs], [f[k] for f in base]) for k in ("test_ce", "rkl",
                                                                                        "teacher_nll")}
            d = s["vs_base"]["rkl"]
            gain = None if d is None else dict(d, mean=-d["mean"], lo=None if d["hi"] is None else -d["hi"],
                                               hi=None if d["lo"] is None else -d["lo"])  # lower reverse KL: a gain
            verdict = guarded_verdict(gain, s["vs_base"]["test_ce"], s["mean"]["entropy"]["mean"], CE_MARGIN,
                                      ENTROPY_FLOOR * sample_entropy(start), MIN_RKL)
            s["decision"] = {"helps": verdict == "helps", "verdict": verdict}
        out[arm] = s
    return out


def format_onpolicy(r: dict) -> str:
    o = r["onpolicy"]
    st, p = o["start"], o["params"]
    rows = [["warm start", f"{st['test_ce']:.4f}", f"{st['rkl']:.4f}", f"{st['teacher_nll']:.4f}",
             f"{sample_entropy(st):.4f}", "—", "—", "—", "—"]]
    for arm, s in o["summary"].items():
        m = s["mean"]
        rows.append([arm, *(f"{m[k]['mean']:.4f} ± {m[k]['sd']:.4f}" for k in ("test_ce", "rkl", "teacher_nll",
                                                                             "entropy")),
                     f"{s['teacher_rows_per_sample']['mean']:.2f} + {s['teacher_written_per_sample']['mean']:.2f}",
                     f"{s['step_s']['mean']:.2f}", f"{s['wall_s'] / 60:.1f}", s.get("decision", {}).get("verdict",
                                                                                                     "(base)")])
    d_rows = [[arm, fmt_interval(s["vs_base"]["rkl"], 4), fmt_interval(s["vs_base"]["teacher_nll"], 4),
               fmt_interval(s["vs_base"]["test_ce"], 4)] for arm, s in o["summary"].items() if "vs_base" in s]
    c = o.get("control") or {}
    return "\n".join([
        f"on-policy heal ({r['config']}): teacher {r['teacher']} live in process, its pruned student from the CE warm "
        f"start; {o['train_records']} prompt/completion records cut from the Python docs ({p['prompt']} + "
        f"{p['completion']} tokens), {o['steps']} steps x batch {r['batch_size']} per arm at lr {o['lr']:.2g}, "
        f"seeds {list(range(o['seeds']))}; held out: {o['score']['prompts']} test prompts sampled once per run "
        f"(temperature 1, {st['tokens']} tokens at the warm start)",
        format_table(["arm", "test CE", "reverse KL of own samples", "teacher NLL of samples", "samples' entropy",
                      "teacher fwd + writes / sample", "s/step", "wall min", "decision"], rows),
        "",
        f"paired differences against {OP_BASE} (arm - {OP_BASE}, mean [95 % t-interval], * = excludes 0):",
        format_table(["arm", "Δ reverse KL", "Δ teacher NLL", "Δ test CE"], d_rows),
        f"decision rule (fixed before the run): {o['decision_rule']}",
        f"harness control ({OP_BASE} from the warm start, paired): reverse KL {fmt_interval(c.get('rkl'), 4)}, "
        f"test CE {fmt_interval(c.get('test_ce'), 4)}",
    ])
