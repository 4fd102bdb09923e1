"""Typed job config: load YAML (a file or a shipped preset, which may `extends:` another), apply
dotted overrides, validate.

Every problem a user can make in a config becomes one `KavaError` line that names the
key, e.g. ``config key 'optim.lr_student': must be > 0 (got -1.0)``.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kava_ray.common.errors import KavaError
from kava_ray.common.files import name_problem
from kava_ray.common.placement import normalize_selector
from kava_ray.common.trackers import check_loggers

PRESET_PACKAGE = "kava_ray.configs"
# the sections that fix model and projector shapes: what a checkpoint must match to resume
SHAPE_SECTIONS = ("teachers", "student", "align", "fusion")


class _Section(BaseModel):
    """Strict base: unknown keys, type coercions that lose information and non-finite numbers
    (`inf`, `nan`: a loss weight of inf trains a NaN student) are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def replica_label(teacher: str, replica: int) -> str:
    """How replica `replica` of a teacher is named in status, plans and errors: `t` for the first, `t#1`, ..."""
    return teacher if replica == 0 else f"{teacher}#{replica}"


def _check_selector(selector: Optional[dict]) -> Optional[dict]:
    """A Ray label selector ({label: value | !value | in(a, b) | !in(a, b)}), checked before Ray sees it."""
    return normalize_selector(selector) if selector else None


class TeacherConfig(_Section):
    # names key metrics (`cos/<name>`) and replicas (`<name>#1`): no '/', '#' or spaces
    name: str = Field(min_length=1, pattern=r"^[^/#\s]+$")
    model: str = Field(min_length=1)  # hub id, local dir, .gguf path, or pypi://dist/path/in/dist
    quantization: Literal["none", "4bit", "8bit"] = "none"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    num_gpus: float = Field(0.0, ge=0)  # fractional to colocate; >1 spreads one teacher (device_map=auto)
    num_cpus: float = Field(1.0, gt=0)
    layers: Optional[list[int]] = None  # teacher layers to ship; None = the ones the layer map uses
    max_restarts: int = Field(3, ge=0)
    # copies of this teacher, each an actor with its own num_gpus/num_cpus; batch keys are spread over them
    replicas: int = Field(1, ge=1)
    # the nodes it may run on, by their Ray labels (`ray start --labels`, cluster.yaml): {"kava-role": "teacher"}
    label_selector: Optional[dict[str, str]] = None
    # what serves it: hf (a Hugging Face forward: KV, hidden states, logits), vllm (a vLLM engine's
    # prompt log-probs in the actor) or openai (a server behind `url`: vLLM's OpenAI-compatible
    # `vllm serve`); vllm and openai serve top-k logits and token log-probs only (LOGITS_ONLY)
    engine: Literal["hf", "vllm", "openai"] = "hf"
    # engine openai: the server's base URL (http://host:port), the environment variable that holds its
    # API key (the name, never the key), where its tokenizer and config load from here (default: model,
    # which is the name the server serves), and each request's timeout, retries and parallel requests
    url: Optional[str] = None
    api_key_env: Optional[str] = None
    tokenizer: Optional[str] = None
    timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(3, ge=0)
    concurrency: int = Field(4, ge=1)
    # engine vllm: the engine's memory: its share of the GPU on CUDA (weights, activations, KV cache), its KV cache on
    # CPU; `kava-ray plan` counts them
    vllm_gpu_memory_utilization: float = Field(0.8, gt=0, lt=1)
    vllm_kv_cache_mb: int = Field(256, ge=16)

    @field_validator("label_selector")
    @classmethod
    def _selector_syntax(cls, v):
        return _check_selector(v)

    @field_validator("layers")
    @classmethod
    def _layers_nonneg(cls, v):
        if v is not None and (not v or min(v) < 0):
            raise ValueError("must be a non-empty list of layer indices >= 0")
        return v

    @model_validator(mode="after")
    def _server(self):
        """`url` and `engine: openai` go together; the key is named by its environment variable."""
        if self.engine == "openai" and not self.url:
            raise ValueError(f"teachers[{self.name}].engine: openai needs url (the server's, e.g. "
                             f"http://127.0.0.1:8000)")
        if self.url is not None and self.engine != "openai":
            raise ValueError(f"teachers[{self.name}].url: only engine openai reads it (engine is {self.engine})")
        if self.url is not None and not re.match(r"^https?://[^/\s]+", self.url):
            raise ValueError(f"teachers[{self.name}].url: {self.url!r} is not an http(s):// URL")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            raise ValueError(f"teachers[{self.name}].api_key_env: give the name of the environment variable that "
                             f"holds the key, not the key")
        return self

    def served_from(self) -> str:
        """Where this teacher's tokenizer and config load from here: `tokenizer` (engine openai), else
        its model."""
        return self.tokenizer or self.model


# student.precision -> the dtype the student's weights are stored in (kava_ray/core/precision.py has the policies)
PRECISION_WEIGHT_DTYPE = {"auto": "float32", "fp32": "float32", "bf16-mixed": "float32", "bf16-sr": "bfloat16"}


class LoraSpec(_Section):
    """`student.lora`: train low-rank adapters on a frozen student (PEFT; `kava_ray/core/lora.py`).
    Defaults: TRL's `--use_peft` (r 16, alpha 32, dropout 0.05, PEFT's target modules for the
    architecture: q_proj and v_proj for Qwen2 and Llama; "all-linear" for every Linear but the
    head)."""

    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: Optional[Union[list[str], Literal["all-linear"]]] = None
    quantize_base: Literal["none", "4bit"] = "none"  # 4bit: QLoRA (bitsandbytes NF4, double quantisation)


