"""`extends:` in job configs: a preset or file deep-merged on top of its base (a preset or a file)."""

import pytest
import yaml

from kava_ray.common.config import deep_merge, load_config, read_raw_config, resolve_paths, validate_config
from kava_ray.common.errors import KavaError

# kava_ray/configs/qwen_multi_nf4.yaml before it said `extends: qwen_multi`
# (`git show 2531b10:kava_ray/configs/qwen_multi_nf4.yaml`)
OLD_QWEN_MULTI_NF4 = """
name: qwen_multi_nf4
teachers:
  - name: qwen7b
    model: Qwen/Qwen2.5-7B-Instruct
    dtype: bfloat16
    num_gpus: 1
    num_cpus: 2
  - name: qwen14b
    model: Qwen/Qwen2.5-14B-Instruct
    dtype: bfloat16
    num_gpus: 1
    num_cpus: 2
    layers: [2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 44, 47]
  - name: qwen72b
    model: Qwen/Qwen2.5-72B-Instruct
    quantization: 4bit          # NF4, compute in bf16
    num_gpus: 1
    num_cpus: 2
    layers: [4, 9, 14, 19, 24, 29, 34, 39, 44, 49, 54, 59, 64, 69, 74, 79]
student:
  model: Qwen/Qwen2.5-1.5B-Instruct
  dtype: auto                   # bf16 on the GPU
  gradient_checkpointing: true
data:
  source: openai/gsm8k
  hub_config: main
  num_train: 7473
  num_test: 256
align:
  mode: structured
  layer_map: ratio              # 28 student layers over each teacher's selected layers
  key_space: pre_rope
  wire_dtype: bf16
  prefetch_depth: 2
  projector: {kind: elastic, mlp_ratio: 1.0, dropout: 0.1}
fusion: {kind: gate, per_layer: true}
loss: {kind: mercator, alpha: 1.0, beta: 0.01, kv_weight: 1.0, ce_weight: 1.0, loss_tokens: all}
optim:
  optimizer: adamw
  lr_student: 2.0e-5
  lr_projector: 1.0e-3
  warmup_steps: 50
  schedule: cosine
  grad_clip: 1.0
  accumulation: 4
train: {steps: 1000, batch_size: 8, max_length: 512, log_steps: 10, eval_steps: 200, save_steps: 200, seed: 0}
ray:
  address: auto                 # a running cluster (ray up cluster.yaml, or ray job submit)
  num_workers: 2
  use_gpu: true
  cpus_per_worker: 4
  gpus_per_worker: 1
"""


def _write(path, data):
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _one_line_error(path_or_preset) -> str:
    with pytest.raises(KavaError) as e:
        load_config(path_or_preset)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_qwen_multi_nf4_resolves_to_its_old_full_copy():
    assert read_raw_config("qwen_multi_nf4")["name"] == "qwen_multi_nf4"
    assert "extends" not in read_raw_config("qwen_multi_nf4")
    raw = yaml.safe_load(OLD_QWEN_MULTI_NF4)
    for t in raw["teachers"]:  # the placement both presets gained since (cluster.yaml's node labels)
        t["label_selector"] = {"kava-role": "teacher"}
    raw["ray"]["worker_label_selector"] = {"kava-role": "student"}
    old = resolve_paths(validate_config(raw))  # load_config makes paths absolute
    assert load_config("qwen_multi_nf4").to_dict() == old.to_dict()


def test_deep_merge_merges_mappings_and_replaces_lists_and_scalars():
    base = {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "l": [1, 2, 3], "s": "base", "keep": True}
    over = {"a": {"y": {"q": 9}, "z": 3}, "l": [4], "s": None}
    assert deep_merge(base, over) == {"a": {"x": 1, "y": {"p": 1, "q": 9}, "z": 3}, "l": [4], "s": None, "keep": True}
    assert base["a"]["y"] == {"p": 1, "q": 2}  # the inputs are untouched


def test_file_extends_a_preset_and_a_file_relative_to_it(tmp_path):
    (tmp_path / "sub").mkdir()
    mid = _write(tmp_path / "sub" / "mid.yaml",
                 {"extends": "demo_cpu", "align": {"projector": {"dropout": 0.2}}, "train": {"steps": 7}})
    top = _write(tmp_path / "top.yaml", {"extends": "sub/mid.yaml", "name": "top", "train": {"batch_size": 3}})
    demo = load_config("demo_cpu")
    cfg = load_config(top, ["train.seed=5"])
    assert cfg.name == "top" and cfg.train.steps == 7 and cfg.train.batch_size == 3 and cfg.train.seed == 5
    assert cfg.align.projector.dropout == 0.2
    assert cfg.align.projector.mlp_ratio == demo.align.projector.mlp_ratio  # siblings come from the base
    assert cfg.teachers == demo.teachers and cfg.align.mode == demo.align.mode
    assert load_config(mid).train.steps == 7  # a base is an ordinary config too


def test_extends_cycle_is_one_line_naming_it(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    _write(a, {"extends": "b.yaml", "name": "a"})
    _write(b, {"extends": "a.yaml", "name": "b"})
    msg = _one_line_error(a)
    assert "cycle" in msg and "a.yaml" in msg and "b.yaml" in msg
    _write(a, {"extends": "a.yaml"})
    assert "cycle" in _one_line_error(a)


def test_extends_unknown_base_is_one_line_naming_it(tmp_path):
    bad = _write(tmp_path / "bad.yaml", {"extends": "no_such_base", "name": "x"})
    msg = _one_line_error(bad)
    assert "'no_such_base'" in msg and str(bad) in msg and "demo_cpu" in msg  # lists the presets
    deep = _write(tmp_path / "deep.yaml", {"extends": "bad.yaml"})
    assert "'no_such_base'" in _one_line_error(deep)
    odd = _write(tmp_path / "odd.yaml", {"extends": ["demo_cpu"]})
    assert "extends must name a preset or a file" in _one_line_error(odd)


def test_derive_sets_dotted_keys_and_validates_like_an_override_line():
    from kava_ray.common.config import derive, parse_overrides

    demo = load_config("demo_cpu")
    cfg = derive(demo, {"data.kv_source": "cache", "data.kv_cache_dir": "/tmp/c", "teachers.0.replicas": 2})
    assert (cfg.data.kv_source, cfg.data.kv_cache_dir, cfg.teachers[0].replicas) == ("cache", "/tmp/c", 2)
    assert derive(demo, {"teachers": demo.teachers[:1]}).teachers == demo.teachers[:1]  # a section value
    assert demo.data.kv_source == "live" and cfg is not demo  # a new config; the base is unchanged
    assert derive(demo, parse_overrides(["optim.lr_student=1e-4", "train.steps=3"])).to_dict() == \
        load_config(demo, ["optim.lr_student=1e-4", "train.steps=3"]).to_dict()
    with pytest.raises(KavaError, match=r"config key 'optim.lr_student'"):
        derive(demo, {"optim.lr_student": -1.0})
    with pytest.raises(KavaError, match="unknown key"):
        derive(demo, {"optim.lr": 1.0})
