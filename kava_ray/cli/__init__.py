"""The `kava-ray` command: parse, call one orchestration function, print.

Exit codes: 0 ok; 2 bad input (every KavaError: one `error:` line on stderr); 3 `kava-ray plan` says
the config does not fit; 130 interrupted. Subcommands import their modules lazily so `kava-ray
config show` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

from kava_ray.common.errors import KavaError
from kava_ray.common.files import first_line, format_table

EXIT_BAD_INPUT = 2
EXIT_DOES_NOT_FIT = 3


def _print_json_last(obj: dict) -> None:
    """`--json`: one JSON object as the last line of stdout, for scripts."""
    print(json.dumps(obj, sort_keys=True, default=float))


def _show(args, text: str, result: dict) -> int:
    """A command's result: its table, then with `--json` the whole result as the last line; exit 0."""
    print(text)
    if args.json:
        _print_json_last(result)
    return 0


# ----------------------------------------------------------------------------- config


def cmd_config_show(args) -> int:
    from kava_ray.common.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    return 0


# ----------------------------------------------------------------------------- bench


def cmd_bench_projector_ab(args) -> int:
    from kava_ray.bench.projector import format_projector_ab, run_projector_ab

    result = run_projector_ab(seeds=args.seeds, steps=args.steps, lr=args.lr)
    return _show(args, format_projector_ab(result), result)


def cmd_bench_feed(args) -> int:
    from kava_ray.bench.feed import format_feed_bench, run_feed_bench

    result = run_feed_bench(steps=args.steps, batch=args.batch, tokens=args.tokens, ratios=args.ratios,
                            teacher_counts=args.teachers, replicas=args.replicas, real_layers=args.real_layers,
                            transport_mib=args.transport_mib, cross_node=args.cross_node)
    return _show(args, format_feed_bench(result), result)


def cmd_bench_step(args) -> int:
    from kava_ray.bench.step import format_step_bench, run_step_bench

    result = run_step_bench(steps=args.steps, rounds=args.rounds, memory=args.memory)
    return _show(args, format_step_bench(result), result)


def cmd_bench_gpu(args) -> int:
    from kava_ray.bench.gpu import format_gpu, run_gpu_bench

    result = run_gpu_bench(out=args.out, toy=args.toy, steps=args.steps)
    return _show(args, format_gpu(result), result)


# ----------------------------------------------------------------------------- quiet console


def _quiet(args, command: str, storage_path: Optional[str] = None):
    """`--verbose` off: the command's chatter goes to `<ray.storage_path>/logs/<command>-<time>/`
    (kava_ray.runtime.console.quiet); its own output (printed after this block) stays on the terminal."""
    from datetime import datetime

    from kava_ray.common.config import RayConfig
    from kava_ray.runtime.console import quiet

    storage = storage_path or RayConfig().storage_path
    return quiet(Path(storage).expanduser() / "logs" / f"{command}-{datetime.now():%Y%m%d-%H%M%S}", args.verbose)


def _add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's, the workers' and the libraries' log lines live (default: only status lines "
                        "and the progress bar; the rest goes to the run's logs/ dir)")


# ----------------------------------------------------------------------------- teachers


def _job_config(args):
    from kava_ray.common.config import load_config

    return load_config(args.config, args.overrides)


def _select_teachers(cfg, names):
    """Restrict cfg to the teachers named with --teacher (unknown names are a one-line error)."""
    if not names:
        return cfg
    keep = [cfg.teacher(n) for n in names]
    return cfg.model_copy(update={"teachers": keep})


def cmd_teachers(args) -> int:
    from kava_ray.runtime.job import precompute, teacher_pool

    cfg = _select_teachers(_job_config(args), args.teacher)
    if args.teachers_command == "precompute":
        with _quiet(args, "precompute", cfg.ray.storage_path):
            stats = precompute(cfg, args.out, restart_teachers=args.restart_teachers, address=args.address)
        return _show(args, f"KV cache {args.out}: {stats['written']} example(s) written in {stats['forwards']} teacher "
                           f"batch(es), {stats['skipped']} already there, {stats['bytes'] / 2**20:.1f} MiB", stats)
    with _quiet(args, f"teachers-{args.teachers_command}", cfg.ray.storage_path):
        out = teacher_pool(cfg, args.teachers_command, args.address)
    if out["action"] == "up":
        text = f"started {len(out['teachers'])} teacher(s) in namespace '{out['namespace']}': {', '.join(out['teachers'])}"
    elif out["action"] == "down":
        text = f"stopped: {', '.join(out['teachers']) if out['teachers'] else 'nothing was running'}"
    else:
        text = format_status(out["teachers"])
    return _show(args, text, out)