class StudentConfig(_Section):
    model: str = Field(min_length=1)
    lora: Optional[LoraSpec] = None  # train adapters on the frozen student (LoRA; QLoRA with quantize_base 4bit)
    # auto: bf16-mixed on a CUDA GPU with bf16, fp32 elsewhere | fp32 | bf16-mixed (fp32 master weights, bf16
    # autocast) | bf16-sr (bf16 weights, torchao AdamW with stochastic rounding); see kava_ray/core/precision.py
    precision: Literal["auto", "fp32", "bf16-mixed", "bf16-sr"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # stored weights: auto = the policy's
    keep_layers: Optional[list[int]] = None  # build the student by keeping these layers of `model`, in order
    gradient_checkpointing: bool = False

    @field_validator("keep_layers")
    @classmethod
    def _keep_layers_in_order(cls, v):
        """Non-empty, >= 0, strictly increasing: `[]` would silently keep every layer and `[20, 0,
        10]` scramble their order (the range against the model's depth is the preflight's: it reads
        the model's config)."""
        if v is None:
            return v
        if not v:
            raise ValueError("must name at least one layer (leave it out to keep every layer)")
        if min(v) < 0:
            raise ValueError("layer indices are >= 0")
        if any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"must be strictly increasing, as the student keeps the layers in the model's order "
                             f"(did you mean {sorted(set(v))}?)")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype_follows_precision(cls, v, info):
        if v == "float16":
            raise ValueError("float16 student weights are refused (AdamW overflows them to inf without loss "
                             "scaling); use student.precision: bf16-mixed (fp32 weights, bf16 compute) or fp32")
        policy = info.data.get("precision")  # absent when precision itself failed validation
        if v == "auto" or policy is None or v == PRECISION_WEIGHT_DTYPE[policy]:
            return v
        if v == "bfloat16":
            raise ValueError(f"bfloat16 weights train only with student.precision: bf16-sr (plain AdamW rounds "
                             f"small bf16 updates away), not {policy}; or leave student.dtype: auto")
        raise ValueError(f"student.precision {policy} stores {PRECISION_WEIGHT_DTYPE[policy]} weights; "
                         f"leave student.dtype: auto")


RECORD_FIELDS = ("text", "prompt", "completion", "messages", "question", "answer")  # what data.columns may rename


class DataConfig(_Section):
    # "synthetic", a hub id (e.g. openai/gsm8k), or local .jsonl / .json / .parquet / .csv files or
    # a directory of them (`{split}` in the path is replaced by the split's name)
    source: str = "synthetic"
    hub_config: Optional[str] = "main"
    # the record format (kava_ray/data/records.py): detected from the columns, or one of them
    format: Literal["auto", "text", "prompt_completion", "messages", "gsm8k"] = "auto"
    columns: Optional[dict[str, str]] = None  # a record field -> the dataset's column, e.g. {prompt: instruction}
    packing: Optional[bool] = None  # text: documents joined with EOS, cut into max_length blocks (None = on for text)
    group_by_length: bool = True  # other formats: batches of similar lengths (less padding)
    train_split: str = "train"
    val_split: Optional[str] = None  # a split of its own for validation; None = carved from the training data
    test_split: str = "test"  # evaluated once at the end of a run (final/) and by `kava-ray eval`, never for selection
    # held-out splits that share records with the training split are refused; true: allowed, with a
    # warning line. One file for every split (no `{split}` in its path): validation and test are
    # carved from it unless this is set
    allow_overlap: bool = False
    num_train: Optional[int] = Field(512, ge=1)  # synthetic generator size, or a cap on real data (null: every record)
    # validation records (eval during training, checkpoint_score, Tune); null: every record of
    # val_split, or where validation is carved from the training records (no val_split, or one
    # file), `splits.carved_counts`' 5 %
    num_val: Optional[int] = Field(32, ge=1)
    num_test: Optional[int] = Field(64, ge=1)
    seed: int = 0
    prompt_format: Literal["auto", "chat", "plain"] = "auto"  # gsm8k rows: the chat template or "Question: ..."
    overlength: Literal["truncate", "error"] = "truncate"
    cache_dir: Optional[str] = None  # tokenized splits (Arrow); None = $KAVA_RAY_CACHE or ~/.cache/kava-ray, /data
    kv_source: Literal["live", "cache"] = "live"
    kv_cache_dir: Optional[str] = None

    @field_validator("columns")
    @classmethod
    def _columns(cls, v):
        bad = [k for k in (v or {}) if k not in RECORD_FIELDS]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a record field ({', '.join(RECORD_FIELDS)}): map a field to "
                             f"your column, e.g. {{prompt: instruction}}")
        return v

    @model_validator(mode="after")
    def _counts(self):
        for key in ("num_train", "num_val", "num_test"):
            if getattr(self, key) is None and self.source == "synthetic":
                raise ValueError(f"data.{key}: the synthetic generator needs a number")
        return self


class ProjectorConfig(_Section):
    # auto: identity (the teacher's own KV is the target, nothing learned) for a student copied from
    # that teacher (`plans.copied_from_teacher`: not the geometry alone, a student trained apart has
    # its own basis), else fit where it can serve (one teacher or fusion sum, the student's
    # tokenizer), else linear (`projectors.resolve_kind`); fit: a map on the student's side (student
    # KV -> its teacher layer's), the ridge fit of the student to the teacher before step 1, then
    # frozen (or trained at the student's rate: train_map)
    kind: Literal["auto", "identity", "elastic", "linear", "fit"] = "auto"
    train_map: bool = False
    mlp_ratio: float = Field(1.0, gt=0)
    dropout: float = Field(0.1, ge=0, lt=1)
    # structured mode: one head_dim projector shared by every student head, or one per student head
    head_proj: Literal["shared", "per_head"] = "shared"


