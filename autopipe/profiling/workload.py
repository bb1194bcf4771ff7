"""One unit as a runnable workload: its inputs, the state it reads, and its outputs."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph import Graph
from ..interpreter import run_nodes
from ..tracing.units import UnitWorkload


def run_forward_backward(
    graph: Graph,
    work: UnitWorkload,
    make_value: Callable[[str], torch.Tensor],
    device: torch.device,
    forward_mode: Callable[[], Any],
    backward_mode: Callable[[], Any],
) -> int:
    """Run a unit forward (inside ``forward_mode()``) and backward (inside ``backward_mode()``).

    ``make_value(name)`` gives a fresh tensor for each input and state placeholder. Returns the
    bytes autograd saved for backward, storages counted once, parameters not counted.
    """
    env: dict[str, Any] = {}
    leaves: list[torch.Tensor] = []
    for name in work.inputs + work.state:
        value = make_value(name)
        if value.requires_grad:
            leaves.append(value)
            value = (
                value.clone() if graph[name].kind != "param" else value
            )  # in-place ops stay legal
        env[name] = value
    params = {
        StorageWeakRef(env[n].untyped_storage()) for n in work.state if graph[n].kind == "param"
    }
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(tensor.untyped_storage())
        if ref not in params:
            saved[ref] = tensor.untyped_storage().nbytes()
        return tensor

    with forward_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_nodes(work.nodes, env, device, graph.functions)
    outputs = [
        env[n] for n in work.outputs if isinstance(env[n], torch.Tensor) and env[n].requires_grad
    ]
    wrt = [leaf for leaf in leaves if leaf.requires_grad]
    if outputs and wrt:
        grads = [torch.ones_like(o) for o in outputs]
        with backward_mode():
            torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    return sum(saved.values())


def output_bytes(graph: Graph, work: UnitWorkload) -> int:
    return sum(graph.value_bytes(n) for n in work.outputs)


def parameter_bytes(graph: Graph, work: UnitWorkload) -> int:
    """Bytes of the distinct parameters a unit reads."""
    params = {
        graph.param_of(graph[n].target).names[0] for n in work.state if graph[n].kind == "param"
    }
    return sum(graph.params[name].nbytes for name in params)
