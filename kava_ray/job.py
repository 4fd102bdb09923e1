"""What a job derives from its config before any training: geometries, per-teacher layer plans,
the tokenized splits and the batch stream fed to both teachers and student.

Shared by `kava-ray train`, `tune`, `teachers precompute` and the benches, so they all agree on
which teacher layers ship and which batch a key names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from kava_ray.align.layers import LayerMap, plan_teacher_layers
from kava_ray.config import JobConfig
from kava_ray.data import BatchStream, TokenizedSplit, load_split, tokenizer_fingerprint
from kava_ray.errors import KavaError
from kava_ray.models import KVGeometry, kv_geometry, load_model_config, load_tokenizer


@dataclass
class TeacherPlan:
    """One teacher as the student sees it: its geometry, the layer map and the layers it ships."""

    name: str
    geometry: KVGeometry
    layer_map: LayerMap
    layers: list[int]


def student_geometry(cfg: JobConfig) -> KVGeometry:
    return kv_geometry(load_model_config(cfg.student.model, keep=cfg.student.keep_layers))


def teacher_plans(cfg: JobConfig, teacher_geoms: dict[str, dict], s_geom: KVGeometry) -> dict[str, TeacherPlan]:
    """Layer map + shipped layers per teacher, from the geometries the teacher actors report."""
    plans = {}
    for t in cfg.teachers:
        g = KVGeometry.from_dict(teacher_geoms[t.name])
        layer_map, shipped = plan_teacher_layers(
            cfg.align.layer_map, g.num_layers, s_geom.num_layers, mode=cfg.align.mode, selected=t.layers,
            explicit=cfg.align.explicit_map, cka_path=cfg.align.cka_path)
        plans[t.name] = TeacherPlan(t.name, g, layer_map, shipped)
    return plans


def check_tokenizers(cfg: JobConfig, teacher_geoms: dict[str, dict], student_fp: str) -> None:
    """Teachers and student must share a tokenizer: KV positions are aligned one to one.

    (Char-offset alignment across tokenizers is in DESIGN's align/tokens.py and not built yet.)
    """
    for t in cfg.teachers:
        if teacher_geoms[t.name]["tokenizer_fingerprint"] != student_fp:
            raise KavaError(f"teacher '{t.name}' uses a different tokenizer than the student; "
                            f"kava-ray aligns tokens one to one, so teachers must share the student's tokenizer")


def load_splits(cfg: JobConfig, tokenizer) -> tuple[TokenizedSplit, TokenizedSplit]:
    """(train, eval) tokenized splits of cfg.data, cut to train.max_length."""
    d = cfg.data
    train = load_split(d, tokenizer, d.train_split, d.num_train, cfg.train.max_length)
    held = load_split(d, tokenizer, d.eval_split, d.num_eval, cfg.train.max_length)
    return train, held


def student_tokenizer(cfg: JobConfig):
    tok = load_tokenizer(cfg.student.model)
    return tok, tokenizer_fingerprint(tok)
