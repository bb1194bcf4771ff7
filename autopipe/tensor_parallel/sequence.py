"""Sequence parallelism between tensor-parallel regions (issue 45, item 1): which values each
tensor-parallel rank holds a ``1/t`` slice of along dimension 1 (the sequence of a
``[batch, sequence, hidden]`` state), as Megatron's sequence parallelism does.

A sharded region's row projection then reduce-scatters its partial sums along the sequence
(torch's ``RowwiseParallel(output_layouts=Shard(1))``) instead of all-reducing them, the
vocabulary-parallel embedding too, and everything between regions (residual additions,
normalisations, dropout) runs on each rank's slice of the positions; the region's input is
gathered whole along the sequence once (``PrepareModuleInput`` on the region's input module) and
the head gathers its input the same way. What runs between regions must then work position by
position: this pass follows the sharded values forward from the row projections and the
embedding and checks every operator reading one, refusing with the operator's name where one
mixes positions (a reduction or a view over the sequence, attention outside a sharded region, a
value whole along the sequence added to a slice of it, a model output).

The parameters those operators read (the normalisations' weights) see each rank's positions
only: their gradients are partial sums over the tensor-parallel ranks, which the runtime sums
once per step (as Megatron-LM does for its sequence-parallel parameters).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..ir import Graph, Node, Ref
from ..ir.types import argument_value

__all__ = ["SEQUENCE_DIM", "SequenceRefused", "SequenceSharding", "sequence_sharding"]

#: the dimension sequence parallelism splits (torch's styles' ``Shard(1)``)
SEQUENCE_DIM = 1
#: operators working element by element (their other tensor operands broadcast over the
#: sequence, or sliced the same way)
_POINTWISE = {
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.div.Tensor",
    "aten.add.Scalar",
    "aten.sub.Scalar",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.pow.Tensor_Scalar",
    "aten.pow.Tensor_Tensor",
    "aten.rsqrt.default",
    "aten.sqrt.default",
    "aten.neg.default",
    "aten.abs.default",
    "aten.exp.default",
    "aten.tanh.default",
    "aten.sigmoid.default",
    "aten.relu.default",
    "aten.gelu.default",
    "aten.silu.default",
    "aten.erf.default",
    "aten.dropout.default",
    "aten.native_dropout.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy.default",
    "aten.type_as.default",
    "aten.where.self",
    "aten.masked_fill.Scalar",
    "aten.clamp.default",
    "getitem",
}
#: reductions over the dimensions their ``dim`` argument names
_REDUCTIONS = {
    "aten.mean.dim",
    "aten.sum.dim_IntList",
    "aten.amax.default",
    "aten.var.correction",
    "aten.var_mean.correction",
}
#: normalisations over their trailing ``normalized_shape``
_NORMS = {
    "aten.layer_norm.default",
    "aten.native_layer_norm.default",
    "aten.rms_norm.default",
    "aten._fused_rms_norm.default",
}
#: a projection of a replicated weight between regions works position by position too
_PROJECTIONS = {"aten.linear.default"}


class SequenceRefused(Exception):
    """Why a graph cannot run sequence parallel (the operator that mixes positions)."""


@dataclass(frozen=True)
class SequenceSharding:
    """The values each tensor-parallel rank holds a slice of along :data:`SEQUENCE_DIM`, and
    the parameters the operators between regions read (their gradients summed over the
    tensor-parallel ranks)."""

    values: frozenset[str]
    parameters: tuple[str, ...]


def sequence_sharding(
    graph: Graph, sources: Collection[str], readers: Collection[str], degree: int
) -> SequenceSharding:
    """The sharding that starts at ``sources`` (the row projections and the embedding, whose
    outputs torch's styles reduce-scatter along the sequence) and ends at ``readers`` (the
    column projections and the head, whose input is gathered whole): everything in between
    must work position by position. Raises :class:`SequenceRefused` naming what does not."""
    for name in sources:
        meta = graph[name].tensor_meta
        if meta is None or len(meta.shape) < 3:
            raise SequenceRefused(f"{name} is not a [batch, sequence, ...] value")
        size = meta.shape[SEQUENCE_DIM]
        if meta.sizes and not meta.sizes[SEQUENCE_DIM].isdigit():
            raise SequenceRefused(
                f"the sequence ({name}'s dimension {SEQUENCE_DIM}) is a dynamic dimension "
                f"({meta.sizes[SEQUENCE_DIM]}), whose size generated code reads from values "
                "that would hold a slice of it"
            )
        if size % degree:
            raise SequenceRefused(
                f"the sequence ({size} positions at {name}) does not divide by {degree}"
            )
    sharded = _reached(graph, sources, set(readers))
    parameters: dict[str, None] = {}
    order = {node.name: i for i, node in enumerate(graph.nodes)}
    for name in sorted(sharded - set(sources), key=order.__getitem__):
        node = graph[name]
        if node.kind != "call":
            raise SequenceRefused(
                f"a value sliced along the sequence leaves the model as its output ({name})"
            )
        _check(graph, node, sharded)
        for ref in node.args:
            if isinstance(ref, Ref) and ref.name not in sharded:
                parameters.update(dict.fromkeys(_trained_leaves(graph, ref.name, sharded)))
    return SequenceSharding(frozenset(sharded), tuple(parameters))


def _reached(graph: Graph, sources: Collection[str], readers: set[str]) -> set[str]:
    """Every value computed from ``sources`` without passing a reader."""
    reached, pending = set(sources), list(sources)
    while pending:
        for user in graph.users(pending.pop()):
            if user not in reached and user not in readers:
                reached.add(user)
                pending.append(user)
    return reached


def _check(graph: Graph, node: Node, sharded: set[str]) -> None:
    """Refuse ``node`` unless it works position by position on its sliced operands."""
    target = node.target
    if target == "getitem":  # one of a sliced operator's outputs (checked with it)
        return
    out = node.tensor_meta
    if target in _NORMS and isinstance(node.meta, tuple):  # native_layer_norm: (out, mean, rstd)
        out = node.meta[0]
    first = next((a for a in node.args if isinstance(a, Ref) and a.name in sharded), None)
    if first is None:  # only a keyword operand is sliced: not one of ours
        raise SequenceRefused(f"{node.name} ({target}) reads a sliced value as a keyword")
    shape = _shape(graph, first.name)
    if target in _REDUCTIONS:
        dims = argument_value(node, "dim")
        if not dims:
            raise SequenceRefused(f"{node.name} ({target}) reduces every position together")
        if any(int(d) % len(shape) <= SEQUENCE_DIM for d in dims):
            raise SequenceRefused(f"{node.name} ({target}) reduces over the sequence")
    elif target in _NORMS:
        normalized = node.args[1] if len(node.args) > 1 else ()
        if len(normalized) > len(shape) - SEQUENCE_DIM - 1:
            raise SequenceRefused(f"{node.name} ({target}) normalises over the sequence")
    elif target not in _POINTWISE and target not in _PROJECTIONS:
        raise SequenceRefused(
            f"{node.name} ({target}) reads a value sliced along the sequence and is not known "
            "to work position by position"
        )
    if out is None or len(out.shape) != len(shape):
        raise SequenceRefused(f"{node.name} ({target}) moves the sequence dimension")
    operands = node.args[:1] if target in _PROJECTIONS else node.args  # not its weight, bias
    for ref in (a for a in operands if isinstance(a, Ref)):
        if ref.name in sharded:
            if len(_shape(graph, ref.name)) != len(shape):
                raise SequenceRefused(f"{node.name} ({target}) broadcasts a sliced value")
            continue
        meta = graph[ref.name].tensor_meta
        if meta is None:
            continue
        at = SEQUENCE_DIM - (len(shape) - len(meta.shape))
        if 0 <= at < len(meta.shape) and meta.shape[at] != 1:
            raise SequenceRefused(
                f"{node.name} ({target}) combines a value sliced along the sequence with "
                f"{ref.name} {list(meta.shape)}, whole along it"
            )


def _shape(graph: Graph, name: str) -> tuple[int, ...]:
    meta = graph[name].tensor_meta
    if meta is None:
        raise SequenceRefused(f"{name} is not one tensor")
    return meta.shape


def _trained_leaves(graph: Graph, name: str, sharded: set[str]) -> list[str]:
    """The trained parameters (first names) ``name`` is computed from, outside ``sharded``;
    refused where a model input that requires a gradient reaches it (each rank's gradient of
    it would be a partial sum nobody completes)."""
    found: list[str] = []
    seen, pending = {name}, [name]
    while pending:
        node = graph[pending.pop()]
        meta = node.tensor_meta
        if node.kind == "param":
            info = graph.param_of(node.target)
            if info.requires_grad:
                found.append(info.names[0])
            continue
        if node.kind == "input" and meta is not None and meta.requires_grad:
            raise SequenceRefused(
                f"{node.name}, a model input that requires a gradient, meets values sliced "
                "along the sequence"
            )
        for inner in node.inputs:
            if inner not in seen and inner not in sharded:
                seen.add(inner)
                pending.append(inner)
    return found