class AlignConfig(_Section):
    mode: Literal["flat", "structured"] = "structured"
    aggregation: Literal["concat", "mean", "weighted"] = "concat"
    # auto: identity for a student built by keep_layers from the teacher's own model (student layer
    # i <- the teacher layer it was copied from), else ratio
    layer_map: Literal["auto", "identity", "ratio", "uniform", "explicit", "cka"] = "auto"
    explicit_map: Optional[dict[int, list[int]]] = None  # student layer -> teacher layers (layer_map=explicit)
    cka_path: Optional[str] = None  # JSON written by the CKA calibration (layer_map=cka)
    key_space: Literal["pre_rope", "post_rope"] = "pre_rope"
    # teachers whose tokenizer differs from the student's: which of the teacher tokens overlapping a
    # student token's characters give its KV -- their mean, the last (it has seen the whole span) or
    # the first
    token_align: Literal["mean", "last", "first"] = "mean"
    # fp32: K, V, hidden states and top-k log-probs as computed (twice bf16's bytes): an exact logit
    # term (GKD over the whole vocabulary as TRL computes it; bf16 log-probs move a JSD by ~0.2 %)
    wire_dtype: Literal["bf16", "fp16", "fp8", "fp32"] = "bf16"
    prefetch_depth: int = Field(2, ge=1, le=64)
    projector: ProjectorConfig = ProjectorConfig()

    @model_validator(mode="after")
    def _identity_needs_structured(self):
        if self.projector.kind in ("identity", "fit") and self.mode == "flat":
            raise ValueError(f"align.projector.kind: {self.projector.kind} needs align.mode: structured (flat mixes "
                             f"every layer)")
        return self


class FusionConfig(_Section):
    kind: Literal["fixed", "gate", "router", "sum"] = "fixed"
    weights: Optional[list[float]] = None  # one per teacher; default equal
    per_layer: bool = False

    @field_validator("weights")
    @classmethod
    def _weights_positive(cls, v):
        if v is not None and (not v or min(v) < 0 or sum(v) <= 0):
            raise ValueError("must be non-negative with a positive sum")
        return v


class LossConfig(_Section):
    kind: Literal["mercator", "hybrid", "mse", "smooth_l1"] = "mercator"
    alpha: float = Field(1.0, ge=0)
    beta: float = Field(0.0, ge=0)
    hybrid_weight: float = Field(0.5, ge=0, le=1)
    kv_weight: float = Field(1.0, ge=0)
    kv_parts: Literal["both", "keys", "values"] = "both"  # which of K and V the KV loss trains (metrics: both)
    ce_weight: float = Field(1.0, ge=0)
    # which tokens the KV loss and KV metrics count: all real tokens; the answer tokens only; or all
    # real tokens minus the leading positions identical in every sample of the batch (the chat
    # template's system prompt; nothing is dropped for a batch of one sample)
    loss_tokens: Literal["all", "answer", "no_shared_prefix"] = "all"
    # centre student and target per (layer, head) over the batch's counted tokens before the cosine
    # term of mercator/hybrid (a constant target then scores 0; teachers are fused on their centred
    # projections too); the magnitude term is unchanged. Default on: it is alignment above the
    # constant baseline a bias can reach (README "Reading the metrics")
    center: bool = True
    # logit KD, the standard baseline (DistillKit's sparse_kl_div, Megatron offline top-k, TRL):
    # forward KL on each teacher's top-k next-token log-probs, the student normalised over its full
    # vocabulary, T^2-scaled, on the positions CE counts; teachers combined with the fusion weights.
    # 0 = off (no teacher logits)
    logit_weight: float = Field(0.0, ge=0)
    # MiniLMv2's K-K and V-V self-relation KL to each teacher's matched layer (`losses.relation_loss`): no projector
    relation_weight: float = Field(0.0, ge=0)
    # Minitron's hidden-state cosine loss (NVIDIA ModelOpt `HiddenStateCosineLoss`): 1 - cos between
    # each student layer's output hidden state and its matched teacher layer's, on the CE positions;
    # through one learned Linear(student hidden -> teacher hidden) per teacher where the widths
    # differ (ModelOpt's ProjectionLayer), else none. The teachers then serve hidden states too
    # (`losses.hidden_cosine_loss`)
    hidden_weight: float = Field(0.0, ge=0)
    logit_top_k: int = Field(64, ge=1)  # the top-k ids used (the first k of what the teachers send)
    # applied to teacher and student alike (T^2-scaled). The teachers send top-k and tail at T = 1:
    # at T != 1 the top-k forms temper the teacher's tail bucket as one token, (tail)^(1/T), not its
    # full distribution's tail at T (T 2, k 8: 2.45 against the exact 0.47; docs/training.md,
    # tests/test_logit_loss.py)
    logit_temperature: float = Field(1.0, gt=0)
    # the teacher's mass outside its top-k ids: a (k+1)-th bucket matched against the student's mass
    # outside them (DistillKit's SYMMETRIC_UNIFORM), or none (the teacher renormalised over its k
    # ids: ZERO)
    logit_tail: Literal["bucket", "none"] = "bucket"
    # teachers of another tokenizer (their ids name other strings), at the positions where both have
    # read the same text (`data.alignment.pair_positions`): hybrid (TRL GOLD: ids whose string the
    # student also has by forward KL, the rest by the sorted ULD distance), uld (the sorted distance
    # only: no vocabulary map), or off (KV only)
    logit_cross_vocab: Literal["hybrid", "uld", "off"] = "hybrid"
    # hybrid: the weight of the matched part (the unmatched part gets 1 - it); None = GOLD's
    # default, the share of the teacher's vocabulary that maps (1 for one tokenizer)
    logit_hybrid_matched_weight: Optional[float] = Field(None, ge=0, le=1)
    # the divergence of the logit term for teachers of the student's tokenizer
    # (`kava_ray.core.divergences`): forward_kl (the KD above), reverse_kl and jsd (TRL GKD's
    # generalized JSD at jsd_beta, on the top-k with its tail), reverse_kl_sampled (on-policy
    # distillation's per-token policy gradient on the student's own samples; reverse_kl on batches
    # of the data). A teacher of another tokenizer keeps its logit_cross_vocab rule
    logit_divergence: Literal["forward_kl", "reverse_kl", "jsd", "reverse_kl_sampled"] = "forward_kl"
    jsd_beta: float = Field(0.5, ge=0, le=1)  # GKD's beta: 0 forward KL, 1 reverse KL
    # reverse_kl_sampled's stabilisers (`divergences.sampled_reverse_kl_loss`): loo subtracts from
    # each token's advantage the mean over the sampled tokens of the OTHER samples of its prompt
    # (onpolicy.samples_per_prompt): RLOO's leave-one-out baseline (TRL `RLOOTrainer`), per token,
    # which keeps the expected gradient exact; rkl_clip eps clips the importance ratio pi_S / q to
    # [1 - eps, 1 + eps] as PPO / verl's `compute_policy_loss` (clip_ratio 0.2 there): the lag-1
    # sample's ratio, off by default
    rkl_baseline: Literal["none", "loo"] = "none"
    rkl_clip: Optional[float] = Field(None, gt=0, lt=1)
    # CE and the logit terms read the student's logits this many positions at a time, from its final
    # hidden states, gradients taken chunk by chunk (`core.vocab_chunks`): [B, T, V] never exists at
    # once; equal to the whole-logits path. 0 = whole logits (also what families whose logits are
    # scaled after the head get)
    vocab_chunk: int = Field(512, ge=0)

    @field_validator("logit_cross_vocab", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false

    @field_validator("rkl_baseline", mode="before")
    @classmethod
    def _no_group_mean(cls, v):
        if v == "group_mean":
            raise ValueError("group_mean (GRPO's group mean, the row's own tokens included) biases the sampled "
                             "reverse KL's expected gradient (19-50 % of its norm at 2 samples per prompt, by exact "
                             "enumeration): set loss.rkl_baseline=loo, the leave-one-out mean (RLOO)")
        return v


class OnPolicyConfig(_Section):
    """On-policy distillation (README "On-policy distillation"): the share of batches whose
    completions are sampled, and how. Prompts are the records' prompts (prompt_completion, messages,
    gsm8k rows)."""

    fraction: float = Field(0.0, ge=0, le=1)  # GKD's lambda: the share of batches sampled; 0 = off
    source: Literal["student", "teacher"] = "student"  # teacher: sequence-level KD (TRL's seq_kd)
    teacher: Optional[str] = None  # source teacher: which teacher writes (default: the first)
    max_new_tokens: int = Field(64, ge=1)  # below train.max_length (the prompt and completion are cut there)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    # 1: one-step-off (the next batch is sampled while the teachers score this one, with the weights
    # of one step earlier); 0: sampled with the current weights, then scored
    lag: Literal[0, 1] = 1
    # completions sampled per prompt (each row of a sampled batch repeated): loss.rkl_baseline loo's
    # groups (tinker's group_size is 4; TRL GRPO's num_generations)
    samples_per_prompt: int = Field(1, ge=1)
    # what samples the student's completions: hf (Hugging Face generate on the worker) or vllm (a
    # vLLM engine colocated on the worker, the student's weights pushed in before each sampling
    # round; the `vllm` extra)
    engine: Literal["hf", "vllm"] = "hf"
    vllm_kv_cache_mb: int = Field(256, ge=16)  # vllm on CPU: its KV cache (MiB)
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)  # vllm on CUDA: its share of the GPU (TRL's 0.3)


