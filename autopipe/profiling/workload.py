"""One unit as a runnable workload: its inputs, the state it reads, and its outputs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..ir import Graph
from ..ir.interpreter import run_nodes
from ..runtime.core.memory import LiveTensorBytes
from ..ir.analysis import UnitWorkload
from .precision import ParameterCasts, autocast


@dataclass
class UnitMemory:
    """Bytes one unit holds for one microbatch (a dataclass of numbers: ``worst_branch`` takes
    the larger field by field)."""

    saved: int  # what autograd saves for backward (storages once, parameters not)
    temporaries: int  # what its forward creates and autograd does not save
    backward: int  # the most its backward holds at once: gradients and their temporaries
    #: which of its inputs and outputs (positions in ``inputs + outputs``) it saves: another
    #: unit of the stage may save the same tensor, which the cost model then counts once
    saved_values: tuple[int, ...] = ()
    #: of ``saved``, the bf16 copies autocast made of its parameters (``bf16`` runs)
    cast_parameters: int = 0
    #: seconds its forward spends making those copies (``time_casts`` of the run)
    cast_time: float = 0.0


def run_forward_backward(
    graph: Graph,
    work: UnitWorkload,
    make_value: Callable[[str], torch.Tensor],
    device: torch.device,
    forward_mode: Callable[[], Any],
    backward_mode: Callable[[], Any],
    *,
    bf16: bool = False,
    time_casts: Callable[[list[torch.Tensor]], float] | None = None,
) -> UnitMemory:
    """Run a unit forward (inside ``forward_mode()``; with ``bf16``, under bf16 autocast as
    train.py's ``--bf16`` runs a stage) and backward (inside ``backward_mode()``).
    ``time_casts(parameters)``, with ``bf16``: the seconds casting those parameters to bf16
    takes (the copies autocast made in the forward), in ``cast_time``.

    ``make_value(name)`` gives a fresh tensor for each input and state placeholder. Returns what
    it holds: the bytes autograd saved for backward (storages counted once, parameters not),
    the other storages its forward created (the generated code keeps them until the stage or
    block forward returns), and the most bytes alive at once in its backward.
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
    params = {_storage(env[n]) for n in work.state if graph[n].kind == "param"}
    saved: dict[StorageWeakRef, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ref = _storage(tensor)
        if ref not in params:
            saved[ref] = tensor.untyped_storage().nbytes()
        return tensor

    existing = {_storage(v) for v in [*env.values(), *leaves]}
    casts = ParameterCasts(params) if bf16 else None
    with (
        forward_mode(),
        autocast(device.type, bf16),
        casts if casts is not None else contextlib.nullcontext(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        run_nodes(work.nodes, env, device, graph.functions)
    cast = sum(n for ref, n in saved.items() if casts is not None and ref in casts.casts)
    cast_time = time_casts(casts.sources) if casts is not None and time_casts else 0.0
    # the values the generated code names (its locals), other than what autograd saves and
    # what it hands to other units (which those save, or count as their inputs)
    held = {_storage(v): v.untyped_storage().nbytes() for v in env.values() if _is_tensor(v)}
    handed = {_storage(env[n]) for n in work.outputs if _is_tensor(env[n])}
    not_temporary = existing | set(saved) | handed
    temporaries = sum(n for ref, n in held.items() if ref not in not_temporary)
    outputs = [
        env[n] for n in work.outputs if isinstance(env[n], torch.Tensor) and env[n].requires_grad
    ]
    wrt = [leaf for leaf in leaves if leaf.requires_grad]
    gradients = LiveTensorBytes(existing | set(held) | set(saved))
    if outputs and wrt:
        with gradients:
            # the gradients of the outputs come from later units: held, not made, by this
            # unit's backward (counted in its memory, not in its time or FLOPs)
            grads = [torch.ones_like(o) for o in outputs]
            with backward_mode():
                torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    shared = tuple(
        i
        for i, n in enumerate((*work.inputs, *work.outputs))
        if _is_tensor(env[n]) and _storage(env[n]) in saved
    )
    return UnitMemory(sum(saved.values()), temporaries, gradients.peak, shared, cast, cast_time)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def output_bytes(graph: Graph, work: UnitWorkload) -> int:
    return sum(graph.value_bytes(n) for n in work.outputs)


def parameter_bytes(graph: Graph, work: UnitWorkload) -> int:
    """Bytes of the distinct parameters a unit reads."""
    params = {
        graph.param_of(graph[n].target).names[0] for n in work.state if graph[n].kind == "param"
    }
    return sum(graph.params[name].nbytes for name in params)
