"""The README's "your teachers, your data" job is a valid, complete job: copied as printed, it loads."""

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


def test_the_readme_on_policy_block_loads_on_top_of_the_demo(tmp_path):
    section = README.read_text().split("## On-policy distillation", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    job = tmp_path / "onpolicy.yaml"
    job.write_text("extends: demo_cpu\n" + block)
    cfg = load_config(str(job))
    assert cfg.onpolicy.fraction == 1.0 and cfg.onpolicy.lag == 1 and cfg.onpolicy.max_new_tokens == 256
    assert cfg.loss.logit_divergence == "reverse_kl_sampled" and cfg.loss.logit_weight == 1.0
