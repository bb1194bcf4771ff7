"""Small hand-built graphs and profiles for unit tests of the IR, code emission and partitioners.

A graph here is a DAG of ATen calls, one unit per call, whose costs the test chooses: the optimum
of a partitioner on it can be worked out by hand.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from autopipe.ir import Graph, ModelFacts, Node, ParamInfo, Ref, TensorMeta, Unit
from autopipe.profiling import Profile, UnitCost, device_spec
from autopipe.profiling.devices import DeviceSpec
from autopipe.profiling.profile import graph_digest

#: a small value: 32 bytes cross a stage boundary in microseconds of even a slow link
SMALL = (2, 4)


def meta(shape: tuple[int, ...], requires_grad: bool = False, dtype=torch.float32) -> TensorMeta:
    """Metadata of a contiguous tensor."""
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return TensorMeta(tuple(shape), dtype, stride, requires_grad)


def dag_graph(
    reads: dict[str, list[str]],
    *,
    shapes: dict[str, tuple[int, ...]] | None = None,
    params: dict[str, tuple[int, ...]] | None = None,
) -> Graph:
    """A graph whose calls, in program order, are the keys of ``reads``; each reads the values
    listed (``"x"``, the model input, or earlier calls) and is a unit of its own. A call with a
    parameter in ``params`` (by call name: its shape) also reads parameter ``p_<call>``. Values
    are :data:`SMALL` unless ``shapes`` says otherwise; the outputs are the calls no call reads."""
    shapes = shapes or {}
    params = params or {}
    nodes = [Node("x", "input", meta=meta(SMALL))]
    param_infos: dict[str, ParamInfo] = {}
    for name, shape in params.items():
        param = f"p_{name}"
        nodes.append(Node(param, "param", param, meta=meta(shape, requires_grad=True)))
        param_infos[param] = ParamInfo((param,), shape, torch.float32, True, "Model")
    units = []
    for index, (name, sources) in enumerate(reads.items()):
        args = tuple(Ref(s) for s in sources)
        if name in params:
            target, args = "aten.mul.Tensor", (args[0], Ref(f"p_{name}"))
        elif len(args) == 1:
            target = "aten.tanh.default"
        else:
            target = "aten.add.Tensor"
        value = meta(shapes.get(name, SMALL), requires_grad=True)
        nodes.append(Node(name, "call", target, args, meta=value, unit=index))
        units.append(Unit(index, name, [name]))
    read = {s for sources in reads.values() for s in sources}
    return Graph(
        nodes,
        inputs=["x"],
        outputs=[name for name in reads if name not in read],
        signature=["x"],
        params=param_infos,
        buffers={},
        constants={},
        model=ModelFacts.from_json({"class": "Model"}, ""),
        units=units,
    )


def chain_graph(length: int, **options) -> Graph:
    """``u0 -> u1 -> ... -> u<length-1>``, reading ``x`` first."""
    reads = {f"u{i}": [f"u{i - 1}" if i else "x"] for i in range(length)}
    return dag_graph(reads, **options)


def device(memory: float = 80 * 2**30, link_bandwidth: float = 100e9) -> DeviceSpec:
    """An A100 with the given memory (bytes) and link bandwidth (bytes/s)."""
    return dataclasses.replace(device_spec("a100"), memory=memory, link_bandwidth=link_bandwidth)


def profile(
    graph: Graph,
    compute: list[float],
    *,
    activations: list[int] | None = None,
    spec: DeviceSpec | None = None,
) -> Profile:
    """A profile of ``graph`` with these seconds of compute per unit, half forward and half
    backward (so a stage whose transfers are faster costs exactly its units' sum), and these
    activation bytes (0 unless given)."""
    activations = activations or [0] * len(compute)
    units = [
        UnitCost(forward=c / 2, backward=c / 2, activations=a)
        for c, a in zip(compute, activations, strict=True)
    ]
    return Profile("analytic", spec or device(), units, graph_digest(graph))
