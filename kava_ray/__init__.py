"""kava-ray: Ray-distributed multi-teacher KV-cache distillation."""

from kava_ray.common.errors import KavaError

__version__ = "0.1.0"
__all__ = ["KavaError", "__version__"]
