"""Memory / KV-throughput planner: where a job's bytes go, per device, before anything is loaded.

`plan(cfg, gpu_mem_bytes)` estimates every device the config places work on as items in bytes, says
whether each fits, and when one does not, the cheapest config change that makes it fit. Nothing is
downloaded or loaded. The memory model (every item's formula): docs/internals/runtime.md#planner.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoModelForCausalLM

from kava_ray.common import placement, resources
from kava_ray.common.config import JobConfig, derive, parse_overrides, replica_label
from kava_ray.common.errors import KavaError
from kava_ray.core.fusion import Fusion
from kava_ray.core.known_models import known_config, model_geometry, param_breakdown
from kava_ray.core.kv import kv_bytes_per_token, logits_bytes_per_token
from kava_ray.core.models import KVGeometry, kv_geometry, load_model_config
from kava_ray.core.plans import copied_from_teacher, cross_vocab, layer_plan, logits_top_k
from kava_ray.core.precision import planned_policy, student_bytes_per_param
from kava_ray.core.projectors import TeacherProjector, job_kind, matmul_weights

GiB = 1024 ** 3
MiB = 1024 ** 2

# bytes per decoder Linear param when quantized (bitsandbytes): NF4 4-bit codes + absmax per 64
# (double-quantized) ~0.52, rounded up for the quant state; LLM.int8 1 B + an fp32 scale per row.
QUANT_BYTES = {"4bit": 0.55, "8bit": 1.03}
# Saved-for-backward elements per token per decoder layer, counted with torch saved-tensor hooks on
# HF transformers 5.23 Qwen2 layers (SDPA, fp32, CPU; h 384-768, i 1024-3072, T 128-512): the two
# RMSNorms (input + normalised + output: 6h), q / repeated k, v / attention output / o_proj input
# (4q), gate, up, SiLU, product (4i), and the [B, 1, T, T] mask copy SDPA keeps per layer (T).
ACT_H, ACT_Q, ACT_I, ACT_T = 6, 4, 4, 1
ACT_FIXED_H = 3  # embedding output + final norm input/output, per token
# The mercator KV loss saves ~8.3 elements per student K/V element and token (K and V together:
# the masked student and target copies and cosine/norm intermediates; saved-tensor hooks).
LOSS_S = 8.5
LOGIT_BYTES = 12  # fp32 log-softmax output + its gradient in + gradient out, per logit
# CUDA context (~0.3-0.4 GiB with lazy module loading) + cuBLAS workspaces + allocator slack.
RUNTIME_BYTES = 512 * MiB
# glibc keeps freed heap blocks resident, so a CPU process's RSS peaks above its live heap: measured
# ~+30 % on tests/test_plan.py's calibration job (mallinfo2's live peak vs RSS). It applies to what is freed
# and allocated again every step (activations, logits, grads, KV buffers, a teacher's forward), not to the
# weights (mmapped from safetensors, or allocated once) and optimizer states (allocated once): with the slack
# on every item, `kava-ray bench step --memory`'s job (6-layer hidden-384 student, 12-layer hidden-512
# teacher, vocab 8192, 4 x 256 tokens; weights and AdamW states ~55 % of the total) was planned at +11..+23 %
# (student worker) and +5..+28 % (teacher) of the measured peak RSS growth of each of its 6 recipes, the
# calibration job (~15 % weights and states) at -7..-3 % and -12..+14 %; on these items only, +2..+14 % and
# -9..+7 %, and -10..-5 % and -16..+11 % (`cpu_allocator_slack`; measured by `kava_ray.bench.memory`).
CPU_ALLOCATOR_SLACK = 0.25
PERSISTENT_ITEMS = ("weights", "optimizer")  # items named so get no allocator slack


def cpu_allocator_slack(items: dict) -> int:
    """CPU_ALLOCATOR_SLACK of the items a CPU process frees and allocates again (all but PERSISTENT_ITEMS)."""
    return int(CPU_ALLOCATOR_SLACK * sum(v for k, v in items.items() if not any(w in k for w in PERSISTENT_ITEMS)))


# ------------------------------------------------------------------------------------------ parsing

_UNITS = {"": 1, "b": 1, "k": 1024, "m": MiB, "g": GiB, "t": 1024 * GiB,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "ki": 1024, "mi": MiB, "gi": GiB, "ti": 1024 * GiB,
          "kib": 1024, "mib": MiB, "gib": GiB, "tib": 1024 * GiB}


def parse_bytes(text) -> int:
    """'8GiB' | '8Gi' | '8G' (binary) | '8GB' (decimal) | '8192MiB' | '8e9' (bytes) -> int bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise KavaError(f"memory size {text!r}: expected a number with an optional unit, e.g. 8GiB, 8GB, "
                            f"8192MiB or 8e9")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value * _UNITS[unit]) or value * _UNITS[unit] < 1:
        raise KavaError(f"memory size {text!r}: must be a finite size >= 1 byte")
    return int(value * _UNITS[unit])


