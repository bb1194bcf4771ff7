"""Analytic profiling: FLOPs and bytes on fake tensors, turned into time by a roofline.

Nothing is allocated and no weights are needed, so a model of any size profiles on a laptop.
Each operator costs ``max(flops / achievable FLOP/s, bytes / achievable bandwidth)`` plus a launch
overhead; views and queries of metadata (a tensor's device or size) launch no kernel and cost
nothing. FLOPs follow ``torch.utils.flop_counter.FlopCounterMode`` (two per multiply-add), forward
and backward, with the CPU's attention kernels counted as the GPU's (:mod:`.flops`).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from ..ir.cond import worst_branch
from ..ir import Graph
from ..ir.interpreter import empty_placeholder
from .devices import DeviceSpec
from .dropout import gpu_dropout
from .flops import flop_counter
from .operator_rates import operator_size
from .precision import AUTOCAST_DTYPE, autocast_dtypes, cuda_policy, unit_dtypes
from .profile import Profile, UnitCost, graph_digest
from ..ir.analysis import UnitWorkload, signature, unit_workloads
from ..runtime.core.fused_attention import fused_kernels
from .workload import output_bytes, parameter_bytes, run_forward_backward

#: Operators that read only the rows they gather, not their whole (table) input.
_GATHERS = {"embedding", "index", "gather", "index_select", "take", "_unsafe_index"}
#: Operators whose time a calibrated spec reads from its tables of that kind, by name
_KINDS = {
    name: "matmul"
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm")
} | {
    name: "attention"
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_cudnn_attention_backward",
    )
}
#: Operators that launch no kernel though their schema does not say they return a view
_NO_KERNEL = {torch.ops.aten._unsafe_view.default}


class RooflineMode(TorchDispatchMode):
    """Accumulates the roofline time, FLOPs and bytes of the operators dispatched inside it."""

    def __init__(self, spec: DeviceSpec, flop_counter: FlopCounterMode):
        super().__init__()
        self.spec = spec
        self.flop_counter = flop_counter
        self.time = 0.0
        self.flops = 0.0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.flop_counter.get_total_flops()
        out = func(*args, **(kwargs or {}))
        flops = self.flop_counter.get_total_flops() - before
        schema = func._schema
        if schema.returns and schema.returns[0].alias_info is not None and not schema.is_mutable:
            self.time += self.spec.view_overhead
            return out  # a view: no kernel, no traffic
        if func in _NO_KERNEL:
            self.time += self.spec.view_overhead
            return out
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outputs and not schema.is_mutable:
            self.time += self.spec.view_overhead
            return out  # a query of metadata (a tensor's device, a size): no kernel
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        written = sum(_nbytes(t) for t in outputs)
        read = sum(_nbytes(t) for t in inputs)
        if func._opname in _GATHERS:
            read = min(read, 2 * written)
        dtype = next((t.dtype for t in inputs if t.is_floating_point()), None)
        size, kind = operator_size(flops, outputs), _kind(func, args, kwargs)
        self.time += self.spec.operator_seconds(
            func._opname, dtype, size, read + written, flops, kind
        )
        self.flops += flops
        self.bytes += read + written
        return out


def _kind(func, args, kwargs) -> str | None:
    """The kind of table a calibrated spec times ``func`` by: matmul, attention or
    attention_backward, causal_ ones for an attention kernel called with ``is_causal`` (which
    skips the masked half); None for the rest."""
    kind = _KINDS.get(func._opname)
    if kind != "attention":
        return kind
    if func._opname.endswith("_backward"):
        kind = "attention_backward"
    names = [argument.name for argument in func._schema.arguments]
    if "is_causal" not in names:
        return kind
    index = names.index("is_causal")
    causal = (kwargs or {}).get("is_causal", args[index] if index < len(args) else False)
    return f"causal_{kind}" if causal else kind


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _counting(spec: DeviceSpec, sink: list[RooflineMode]):
    with flop_counter() as counter, RooflineMode(spec, counter) as roofline:
        yield
    sink.append(roofline)


def profile_analytic(graph: Graph, spec: DeviceSpec, bf16: bool = False) -> Profile:
    """Profile every unit of ``graph`` on fake tensors for the device ``spec``: on a GPU's,
    attention runs the fused kernel a GPU picks (its time, and the log-sum-exp it keeps for the
    backward), not the CPU's choice (the math path, which keeps the probabilities, where it
    drops some out), and dropout a GPU's fused kernel (a boolean mask, :mod:`.dropout`).
    ``bf16``: as train.py's ``--bf16`` runs it (:mod:`.precision`)."""
    device = torch.device("cpu")
    costs = []
    known: dict[str, UnitCost] = {}  # structurally identical units (repeated layers) cost the same
    fakes = FakeTensorMode(allow_non_fake_inputs=True)
    with contextlib.ExitStack() as kernels:
        if spec.device_type == "cuda":
            kernels.enter_context(fused_kernels("cpu"))
            kernels.enter_context(gpu_dropout())  # a boolean mask, not the CPU's
            if bf16:  # autocast casting as CUDA's does
                kernels.enter_context(cuda_policy())
            # fake tensors' cache of operator outputs answers a fused kernel's repeated call
            # with storages of other sizes than its first call's (a few bytes): without it, a
            # profile is the same whatever ran before it in the process
            fakes.cache_enabled = False
        dtypes = autocast_dtypes(graph, device) if bf16 else None
        with fakes:
            for work in unit_workloads(graph):
                key = signature(graph, work) + unit_dtypes(work.inputs, dtypes or {})
                if key in known:
                    costs.append(known[key])
                    continue
                # a unit holding torch.cond costs as much as its more expensive branch
                cost = partial(_unit_cost, graph, work, spec, device, dtypes)
                costs.append(worst_branch(work.nodes, cost))
                known[key] = costs[-1]
    return Profile(
        "analytic", spec, costs, graph_digest(graph), bf16=bf16, autocast_dtypes=dtypes or {}
    )


