"""The student's current weights, as its sampler reads them before a sampling round.

`LocalWeights`: the student on this worker holds every weight (DDP, one worker): read in place, and
pushed into a vLLM engine only when an optimizer step changed them (the parameters' version
counters). `GatheredWeights`: FSDP2 shards the student over the workers (`ray.strategy: fsdp`);
each tensor is gathered whole (`DTensor.full_tensor`, an all-gather) one at a time, so no rank ever
holds two whole copies of the student beside its sampler's. Every rank gathers on every sampling
round: the ranks sample at the same steps (under FSDP2 the on-policy draw is per step,
`onpolicy_source.onpolicy_items`), so their all-gathers pair up. A sharded student samples
from `core.models.whole_copy`, an unsharded model of the same class and config in the forwards'
dtype, loaded from the gathered tensors each round (TRL gathers ZeRO-3 parameters for generation
the same way, `unwrap_model_for_generation`); a vLLM sampler takes them straight into its engine.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.distributed.tensor import DTensor

from kava_ray.core.lora import has_lora, merged, scalings


class LocalWeights:
    """The weights of a student this worker holds whole, under its plain model's names (a LoRA
    student's merged: `core.lora.merged`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.scale = scalings(model) if has_lora(model) else None

    def version(self) -> Optional[int]:
        """Changes whenever an in-place update (an optimizer step) touched a parameter."""
        return sum(p._version for p in self.model.parameters())

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        pairs = self._tensors()
        yield from pairs if self.scale is None else merged(pairs, self.scale)


class GatheredWeights(LocalWeights):
    """The weights of an FSDP2-sharded student, each gathered whole when read (a collective: every
    rank reads them in the same order, the same number of times)."""

    def version(self) -> Optional[int]:
        return None  # unknown without a collective: every round gathers

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self.model.state_dict().items():
            yield n, t.full_tensor() if isinstance(t, DTensor) else t


def weights_of(model: torch.nn.Module) -> LocalWeights:
    """`GatheredWeights` where any parameter is an FSDP2 shard, else `LocalWeights`."""
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    return GatheredWeights(model) if sharded else LocalWeights(model)