# ------------------------------------------------------------------------------------------ models


@dataclass
class ModelInfo:
    """What the planner needs from one model: KV geometry, layer sizes and parameters by kind."""

    geometry: KVGeometry
    intermediate: int
    q_dim: int
    params: dict  # embed, lm_head, linear (decoder Linear weights + biases), other (norms, ...)

    @property
    def total(self) -> int:
        return sum(self.params.values())


def _meta_params(config) -> dict:
    """Parameters by kind of an HF config's model, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is None or head.weight is emb.weight
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
                 for p in m.parameters(recurse=False))
    total = sum(p.numel() for p in model.parameters())
    lm_head = 0 if tied else head.weight.numel()
    return dict(embed=emb.weight.numel(), lm_head=lm_head, linear=linear,
                other=total - emb.weight.numel() - lm_head - linear)


def model_info(spec, keep_layers=None) -> ModelInfo:
    """ModelInfo from the known-models table, else from the model's config (meta device)."""
    c = known_config(spec)
    if c is not None:
        g = model_geometry(spec, keep_layers)
        return ModelInfo(g, c["intermediate_size"], c["num_attention_heads"] * c["head_dim"],
                         param_breakdown(c, g.num_layers))
    config = load_model_config(spec, keep=keep_layers)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    g = kv_geometry(text)
    inter = getattr(text, "intermediate_size", None) or 4 * g.hidden_size
    return ModelInfo(g, int(inter), g.num_attention_heads * g.head_dim, _meta_params(config))


# the decoder layer's Linears, (in, out) from (hidden, q, kv, intermediate): what LoRA can target
_LINEARS = {"q_proj": lambda h, q, kv, i: (h, q), "k_proj": lambda h, q, kv, i: (h, kv),
            "v_proj": lambda h, q, kv, i: (h, kv), "o_proj": lambda h, q, kv, i: (q, h),
            "gate_proj": lambda h, q, kv, i: (h, i), "up_proj": lambda h, q, kv, i: (h, i),
            "down_proj": lambda h, q, kv, i: (i, h)}


def _lora_shapes(lora, s: ModelInfo) -> list[tuple[int, int]]:
    """(in, out) of each Linear LoRA targets in one decoder layer (target_modules None: PEFT's
    defaults for the architecture, q_proj and v_proj for Qwen2 / Llama)."""
    names = lora.target_modules
    targets = list(_LINEARS) if names == "all-linear" else [n for n in (names or ("q_proj", "v_proj"))
                                                            if n in _LINEARS]
    g = s.geometry
    return [_LINEARS[n](g.hidden_size, s.q_dim, g.kv_dim, s.intermediate) for n in targets]


def lora_params(lora, s: ModelInfo) -> int:
    """The adapters' parameters: r x (in + out) for each targeted Linear of each decoder layer."""
    return lora.r * sum(i + o for i, o in _lora_shapes(lora, s)) * s.geometry.num_layers


def lora_activations(lora, s: ModelInfo, act_bytes: int) -> int:
    """Bytes per token per decoder layer PEFT's LoRA branch saves beyond the full student's: with
    dropout, a copy of each targeted Linear's input and its mask (bool); A x (r) for B's gradient."""
    shapes = _lora_shapes(lora, s)
    copies = sum(i for i, _ in shapes) * (act_bytes + 1) if lora.dropout > 0 else 0
    return copies + len(shapes) * lora.r * act_bytes


def _projector_params(cfg: JobConfig, plans: dict, s_geom: KVGeometry) -> dict:
    """{'total', 'linear_weight', 'small'} trainable projector + fusion params, built on the meta device.

    small: params in tensors < 4096 elements (bitsandbytes keeps 32-bit Adam states for those).
    """
    a, p = cfg.align, cfg.align.projector
    mods = []
    with torch.device("meta"):
        for name, (geom, layer_map, layers) in plans.items():
            if not layers:  # a job whose teachers ship no KV (`JobConfig.ships_kv`): no projectors
                continue
            mods.append(TeacherProjector(layers, geom.num_kv_heads, geom.head_dim, s_geom.num_layers,
                                         s_geom.num_kv_heads, s_geom.head_dim, layer_map, mode=a.mode,
                                         aggregation=a.aggregation,
                                         kind=job_kind(cfg.align, cfg.fusion.kind, len(cfg.teachers), geom, s_geom,
                                                       copied=copied_from_teacher(cfg.student, cfg.teacher(name)),
                                                      sharded=cfg.ray.sharded),
                                         mlp_ratio=p.mlp_ratio, dropout=p.dropout, head_proj=p.head_proj,
                                         train_map=p.train_map))
        mods.append(Fusion(cfg.fusion.kind, len(plans), n_layers=s_geom.num_layers, weights=cfg.fusion.weights,
                           per_layer=cfg.fusion.per_layer, feature_dim=s_geom.hidden_size, names=list(plans)))
    params = [q for m in mods for q in m.parameters() if q.requires_grad]
    linear = sum(w.numel() for mod in mods for w in matmul_weights(mod))  # incl. per_head batched weights
    return dict(total=sum(q.numel() for q in params), linear_weight=linear,
                small=sum(q.numel() for q in params if q.numel() < 4096))