class OptimConfig(_Section):
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    lr_student: float = Field(3e-5, gt=0)
    lr_projector: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    # the warm-up's first rate: false (kava-ray's) (step + 1) / warmup_steps, so step 1 trains at lr
    # / warmup_steps; true: transformers' `get_*_schedule_with_warmup` (TRL's trainers), step /
    # warmup_steps, so step 1 trains at lr 0
    warmup_from_zero: bool = False
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    grad_clip: Optional[float] = Field(1.0, gt=0)
    accumulation: int = Field(1, ge=1)


class TrainConfig(_Section):
    steps: int = Field(100, ge=1)
    batch_size: int = Field(4, ge=1)
    max_length: int = Field(256, ge=8)
    log_steps: int = Field(1, ge=1)
    eval_steps: int = Field(50, ge=1)
    save_steps: int = Field(50, ge=1)
    num_to_keep: int = Field(2, ge=1)
    # e.g. "eval/ce" (min): keep the best checkpoints, not the latest (eval/cos_sim is through the projector)
    checkpoint_score: Optional[str] = None
    checkpoint_mode: Literal["max", "min"] = "max"
    max_failures: int = Field(1, ge=0)
    seed: int = 0
    # the data order's seed (training stream, held-out batching, the KV cache's batch keys); None =
    # `seed`. Set it to vary only the model-side randomness (projector init, dropout) over one
    # precomputed cache
    data_seed: Optional[int] = None
    # a teacher batch with NaN/Inf in K or V: skip it (the step takes the next batch; counted in
    # `skipped_batches`) or stop the run with one line naming the teacher, batch key and step
    on_bad_kv: Literal["skip", "stop"] = "skip"
    # experiment trackers rank 0 mirrors metrics.jsonl to (kava_ray/common/trackers.py); each needs its package
    loggers: list[Literal["tensorboard", "mlflow", "wandb"]] = []
    # lm-evaluation-harness tasks rank 0 runs on the student at every evaluation (step 0 included),
    # logged as eval/task/<task>/<metric> (`kava-ray eval --tasks` takes the same names: kava_gsm8k,
    # kava_pydoc_ppl, file:PATH, an lm-eval task); eval_tasks_limit: the first N documents of each
    # (null: all of them); eval_tasks_max_length: the context the harness reads (null: the model's,
    # lm-eval's default)
    eval_tasks: list[str] = []
    eval_tasks_limit: Optional[int] = Field(32, ge=1)
    eval_tasks_max_length: Optional[int] = Field(None, ge=16)

    @field_validator("loggers")
    @classmethod
    def _loggers(cls, v: list) -> list:
        check_loggers(v)  # duplicates, and a tracker whose package is missing (the pip command)
        return v


