"""Measured profiling: every unit run forward and backward on the local device.

Inputs are the unit's real inputs from one forward pass of the whole graph on the example
microbatch (the model's own weights when it has them). Each unit is warmed up, then timed several
times; the median is kept (CUDA events on GPU, ``time.perf_counter`` on CPU).
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from functools import partial
from typing import Any
from collections.abc import Callable

import torch

from ..control_flow import worst_branch
from ..graph import Graph, decode_tensor
from ..interpreter import run_nodes
from ..spec import Example
from .devices import DeviceSpec
from .profile import Profile, UnitCost, graph_digest
from ..tracing.units import UnitWorkload, unit_workloads
from .workload import output_bytes, parameter_bytes, run_forward_backward


def local_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def profile_measured(
    graph: Graph,
    spec: DeviceSpec,
    example: Example | None = None,
    *,
    warmup: int = 2,
    repeats: int = 5,
    device: torch.device | None = None,
) -> Profile:
    """Time every unit of ``graph`` on ``device`` (default: CUDA when present, else CPU)."""
    device = device or local_device()
    values = _example_values(graph, example, device)
    with torch.no_grad():
        run_nodes(graph.calls, values, device, graph.functions)
    costs = []
    for work in unit_workloads(graph):
        # a unit holding torch.cond costs as much as its more expensive branch (run inline)
        measure = partial(_measure, graph, work, values, device, warmup, repeats)
        costs.append(worst_branch(work.nodes, measure))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Profile("measured", spec, costs, graph_digest(graph), measured_on=name)


def _measure(
    graph: Graph,
    work: UnitWorkload,
    values: dict[str, Any],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> UnitCost:
    forward = _median_time(partial(_run, graph, work, values, device, "forward"), warmup, repeats)
    backward = _median_time(partial(_run, graph, work, values, device, "backward"), warmup, repeats)
    saved = _run(graph, work, values, device, timed=None)
    return UnitCost(
        forward,
        backward,
        activations=saved,
        outputs=output_bytes(graph, work),
        parameters=parameter_bytes(graph, work),
    )


class _Timer:
    """Collects the time spent inside it (synchronising CUDA around the region)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.elapsed = 0.0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.elapsed += time.perf_counter() - self.start


def _run(
    graph: Graph,
    work: UnitWorkload,
    values: dict[str, Any],
    device: torch.device,
    timed: str | None,
):
    timer = _Timer(device)

    def fresh(name: str) -> torch.Tensor:
        value = values[name]
        requires_grad = graph[name].tensor_meta.requires_grad
        if graph[name].kind == "param":
            requires_grad = graph.param_of(graph[name].target).requires_grad
        return value.detach().clone().requires_grad_(requires_grad and value.is_floating_point())

    forward_mode: Callable = (lambda: timer) if timed == "forward" else nullcontext
    backward_mode: Callable = (lambda: timer) if timed == "backward" else nullcontext
    saved = run_forward_backward(graph, work, fresh, device, forward_mode, backward_mode)
    return timer.elapsed if timed else saved


def _median_time(run: Callable[[], float], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(repeats))


def _example_values(graph: Graph, example: Example | None, device: torch.device) -> dict[str, Any]:
    """Real tensors for every placeholder: the example's inputs and weights where it has them."""
    state: dict[str, torch.Tensor] = {}
    bound: dict[str, Any] = {}
    if example is not None:
        model = example.model
        state = {k: v for k, v in model.state_dict(keep_vars=True).items() if not v.is_meta}
        state.update(
            {k: v for k, v in model.named_buffers(remove_duplicate=False) if not v.is_meta}
        )
        bound = dict(zip(graph.signature, example.args))
        bound.update(example.kwargs)
    generator = torch.Generator().manual_seed(0)
    values: dict[str, Any] = {}
    for node in graph.nodes:
        if not node.is_placeholder:
            continue
        meta = node.tensor_meta
        given = bound.get(node.name) if node.kind == "input" else state.get(node.target)
        if node.kind == "constant":
            tensor = decode_tensor(graph.constants[node.name])
        elif isinstance(given, torch.Tensor) and not given.is_meta:
            tensor = given.detach()
        elif meta.dtype.is_floating_point:
            tensor = torch.randn(meta.shape, generator=generator) * 0.02
        elif meta.dtype == torch.bool:
            tensor = torch.ones(meta.shape, dtype=torch.bool)
        else:
            high = graph.model.get("input_ranges", {}).get(node.name, 0)
            tensor = torch.randint(0, high + 1, meta.shape, generator=generator)
        values[node.name] = tensor.to(device=device, dtype=meta.dtype)
    return values