# ------------------------------------------------------------------------------------- estimates

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dtype_bytes(dtype: str, on_gpu: bool) -> int:
    return _DTYPE_BYTES.get(dtype, 2 if on_gpu else 4)  # auto: bf16 on a GPU, fp32 on the CPU


def _dtype_name(dtype: str, on_gpu: bool) -> str:
    if dtype == "auto":
        return "bf16" if on_gpu else "fp32"
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]


def teacher_items(t, info: ModelInfo, shipped: list[int], cfg: JobConfig, on_gpu: bool, top_k: int) -> dict[str, int]:
    """Bytes of one teacher actor over all its GPUs: weights by quantization, KV cache, forward work
    (with its logits when it serves `top_k` > 0)."""
    p, g = info.params, info.geometry
    wb = _dtype_bytes(t.dtype, on_gpu)
    if t.quantization == "none":
        weights, label = info.total * wb, _dtype_name(t.dtype, on_gpu)
    else:
        weights = p["linear"] * QUANT_BYTES[t.quantization] + (info.total - p["linear"]) * wb
        label = {"4bit": "nf4", "8bit": "int8"}[t.quantization]
    tokens = cfg.train.batch_size * cfg.train.max_length
    h, q, i, kv = g.hidden_size, info.q_dim, info.intermediate, g.kv_dim
    # inference (no grad): the cache of every layer [L, B, H, T, D] x (K, V) lives until the forward
    # returns; one layer's transient work (norm, q, repeated k/v, attention out, gate/up/product)
    # and a dequantized weight (bitsandbytes); the shipped layers stacked and de-rotated (K: cat, 2
    # muls, sub) before the copy to the wire. without logits the forward stops after the deepest
    # shipped layer (`teacher_forward_kv`, stop_early)
    cached_layers = g.num_layers if top_k or not shipped else max(shipped) + 1
    cache = 2 * cached_layers * kv * tokens * wb
    layer = tokens * (3 * h + 4 * q + 3 * i) * wb
    dequant = h * i * wb if t.quantization != "none" else 0
    shipped_kv = 3 * 2 * len(shipped) * kv * tokens * wb
    # teacher logits: the LM head's output in the compute dtype, its fp32 copy (if not fp32) and log-softmax
    logits = tokens * g.vocab_size * (wb + (4 if wb != 4 else 0) + 4) if top_k else 0
    return {f"teacher:{t.name} weights ({label})": int(weights), f"teacher:{t.name} kv cache": int(cache),
            f"teacher:{t.name} forward": int(layer + dequant + shipped_kv + logits)}


def _top_k(cfg: JobConfig) -> int:
    return logits_top_k(cfg.loss)  # the job's one rule for the k its teachers serve


def _other_vocab(geom: KVGeometry, s_geom: KVGeometry) -> bool:
    """A teacher of another tokenizer, as the planner sees it: a vocabulary size more than 1 % away
    (it reads configs, not tokenizers: two tokenizers of one size count as one, and LM heads padded
    differently for one tokenizer -- Qwen2.5 <= 3B's 151,936 rows, >= 7B's 152,064, 0.08 % apart --
    as that tokenizer, as the run does)."""
    if geom.vocab_size is None:
        return False
    v, s = int(geom.vocab_size), int(s_geom.vocab_size)
    return abs(v - s) > 0.01 * max(v, s)


def vllm_items(label: str, weights: int, share: float, kv_cache_bytes: int, on_gpu: bool,
               gpu_mem_bytes: Optional[int]) -> dict[str, int]:
    """A vLLM engine's bytes: on a GPU its share of the card (`gpu_memory_utilization`: vLLM takes
    that share for its weights, activations and KV cache, whatever the model), else its weights and
    its CPU KV cache (`kv_cache_memory_bytes`)."""
    if on_gpu and gpu_mem_bytes:
        return {f"{label} (gpu_memory_utilization {share:g} of the GPU)": int(share * gpu_mem_bytes)}
    return {f"{label} weights": int(weights), f"{label} kv cache": int(kv_cache_bytes)}


def _teacher_k(cfg: JobConfig, geom: KVGeometry, s_geom: KVGeometry) -> int:
    """The top-k a teacher serves: the job's (at most its vocabulary: `teacher_forward_kv` clamps
    it), or 0 for another vocabulary with loss.logit_cross_vocab off."""
    if _other_vocab(geom, s_geom) and cross_vocab(cfg.loss) == "off":
        return 0
    return min(_top_k(cfg), int(geom.vocab_size)) if geom.vocab_size else _top_k(cfg)