def format_status(rows: list[dict]) -> str:
    header = ["name", "model", "device", "quant", "geometry", "requests", "forwards", "hits", "fwd ms",
              "KV B/token", "restarts"]
    out = []
    for r in rows:
        if not r["running"]:
            out.append([r["name"], r["model"], "not running"] + [""] * 8)
            continue
        out.append([r["name"], r["model"], r["device"], r["quantization"], r["geometry"], r["requests"],
                    r["forwards"], r["hits"], f"{r['mean_forward_ms']:.1f}", r["kv_bytes_per_token"], r["restarts"]])
    return format_table(header, out)


# ----------------------------------------------------------------------------- align


def cmd_align_cka(args) -> int:
    from kava_ray.recipes.cka import format_cka, measure_cka

    cfg = _job_config(args)
    with _quiet(args, "align-cka", cfg.ray.storage_path):
        out = measure_cka(cfg, samples=args.samples, top_k=args.top_k, features=args.features, out=args.out,
                          address=args.address)
    brief = {k: v for k, v in out.items() if k != "teachers"} | {
        "teachers": {n: {"layer_map": e["layer_map"]} for n, e in out["teachers"].items()}}  # not the CKA matrices
    return _show(args, format_cka(out, " ".join([args.config, *args.overrides])), brief)


# ----------------------------------------------------------------------------- train


def cmd_train(args) -> int:
    from kava_ray.recipes.train import run_training

    cfg = _job_config(args)
    out = run_training(cfg, resume=args.resume, name=args.name, address=args.address,
                       resume_override=args.resume_override, restart_teachers=args.restart_teachers,
                       verbose=args.verbose)
    return _show(args, format_final(out), out)


def format_final(out: dict) -> str:
    m = out["metrics"]
    rows = [[k, f"{v:.4f}" if isinstance(v, float) else v] for k, v in sorted(m.items())
            if k.startswith(("loss", "ce", "kv_loss", "cos", "contrast_gap", "eval/", "teacher_wait_s"))]
    return "\n".join([format_table(["metric (last step)", "value"], rows),
                      f"run dir: {out['run_dir']}  ({out['wall_s']:.0f} s)"])


def cmd_tune(args) -> int:
    from kava_ray.recipes.tune import format_results, run_tune

    cfg = _job_config(args)
    with _quiet(args, "tune", cfg.ray.storage_path):
        out = run_tune(cfg, args.space, num_samples=args.num_samples, max_concurrent=args.max_concurrent,
                       resume=args.resume, name=args.name, address=args.address,
                       restart_teachers=args.restart_teachers)
    return _show(args, format_results(out), out)


def cmd_bench_tune_share(args) -> int:
    from kava_ray.bench.tune_share import format_tune_share, run_tune_share

    out = run_tune_share(trials=args.trials, steps=args.steps)
    return _show(args, format_tune_share(out), out)


def cmd_bench_recipes(args) -> int:
    from kava_ray.bench.recipes import format_recipes, run_recipes_bench

    out = run_recipes_bench(args.config, args.overrides, steps=args.steps, seeds=args.seeds, out=args.out,
                            limit=args.limit, max_new_tokens=args.max_new_tokens, num_test=args.num_test,
                            recipes=args.recipes, address=args.address)
    return _show(args, format_recipes(out), out)


def cmd_bench_all(args) -> int:
    import os
    from pathlib import Path

    import torch

    from kava_ray.bench.all import check_results, format_all, performance_block, run_all, write_results

    results = None if args.no_write else Path(args.results)
    if results is not None:
        check_results(results)
    result = run_all()
    machine = (f"1 {torch.cuda.get_device_name(0)} + {os.cpu_count()} CPU cores" if torch.cuda.is_available()
               else f"a {os.cpu_count()}-core CPU, no GPU")
    text = format_all(result)
    if results is not None:
        write_results(results, performance_block(result, machine))
        text += f"\nwrote the Performance table of {results}"
    return _show(args, text, result)


