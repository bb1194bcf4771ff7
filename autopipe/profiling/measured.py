"""Measured profiling: every unit run forward and backward on the local device.

Inputs are the unit's real inputs from one forward pass of the whole graph on the example
microbatch (the model's own weights when it has them). Units run with the intra-op threads a
rank will have (on CPU one, as torchrun gives each rank); repetitions are interleaved (round r
times every unit once), so a slow moment of a busy machine spreads over all units instead of
inflating one, and each unit keeps the median of its rounds.

Two ways of timing (``in_step``). *Unit by unit* (the CPU's default): each unit runs alone,
forward then backward, timed around its pass. *In the step* (the GPU's default): each round
runs the whole graph forward, unit after unit, and its whole backward, as a training step
does, and marks the time where each unit's forward ends and where each unit's backward starts
(a hook on its outputs' gradients), with CUDA events on a GPU: nothing synchronises between
units, so a unit's time is what it adds to a real step, its kernels overlapping the launches
of the next ones (timing a unit alone between two synchronisations charges every launch to
it: 3.6x the step on an H200 for a 0.2 B Llama, README "On one GPU"). A unit's backward runs
from its start to the next unit's start (or the end of the backward); a unit whose outputs
take no gradient adds its backward, if any, to the unit before it in time.
"""

from __future__ import annotations

import platform
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..ir.cond import forced_branch, has_cond, worst_branch
from ..ir import Graph
from ..ir.codec import decode_tensor
from ..ir.interpreter import run_nodes
from ..spec import Example
from .devices import DeviceSpec
from .flops import flop_counter
from .precision import AUTOCAST_DTYPE, autocast, changed_dtypes
from .profile import Profile, UnitCost, graph_digest
from ..ir.analysis import UnitWorkload, unit_workloads
from .rank_conditions import as_a_rank_runs
from .workload import output_bytes, parameter_bytes, run_forward_backward


def local_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def profile_measured(
    graph: Graph,
    spec: DeviceSpec,
    example: Example | None = None,
    *,
    warmup: int = 2,
    repeats: int = 7,
    device: torch.device | None = None,
    threads: int | None = None,
    in_step: bool | None = None,
    bf16: bool = False,
) -> Profile:
    """Time every unit of ``graph`` on ``device`` (default: CUDA when present, else CPU) with
    ``threads`` intra-op threads (default on CPU: 1, what each torchrun rank runs with),
    ``in_step`` (default: on a GPU) or unit by unit (see the module's text); ``bf16``: the
    forwards under bf16 autocast, as train.py's ``--bf16`` runs them (:mod:`.precision`)."""
    device = device or local_device()
    if bf16 and device.type != spec.device_type:
        warnings.warn(
            f"--profile measured --bf16 on {device.type} for {spec.name} ({spec.device_type}): "
            f"autocast casts as on {device.type}, which keeps other operators in fp32 than "
            f"{spec.device_type} does (its memory differs); the analytic profile casts as "
            f"{spec.device_type} does",
            stacklevel=2,
        )
    threads = threads or (1 if device.type == "cpu" else torch.get_num_threads())
    in_step = device.type == "cuda" if in_step is None else in_step
    with as_a_rank_runs(device, threads):
        values = _example_values(graph, example, device)
        with torch.no_grad(), autocast(device.type, bf16):
            run_nodes(graph.calls, values, device, graph.functions)
        works = unit_workloads(graph)
        rounds = (
            _in_step_rounds(graph, works, values, device, warmup, repeats, bf16)
            if in_step
            else None
        )
        if rounds is None:
            samples = [partial(_sample, graph, work, values, device, bf16) for work in works]
            for _ in range(warmup):
                for work, sample in zip(works, samples):
                    worst_branch(work.nodes, sample)
            rounds = [
                [worst_branch(work.nodes, sample) for work, sample in zip(works, samples)]
                for _ in range(repeats)
            ]
        costs = []
        for i, work in enumerate(works):
            counted = worst_branch(
                work.nodes, partial(_footprint, graph, work, values, device, bf16)
            )
            forward = statistics.median(r[i].forward for r in rounds)
            costs.append(
                UnitCost(
                    forward,
                    statistics.median(r[i].backward for r in rounds),
                    flops_forward=counted.flops_forward,
                    flops_backward=counted.flops_backward,
                    activations=counted.saved,
                    temporaries=counted.temporaries,
                    backward_memory=counted.backward,
                    saved_values=list(counted.saved_values),
                    outputs=output_bytes(graph, work),
                    parameters=parameter_bytes(graph, work),
                    cast_parameters=counted.cast_parameters,
                    cast_time=min(counted.cast_time, forward),  # timed apart: noisy
                )
            )
    return Profile(
        "measured",
        spec,
        costs,
        graph_digest(graph),
        measured_on=machine(device, threads),
        bf16=bf16,
        autocast_dtypes=changed_dtypes(graph, values) if bf16 else {},
    )