def student_items(cfg: JobConfig, s: ModelInfo, plans: dict, proj: dict, on_gpu: bool) -> dict[str, int]:
    """Bytes of one student worker: weights, grads, optimizer, activations, logits, projectors, KV."""
    g, B, T = s.geometry, cfg.train.batch_size, cfg.train.max_length
    tokens = B * T
    policy = planned_policy(cfg.student.precision, on_gpu)
    per = student_bytes_per_param(policy, cfg.optim.optimizer)
    a = 4 if policy == "fp32" else 2  # activations under bf16 autocast
    P = s.total
    adam8 = cfg.optim.optimizer == "adamw8bit"
    label = {"fp32": "fp32", "bf16-mixed": "fp32 master", "bf16-sr": "bf16"}[policy]
    sr = ", stochastic rounding" if policy == "bf16-sr" else ""
    n_shard = cfg.ray.num_workers if cfg.ray.strategy == "fsdp" else 1  # FSDP2: every rank holds 1/n of each
    of_n = f", 1/{n_shard} shard" if n_shard > 1 else ""
    lora = cfg.student.lora
    trained = lora_params(lora, s) if lora else P  # LoRA: only the adapters have grads and optimizer states
    if lora:
        four = lora.quantize_base == "4bit"  # NF4: 4 bits + a double-quantised absmax per 64 (~0.127 bits)
        base = s.params["linear"] * (4.127 / 8 if four else per["weights"]) + (P - s.params["linear"]) * per["weights"]
        items = {f"student base weights (frozen, {'NF4 linears, ' if four else ''}{label}{of_n})": base / n_shard,
                 f"LoRA adapters (r {lora.r}, {trained / 1e6:.1f}M params, {label}{of_n})":
                     trained * per["weights"] / n_shard}
    else:
        items = {f"student weights ({label}{of_n})": P * per["weights"] / n_shard}
    items[f"student grads{of_n}"] = trained * per["grads"] / n_shard
    items[f"student optimizer ({cfg.optim.optimizer}{sr}{of_n})"] = trained * per["optimizer"] / n_shard
    if n_shard > 1:
        # FSDP2 gathers the root unit (embeddings, LM head, norms) for the whole step and one
        # decoder layer at a time (two with the next one's prefetch), in the compute dtype, with the
        # unsharded gradients of each
        layer = s.params["linear"] / g.num_layers
        root = s.params["embed"] + s.params["lm_head"]
        w = 2 if policy == "bf16-mixed" and on_gpu else per["weights"]
        items["fsdp gathered: root unit + 2 decoder layers, with their grads"] = (root + 2 * layer) * (w + per["grads"])
        if cfg.optim.accumulation > 1 and cfg.ray.fsdp_reduce == "step":
            # `_no_sync` skips the reduce-scatter of all but the last micro-batch: FSDP2 then keeps
            # every parameter's unsharded gradient, in its reduce dtype (fp32 under bf16-mixed,
            # `core.fsdp.shard`), until that one reduce-scatters them unit by unit into the 1/n
            # shards (which exist only from then to zero_grad)
            del items[f"student grads{of_n}"]
            g_dtype = "fp32" if per["grads"] == 4 else "bf16"
            items[f"student grads, unsharded until the last micro-batch ({g_dtype}, accumulation "
                  f"{cfg.optim.accumulation})"] = trained * per["grads"]
    elif per["autocast_copy"]:  # decoder Linears + the LM head (the embedding matrix when tied)
        read_by_matmuls = s.params["linear"] + (s.params["lm_head"] or s.params["embed"])
        items["student bf16 autocast copies"] = read_by_matmuls * per["autocast_copy"]
    h, q, i, kv, L = g.hidden_size, s.q_dim, s.intermediate, g.kv_dim, g.num_layers
    per_layer = ACT_H * h + ACT_Q * q + ACT_I * i + ACT_T * T  # elements per token
    if cfg.student.gradient_checkpointing:
        layers = L * h + per_layer  # checkpointed inputs + one layer recomputed in backward
    else:
        layers = L * per_layer
    gc = " (checkpointed)" if cfg.student.gradient_checkpointing else ""
    items[f"student activations{gc}"] = tokens * (layers + ACT_FIXED_H * h) * a
    if lora:
        dropout = f"dropout {lora.dropout:g}: copies of the inputs, " if lora.dropout > 0 else ""
        items[f"LoRA branch activations ({dropout}A x){gc}"] = \
            tokens * lora_activations(lora, s, a) * (1 if cfg.student.gradient_checkpointing else L)
    chunk = cfg.loss.vocab_chunk
    if chunk and chunk < tokens:  # `core.vocab_chunks`: one chunk's logits at a time; the head's gradient, taken
        head = s.params["lm_head"] or s.params["embed"]  # in the forward (summed in fp32), kept until the backward
        items[f"student logits (chunks of {chunk} positions x vocab)"] = \
            chunk * g.vocab_size * LOGIT_BYTES + head * 4 + tokens * h * a
    else:
        items["student logits (B*T*vocab)"] = tokens * g.vocab_size * LOGIT_BYTES

    # projectors + fusion: fp32 params + grads, Adam states (bnb: 8-bit except small tensors), the
    # bf16 copies autocast keeps of Linear weights, and the activations the projectors save for
    # backward
    Pp = proj["total"]
    p_opt = (Pp - proj["small"]) * 2 + proj["small"] * 8 if adam8 else Pp * 8
    autocast_copy = proj["linear_weight"] * 2 if policy != "fp32" else 0
    p_acts = tokens * sum(_projector_bytes(cfg, name, geom, layers_, g, a)
                          for name, (geom, _, layers_) in plans.items())
    items[f"projectors + fusion ({Pp / 1e6:.1f}M params)"] = Pp * 8 + p_opt + autocast_copy + p_acts

    # the KV loss saves ~LOSS_S elements per token per student-layout element (K and V together);
    # gate and router fusion save the stacked teacher targets; `sum` computes one loss per teacher
    S, n = L * kv, len(plans)
    fusion = {"fixed": 0, "sum": 0}.get(cfg.fusion.kind, 2 * n * S)
    losses = n if cfg.fusion.kind == "sum" else 1
    items["kv loss activations"] = tokens * (LOSS_S * losses * S + fusion) * 4

    # teacher KV: wire batches in flight (prefetch_depth + 1) and the fp32 copy the projectors read
    wire_b = 1 if cfg.align.wire_dtype == "fp8" else 2
    kv_t = sum(2 * len(layers_) * geom.kv_dim for geom, _, layers_ in plans.values())  # elements per token
    depth = cfg.align.prefetch_depth + 1
    kv_buffers = tokens * kv_t * (wire_b * depth + 4)
    k = _top_k(cfg)
    for geom, _, _ in plans.values():  # top-k ids (int32) + log-probs on the wire x depth; int64 ids + fp32 decoded
        k_t = _teacher_k(cfg, geom, g)
        kv_buffers += tokens * (logits_bytes_per_token(k_t, cfg.align.wire_dtype) * depth + k_t * 12)
    logits_label = f", top-{k} logits" if k else ""
    items[f"teacher kv buffers ({cfg.align.wire_dtype} x {depth} + fp32{logits_label})"] = kv_buffers
    for name, (geom, _, _) in plans.items():  # `losses.hybrid_logit_loss` / `uld_loss` across vocabularies
        if k and _other_vocab(geom, g) and _teacher_k(cfg, geom, g):
            # the map (int64 per teacher id, and the student ids it misses) and the student's logits
            # over those ids with their gradient (a [B, T, V] scatter): at most the whole student
            # vocabulary, fp32
            items[f"cross-vocab logits {name} (vocab map, unmatched student logits)"] = \
                (int(geom.vocab_size) + g.vocab_size) * 8 + tokens * g.vocab_size * 8
    if cfg.ray.num_workers > 1 and n_shard == 1:  # DDP gradient buckets are a second copy of the gradients
        items["ddp gradient buckets"] = trained * per["grads"] + Pp * 4
    return {k: int(v) for k, v in items.items()}


