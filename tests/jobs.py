"""Job configs over the tiny test models, written as YAML the way a user would."""

from __future__ import annotations

from pathlib import Path

import yaml


def job_dict(qwen_dir, llama_dir, student_dir, storage) -> dict:
    return {
        "name": "tiny",
        "teachers": [
            {"name": "qwen", "model": str(qwen_dir), "dtype": "float32"},
            {"name": "llama", "model": str(llama_dir), "dtype": "float32", "quantization": "4bit"},
        ],
        "student": {"model": str(student_dir), "dtype": "float32"},
        "data": {"source": "synthetic", "num_train": 64, "num_test": 8, "num_val": 8},
        "align": {"mode": "structured", "projector": {"kind": "linear", "dropout": 0.0}, "prefetch_depth": 2},
        "loss": {"kind": "mercator", "beta": 0.01},
        "optim": {"lr_student": 1e-3, "lr_projector": 3e-3, "warmup_steps": 0},
        "train": {"steps": 4, "batch_size": 4, "max_length": 288, "log_steps": 1, "eval_steps": 2, "save_steps": 2},
        "ray": {"namespace": "kava-test", "storage_path": str(storage), "num_workers": 1, "use_gpu": False},
    }


def write_job(tmp: Path, qwen_dir, llama_dir, student_dir, **sections) -> Path:
    """YAML file of `job_dict`, with whole sections replaced/merged from `sections`."""
    d = job_dict(qwen_dir, llama_dir, student_dir, Path(tmp) / "runs")
    for k, v in sections.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    path = Path(tmp) / "job.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path