def _unit_cost(
    graph: Graph,
    work: UnitWorkload,
    spec: DeviceSpec,
    device: torch.device,
    dtypes: dict[str, torch.dtype] | None = None,
) -> UnitCost:
    """One unit run forward and backward on fake tensors under the roofline; ``dtypes`` (None:
    the model's precision) the dtypes of the values under bf16 autocast that differ from the
    traced ones, the unit's forward then run under it."""
    forward: list[RooflineMode] = []
    backward: list[RooflineMode] = []
    changed = dtypes or {}
    memory = run_forward_backward(
        graph,
        work,
        lambda name: empty_placeholder(graph, graph[name], device, changed.get(name)),
        device,
        partial(_counting, spec, forward),
        partial(_counting, spec, backward),
        bf16=dtypes is not None,
        time_casts=partial(_cast_time, spec),
    )
    fwd = forward[0]
    bwd = backward[0] if backward else None
    return UnitCost(
        forward=fwd.time,
        backward=bwd.time if bwd else 0.0,
        flops_forward=fwd.flops,
        flops_backward=bwd.flops if bwd else 0.0,
        bytes_forward=fwd.bytes,
        bytes_backward=bwd.bytes if bwd else 0,
        activations=memory.saved,
        temporaries=memory.temporaries,
        backward_memory=memory.backward,
        saved_values=list(memory.saved_values),
        outputs=output_bytes(graph, work),
        parameters=parameter_bytes(graph, work),
        cast_parameters=memory.cast_parameters,
        cast_time=memory.cast_time,
    )


def _cast_time(spec: DeviceSpec, parameters: list[torch.Tensor]) -> float:
    """The roofline time of casting ``parameters`` (fake tensors) to bf16, each copy timed as
    the forward timed autocast's."""
    sink: list[RooflineMode] = []
    with torch.no_grad(), _counting(spec, sink):
        for parameter in parameters:
            torch.ops.aten._to_copy.default(parameter, dtype=AUTOCAST_DTYPE)
    return sink[0].time