def _projector_bytes(cfg: JobConfig, name: str, geom: KVGeometry, layers: list[int], s_geom: KVGeometry,
                     a: int) -> float:
    """Bytes per token one teacher's K and V projectors save for backward (counted with saved-tensor hooks).

    A projector of width d saves its input (linear) or, for elastic, its fp32 input, the LayerNorm
    output, the hidden pre-activation and the SiLU/Dropout output (r*d each) plus the dropout mask
    (1 B per hidden unit). flat: d = shipped layers * kv (concat) or kv (mean/weighted). structured,
    per student layer: the gathered mapped teacher layers and their weighted sum, then d = H_s * D_t
    after head mixing — the same for head_proj shared and per_head (each student head's projector
    sees its own D_t slice). Checked against saved-tensor hooks on CPU (fp32): exact for every mode.
    """
    al, p = cfg.align, cfg.align.projector
    kind = job_kind(cfg.align, cfg.fusion.kind, len(cfg.teachers), geom, s_geom,
                    copied=copied_from_teacher(cfg.student, cfg.teacher(name)), sharded=cfg.ray.sharded)
    if kind == "identity":  # the teacher's KV as it is: nothing trained, nothing saved for backward
        return 0.0
    if kind == "fit":  # the student-side map saves its input, the student's KV of each layer
        return 2 * s_geom.num_layers * s_geom.kv_dim * a
    r = p.mlp_ratio if kind == "elastic" else 0.0

    def proj(d: float) -> float:  # [.., d] -> projector; LayerNorm keeps an fp32 input even under autocast
        if kind == "linear":
            return d * a
        return d * 4 + d * (1 + 2 * r) * a + (d * r if p.dropout > 0 else 0)

    if al.mode == "flat":
        d = len(layers) * geom.kv_dim if al.aggregation == "concat" else geom.kv_dim
        per = proj(d)
    else:
        Ls = s_geom.num_layers
        src = len(layers) / max(1, Ls)  # mapped teacher layers per student layer (ratio: 1)
        per = Ls * ((src + 1) * geom.kv_dim * a + proj(s_geom.num_kv_heads * geom.head_dim))
    return 2 * per  # K and V


