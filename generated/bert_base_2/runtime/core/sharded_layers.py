"""Projections torch's tensor-parallel styles do not shard, and the styles that shard them.

torch's ``ColwiseParallel`` and ``RowwiseParallel`` shard an ``nn.Linear`` (weight stored
``[out_features, in_features]``) whose output features are one block. Two common projections
are neither:

- a *transposed* projection stores its weight ``[in_features, out_features]`` and computes
  ``addmm(bias, x, weight)`` (GPT-2's ``Conv1D``): generated code holds it as a
  :class:`TransposedLinear` at its original name (its parameters keep their names and shapes);
- a *fused* projection computes several sections at once (GPT-2's ``c_attn``: query, key and
  value side by side): splitting its output features in ``t`` contiguous blocks would give a
  rank all the queries and half the keys. :class:`SectionedColwiseParallel` splits each
  section alike (torch's ``_StridedShard`` placement), so that each rank holds its share of
  every section, whole heads of each, in the section order the code after it splits;
- a *grouped* key or value projection of grouped-query attention has fewer heads than there
  are ranks (2 key/value heads at degree 4): no split gives each rank the head its query heads
  read. :class:`ReplicatedHeadsParallel` keeps it whole on every rank, which computes that head
  alone; the ranks sharing a head each take the gradient of their query heads' part, summed
  over the ranks with the other partial gradients once per step (train.py).

The first two styles are torch's own with another partition: inputs and outputs are made DTensors
and redistributed exactly as ``ColwiseParallel`` / ``RowwiseParallel`` do, and DTensor runs the
product and its collectives. Copied into every generated pipeline; needs only torch.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.nn import functional as F

__all__ = [
    "ReplicatedHeadsParallel",
    "SectionedColwiseParallel",
    "TransposedLinear",
    "TransposedRowwiseParallel",
    "fsdp_placement",
    "plain_placement",
    "sectioned",
    "is_split",
]


class TransposedLinear(nn.Module):
    """``y = x @ weight + bias`` with ``weight`` stored ``[in_features, out_features]`` (GPT-2's
    ``Conv1D``), on a 2-D input, computed with the operator the model computes it with
    (``addmm``, or ``mm`` without a bias)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(in_features, out_features, device=device, dtype=dtype)
        )
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(out_features, device=device, dtype=dtype)
            )
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (uniform within 1/sqrt(in_features)), read along the
        transposed layout: a module built here holds numbers, never uninitialised memory, even
        where a checkpoint or the original model's weights overwrite them next."""
        bound = 1.0 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            f"bias={self.bias is not None}"
        )


def sectioned(dim: int, sections: int) -> Placement:
    """The placement that splits each of ``sections`` equal sections of dimension ``dim`` over a
    mesh dimension (a plain ``Shard`` for one section). torch names it privately
    (``_StridedShard``, which FSDP2 places on tensor-parallel parameters too); this module is
    the one place autopipe names it."""
    return Shard(dim) if sections == 1 else _StridedShard(dim, split_factor=sections)


def is_split(placement: Placement) -> bool:
    """Whether ``placement`` splits a tensor over its mesh dimension (``Shard``, or the
    sectioned placement, which ``is_shard()`` does not count)."""
    return placement.is_shard() or isinstance(placement, _StridedShard)


def fsdp_placement(param: nn.Parameter) -> Shard | None:
    """Where FSDP2 shards ``param`` (its ``shard_placement_fn``): a fused ``nn.Linear``'s weight,
    split by sections along its dimension 0 over the tensor-parallel ranks, along dimension 1
    (FSDP2 splits a rank's part as one block, which split by sections along the same dimension
    gives a layout no placement describes); any other along dimension 0, as by default."""
    if isinstance(param, DTensor) and param.ndim > 1:
        if any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements):
            return Shard(1)
    return None


def plain_placement(placement: Placement) -> Placement:
    """``placement`` with a sectioned split as the plain ``Shard`` of its dimension: the layout
    a checkpoint holds (DCP writes each rank's one contiguous block)."""
    return Shard(placement.dim) if isinstance(placement, _StridedShard) else placement


class SectionedColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` for an ``nn.Linear`` or a :class:`TransposedLinear` whose
    output features are ``sections`` equal sections (a fused query-key-value projection: 3),
    each split over the ranks alike; with one section, a transposed projection split by its
    output features. Each rank's output is its share of every section, in order."""

    def __init__(
        self,
        *,
        sections: int = 1,
        input_layouts: Placement | None = None,
        use_local_output: bool = True,
    ) -> None:
        super().__init__(input_layouts=input_layouts, use_local_output=use_local_output)
        if sections < 1:
            raise ValueError(f"a projection has at least one section, not {sections}")
        self.sections = sections

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, TransposedLinear):
            dim = 1  # weight [in, out]
        elif isinstance(module, nn.Linear):
            dim = 0  # weight [out, in]
        else:
            raise NotImplementedError(
                "SectionedColwiseParallel shards an nn.Linear or a TransposedLinear, not a "
                f"{type(module).__name__}"
            )
        # a fused projection's bias stays whole: DTensor slices it for the product, and its
        # gradient (each rank's share of each section) is gathered where the optimizer or
        # FSDP2 reads it. Split by sections, FSDP2 would split each rank's part along the same
        # dimension as one block: a layout no placement describes (full_tensor, DCP misread it)
        bias = Shard(0) if self.sections == 1 else Replicate()
        placements = {"weight": sectioned(dim, self.sections), "bias": bias}
        return distribute_module(
            module,
            device_mesh,
            partial(_partition, placements, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(_local_output, self.use_local_output),
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sections={self.sections}, input_layouts={self.input_layouts})"
        )


class TransposedRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` for a :class:`TransposedLinear`: its weight split along its
    input features (its rows), its bias replicated, the partial sums reduced as the output
    layout asks (an all-reduce by default)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, TransposedLinear):
            raise NotImplementedError(
                f"TransposedRowwiseParallel shards a TransposedLinear, not a {type(module).__name__}"
            )
        self.desired_input_layouts = (Shard(-1),)
        placements: dict[str, Placement] = {"weight": Shard(0), "bias": Replicate()}
        return distribute_module(
            module,
            device_mesh,
            partial(_partition, placements, self.src_data_rank),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class ReplicatedHeadsParallel(ParallelStyle):
    """The key or value projection (an ``nn.Linear``) of ``heads`` grouped-query heads at a
    degree that is a multiple of them (2 heads at degree 4 or 8): each rank holds the whole
    projection, plain parameters replicated, and computes the one head its query heads read
    (rank ``r`` of ``t``: head ``r // (t / heads)``, as grouped-query attention pairs query heads
    ``[r H/t, (r+1) H/t)`` with their key/value head), so its output is the rank's share the
    code after it expects, a head's features.

    Its input is made one replicated DTensor as ``ColwiseParallel``'s is (gathered along the
    sequence where ``input_layouts`` says it arrives sliced) and computed on locally; the input
    gradient each rank hands back is its own heads' part, declared partial, so that DTensor sums
    it over the ranks with the region's other column gradients in the region input's one
    collective. The parameters' gradients are partial alike (each rank's query heads' part of
    its head's rows): the stage lists them (``REPLICATED_HEADS_PARAMETERS``) and train.py sums
    them over the ranks once per step."""

    def __init__(self, *, heads: int, input_layouts: Placement | None = None) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"a projection has at least one head, not {heads}")
        self.heads = heads
        self.input_layouts = (input_layouts or Replicate(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(
                f"ReplicatedHeadsParallel keeps an nn.Linear whole, not a {type(module).__name__}"
            )
        degree = device_mesh.size()
        if degree % self.heads or module.out_features % self.heads:
            raise ValueError(
                f"{self.heads} key/value heads of {module.out_features} features cannot be "
                f"shared among {degree} tensor-parallel ranks (the degree must be a multiple of "
                "the heads)"
            )
        size = module.out_features // self.heads
        head = device_mesh.get_local_rank() // (degree // self.heads)
        module.register_forward_pre_hook(
            partial(_replicated_local_input, self.input_layouts, device_mesh)
        )
        # the rank's head's rows alone: the other heads' products would be thrown away
        rows = partial(_rows_forward, module, head * size, size)
        module.forward = rows  # type: ignore[method-assign]
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(heads={self.heads}, input_layouts={self.input_layouts})"


def _replicated_local_input(
    input_layouts: tuple[Placement, ...], device_mesh: DeviceMesh, module: nn.Module, inputs: Any
) -> tuple[Any, ...]:
    """The module's input whole on every rank, as a local tensor whose gradient is partial: the
    rank's part, summed over the ranks by the DTensor it comes from (or is made into here)."""
    x, *rest = inputs
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
    if tuple(x.placements) != (Replicate(),):
        x = x.redistribute(placements=(Replicate(),))
    return (x.to_local(grad_placements=(Partial(),)), *rest)


def _rows_forward(module: nn.Linear, start: int, size: int, x: torch.Tensor) -> torch.Tensor:
    """``module``'s product for its output features ``[start, start + size)``."""
    bias = module.bias.narrow(0, start, size) if module.bias is not None else None
    return F.linear(x, module.weight.narrow(0, start, size), bias)


def _partition(
    placements: dict[str, Placement],
    src_data_rank: int | None,
    name: str,
    module: nn.Module,
    device_mesh: DeviceMesh,
) -> None:
    """Each of ``module``'s own parameters distributed with its placement."""
    for key, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(
            param, device_mesh, [placements[key]], src_data_rank=src_data_rank
        )
        module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _local_output(use_local_output: bool, module: nn.Module, outputs: Any, device_mesh: Any) -> Any:
    """A column projection's output as it is: each rank's share of every section (no
    redistribution), a local tensor unless asked otherwise."""
    if use_local_output and isinstance(outputs, DTensor):
        return outputs.to_local()
    return outputs