class RayConfig(_Section):
    address: Optional[str] = None  # None = embedded local Ray; "auto" = a running `ray start --head`
    namespace: str = "kava"
    storage_path: str = "./kava_runs"
    num_workers: int = Field(1, ge=1)
    # how the Train workers hold the student: ddp (a whole copy each, gradients all-reduced) or fsdp
    # (FSDP2: parameters, gradients and optimizer state sharded over the workers, one decoder layer
    # gathered at a time; `core.fsdp`, docs/training.md#fsdp); fsdp needs several workers
    strategy: Literal["ddp", "fsdp"] = "ddp"
    # fsdp with optim.accumulation > 1: `step` reduce-scatters once per step (the micro-batches
    # before the last keep the whole unsharded gradients, in fp32 under bf16-mixed, until it);
    # `micro_batch` after every micro-batch (only the 1/n gradient shard is held: torchtune's
    # recipes; more communication, less memory)
    fsdp_reduce: Literal["step", "micro_batch"] = "step"
    use_gpu: Union[Literal["auto"], bool] = "auto"
    cpus_per_worker: float = Field(1.0, gt=0)
    gpus_per_worker: float = Field(1.0, ge=0)
    num_cpus: Optional[int] = Field(None, ge=1)  # logical CPUs for an embedded Ray; None = enough for the job
    # the nodes the Ray Train workers may run on, by their Ray labels: {"kava-role": "student"}
    worker_label_selector: Optional[dict[str, str]] = None
    # a teacher whose node died and that no live node can hold: how long a run waits for one (an
    # autoscaler replacing the node) before it stops with one line naming the teacher and the node
    lost_teacher_wait_s: float = Field(300.0, gt=0)

    @field_validator("worker_label_selector")
    @classmethod
    def _selector_syntax(cls, v):
        return _check_selector(v)

    @property
    def sharded(self) -> bool:
        """Whether the job's workers shard the student with FSDP2 (strategy fsdp with several workers)."""
        return self.strategy == "fsdp" and self.num_workers > 1


LOGITS_ONLY = ("vllm", "openai")  # the engines that serve log-probs only: no KV, no hidden states


def ships_kv(teachers: list[TeacherConfig]) -> bool:
    """Whether the teachers ship KV layers: not in a job with a logits-only teacher (`LOGITS_ONLY`,
    `_check_logits_only_teachers`)."""
    return not any(t.engine in LOGITS_ONLY for t in teachers)


