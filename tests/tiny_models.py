"""Test helpers: the tiny models live in the package (`kava_ray.testing`), benches use them too."""

from kava_ray.testing.gguf import write_tiny_gguf  # noqa: F401
from kava_ray.testing.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model, build_tokenizer  # noqa: F401
