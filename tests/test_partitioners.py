"""Properties every partitioner keeps, on random DAGs (hypothesis)."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopipe.ir import Graph, ModelFacts, Node, Ref, TensorMeta, Unit
from autopipe.ir.ordering import order_edges
from autopipe.partitioning import METHODS, partition
from autopipe.profiling import Profile, UnitCost, device_spec
from autopipe.profiling.profile import graph_digest


def random_graph(seed: int, size: int, fan_in: int, inplace: float) -> Graph:
    """A random DAG of ATen operators, one unit each: long skips, fan-out, and in-place writes
    (``relu_`` on a value other operators also read, which adds write-order edges)."""
    rng = random.Random(seed)
    width = rng.choice([4, 16, 64])
    meta = TensorMeta((2, width), torch.float32, (width, 1), True)
    nodes = [Node("x", "input", meta=TensorMeta((2, width), torch.float32, (width, 1), False))]
    values = ["x"]
    for i in range(size):
        k = min(len(values), rng.randint(1, fan_in))
        sources = sorted(rng.sample(values, k), key=values.index)
        name = f"n{i}"
        if len(sources) >= 2:
            node = Node(
                name, "call", "aten.add.Tensor", (Ref(sources[0]), Ref(sources[1])), meta=meta
            )
        elif rng.random() < inplace and sources[0] != "x":
            node = Node(name, "call", "aten.relu_.default", (Ref(sources[0]),), meta=meta)
        else:
            node = Node(name, "call", "aten.tanh.default", (Ref(sources[0]),), meta=meta)
        node.unit = i
        nodes.append(node)
        values.append(name)
    readers = {r.name for n in nodes for r in n.args}
    outputs = [n.name for n in nodes[1:] if n.name not in readers] or [nodes[-1].name]
    return Graph(
        nodes,
        inputs=["x"],
        outputs=outputs,
        signature=["x"],
        params={},
        buffers={},
        constants={},
        model=ModelFacts.from_json({"class": "Random"}, ""),
        units=[Unit(i, f"n{i}", [f"n{i}"]) for i in range(size)],
    )


def random_profile(graph: Graph, seed: int) -> Profile:
    rng = random.Random(seed)
    units = [
        UnitCost(rng.uniform(0, 2), rng.uniform(0, 4), activations=rng.randint(0, 1 << 20))
        for _ in graph.units
    ]
    return Profile("analytic", device_spec("a100"), units, graph_digest(graph))


graphs = st.builds(
    random_graph,
    seed=st.integers(0, 10_000),
    size=st.integers(4, 40),
    fan_in=st.integers(1, 3),
    inplace=st.sampled_from([0.0, 0.3]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    graph=graphs, seed=st.integers(0, 100), method=st.sampled_from(sorted(METHODS)), data=st.data()
)
def test_partitions_are_complete_acyclic_and_exact(graph, seed, method, data):
    stages = data.draw(st.integers(1, min(6, len(graph.units))))
    devices = data.draw(st.integers(1, stages))
    part = partition(graph, random_profile(graph, seed), stages, num_devices=devices, method=method)
    assert len(part.stage_of_unit) == len(graph.units)  # every unit (hence node) assigned
    assert sorted(set(part.stage_of_unit)) == list(range(stages))  # exactly `stages`, none empty
    assert len(part.device_of_stage) == stages
    assert sorted(set(part.device_of_stage)) == list(range(devices))  # every device has work
    stage_of = {
        n: part.stage_of_unit[graph[n].unit] for n in graph.dag.nodes if graph[n].kind == "call"
    }
    for u, v in graph.dag.edges:  # data edges never point to an earlier stage
        if u in stage_of:
            assert stage_of[u] <= stage_of[v]
    for before, after in order_edges(graph):  # nor do write-order edges
        assert stage_of[before] <= stage_of[after]
    assert part.predicted.bottleneck >= part.predicted.lower_bound * (1 - 1e-9)


@settings(max_examples=15, deadline=None)
@given(graph=graphs, seed=st.integers(0, 100), method=st.sampled_from(sorted(METHODS)))
def test_partitioners_are_deterministic(graph, seed, method):
    stages = min(3, len(graph.units))
    runs = [
        partition(graph, random_profile(graph, seed), stages, method=method).to_json()
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_inplace_order_edges_in_random_graph():
    graph = random_graph(seed=3, size=30, fan_in=2, inplace=0.5)
    assert order_edges(graph), "the generator should produce write-order edges"


@settings(max_examples=20, deadline=None)
@given(graph=graphs, seed=st.integers(0, 100))
def test_refinement_never_worse_than_its_start(graph, seed):
    """acyclic refines the contiguous optimum, keeping only improvements of the busiest device;
    mpipe keeps the fastest simulated step among candidates that include that optimum."""
    profile = random_profile(graph, seed)
    stages = min(4, len(graph.units))
    dp = partition(graph, profile, stages, method="dp").predicted
    acyclic = partition(graph, profile, stages, method="acyclic").predicted
    mpipe = partition(graph, profile, stages, method="mpipe").predicted
    assert acyclic.bottleneck <= dp.bottleneck * (1 + 1e-9)
    assert mpipe.step_time <= dp.step_time * (1 + 1e-9)