class JobConfig(_Section):
    name: str = "kava"
    teachers: list[TeacherConfig] = Field(min_length=1)
    student: StudentConfig
    data: DataConfig = DataConfig()
    align: AlignConfig = AlignConfig()
    fusion: FusionConfig = FusionConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    ray: RayConfig = RayConfig()
    onpolicy: OnPolicyConfig = OnPolicyConfig()

    @field_validator("name")
    @classmethod
    def _one_directory(cls, v):  # run dirs are named `<name>-<time>` under ray.storage_path: --name's rule
        why = name_problem(v)
        if why:
            raise ValueError(why)
        return v

    @model_validator(mode="after")
    def _cross_checks(self):
        names = [t.name for t in self.teachers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"teachers: duplicate teacher name {dup[0]!r}")
        w = self.fusion.weights
        if w is not None and len(w) != len(self.teachers):
            raise ValueError(f"fusion.weights: {len(w)} weights for {len(self.teachers)} teachers")
        if self.align.layer_map == "explicit" and not self.align.explicit_map:
            raise ValueError("align.explicit_map: required when align.layer_map is 'explicit'")
        if self.align.layer_map == "cka" and not self.align.cka_path:
            raise ValueError("align.cka_path: required when align.layer_map is 'cka'")
        if self.data.kv_source == "cache" and not self.data.kv_cache_dir:
            raise ValueError("data.kv_cache_dir: required when data.kv_source is 'cache'")
        o = self.onpolicy
        if o.fraction > 0:
            if self.data.kv_source == "cache":
                raise ValueError("onpolicy.fraction: sampled batches are scored live; a precomputed KV cache "
                                 "(data.kv_source: cache) cannot hold them")
            if o.source == "teacher" and o.teacher is not None and o.teacher not in names:
                raise ValueError(f"onpolicy.teacher: no teacher named {o.teacher!r} (teachers: {', '.join(names)})")
            if self.loss.logit_weight == 0 and self.loss.kv_weight == 0 and o.source == "student":
                raise ValueError("onpolicy.fraction: the student's own samples train only through the teachers' "
                                 "terms, and loss.logit_weight and loss.kv_weight are both 0")
        if o.fraction > 0 and o.max_new_tokens >= self.train.max_length:  # a prompt takes one token at least
            raise ValueError(f"onpolicy.max_new_tokens: {o.max_new_tokens} must be below train.max_length "
                             f"({self.train.max_length}): the prompt and its completion are cut at max_length")
        if self.ray.fsdp_reduce != "step" and self.ray.strategy != "fsdp":
            raise ValueError(f"ray.fsdp_reduce: {self.ray.fsdp_reduce} is for ray.strategy: fsdp (this job's is "
                             f"{self.ray.strategy}, which reduces once per step): set ray.fsdp_reduce=step with it")
        if self.ray.strategy == "fsdp" and self.ray.num_workers == 1:
            raise ValueError("ray.strategy: fsdp shards the student over the workers, and ray.num_workers is 1 (it "
                             "would train unsharded): set ray.num_workers above 1 or ray.strategy: ddp")
        if self.ray.sharded:
            if self.train.eval_tasks:
                raise ValueError("train.eval_tasks: rank 0 runs them on the whole student, and ray.strategy: fsdp "
                                 "shards it over the workers; use ray.strategy: ddp, or `kava-ray eval RUN --tasks "
                                 "...` on the run's checkpoints")
            if self.align.projector.kind == "fit":
                raise ValueError("ray.strategy: fsdp shards the student-side maps of align.projector.kind fit, which "
                                 "are fitted on rank 0 and broadcast; use ray.strategy: ddp or another projector kind")
        self._check_lora()
        if o.engine == "vllm" and (o.fraction == 0 or o.source != "student"):
            raise ValueError("onpolicy.engine: vllm samples the student's completions, and this job samples none "
                             f"(onpolicy.fraction {o.fraction}, onpolicy.source {o.source}): set onpolicy.engine=hf")
        self._check_logits_only_teachers()
        if self.loss.logit_divergence == "reverse_kl_sampled" and (o.fraction == 0 or o.source != "student"):
            raise ValueError("loss.logit_divergence: reverse_kl_sampled needs the student's samples "
                             "(onpolicy.fraction > 0, onpolicy.source: student)")
        rkl = self.loss.logit_divergence == "reverse_kl_sampled"
        if not rkl and (self.loss.rkl_baseline != "none" or self.loss.rkl_clip is not None):
            which = "rkl_baseline" if self.loss.rkl_baseline != "none" else "rkl_clip"
            raise ValueError(f"loss.{which}: a stabiliser of loss.logit_divergence reverse_kl_sampled, and this "
                             f"job's is {self.loss.logit_divergence}")
        if o.samples_per_prompt > 1 and o.fraction == 0:
            raise ValueError(f"onpolicy.samples_per_prompt: {o.samples_per_prompt} samples of each prompt, but "
                             f"onpolicy.fraction is 0 (nothing is sampled): set onpolicy.fraction above 0")
        if self.loss.rkl_baseline == "loo" and o.samples_per_prompt < 2:
            raise ValueError("loss.rkl_baseline: loo needs several samples of each prompt: set "
                             "onpolicy.samples_per_prompt above 1 (e.g. 4, tinker's group_size)")
        if self.loss.logit_divergence == "reverse_kl_sampled" and o.top_p < 1:
            raise ValueError(f"onpolicy.top_p: {o.top_p} never samples the student's tokens outside the nucleus, "
                             f"and the sampled reverse KL needs them (its importance weights cannot recover them): "
                             f"set onpolicy.top_p=1 with loss.logit_divergence reverse_kl_sampled")
        if self.loss.logit_divergence == "reverse_kl_sampled" and o.temperature != 1:
            raise ValueError(f"onpolicy.temperature: {o.temperature:g} draws the samples' prefixes from the tempered "
                             f"q, and the sampled reverse KL's importance weights correct each token, not its prefix: "
                             f"its expected gradient is off (2-11 % of its norm at 0.7, 4-22 % at 0.5, by exact "
                             f"enumeration): set onpolicy.temperature=1 with loss.logit_divergence reverse_kl_sampled")
        return self

    def _check_lora(self) -> None:
        lora = self.student.lora
        if lora is None:
            return
        if self.student.keep_layers:
            raise ValueError("student.lora: its adapters train on the student as it loads, and student.keep_layers "
                             "builds a smaller model whose every weight should train; use one or the other "
                             "(student.keep_layers=null: adapters on the whole model)")
        if lora.quantize_base == "4bit" and self.ray.sharded:
            raise ValueError("student.lora.quantize_base: 4bit (QLoRA) keeps the base in bitsandbytes' 4-bit "
                             "weights, which FSDP2 does not shard: use ray.strategy: ddp, or quantize_base: none")
        if lora.quantize_base == "4bit" and self.onpolicy.engine == "vllm":
            raise ValueError("student.lora.quantize_base: 4bit (QLoRA): the vLLM sampler takes the merged "
                             "weights, and a 4-bit base has none to merge into; use onpolicy.engine: hf")

    def _check_logits_only_teachers(self) -> None:
        """A teacher on vLLM or behind a URL serves log-probs only: the job may ask it (and so, the
        terms being job-wide, every teacher) for nothing else."""
        t = next((t for t in self.teachers if t.engine in LOGITS_ONLY), None)
        if t is None:
            return
        key, c, e = f"teachers[{t.name}].engine", self.loss, t.engine
        asked = [f"loss.{w} is {getattr(c, w):g}" for w in ("kv_weight", "relation_weight", "hidden_weight")
                 if getattr(c, w) > 0]
        if asked:
            raise ValueError(f"{key}: {e} serves log-probs only (no KV or hidden states), and {asked[0]}: set it "
                             f"to 0, or {key}=hf")
        if t.layers is not None:
            raise ValueError(f"{key}: {e} ships no layers, and teachers[{t.name}].layers asks for {t.layers}")
        if t.quantization != "none":
            raise ValueError(f"{key}: {e} serves the teacher as its weights are stored; teachers[{t.name}]."
                             f"quantization {t.quantization} is bitsandbytes' (hf): set it to none")
        if self.fusion.kind in ("gate", "router"):
            raise ValueError(f"{key}: {e} serves no KV, and fusion.kind {self.fusion.kind} learns its weights "
                             f"from the teachers' KV: use fusion.kind fixed or sum")
        if c.logit_weight == 0:
            raise ValueError(f"{key}: {e} serves log-probs, and this job uses none (loss.logit_weight is 0)")

    @property
    def ships_kv(self) -> bool:
        """Whether the teachers ship KV layers: `ships_kv(self.teachers)`."""
        return ships_kv(self.teachers)

    def teacher(self, name: str) -> TeacherConfig:
        for t in self.teachers:
            if t.name == name:
                return t
        raise KavaError(f"unknown teacher {name!r} (config has: {', '.join(t.name for t in self.teachers)})")

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------- loading


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files(PRESET_PACKAGE).iterdir() if p.name.endswith(".yaml"))