def machine(device: torch.device, threads: int) -> str:
    """The device a profile was measured on, in words: ``cpu (x86_64, 1 thread)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    plural = "" if threads == 1 else "s"
    return f"cpu ({platform.processor() or platform.machine()}, {threads} thread{plural})"


@dataclass
class _Sample:
    """One timing of a unit (a dataclass, so that worst_branch compares field by field)."""

    forward: float
    backward: float


def _sample(
    graph: Graph, work: UnitWorkload, values: dict[str, Any], device: torch.device, bf16: bool
) -> _Sample:
    return _Sample(
        _run(graph, work, values, device, "forward", bf16),
        _run(graph, work, values, device, "backward", bf16),
    )


class _Clock:
    """Marks points in time without synchronising: CUDA events recorded on the current stream
    on a GPU, ``perf_counter`` on a CPU; :meth:`seconds` reads them (after one
    synchronisation)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, marks: list[Any]) -> list[float]:
        """Each mark's time after the first, in seconds."""
        if self.device.type != "cuda":
            return [m - marks[0] for m in marks]
        torch.cuda.synchronize(self.device)
        return [marks[0].elapsed_time(m) / 1e3 for m in marks]


def _in_step_rounds(
    graph: Graph,
    works: list[UnitWorkload],
    values: dict[str, Any],
    device: torch.device,
    warmup: int,
    repeats: int,
    bf16: bool,
) -> list[list[_Sample]] | None:
    """``repeats`` rounds timed in the step (after ``warmup``), each unit holding a cond at
    the larger of its times with every cond taking either branch; None where the whole step
    does not fit the GPU (it holds every activation of the microbatch at once, where timing
    units alone holds one unit's: those are timed alone then, as a warning says)."""

    def one_round() -> list[_Sample]:
        if not has_cond(graph.calls):
            return _step_round(graph, works, values, device, bf16)
        with forced_branch(True):
            taken = _step_round(graph, works, values, device, bf16)
        with forced_branch(False):
            other = _step_round(graph, works, values, device, bf16)
        return [
            _Sample(max(a.forward, b.forward), max(a.backward, b.backward))
            for a, b in zip(taken, other)
        ]

    try:
        for _ in range(warmup):
            one_round()
        return [one_round() for _ in range(repeats)]
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        warnings.warn(
            "--profile measured: a whole forward and backward of the example does not fit "
            f"{machine(device, 1)}; its units are timed one by one instead (each alone between "
            "two synchronisations: slower than in a step)",
            stacklevel=3,
        )
        return None


