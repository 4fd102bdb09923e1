"""The student's current weights, as its sampler reads them before a sampling round.

`LocalWeights`: the student on this worker holds every weight (DDP, one worker): read in place, and
pushed into a vLLM engine only when an optimizer step changed them (the parameters' version
counters). `GatheredWeights`: FSDP2 shards the student over the workers (`ray.strategy: fsdp`);
each tensor is gathered whole (`DTensor.full_tensor`, an all-gather) one at a time, so no rank ever
holds two whole copies of the student beside its sampler's. Every rank gathers on every sampling
round: the ranks sample the same batches (the on-policy draw is per batch key), so their
all-gathers pair up. A sharded student samples from `whole_copy`, an unsharded model of the same
class and config in the forwards' dtype, loaded from the gathered tensors each round (TRL
gathers ZeRO-3 parameters for generation the same way, `unwrap_model_for_generation`); a vLLM
sampler takes them straight into its engine.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.distributed.tensor import DTensor


class LocalWeights:
    """The weights of a student this worker holds whole."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def version(self) -> Optional[int]:
        """Changes whenever an in-place update (an optimizer step) touched a parameter."""
        return sum(p._version for p in self.model.parameters())

    def named(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self.model.state_dict().items():
            yield n, t if dtype is None or not t.is_floating_point() else t.to(dtype)


class GatheredWeights(LocalWeights):
    """The weights of an FSDP2-sharded student, each gathered whole when read (a collective: every
    rank reads them in the same order, the same number of times)."""

    def version(self) -> Optional[int]:
        return None  # unknown without a collective: every round gathers

    def named(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self.model.state_dict().items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            yield n, whole if dtype is None or not whole.is_floating_point() else whole.to(dtype)


def weights_of(model: torch.nn.Module) -> LocalWeights:
    """`GatheredWeights` where any parameter is an FSDP2 shard, else `LocalWeights`."""
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    return GatheredWeights(model) if sharded else LocalWeights(model)


def whole_copy(model: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """An unsharded model of `model`'s class and config in `dtype` on `device`, its weights left
    uninitialised (`load` fills them), frozen, in eval mode: what a sharded student samples from."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        copy = type(model)(model.config)
    return copy.to(device=device, dtype=dtype).requires_grad_(False).eval()


@torch.no_grad()
def load(model: torch.nn.Module, named) -> None:
    """Copy (name, tensor) pairs into `model`'s state in place (tied weights: the same tensor twice)."""
    own = model.state_dict()
    for n, t in named:
        own[n].copy_(t)
