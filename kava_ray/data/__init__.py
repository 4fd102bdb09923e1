"""GSM8K-style data, one module per job:

  synthetic  the synthetic GSM8K-format generator (deterministic per seed)
  sources    load_examples: synthetic, a local .jsonl/.json/.parquet file, or a hub dataset
  answers    final_answer / normalize_number
  tokenize   prompt and example encoding with label masking, TokenizedSplit, load_split
  batching   length-bucketed deterministic batches, DDP sharding, collate, batch keys, BatchStream

Pure Python/torch/HF (no Ray). The public names are re-exported here: `from kava_ray.data import X`.
"""

from kava_ray.data.answers import final_answer, normalize_number
from kava_ray.data.batching import (
    BatchStream,
    batch_key,
    collate,
    collate_split,
    collate_view,
    plan_batches,
    shard_batches,
    with_layers,
)
from kava_ray.data.sources import load_examples
from kava_ray.data.synthetic import Example, synthetic_gsm8k
from kava_ray.data.tokenize import (
    IGNORE_INDEX,
    PLAIN_PROMPT,
    TeacherView,
    TokenizedSplit,
    encode_example,
    encode_prompt,
    load_split,
    teacher_view,
    tokenize_split,
    tokenizer_fingerprint,
)

__all__ = [
    "IGNORE_INDEX", "PLAIN_PROMPT", "BatchStream", "Example", "TeacherView", "TokenizedSplit", "batch_key", "collate",
    "collate_split", "collate_view", "encode_example", "encode_prompt", "final_answer", "load_examples", "load_split", "normalize_number",
    "plan_batches", "shard_batches", "synthetic_gsm8k", "teacher_view", "tokenize_split", "tokenizer_fingerprint", "with_layers",
]