# ----------------------------------------------------------------------------------------- layout


def _on_gpu(cfg: JobConfig, gpu_mem_bytes) -> bool:
    """Whether the student trains on GPUs: ray.use_gpu, or for 'auto' a given GPU size / visible CUDA."""
    u = cfg.ray.use_gpu
    if u == "auto":
        return bool(gpu_mem_bytes) or torch.cuda.is_available() or any(t.num_gpus > 0 for t in cfg.teachers)
    return bool(u) and cfg.ray.gpus_per_worker > 0


def _layer_plans(cfg: JobConfig, s: ModelInfo, t_infos: dict) -> dict:
    out = {}
    for t in cfg.teachers:
        g = t_infos[t.name].geometry
        layer_map, shipped = ((layer_plan(cfg.align, cfg.student, t, g.num_layers, s.geometry.num_layers))
                              if cfg.ships_kv else ([], []))
        out[t.name] = (g, layer_map, shipped)
    return out


def _device(items: dict, capacity: Optional[int]) -> dict:
    total = int(sum(items.values()))
    return {"items": dict(items), "total": total, "capacity": capacity,
            "fits": None if capacity is None else total <= capacity}


def _layout(cfg: JobConfig, gpu_mem_bytes, infos: tuple) -> dict:
    """{device name: device dict}: items placed the way Ray places the config's actors and workers."""
    s, t_infos = infos
    student_gpu = _on_gpu(cfg, gpu_mem_bytes)
    plans = _layer_plans(cfg, s, t_infos)
    proj = _projector_params(cfg, plans, s.geometry)
    cpu: dict[str, int] = {}
    gpu_bins: list[dict] = []  # fractional consumers first-fit onto shared GPUs
    devices: dict[str, dict] = {}

    def add_fraction(share: float, items: dict) -> None:
        for b in gpu_bins:
            if b["share"] + share <= 1 + 1e-9:
                b["share"] += share
                b["items"].update(items)
                b["procs"] += 1
                return
        gpu_bins.append({"share": share, "items": dict(items), "procs": 1})

    for t in cfg.teachers:
        if t.engine == "openai":  # behind a URL: nothing of it on this cluster
            continue
        on_gpu = t.num_gpus > 0
        if t.engine == "vllm":  # its engine's memory, as the job sets it
            info = t_infos[t.name]
            items = vllm_items(f"teacher:{t.name} vLLM", info.total * _dtype_bytes(t.dtype, on_gpu),
                               t.vllm_gpu_memory_utilization, t.vllm_kv_cache_mb << 20, on_gpu, gpu_mem_bytes)
        else:
            items = teacher_items(t, t_infos[t.name], plans[t.name][2], cfg, on_gpu,
                                  _teacher_k(cfg, t_infos[t.name].geometry, s.geometry))
        if not on_gpu:  # replicas on the CPU: N copies of every item
            cpu.update({(f"{k} x {t.replicas} replicas" if t.replicas > 1 else k): v * t.replicas
                        for k, v in items.items()})
            continue
        for r in range(t.replicas):  # each replica its own GPU share
            name = replica_label(t.name, r)
            r_items = {k.replace(f"teacher:{t.name} ", f"teacher:{name} ", 1): v for k, v in items.items()}
            if t.num_gpus < 1:
                add_fraction(t.num_gpus, r_items)
                continue
            n = t.num_gpus  # device_map=auto splits weights and cache by layer; the forward's work peaks on one GPU
            # (vLLM's tensor parallelism takes its gpu_memory_utilization of each of them)
            per_gpu = {k: (v if k.endswith(" forward") or t.engine == "vllm" else v / n) for k, v in r_items.items()}
            per_gpu["cuda runtime"] = RUNTIME_BYTES
            label = f"{n:g} GPU" + ("s" if n != 1 else "")
            devices[f"teacher:{name} ({label})"] = _device(per_gpu, gpu_mem_bytes)
    s_items = student_items(cfg, s, plans, proj, student_gpu)
    o = cfg.onpolicy
    compute = 4 if planned_policy(cfg.student.precision, student_gpu) == "fp32" else 2  # the forwards' dtype
    if o.fraction > 0 and o.source == "student" and o.engine == "vllm":  # the sampler colocated on each worker
        s_items.update(vllm_items("vLLM sampler", s.total * compute, o.vllm_gpu_memory_utilization,
                                  o.vllm_kv_cache_mb << 20, student_gpu, gpu_mem_bytes))
    elif o.fraction > 0 and o.source == "student" and cfg.ray.sharded:  # `rollout.student_weights.whole_copy`
        s_items["whole student to sample from (FSDP2: gathered each round, forwards' dtype)"] = s.total * compute
    share = cfg.ray.gpus_per_worker
    if not student_gpu:
        w = cfg.ray.num_workers
        cpu.update({(f"{k} x {w} workers" if w > 1 else k): v * w for k, v in s_items.items()})
    elif share < 1:
        for r in range(cfg.ray.num_workers):
            add_fraction(share, {(f"worker{r} {k}" if cfg.ray.num_workers > 1 else k): v for k, v in s_items.items()})
    else:
        devices["student worker"] = _device({**s_items, "cuda runtime": RUNTIME_BYTES}, gpu_mem_bytes)
    shared = {}
    for k, b in enumerate(gpu_bins):  # one CUDA context per process on a shared GPU
        procs = b["procs"]
        runtime = {f"cuda runtime ({procs} process{'es' if procs > 1 else ''})": RUNTIME_BYTES * procs}
        shared[f"gpu{k}"] = _device({**b["items"], **runtime}, gpu_mem_bytes)
    devices = {**shared, **devices}
    if cpu:
        cpu["allocator slack (glibc)"] = cpu_allocator_slack(cpu)
        devices["cpu"] = _device(cpu, None)
    return devices


