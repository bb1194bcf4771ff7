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
  every section, whole heads of each, in the section order the code after it splits.

The styles are torch's own with another partition: inputs and outputs are made DTensors and
redistributed exactly as ``ColwiseParallel`` / ``RowwiseParallel`` do, and DTensor runs the
product and its collectives. Copied into every generated pipeline; needs only torch.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = [
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
