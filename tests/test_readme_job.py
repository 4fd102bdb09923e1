"""The README's "your teachers, your data" job is a valid, complete job: copied as printed, it loads; on one file
for every split (its documented alternative) it runs, and `kava-ray eval` tests it on another file."""

import json
import re
from pathlib import Path

import pytest

from kava_ray.common.config import load_config
from kava_ray.common.errors import KavaError

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_job() -> str:
    section = README.read_text().split("## Your teachers, your data", 1)[1]
    return re.search(r"```yaml\n(.*?)```", section, re.S).group(1)


def test_the_readme_job_loads_as_printed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "my_job.yaml"
    job.write_text(_readme_job())
    cfg = load_config(str(job))
    assert [t.name for t in cfg.teachers] == ["qwen7b", "llama8b"]
    assert cfg.teachers[0].quantization == "4bit"
    assert cfg.loss.logit_weight == 1.0 and cfg.data.val_split == "validation"
    assert cfg.data.source == str(tmp_path / "my_data/{split}.jsonl")  # local: absolute from where you run


def test_a_typo_in_the_readme_job_is_one_line(tmp_path):
    job = tmp_path / "my_job.yaml"
    job.write_text(_readme_job().replace("logit_weight:", "logit_wieght:"))
    with pytest.raises(KavaError, match=r"loss.logit_wieght.*did you mean 'loss.logit_weight'"):
        load_config(str(job))


def test_the_readme_job_without_val_split_on_one_file_loads(tmp_path):
    """The block's comment: omit `val_split` to carve validation from the training records -- with one file
    (`source: chat.jsonl`) and the block's `num_val: null` too (5 % of its records, `splits.carved_counts`)."""
    from kava_ray.data.splits import carved

    block = _readme_job()
    assert "  val_split: validation" in block and "./my_data/{split}.jsonl" in block
    job = tmp_path / "my_job.yaml"
    job.write_text("\n".join(line for line in block.replace("./my_data/{split}.jsonl", str(tmp_path / "chat.jsonl"))
                             .splitlines() if not line.startswith("  val_split:")))
    cfg = load_config(str(job))
    assert cfg.data.val_split is None and cfg.data.num_val is None and carved(cfg.data)


def test_the_readme_on_policy_block_loads_on_top_of_the_demo(tmp_path):
    section = README.read_text().split("## On-policy distillation", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    job = tmp_path / "onpolicy.yaml"
    job.write_text("extends: demo_cpu\n" + block)
    cfg = load_config(str(job))
    assert cfg.onpolicy.fraction == 0.5 and cfg.onpolicy.lag == 1 and cfg.onpolicy.max_new_tokens == 128
    assert cfg.loss.ce_weight == 1.0  # on the other half: the records' own completions (CE is off on the samples)
    assert cfg.loss.logit_divergence == "reverse_kl_sampled" and cfg.loss.logit_weight == 1.0


# ------------------------------------------------- the job run as printed, on one file for every split


def chat_records(n: int, times: int = 2) -> str:
    """n chat records, one a line: "What is i times `times`?" and its answer."""
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} times {times}?"},
                                            {"role": "assistant", "content": f"It is {i * times}."}]}) + "\n"
                   for i in range(n))


@pytest.fixture(scope="module")
def readme_run(ray_session, tmp_path_factory, tiny_qwen2_dir, tiny_llama_dir, tiny_student_dir):
    """The README's job as printed with `source: chat.jsonl` (one file for every split, its `num_val: null` and
    `num_test: null` kept): the hub ids are the tiny local models (no downloads; their context is 512 positions, so
    train.max_length 256), the teachers on CPUs, 2 steps.
    The job's teachers are held for the module (its eval below finds them running)."""
    from actors.pool import start_missing, stop_pool
    from kava_ray.recipes.train import run_training

    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "chat.jsonl").write_text(chat_records(40))
    block = _readme_job()
    for printed, local in {"Qwen/Qwen2.5-7B-Instruct": tiny_qwen2_dir,
                           "meta-llama/Llama-3.1-8B-Instruct": tiny_llama_dir,
                           "Qwen/Qwen2.5-0.5B-Instruct": tiny_student_dir,
                           "./my_data/{split}.jsonl": tmp / "chat.jsonl"}.items():
        assert printed in block, printed
        block = block.replace(printed, str(local))
    (tmp / "my_job.yaml").write_text(block)
    cfg = load_config(str(tmp / "my_job.yaml"), ["teachers.0.num_gpus=0", "teachers.1.num_gpus=0", "train.steps=2",
                                                 "train.max_length=256",  # the tiny models' context is 512
                                                 f"ray.storage_path={tmp / 'runs'}"])
    handles, started = start_missing(cfg)  # held: Ray ends a non-detached actor once no handle to it is left
    out = run_training(cfg, name="my_job", progress=False)
    yield cfg, out, tmp
    stop_pool(cfg, only=started)
    del handles