def _step_round(
    graph: Graph,
    works: list[UnitWorkload],
    values: dict[str, Any],
    device: torch.device,
    bf16: bool,
) -> list[_Sample]:
    """One forward and backward of the whole graph, each unit's forward and backward timed
    where it runs in them (see the module's text)."""
    fresh = _fresh(graph, values)
    env: dict[str, Any] = {}
    for node in graph.nodes:
        if node.is_placeholder:
            value = fresh(node.name)
            # a leaf that takes a gradient is cloned, so in-place operators stay legal on it
            leaf_ok = node.kind == "param" or not value.requires_grad
            env[node.name] = value if leaf_ok else value.clone()
    clock = _Clock(device)
    forward_marks = [clock.mark()]
    with autocast(device.type, bf16):
        for work in works:
            run_nodes(work.nodes, env, device, graph.functions)
            forward_marks.append(clock.mark())
    started: dict[int, Any] = {}  # unit -> when its outputs' gradients were all in (the last)

    def starts(unit: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            started[unit] = clock.mark()

        return hook

    for index, work in enumerate(works):
        for name in work.outputs:
            value = env[name]
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.register_hook(starts(index))
    outputs = [
        env[name]
        for name in graph.outputs
        if isinstance(env.get(name), torch.Tensor) and env[name].requires_grad
    ]
    begin = clock.mark()
    if outputs:
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    end = clock.mark()
    forward = clock.seconds(forward_marks)
    units = sorted(started)
    times = clock.seconds([begin, *(started[u] for u in units), end])[1:]
    order = sorted(range(len(units)), key=lambda i: times[i])  # the units in backward order
    backward = [0.0] * len(works)
    finish = times[-1]
    for position, i in enumerate(order):
        after = times[order[position + 1]] if position + 1 < len(order) else finish
        backward[units[i]] = max(after - times[i], 0.0)
    return [_Sample(forward[u + 1] - forward[u], backward[u]) for u in range(len(works))]


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


@dataclass
class _Footprint:
    """A unit's FLOPs and memory, counted on one untimed run."""

    flops_forward: float
    flops_backward: float
    saved: int
    temporaries: int
    backward: int
    saved_values: tuple[int, ...]
    cast_parameters: int
    cast_time: float


def _footprint(
    graph: Graph, work: UnitWorkload, values: dict[str, Any], device: torch.device, bf16: bool
) -> _Footprint:
    forward, backward = flop_counter(), flop_counter()
    memory = run_forward_backward(
        graph,
        work,
        _fresh(graph, values),
        device,
        lambda: forward,
        lambda: backward,
        bf16=bf16,
        time_casts=partial(_cast_seconds, device),
    )
    return _Footprint(
        forward.get_total_flops(),
        backward.get_total_flops(),
        memory.saved,
        memory.temporaries,
        memory.backward,
        memory.saved_values,
        memory.cast_parameters,
        memory.cast_time,
    )


def _cast_seconds(device: torch.device, parameters: list[torch.Tensor], repeats: int = 5) -> float:
    """Seconds casting ``parameters`` to bf16 takes (as autocast copies them in a forward): the
    median of ``repeats`` rounds after one untimed, marked as a step's units are (no
    synchronisation between them)."""
    if not parameters:
        return 0.0
    clock = _Clock(device)
    with torch.no_grad():
        for parameter in parameters:
            parameter.to(AUTOCAST_DTYPE)
        marks = [clock.mark()]
        for _ in range(repeats):
            for parameter in parameters:
                parameter.to(AUTOCAST_DTYPE)
            marks.append(clock.mark())
    times = clock.seconds(marks)
    return statistics.median(later - earlier for earlier, later in zip(times, times[1:]))


def _run(
    graph: Graph,
    work: UnitWorkload,
    values: dict[str, Any],
    device: torch.device,
    timed: str,
    bf16: bool,
) -> float:
    """Seconds the unit's ``timed`` pass ("forward" or "backward") takes."""
    timer = _Timer(device)
    forward_mode: Callable = (lambda: timer) if timed == "forward" else nullcontext
    backward_mode: Callable = (lambda: timer) if timed == "backward" else nullcontext
    run_forward_backward(
        graph, work, _fresh(graph, values), device, forward_mode, backward_mode, bf16=bf16
    )
    return timer.elapsed


def _fresh(graph: Graph, values: dict[str, Any]) -> Callable[[str], torch.Tensor]:
    """A new leaf for each placeholder of a unit run, from the example's values."""

    def fresh(name: str) -> torch.Tensor:
        value = values[name]
        meta = graph[name].tensor_meta
        assert meta is not None  # a placeholder or a value handed between units: a tensor
        requires_grad = meta.requires_grad
        if graph[name].kind == "param":
            requires_grad = graph.param_of(graph[name].target).requires_grad
        return value.detach().clone().requires_grad_(requires_grad and value.is_floating_point())

    return fresh


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
        assert meta is not None  # lint: a placeholder has tensor metadata
        given = bound.get(node.name) if node.kind == "input" else state.get(node.target)
        if node.kind == "constant":
            tensor = decode_tensor(graph.constants[node.name])
        elif (
            isinstance(given, torch.Tensor)
            and not given.is_meta
            and tuple(given.shape) == meta.shape  # dynamic dimensions: planned at other sizes
        ):
            tensor = given.detach()
        elif meta.dtype.is_floating_point:
            tensor = torch.randn(meta.shape, generator=generator) * 0.02
        elif meta.dtype == torch.bool:
            tensor = torch.ones(meta.shape, dtype=torch.bool)
        else:
            high = graph.model.input_ranges.get(node.name, 0)
            tensor = torch.randint(0, high + 1, meta.shape, generator=generator)
        values[node.name] = tensor.to(device=device, dtype=meta.dtype)
    return values