def cmd_bench_align(args) -> int:
    from kava_ray.bench.align import format_align_bench, run_align_bench

    out = run_align_bench(args.config, args.overrides, steps=args.steps, out=args.out, cka_samples=args.cka_samples)
    return _show(args, format_align_bench(out), out)


def cmd_bench_vocab(args) -> int:
    from kava_ray.bench.vocab import format_vocab_bench, run_vocab_bench

    out = run_vocab_bench(docs=args.docs, problems=args.problems, max_length=args.max_length)
    return _show(args, format_vocab_bench(out), out)


def cmd_plan(args) -> int:
    from kava_ray.runtime.planner import format_plan, parse_bytes, plan

    cfg = _job_config(args)
    nodes, source = _plan_nodes(args)
    p = plan(cfg, parse_bytes(args.gpu_mem) if args.gpu_mem else None, args.tokens_per_s, nodes, source)
    _show(args, format_plan(p), p)
    if p["fits"] is False:
        print(p["advice"], file=sys.stderr)  # the verdict: "does not fit gpu0 (... > ...): set ..."
        return EXIT_DOES_NOT_FIT
    return 0


def _plan_nodes(args) -> tuple:
    """The nodes `plan` places the job on: a cluster.yaml's node types (no Ray), a running cluster's live nodes
    (--address), or none."""
    if args.cluster:
        import yaml

        from kava_ray.common.placement import cluster_yaml_nodes

        try:
            spec = yaml.safe_load(Path(args.cluster).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise KavaError(f"--cluster {args.cluster}: {first_line(e)}") from None
        try:
            return cluster_yaml_nodes(spec if isinstance(spec, dict) else {}, args.cluster), args.cluster
        except (TypeError, ValueError) as e:
            raise KavaError(f"--cluster {first_line(e)}") from None
    if args.address:
        import ray

        from actors.pool import cluster_nodes
        from kava_ray.runtime.connect import connect

        with _quiet(args, "plan"):
            connect(args.address, "kava-plan", require_cluster=True)
            try:
                return cluster_nodes(), f"the cluster at {args.address}"
            finally:
                ray.shutdown()
    return None, ""


def cmd_demo(args) -> int:
    from kava_ray.recipes.demo import format_summary, run_demo

    summary = run_demo(args.overrides, address=args.address, verbose=args.verbose)
    return _show(args, format_summary(summary), summary)


def cmd_eval(args) -> int:
    from kava_ray.recipes.evaluate import evaluate_checkpoint

    with _quiet(args, "eval"):
        out = evaluate_checkpoint(args.path, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  address=args.address, restart_teachers=args.restart_teachers)
    rows = [[k, f"{v:.4f}" if isinstance(v, float) else v] for k, v in out.items() if k != "gsm8k_samples"]
    return _show(args, format_table(["metric", "value"], rows), out)


def cmd_report(args) -> int:
    from kava_ray.recipes.report import summarize_run, write_report

    out = write_report(args.run_dir)
    return _show(args, f"{summarize_run(args.run_dir)}\nreport: {Path(args.run_dir) / 'report'}", out)


# ----------------------------------------------------------------------------- parser


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _add_address(p: argparse.ArgumentParser, cluster_only: bool = False) -> None:
    help_ = ("Ray address of a running cluster (auto = a local `ray start --head`)" if cluster_only else
             "Ray address (default: an embedded local Ray of the job's own; auto = a local `ray start --head`)")
    p.add_argument("--address", default=None, help=help_)


def _add_restart_teachers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--restart-teachers", action="store_true",
                   help="replace a running teacher pool that was started for another config (model, weights, "
                        "quantization, dtype, key space) instead of refusing it")


def _add_name(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--name", default=None, help=f"{what} name: its directory under ray.storage_path "
                                                "(default: the config's name and the time)")


def _add_bench_job(p: argparse.ArgumentParser, default_out: str) -> None:
    """A bench that trains real runs: its base job (default the demo's), overrides, output dir, --json."""
    p.add_argument("--config", default="demo_cpu", help="base job config (a YAML path or a preset)")
    p.add_argument("--out", default=None, help=f"output dir (default: {default_out})")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE overrides of the base config")
    _add_json(p)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="a YAML file or a preset name (see `kava-ray config presets`)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr_student=3e-5")


def cmd_data_pydoc(args) -> int:
    from kava_ray.recipes.datacmd import format_pydoc, pydoc_corpus

    with _quiet(args, "data-pydoc"):
        out = pydoc_corpus(args.out, config=args.config, block=args.block, overrides=args.overrides,
                           models=not args.no_models)
    return _show(args, format_pydoc(out), out)