def test_the_readme_job_runs_on_one_file_for_every_split(readme_run):
    """One file, `num_val` / `num_test` null: validation and test are each 5 % of its records (at least one),
    carved apart from the training records; the run trains, validates and tests."""
    from kava_ray.runtime.preflight import prepare_data

    cfg, out, _ = readme_run
    assert cfg.data.num_val is None and cfg.data.num_test is None and "{split}" not in cfg.data.source
    assert prepare_data(cfg) == {"train": 36, "validation": 2, "test": 2, "carved": True, "warning": None,
                                 "format": "messages"}
    records = [json.loads(line) for line in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2]
    test = [r for r in records if r["kind"] == "test"]
    assert len(test) == 1 and 0 < test[0]["test/ce"] < 20 and (Path(out["run_dir"]) / "final" / "student").is_dir()


def test_eval_on_another_file_tests_on_all_of_it(readme_run):
    """`kava-ray eval RUN data.source=other.jsonl`: the whole file is the test split (nothing is carved from it), its
    last batch short (10 records, batch 4): the student's test CE is the one over every record; `data.num_test=3`
    caps it (one short batch)."""
    from kava_ray.core.models import load_model, load_tokenizer
    from kava_ray.data.splits import load_test_split
    from kava_ray.recipes.evaluate import eval_config, evaluate_checkpoint, heldout_ce

    cfg, out, tmp = readme_run
    other = tmp / "other.jsonl"
    other.write_text(chat_records(10, times=3))
    ev = evaluate_checkpoint(out["run_dir"], limit=0, overrides=[f"data.source={other}"])
    assert ev["test_rows"] == 10
    student = Path(out["run_dir"]) / "final" / "student"
    other_cfg = eval_config(cfg, [f"data.source={other}"])
    split = load_test_split(other_cfg.data, other_cfg.train, load_tokenizer(student))
    assert len(split) == 10
    assert ev["test/ce"] == pytest.approx(heldout_ce(load_model(student, dtype="float32"), split), rel=1e-5)
    assert evaluate_checkpoint(out["run_dir"], limit=0, overrides=[f"data.source={other}", "data.num_test=3"]
                               )["test_rows"] == 3


def test_eval_of_the_runs_own_file_keeps_its_carve(readme_run, capsys):
    """`kava-ray eval RUN data.source=<the file it trained on>` (however spelled: a symlink here) is the run's own
    test split -- its 2 carved rows, not all 40 (36 of them trained on); a data.num_* that would re-carve that file
    is one line, exit 2, before anything loads, nothing written."""
    from kava_ray.cli import main
    from kava_ray.core.models import load_tokenizer
    from kava_ray.data.splits import load_test_split
    from kava_ray.recipes.evaluate import eval_config, evaluate_checkpoint

    cfg, out, tmp = readme_run
    run = Path(out["run_dir"])
    link = tmp / "same.jsonl"
    link.symlink_to(tmp / "chat.jsonl")
    own = eval_config(cfg, [f"data.source={link}"])
    assert len(load_test_split(own.data, own.train, load_tokenizer(run / "final" / "student"))) == 2
    assert evaluate_checkpoint(run, limit=0, overrides=[f"data.source={tmp / 'chat.jsonl'}"])["test_rows"] == 2
    before = sorted(str(p) for p in run.rglob("*"))
    for args in (["data.num_test=8"], [f"data.source={link}", "data.num_val=1"], ["data.allow_overlap=true"]):
        capsys.readouterr()
        code = main(["eval", str(run), *args])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (args, lines)
        assert lines[0].startswith(f"error: eval {args[-1]}: this run carved its test split from its one file "
                                   f"{tmp / 'chat.jsonl'} (data.num_train=null, data.num_val=null, "
                                   f"data.num_test=null); another carve would test on rows it trained on"), lines[0]
    assert sorted(str(p) for p in run.rglob("*")) == before
