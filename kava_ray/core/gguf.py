"""A .gguf file -> a plain Hugging Face model dir, converted once per file and cached.

Measured on a 2-core CPU (torch 2.13, transformers 5.23): SmolLM2-135M-Instruct.Q4_1.gguf loaded
with `from_pretrained(dir, gguf_file=...)` de-quantizes in 18-21 s, the GGUF tokenizer another ~5 s;
`gguf_to_hf_dir` does that once (~30 s incl. save) and later loads of the plain directory take ~1 s.
Concurrent processes (teacher actors) converting one file wait on a file lock; the cached dir
appears complete or not at all.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_dir, content_key, default_cache_dir, file_lock, first_line, write_json

GGUF_MARKER = ".kava-gguf-complete"


@contextlib.contextmanager
def wrap_load_errors(spec):
    """Turn any loader failure (missing hub id, offline, corrupt file...) into a one-line KavaError.

    Shared with models.py, which sits above this module.
    """
    try:
        yield
    except (KavaError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - HF raises many types; the user needs one line
        raise KavaError(f"model '{spec}': cannot load ({first_line(e, with_type=True)})") from e


def gguf_cache_path(gguf_path: Path, cache_dir=None) -> Path:
    """The cached HF dir of `gguf_path`, keyed by its content: size, first and last MiB (the header
    with every tensor's name, shape and offset; the last tensors' data). The same file in another
    venv, checkout or place shares one conversion; a file rewritten with other weights gets its
    own."""
    h = content_key(gguf_path)
    return Path(cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{h.hexdigest()[:12]}"


def gguf_to_hf_dir(gguf_path, out_dir) -> Path:
    """De-quantize a .gguf once and save it as a plain HF dir (model + tokenizer); cached by a marker file.

    A model loaded with gguf_file= carries a GGUF quantization_config, so we rebuild the model from
    its config without it, load the state dict, and save it through `atomic_dir` (a temp dir renamed
    into place, replacing an incomplete leftover of a crashed conversion).
    Measured on 2 CPUs with SmolLM2-135M Q4_1: ~30 s the first time, then a no-op.
    """
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if (out_dir / GGUF_MARKER).is_file():
        return out_dir
    if not gguf_path.is_file():
        raise KavaError(f"model '{gguf_path}': GGUF file does not exist")
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if (out_dir / GGUF_MARKER).is_file():  # another process finished while we waited
            return out_dir
        d, name = str(gguf_path.parent), gguf_path.name
        with wrap_load_errors(gguf_path):
            src = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        config = src.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        model.generation_config = src.generation_config
        del src
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            write_json(tmp / GGUF_MARKER, {"source": str(gguf_path.resolve())}, indent=None)
    return out_dir