def read_yaml_mapping(text: str, origin: str, what: str = "config", expected: str = "a mapping of sections") -> dict:
    """YAML text -> dict; bad YAML or a non-mapping top level is one KavaError line naming the file."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise KavaError(f"{what} {origin}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise KavaError(f"{what} {origin}: top level must be {expected}")
    return data


def read_raw_config(path_or_preset: Union[str, Path]) -> dict:
    """The raw dict of a YAML file, or of a shipped preset when no such file exists, `extends:` resolved."""
    p = Path(path_or_preset)
    if p.is_file():
        return _read_extending(p, str(p), ())
    name = str(path_or_preset)
    if name in preset_names():
        return _read_extending(resources.files(PRESET_PACKAGE).joinpath(f"{name}.yaml"), f"preset {name}", ())
    raise KavaError(f"config {name!r}: no such file and no such preset (presets: {', '.join(preset_names())})")


def _read_extending(file, origin: str, chain: tuple[tuple[str, str], ...]) -> dict:
    """The mapping in `file` (a path or a preset resource) deep-merged on top of its `extends:` base.

    The base is a path relative to the file, else a preset name; it may extend another in turn.
    chain: the (real path, origin) pairs that led here, to report a cycle instead of recursing
    forever.
    """
    real = os.path.realpath(str(file))
    if any(r == real for r, _ in chain):
        names = [o for _, o in chain] + [origin]
        raise KavaError(f"config {chain[0][1]}: extends forms a cycle ({' -> '.join(names)})")
    data = read_yaml_mapping(file.read_text(), origin)
    if "extends" not in data:
        return data
    base = data.pop("extends")
    if not isinstance(base, str) or not base.strip():
        raise KavaError(f"config {origin}: extends must name a preset or a file relative to it (got {base!r})")
    near = Path(os.path.dirname(real)) / os.path.expanduser(base)
    if near.is_file():
        base_file, base_origin = near, str(near)
    elif base in preset_names():
        base_file, base_origin = resources.files(PRESET_PACKAGE).joinpath(f"{base}.yaml"), f"preset {base}"
    else:
        raise KavaError(f"config {origin}: extends {base!r}: no such file next to it and no such preset "
                        f"(presets: {', '.join(preset_names())})")
    return deep_merge(_read_extending(base_file, base_origin, chain + ((real, origin),)), data)


def deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merge key by key, lists and scalars replace."""
    out = dict(base)
    for key, value in over.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """'optim.lr_student=3e-5' -> (['optim', 'lr_student'], 3e-05); the value is parsed as YAML."""
    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not key.strip() or any(not p for p in parts):
        raise KavaError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. optim.lr_student=3e-5")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        raise KavaError(f"override {text!r}: value is not valid YAML") from None
    return parts, parsed


def parse_overrides(lines: Iterable[str]) -> dict[str, Any]:
    """Override lines -> {dotted key: value} for `derive`: ['train.steps=5'] -> {'train.steps': 5}."""
    return {".".join(parts): value for parts, value in map(parse_override, lines)}


def set_dotted(data: dict, parts: list[str], value: Any) -> None:
    """Set data[a][b][c] = value; a numeric part indexes a list (teachers.0.model=...)."""
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if isinstance(node, list):
            node = node[_index(part, where, len(node))]
        else:
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, (dict, list)):
                raise KavaError(f"config key {where!r}: is a value, not a section")
            node = nxt
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(last, ".".join(parts), len(node))
        node[idx] = value
    else:
        node[last] = value


def _index(part: str, where: str, n: int) -> int:
    if not part.isdigit() or int(part) >= n:
        raise KavaError(f"config key {where!r}: list index out of range (have {n} items)")
    return int(part)


def apply_overrides(data: dict, overrides: Optional[list[str]]) -> dict:
    """A copy of `data` with `KEY=VALUE` override lines set (`--set`, the CLI's trailing overrides)."""
    out = copy.deepcopy(data)
    for text in overrides or []:
        parts, value = parse_override(text)
        set_dotted(out, parts, value)
    return out


def _plain(value: Any) -> Any:
    """A config section (or a list of them) as the plain data a config dict holds."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def derive(cfg: JobConfig, changes: dict[str, Any]) -> JobConfig:
    """`cfg` with {dotted key: value} set, validated as override lines are: the one way a config is
    made from another (benches, Tune trials, precompute), e.g. `derive(cfg, {"data.kv_source":
    "live", "teachers.0.model": p})`. A value may be a section (`{"teachers": [TeacherConfig,
    ...]}`); a bad key or value is one KavaError line."""
    data = cfg.to_dict()
    for key, value in changes.items():
        set_dotted(data, key.split("."), _plain(value))
    return validate_config(data)


# keys an earlier version had, for the one-line error a config that still uses them gets
RENAMED = {"data.eval_split": "data.test_split", "data.num_eval": "data.num_test"}


def section_of(annotation: Any) -> Optional[type[BaseModel]]:
    """The config section (pydantic model) inside a field's annotation (`X`, `Optional[X]`, `list[X]`), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = section_of(arg)
        if found is not None:
            return found
    return None


def did_you_mean(model: type[BaseModel], loc: tuple) -> str:
    """` (did you mean 'ray.worker_label_selector'?)` for an unknown key close to one of its section's keys."""
    section: Optional[type[BaseModel]] = model
    for part in loc[:-1]:
        if isinstance(part, int) or str(part).isdigit():  # a list item: its model is already the section
            continue
        field = section.model_fields.get(str(part))
        section = section_of(field.annotation) if field is not None else None
        if section is None:
            return ""
    if str(loc[-1]) in section.model_fields:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(section.model_fields), n=1, cutoff=0.7)
    return f" (did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?)" if close else ""


