"""Data: record formats and sources, tokenization with loss masks and packing, and the batches a step reads.

Pure Python/torch/HF (no Ray). The public names are re-exported here: `from kava_ray.data import X`.
One module per job (records, sources, synthetic, corpus, answers, tokenize, batching):
docs/internals/core.md#data.
"""

from kava_ray.data.answers import final_answer, normalize_number
from kava_ray.data.batching import (
    Batch,
    BatchStream,
    TeacherInputs,
    batch_key,
    collate,
    collate_split,
    collate_view,
    plan_batches,
    shard_batches,
    with_layers,
)
from kava_ray.data.records import FORMATS, PLAIN_PROMPT
from kava_ray.data.sources import load_examples, load_records
from kava_ray.data.synthetic import Example, synthetic_gsm8k
from kava_ray.data.tokenize import (
    IGNORE_INDEX,
    TeacherView,
    TokenizedSplit,
    encode_example,
    encode_prompt,
    encode_record,
    teacher_view,
    tokenize_split,
)

__all__ = [
    "FORMATS", "IGNORE_INDEX", "PLAIN_PROMPT", "Batch", "BatchStream", "Example", "TeacherInputs", "TeacherView",
    "TokenizedSplit", "batch_key", "collate", "collate_split", "collate_view", "encode_example", "encode_prompt",
    "encode_record", "final_answer", "load_examples", "load_records", "normalize_number", "plan_batches",
    "shard_batches", "synthetic_gsm8k", "teacher_view", "tokenize_split", "with_layers",
]
