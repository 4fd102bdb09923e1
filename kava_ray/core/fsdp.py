"""Students larger than one GPU: the Distiller sharded with FSDP2 (`ray.strategy: fsdp`) and its sharded checkpoints.

`shard(distiller, precision, device)`: `torch.distributed.fsdp.fully_shard` on each decoder layer of
the student, then on the whole Distiller as the root group -- the embeddings, final norm, LM head,
the projectors, the fusion and the hidden-state maps are sharded together there (the projectors are
small beside the student; one group keeps one all-gather for them and lets the root stay unsharded
between forward and backward, as FSDP2 keeps its root, which the chunked vocabulary loss reads the
LM head from). bf16-mixed runs with FSDP2's MixedPrecisionPolicy (bf16 parameters in the forward,
fp32 gradient reduction), as Ray Train's FSDP2 guide and torchtune's recipes do.

Checkpoints (`save_sharded`, `load_sharded`): `torch.distributed.checkpoint` of {"model", "optim"}
from `get_state_dict` (each rank writes its own shard; Ray Train merges every rank's reported
directory into one checkpoint); the final student is gathered (`full_model_state`) and saved as a
plain Hugging Face directory. Details: docs/internals/core.md#fsdp.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kava_ray.common.errors import KavaError
from kava_ray.core.models import decoder_layers

SHARDED = "sharded"  # the checkpoint's DCP directory


def mesh_of(device) -> DeviceMesh:
    """The 1-D mesh of every rank of the default process group on `device`'s type, the device this
    worker trains on. Explicit because `fully_shard` without one builds it on the machine's
    accelerator: a gloo run (`ray.use_gpu: false`) on a GPU host would otherwise move its shards to
    the GPU."""
    import torch.distributed as dist

    return init_device_mesh(torch.device(device).type, (dist.get_world_size(),))


def shard(distiller: torch.nn.Module, precision, device) -> torch.nn.Module:
    """The Distiller sharded in place over the default process group (`mesh_of(device)`): each
    decoder layer its own FSDP2 unit, the rest in the root unit. precision:
    `core.precision.Precision` (bf16-mixed: bf16 parameters, fp32 reduction); device: the worker's
    training device, where the Distiller already is."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision.policy == "bf16-mixed" and precision.device_type == "cuda" else MixedPrecisionPolicy()
    mesh = mesh_of(device)
    for layer in decoder_layers(distiller.student):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(distiller, mesh=mesh, mp_policy=mp)
    return distiller


def is_sharded(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def full_model_state(distiller: torch.nn.Module) -> dict:
    """The whole Distiller's state dict gathered to rank 0 on the CPU (every rank must call it; the others get {})."""
    return get_model_state_dict(distiller, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(path, distiller: torch.nn.Module, optimizer) -> None:
    """This rank's shard of the model and optimizer state into `path`/sharded (every rank, collectively)."""
    model_sd, optim_sd = get_state_dict(distiller, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(path) / SHARDED))


def gather_files(root, sub: str) -> dict:
    """{relative path: size} of every rank's files under `root`/`sub` (every rank calls it; the
    checkpoint's state.json records them all, so a shard lost on the way into Ray's merged
    checkpoint is found before a resume reads it)."""
    import torch.distributed as dist

    root = Path(root)
    mine = {f.relative_to(root).as_posix(): f.stat().st_size for f in sorted((root / sub).rglob("*")) if f.is_file()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for files in every for k, v in files.items()}


def load_sharded(path, distiller: torch.nn.Module, optimizer=None) -> None:
    """The model (and optimizer) state of `path`/sharded into the sharded Distiller (every rank, collectively)."""
    d = Path(path) / SHARDED
    if not (d / ".metadata").is_file():
        raise KavaError(f"checkpoint {path}: {d}/.metadata is missing (an incomplete sharded checkpoint)")
    model_sd, optim_sd = get_state_dict(distiller, optimizer) if optimizer is not None else \
        (get_model_state_dict(distiller), None)
    state = {"model": model_sd, **({"optim": optim_sd} if optimizer is not None else {})}
    dcp.load(state, checkpoint_id=str(d))
    if optimizer is not None:
        set_state_dict(distiller, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(distiller, state["model"])


def local_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (clip_grad_norm_ of sharded parameters returns a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
