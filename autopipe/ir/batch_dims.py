"""The dimension that holds the batch in each of a model's inputs (``pipeline.json``'s
``batch_dims``): dimension 0, unless the trace shows another or ``--batch-dims`` gives it.

The trace shows it where an input goes straight into a torch RNN (``nn.LSTM``, ``nn.GRU``,
``nn.RNN``; traced into its ATen operator, or kept whole): as the RNN's sequence, the batch is
along dimension 1 unless the RNN is ``batch_first``; as its initial state (``h0``, an LSTM's
``c0``), along dimension 1 always. An input the model transforms before an RNN reads it, or one
no RNN reads, is not looked into: ``--batch-dims NAME=DIM`` gives its dimension, and overrides
what the trace shows. A loss's target holds its batch along dimension 0 (torch's schedules split
it so).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import AutopipeError
from .graph import Graph
from .kept_module import specs_of
from .types import MODULE_TARGET, Node, Ref

__all__ = ["RNN_OPERATORS", "batch_dims_of", "found_batch_dims"]

#: the ATen operators a torch RNN over a tensor traces into; each takes (input, hx, params,
#: has_biases, num_layers, dropout, train, bidirectional, batch_first)
RNN_OPERATORS = frozenset(
    {"aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input", "aten.rnn_relu.input"}
)
#: where an RNN operator's ``batch_first`` argument is
_BATCH_FIRST = 8


def _rnn_operands(node: Node) -> Iterator[tuple[Any, int]]:
    """The tensors an RNN call ``node`` reads whose batch dimension its layout fixes, each with
    that dimension (read when the tensor has 3 dimensions: a batched call's)."""
    if node.target in RNN_OPERATORS:
        batch_first = (
            node.args[_BATCH_FIRST]
            if len(node.args) > _BATCH_FIRST
            else node.kwargs.get("batch_first", False)
        )
        yield node.args[0], 0 if batch_first else 1
        hidden = node.args[1]
        for state in hidden if isinstance(hidden, (list, tuple)) else [hidden]:
            yield state, 1
    elif node.target == MODULE_TARGET:
        spec, call = specs_of(node.args[0], node.args[1], node.args[2])
        tensors = list(node.args[3])[: call.tensors]
        if call.form == "rnn":
            yield tensors[0], 0 if dict(spec.args).get("batch_first", False) else 1
            hidden = tensors[1:]
        elif call.form == "packed":
            yield tensors[0], 0 if call.batch_first else 1
            hidden = tensors[2 + int(call.sorted_indices) :]
        else:
            hidden = []
        for state in hidden:
            yield state, 1


def found_batch_dims(graph: Graph) -> dict[str, int]:
    """The batch dimension of each input of ``graph`` that goes straight into an RNN, by name
    (see the module docstring); an input two RNNs read in different layouts is refused."""
    found: dict[str, dict[int, str]] = {}
    inputs = set(graph.inputs)
    for node in graph.nodes:
        for operand, dim in _rnn_operands(node):
            if not (isinstance(operand, Ref) and operand.name in inputs):
                continue
            meta = graph[operand.name].tensor_meta
            if meta is not None and len(meta.shape) == 3:
                found.setdefault(operand.name, {}).setdefault(dim, node.name)
    for name, dims in found.items():
        if len(dims) > 1:
            shown = ", ".join(f"dimension {d} for {n}" for d, n in sorted(dims.items()))
            raise AutopipeError(
                f"input {name!r} goes into RNNs that hold its batch along different dimensions "
                f"({shown}); give the one that holds the batch with --batch-dims {name}=DIM"
            )
    return {name: next(iter(dims)) for name, dims in found.items()}


def batch_dims_of(graph: Graph, given: Mapping[str, int]) -> dict[str, int]:
    """The batch dimensions ``graph``'s inputs record: those the trace shows
    (:func:`found_batch_dims`), overridden and extended by ``given`` (``--batch-dims``), each
    checked to name a tensor input of the model and one of its dimensions; dimension 0 is left
    out (every input not named holds its batch there)."""
    for name, dim in given.items():
        flag = f"--batch-dims {name}={dim}"
        if name not in graph.inputs:
            target = (
                "; a --loss target holds its batch along dimension 0 (torch's schedules split "
                "it so): give the target batch first"
                if name == "target"
                else ""
            )
            raise AutopipeError(
                f"{flag}: the model has no tensor input {name!r} (its tensor inputs: "
                f"{', '.join(graph.inputs) or 'none'}); name one of those{target}"
            )
        meta = graph[name].tensor_meta
        shape = list(meta.shape) if meta is not None else []
        if dim >= len(shape):
            raise AutopipeError(
                f"{flag}: input {name!r} has {len(shape)} dimension(s) (shape {shape} in the "
                f"example); give a dimension from 0 to {len(shape) - 1}"
                if shape
                else f"{flag}: input {name!r} has no dimension (a scalar) to hold the batch; "
                "leave it out"
            )
    dims = found_batch_dims(graph) | dict(given)
    return {name: dims[name] for name in graph.inputs if dims.get(name)}