def cmd_bench_heal(args) -> int:
    from kava_ray.bench.heal import format_heal, parse_recipe, run_heal_bench

    recipes = dict(parse_recipe(r) for r in args.recipe)
    out = run_heal_bench(args.config, args.overrides, steps=args.steps, seeds=args.seeds, arms=args.arms,
                         quick=args.quick, out=args.out, min_gap=args.min_gap, arm_overrides=recipes,
                         address=args.address, base_arm=args.base)
    return _show(args, format_heal(out), out)


def cmd_bench_data(args) -> int:
    from kava_ray.bench.data import format_data_bench, run_data_bench

    out = run_data_bench(sizes_mb=args.sizes, max_length=args.max_length, batch_size=args.batch_size,
                         batches=args.batches, out=args.out)
    return _show(args, format_data_bench(out), out)


def cmd_config_presets(args) -> int:
    from kava_ray.common.config import preset_names

    print("\n".join(preset_names()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kava-ray", description="Multi-teacher KV-cache distillation on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_cfg = sub.add_parser("config", help="inspect job configs")
    cfg_sub = p_cfg.add_subparsers(dest="config_command", required=True)
    p = cfg_sub.add_parser("show", help="print the resolved config as YAML")
    _add_config_args(p)
    p.set_defaults(func=cmd_config_show)
    p = cfg_sub.add_parser("presets", help="list the shipped presets")
    p.set_defaults(func=cmd_config_presets)

    p_data = sub.add_parser("data", help="datasets: the offline Python-docs corpus")
    data_sub = p_data.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser("pydoc", help="write CPython's reference docs as train/validation/test JSONL (split by "
                                         "topic) and print their tokens and the teacher's and student's test CE")
    p.add_argument("--out", required=True, help="the corpus directory (train.jsonl, validation.jsonl, test.jsonl)")
    p.add_argument("--config", default="demo_cpu", help="the job whose tokenizer, teacher and student measure it")
    p.add_argument("--block", type=int, default=128, help="packed block length (train.max_length)")
    p.add_argument("--no-models", action="store_true", help="only write and count (no teacher / student CE)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the job config")
    _add_verbose(p)
    _add_json(p)
    p.set_defaults(func=cmd_data_pydoc)

    p_t = sub.add_parser("teachers", help="the teacher pool: up, status, down, precompute")
    t_sub = p_t.add_subparsers(dest="teachers_command", required=True)
    for name, help_ in (("up", "start the pool as detached actors on a running cluster"),
                        ("status", "a table of the running teachers"),
                        ("down", "stop the pool"),
                        ("precompute", "write the dataset's teacher KV to disk (resumes)")):
        p = t_sub.add_parser(name, help=help_)
        _add_config_args(p)
        _add_address(p, cluster_only=name != "precompute")
        p.add_argument("--teacher", action="append", default=[], help="only this teacher (repeatable)")
        _add_json(p)
        _add_verbose(p)
        if name == "precompute":
            _add_restart_teachers(p)
            p.add_argument("--out", required=True, help="cache directory (manifest.json + one safetensors shard per "
                                                        "example: any batch size, data seed or epoch count reads it)")
        p.set_defaults(func=cmd_teachers)

    p_align = sub.add_parser("align", help="measure teacher/student layer alignment")
    align_sub = p_align.add_subparsers(dest="align_command", required=True)
    p = align_sub.add_parser("cka", help="linear CKA of every teacher layer vs every student layer on training "
                                        "examples -> one JSON of per-teacher layer maps (align.layer_map=cka) + heat maps")
    _add_config_args(p)
    p.add_argument("--samples", type=int, default=64, help="the first N training examples to measure on")
    p.add_argument("--top-k", type=int, default=1, help="teacher layers per student layer (weights: their CKA)")
    p.add_argument("--features", choices=("k", "v", "kv"), default="kv",
                   help="compare keys, values, or both (the mean of the two CKAs)")
    p.add_argument("--out", default=None, help="the JSON (default: <ray.storage_path>/cka/<config name>.json); "
                                               "a PNG per teacher goes next to it")
    _add_address(p)
    _add_json(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_align_cka)

    p = sub.add_parser("train", help="distill the teachers into the student (Ray Train)")
    _add_config_args(p)
    _add_address(p)
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a run: its directory (latest checkpoint) or one checkpoint dir")
    p.add_argument("--resume-override", action="store_true",
                   help="with --resume: continue with this config's optim.*/train.*/data.* values where they differ")
    _add_name(p, "run")
    _add_restart_teachers(p)
    _add_json(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("tune", help="Ray Tune search over projector/loss hyper-parameters (shared teachers)")
    _add_config_args(p)
    p.add_argument("--space", required=True, help="a search-space YAML or a name in tune_spaces/ (e.g. default)")
    p.add_argument("--num-samples", type=int, default=None)
    p.add_argument("--max-concurrent", type=int, default=None)
    _add_name(p, "sweep")
    _add_restart_teachers(p)
    p.add_argument("--resume", default=None, metavar="SWEEP_DIR",
                   help="continue an interrupted sweep: its directory (or its name); finished trials stay")
    _add_address(p)
    _add_json(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("plan", help="memory / KV-throughput plan of a config; does it fit the GPUs?")
    _add_config_args(p)
    p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 8GiB, 24GB, 80GiB")
    p.add_argument("--tokens-per-s", type=float, default=None, help="target student tokens/s for KV bandwidth")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", default=None, metavar="CLUSTER_YAML",
                       help="also place the job on the nodes this Ray cluster launcher config can bring up")
    where.add_argument("--address", default=None,
                       help="also place the job on the live nodes of this running Ray cluster (auto = local head)")
    _add_json(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("demo", help="the CPU demo: real SmolLM2 teachers (fp32 + NF4) -> a 6-layer student")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides of the demo_cpu preset")
    _add_address(p)
    _add_json(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("eval", help="held-out CE, KV cos, contrast gap and GSM8K accuracy of a checkpoint")
    p.add_argument("path", metavar="RUN_OR_CHECKPOINT")
    p.add_argument("--limit", type=int, default=16, help="GSM8K questions to generate answers for")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _add_address(p)
    _add_restart_teachers(p)
    _add_json(p)
    _add_verbose(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="plots + Markdown summary of a run dir's metrics.jsonl")
    p.add_argument("run_dir")
    _add_json(p)
    p.set_defaults(func=cmd_report)

    p_bench = sub.add_parser("bench", help="side-by-side measurements on this machine")
    bench_sub = p_bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("projector-ab", help="Linear vs ElasticBottleneck on the predecessor's synthetic A/B")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-3)
    _add_json(p)
    p.set_defaults(func=cmd_bench_projector_ab)
    p = bench_sub.add_parser("feed", help="teacher/student overlap of the KVFeed across regimes (T/S, teachers, "
                                          "replicas), teacher early stop, and KV transport speed")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 4.0], metavar="T/S",
                   help="timed-teacher regimes: the slowest teacher's time over the student step's")
    p.add_argument("--teachers", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                   help="teacher counts of the timed regimes")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="replica counts at T/S = 4")
    p.add_argument("--real-layers", type=int, nargs="*", default=[8, 32],
                   help="layer counts of the real tiny teachers (none: skip the real mode)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--transport-mib", type=int, default=64)
    p.add_argument("--cross-node", action=argparse.BooleanOptionalAction, default=True,
                   help="also the teacher on another Ray node (a three-node local cluster, started for it)")
    _add_json(p)
    p.set_defaults(func=cmd_bench_feed)
    p = bench_sub.add_parser("step", help="plain CE step vs CE+KV (structured, flat, + logits): time per phase, "
                                         "KV capture cost; --memory: measured vs planned memory per recipe")
    p.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each variant keeps its fastest)")
    p.add_argument("--memory", action="store_true", help="also measure each recipe's memory beside kava-ray plan "
                                                         "(a fresh process per recipe)")
    _add_json(p)
    p.set_defaults(func=cmd_bench_step)
    p = bench_sub.add_parser("gpu", help="proof on a GPU, Ray-free: teacher KV on CUDA vs CPU, the step under each "
                                        "precision, memory vs the planner, the 8 GB preset under an 8 GiB cap, "
                                        "tokens/s and MFU, the wire; toy sizes on a CPU")
    p.add_argument("--out", help="also write bench_gpu.json and bench_gpu.md here")
    p.add_argument("--toy", action="store_true", help="toy geometries even on CUDA")
    p.add_argument("--steps", type=int, default=3, help="steps per precision policy and for the 8 GB run")
    _add_json(p)
    p.set_defaults(func=cmd_bench_gpu)
    p = bench_sub.add_parser("tune-share", help="a tiny sweep with one shared teacher pool vs teachers per trial")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    _add_json(p)
    p.set_defaults(func=cmd_bench_tune_share)
    p = bench_sub.add_parser("heal", help="does it distil? the demo's pruned student healed on the Python docs: a "
                                         "positive control (logit KD), KV arms, paired seeds, a decision rule")
    _add_bench_job(p, "<ray.storage_path>/bench-heal-<time>")
    p.add_argument("--steps", type=int, default=None, help="steps per arm (default 40; --quick 3)")
    p.add_argument("--seeds", type=int, default=None, help="paired seeds (default 3; --quick 2)")
    p.add_argument("--arms", nargs="+", default=None, help="a subset of ce, ce+logits, ce+kv, ce+kv+logits, logits")
    p.add_argument("--quick", action="store_true", help="toy sizes (the test runs this)")
    p.add_argument("--min-gap", type=float, default=1.0, help="the gate: nats the teacher must beat the student by")
    p.add_argument("--recipe", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="an extra arm on top of ce, e.g. best-kv:loss.kv_weight=0.3,loss.kv_parts=keys (repeatable)")
    p.add_argument("--base", default="ce", help="the arm every other is paired against (ce, or a --recipe name, "
                                               "e.g. ce at a tuned learning rate); the control needs ce")
    p.add_argument("--address", default=None)
    p.set_defaults(func=cmd_bench_heal)
    p = bench_sub.add_parser("data", help="driver and worker peak RSS, time to the first batch and stream tokens/s "
                                         "for generated text corpora of growing size (packed, datasets/Arrow)")
    p.add_argument("--sizes", type=float, nargs="+", default=[10, 100, 1000], help="corpus sizes in MB")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=200, help="batches the worker takes to time the stream")
    p.add_argument("--out", default=None, help="where corpora and caches go (default: a temp dir)")
    _add_json(p)
    p.set_defaults(func=cmd_bench_data)
    p = bench_sub.add_parser("recipes", help="ce vs ce+kv vs ce+logits vs ce+kv+logits at equal compute, "
                                            "over one precomputed teacher cache")
    _add_bench_job(p, "<ray.storage_path>/bench-recipes-<time>")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--limit", type=int, default=64, help="test problems for greedy exact match (0 = skip)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="generation budget (SmolLM2 needs ~70 tokens to "
                                                                   "reach '#### <answer>' on the synthetic problems)")
    p.add_argument("--num-test", type=int, default=128, help="test examples every student is scored on")
    p.add_argument("--recipes", nargs="+", default=None, metavar="RECIPE",
                   help="run only these arms (default: ce ce+logits ce+kv ce+kv+logits); the teacher row always")
    p.add_argument("--address", default=None)
    p.set_defaults(func=cmd_bench_recipes)
    p = bench_sub.add_parser("all", help="the performance benches (feed, step + memory) and vocab at small defaults, ~10 min; "
                                         "rewrites the Performance table of docs/results.md")
    p.add_argument("--results", default="docs/results.md", help="the file whose Performance block is rewritten")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/results.md alone")
    _add_json(p)
    p.set_defaults(func=cmd_bench_all)
    p = bench_sub.add_parser("align", help="layer maps (ratio vs CKA), head projection (shared vs per_head) and token "
                                          "alignment modes (teacher of another tokenizer) at equal steps")
    _add_bench_job(p, "<ray.storage_path>/bench-align")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--cka-samples", type=int, default=32, help="training examples the CKA map is measured on")
    p.set_defaults(func=cmd_bench_align)
    p = bench_sub.add_parser("vocab", help="teachers of another tokenizer, real pairs: the vocabulary map's coverage "
                                          "and the share of student positions paired for logits (and aligned for KV)")
    p.add_argument("--docs", type=int, default=24, help="Python doc topics (natural text)")
    p.add_argument("--problems", type=int, default=64, help="synthetic math word problems")
    p.add_argument("--max-length", type=int, default=512)
    _add_json(p)
    p.set_defaults(func=cmd_bench_vocab)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KavaError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # a command that saved its state says where (kava_ray.recipes.tune)
        print(f"error: interrupted{'; ' + str(e) if str(e) else ''}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