def format_validation_error(err: ValidationError, key: Optional[str] = "config key",
                            fields: Iterable[str] = (), model: Optional[type[BaseModel]] = None) -> str:
    """The first problem pydantic found, as one line that names its key.

    key: the words before the quoted key, `config key 'optim.lr_student': Input should be greater than 0
        (got 0)`, then `[+N more]` when pydantic found several problems. None (search spaces): the key
        bare (`scheduler.kind: ...`), an unknown key as `unknown key 'x'` followed by the expected top-level
        `fields`, and the messages of our own validators, which name their key, as they are.
    model: the validated model; an unknown key close to one of its keys gets `(did you mean '...'?)`.
    """
    problems = err.errors()
    e = problems[0]
    kind, loc = e["type"], ".".join(str(x) for x in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        if key is None:
            fields = ", ".join(fields)
            return f"unknown key {loc!r}" + (f" (expected {fields})" if fields and "." not in loc else "")
        msg = "unknown key" + (f" (renamed to {RENAMED[loc]})" if loc in RENAMED
                               else did_you_mean(model, e["loc"]) if model is not None else "")
    elif kind == "missing":
        msg = "required key is missing"
    elif kind == "value_error":
        if key is None:
            return msg
        if ": " in msg and not loc:  # model-level checks name their own key
            loc, msg = msg.split(": ", 1)
    if "input" in e and kind not in ("missing", "extra_forbidden") and not isinstance(e["input"], dict):
        msg += f" (got {e['input']!r})"
    if key is None:
        return f"{loc}: {msg}"
    more = f" [+{len(problems) - 1} more]" if len(problems) > 1 else ""
    return f"{key} {loc!r}: {msg}{more}" if loc else f"config: {msg}{more}"


def validate_config(data: dict) -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise KavaError(format_validation_error(err, model=JobConfig)) from None


def load_config(path_or_preset: Union[str, Path, JobConfig], overrides: Optional[list[str]] = None) -> JobConfig:
    """A validated JobConfig from a YAML path or preset name, with dotted KEY=VALUE overrides; its
    local paths absolute (`resolve_paths`)."""
    if isinstance(path_or_preset, JobConfig):
        raw = path_or_preset.to_dict()
    else:
        raw = read_raw_config(path_or_preset)
    return resolve_paths(validate_config(apply_overrides(raw, overrides)))


def _absolute(p: str) -> str:
    return os.path.abspath(os.path.expanduser(p))  # abspath, not resolve(): a symlinked x.gguf keeps its name


def _local(spec: str) -> bool:
    """A model / data spec that names something on this machine (a hub id, `synthetic`, a URI do not)."""
    if "://" in spec or spec == "synthetic":
        return False
    return os.path.exists(os.path.expanduser(spec.replace("{split}", "train"))) \
        or spec.startswith(("/", "./", "../", "~"))


def resolve_paths(cfg: JobConfig, like: Optional[JobConfig] = None) -> JobConfig:
    """Every path of a job made absolute once, in the driver (relative to its CWD, `~` expanded),
    before any Ray task reads it: a Tune trial or a Train worker runs in a working dir of Ray's,
    where a relative `./kava_runs` would land in Ray's session dir. ray.storage_path,
    data.kv_cache_dir, align.cka_path always (URIs untouched); data.source and teachers[].model /
    student.model only when they name something local (hub ids, `synthetic`, pypi:// stay as they
    are).

    like: a config to match (checkpoint.check_compatible): a relative path of `cfg` whose absolute
    form in `like` ends with it takes that form, from any CWD (a checkpoint saved before paths were
    resolved)."""
    d, ref = cfg.to_dict(), (like.to_dict() if like is not None else None)

    def fix(entry: dict, key: str, ref_entry: Optional[dict], always: bool) -> None:
        value = entry.get(key)
        if not value or "://" in value or os.path.isabs(value):
            return
        target, tail = (ref_entry or {}).get(key), os.path.normpath(value)
        while tail.startswith(".." + os.sep):
            tail = tail[3:]
        if isinstance(target, str) and os.path.isabs(target) and (
                target == _absolute(value) or target.endswith(os.sep + tail)):
            entry[key] = target
        elif always or _local(value):
            entry[key] = _absolute(value)

    def at(*keys):
        node = ref
        for k in keys:
            if node is None:
                return None
            node = node[k] if isinstance(node, dict) else (node[k] if k < len(node) else None)
        return node

    for section, key in (("ray", "storage_path"), ("data", "kv_cache_dir"), ("data", "cache_dir"),
                         ("align", "cka_path")):
        fix(d[section], key, at(section), always=True)
    fix(d["data"], "source", at("data"), always=False)
    fix(d["student"], "model", at("student"), always=False)
    for i, t in enumerate(d["teachers"]):
        fix(t, "model", at("teachers", i), always=False)
    return validate_config(d)


def config_hash(cfg: JobConfig, sections: tuple[str, ...] = SHAPE_SECTIONS) -> str:
    """Hash of the parts that define model/projector shapes (what a checkpoint must match to resume)."""
    d = cfg.to_dict()
    blob = json.dumps({k: d[k] for k in sections}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1}} -> {'optim.lr': 1}; lists are indexed (teachers.0.name)."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(d, list) and d and all(isinstance(x, dict) for x in d):
        out = {}
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: d}


def diff_keys(a: JobConfig, b: JobConfig, sections: tuple[str, ...] = SHAPE_SECTIONS) -> list[str]:
    """Dotted keys whose values differ between two configs, within the given sections."""
    fa = flatten({k: a.to_dict()[k] for k in sections})
    fb = flatten({k: b.to_dict()[k] for k in sections})
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