# --------------------------------------------------------------------------------------- planning


def _infos(cfg: JobConfig) -> tuple:
    s = model_info(cfg.student.model, cfg.student.keep_layers)
    return s, {t.name: model_info(t.served_from()) for t in cfg.teachers}


def _candidates(cfg: JobConfig, student_gpu: bool = True) -> list[list[str]]:
    """The ordered list of cheap changes that apply to this config, each a list of overrides."""
    out = []
    if not cfg.student.gradient_checkpointing:
        out.append(["student.gradient_checkpointing=true"])
    if cfg.optim.optimizer != "adamw8bit":
        out.append(["optim.optimizer=adamw8bit"])
    if student_gpu and planned_policy(cfg.student.precision, True) == "bf16-mixed":  # bf16 weights, SR AdamW
        out.append(["student.precision=bf16-sr"] + (["student.dtype=auto"] if cfg.student.dtype != "auto" else []))
    if cfg.align.mode != "structured":
        out.append(["align.mode=structured"])
    nf4 = [f"teachers.{i}.quantization=4bit" for i, t in enumerate(cfg.teachers) if t.quantization != "4bit"]
    if nf4:
        out.append(nf4)
    if cfg.train.batch_size > 1:
        half = cfg.train.batch_size // 2  # same sequences per optimizer step
        out.append([f"train.batch_size={half}", f"optim.accumulation={cfg.optim.accumulation * 2}"])
    if cfg.train.max_length // 2 >= 64:
        out.append([f"train.max_length={cfg.train.max_length // 2}"])
    return out


def _overflow(devices: dict) -> Optional[tuple[str, dict]]:
    bad = [(d["total"] - d["capacity"], n, d) for n, d in devices.items() if d["fits"] is False]
    return max(bad, key=lambda x: x[0])[1:] if bad else None


def _advice(cfg: JobConfig, gpu_mem_bytes, infos: tuple, devices: dict) -> Optional[str]:
    """'does not fit gpu0 (9.3 GiB > 8.0 GiB): set X' with the first candidate (or prefix) that fits."""
    worst = _overflow(devices)
    if worst is None:
        return None
    name, d = worst
    head = f"does not fit {name} ({d['total'] / GiB:.1f} GiB > {d['capacity'] / GiB:.1f} GiB)"
    cands = _candidates(cfg, _on_gpu(cfg, gpu_mem_bytes))

    def fits(overrides: list[str]) -> bool:
        c = derive(cfg, parse_overrides(overrides))
        return all(x["fits"] is not False for x in _layout(c, gpu_mem_bytes, infos).values())

    for ov in cands:
        if fits(ov):
            return f"{head}: set {' '.join(ov)}"
    acc: list[str] = []
    for ov in cands:
        acc += ov
        if fits(acc):
            return f"{head}: set {' '.join(acc)}"
    tried = f" even with {' '.join(acc)}" if acc else ""
    return f"{head}{tried}; use a larger GPU or spread teachers over more GPUs (teachers[].num_gpus)"


def place_on(cfg: JobConfig, nodes: list[placement.Node], source: str) -> dict:
    """Which node each teacher replica and Ray Train worker can go to (`kava_ray.common.placement`,
    the check a job runs before it starts anything), or the one line saying what cannot be
    placed."""
    use_gpu = cfg.ray.use_gpu
    if use_gpu == "auto":  # as the job resolves it: the cluster has GPUs
        use_gpu = any(n.resources.get("GPU", 0) > 0 for n in nodes)
    where, problem = placement.place(nodes, resources.demands(cfg, resources.worker(cfg, bool(use_gpu))))
    return {"source": source, "nodes": len(nodes), "where": [[w, n.describe()] for w, n in where],
            "problem": problem}


def plan(cfg: JobConfig, gpu_mem_bytes: Optional[int] = None, target_tokens_per_s: Optional[float] = None,
         nodes: Optional[list[placement.Node]] = None, nodes_source: str = "") -> dict:
    """Per-device memory estimate of a job (bytes), the largest item, a verdict and advice; with
    `nodes` (a cluster's, or those its cluster.yaml can bring up), where each actor goes
    (`placement`).

    {"devices": {name: {"items": {item: bytes}, "total", "capacity", "fits"}},
     "largest_item": (device, item, bytes), "fits": bool | None, "advice": str | None,
     "kv_bytes_per_token": {teacher: wire bytes, KV + top-k logits}, "kv_bytes_per_s": {teacher: bytes/s at the
     target}, "logits_bytes_per_token": {teacher: the top-k logits' share} (0 when loss.logit_weight is 0)}
    """
    if gpu_mem_bytes is not None and int(gpu_mem_bytes) <= 0:
        raise KavaError(f"gpu memory must be > 0 bytes, got {gpu_mem_bytes}")
    infos = _infos(cfg)
    devices = _layout(cfg, gpu_mem_bytes, infos)
    largest = max(((n, k, v) for n, d in devices.items() for k, v in d["items"].items()), key=lambda x: x[2])
    verdicts = [d["fits"] for d in devices.values() if d["fits"] is not None]
    plans = _layer_plans(cfg, *infos)
    k = _top_k(cfg)
    s_geom = infos[0].geometry
    logit_b = {n: logits_bytes_per_token(_teacher_k(cfg, g, s_geom), cfg.align.wire_dtype)
               for n, (g, _, _) in plans.items()}
    per_token = {n: kv_bytes_per_token(g, cfg.align.wire_dtype, layers) + logit_b[n]
                 for n, (g, _, layers) in plans.items()}
    out = {
        "devices": devices,
        "largest_item": largest,
        "fits": all(verdicts) if verdicts else None,
        "advice": _advice(cfg, gpu_mem_bytes, infos, devices),
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_s": {n: b * target_tokens_per_s for n, b in per_token.items()} if target_tokens_per_s else {},
        "logits_bytes_per_token": logit_b,
        "logits_top_k": k,
    }
    if nodes is not None:
        out["placement"] = place_on(cfg, nodes, nodes_source)
        if out["placement"]["problem"]:
            out["fits"] = False
            out["advice"] = out["placement"]["problem"]
    return out


def check_fits(cfg: JobConfig, gpu_mem_bytes: int) -> None:
    """Raise a one-line KavaError with the planner's advice when a device does not fit."""
    p = plan(cfg, gpu_mem_bytes)
    if p["fits"] is False:
        raise KavaError(f"{cfg.name}: {p['advice']} (see `kava-ray plan`)")


def format_plan(p: dict) -> str:
    """A readable per-device table in GiB, the largest item, KV volume and the advice."""
    width = max(len(k) for d in p["devices"].values() for k in d["items"]) + 4
    width = max(width, max(len(n) for n in p["devices"]) + 2, 40)
    lines = []
    for name, d in p["devices"].items():
        cap = f"of {d['capacity'] / GiB:.2f}" if d["capacity"] else ""
        verdict = {True: "fits", False: "DOES NOT FIT", None: ""}[d["fits"]]
        lines.append(f"{name:<{width}}{d['total'] / GiB:>8.2f} GiB {cap:>8} {verdict}".rstrip())
        for k, v in sorted(d["items"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {k:<{width - 2}}{v / GiB:>8.2f}")
    dev, item, n = p["largest_item"]
    lines.append(f"largest item: {item} on {dev} ({n / GiB:.2f} GiB)")
    for t, b in p["kv_bytes_per_token"].items():
        rate = p["kv_bytes_per_s"].get(t)
        extra = f", {rate / MiB:.1f} MiB/s at the target rate" if rate else ""
        lb = p.get("logits_bytes_per_token", {}).get(t, 0)
        logits = f" (top-{p['logits_top_k']} logits {lb / 1024:.2f} KiB of it)" if lb else ""
        lines.append(f"kv wire {t}: {b / 1024:.1f} KiB/token{logits}{extra}")
    where = p.get("placement")
    if where:
        lines.append(f"placement on {where['source']} ({where['nodes']} node{'s' * (where['nodes'] != 1)}):"
                     + (" DOES NOT FIT" if where["problem"] else ""))
        lines += [f"  {w:<{width - 2}}{n}" for w, n in where["where"]]
    if p["advice"]:
        lines.append(f"advice: {p['advice']}")
    return "\n".join(lines)
