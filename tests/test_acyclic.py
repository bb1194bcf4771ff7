"""autopipe/partitioning/acyclic.py: multilevel refinement of acyclic partitions, on hand-built
DAGs (independent branches, a diamond, skip connections)."""

from __future__ import annotations

import pytest

from autopipe.partitioning import CostModel, partition
from autopipe.partitioning.acyclic import coarsen_levels, solve_acyclic
from autopipe.partitioning.dp import solve_contiguous
from autopipe.partitioning.refine import Assignment

from graphs import chain_graph, dag_graph, profile


def model_of(reads: dict[str, list[str]], compute: list[float]) -> CostModel:
    graph = dag_graph(reads)
    return CostModel(graph, profile(graph, compute))


def assert_valid(model: CostModel, stage_of_unit: list[int], stages: int) -> None:
    """Every unit in one of exactly ``stages`` non-empty stages; no edge points backwards."""
    assert len(stage_of_unit) == model.num_units
    assert sorted(set(stage_of_unit)) == list(range(stages))
    for u, v in model.dag.edges:
        assert stage_of_unit[u] <= stage_of_unit[v], (u, v)


def test_non_contiguous_stages_beat_every_contiguous_cut():
    """a -> c, and b apart, in program order a (1), b (2), c (1): every contiguous cut leaves 3
    in one stage; {a, c} | {b} reaches the lower bound 2 and keeps a -> c inside a stage."""
    model = model_of({"a": ["x"], "b": ["x"], "c": ["a"]}, [1, 2, 1])
    assert model.evaluate(solve_contiguous(model, 2)).bottleneck == 3.0
    stage_of_unit, devices = solve_acyclic(model, 2, 2)
    assert stage_of_unit in ([0, 1, 0], [1, 0, 1])
    assert devices == [0, 1]
    assert model.evaluate(stage_of_unit).bottleneck == model.lower_bound(2) == 2.0


def test_a_chain_stays_contiguous():
    """In a -> b -> c every acyclic partition is a contiguous cut: {a, c} | {b} would be the
    most balanced, but c reads b."""
    model = model_of({"a": ["x"], "b": ["a"], "c": ["b"]}, [1, 2, 1])
    stage_of_unit, _ = solve_acyclic(model, 2, 2)
    assert stage_of_unit in ([0, 1, 1], [0, 0, 1])
    assert_valid(model, stage_of_unit, 2)


def test_diamond():
    """a -> b, a -> c, b + c -> d with weights 1, 3, 3, 1: 4 | 4 splits between the branches."""
    model = model_of({"a": ["x"], "b": ["a"], "c": ["a"], "d": ["b", "c"]}, [1, 3, 3, 1])
    assert sorted(model.dag.edges) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    stage_of_unit, _ = solve_acyclic(model, 2, 2)
    assert_valid(model, stage_of_unit, 2)
    assert stage_of_unit[0] == 0 and stage_of_unit[3] == 1
    assert stage_of_unit[1] != stage_of_unit[2]  # one branch on each stage
    assert model.evaluate(stage_of_unit).bottleneck == 4.0


SKIPS = {  # a U-Net-like chain: e1..e3 down, d3..d1 up, each d reading its e
    "e1": ["x"],
    "e2": ["e1"],
    "e3": ["e2"],
    "m": ["e3"],
    "d3": ["m", "e3"],
    "d2": ["d3", "e2"],
    "d1": ["d2", "e1"],
    "out": ["d1"],
}


@pytest.mark.parametrize("stages, devices", [(2, 2), (3, 3), (4, 2), (6, 3)])
def test_skip_connections(stages, devices):
    compute = [2, 1, 3, 1, 2, 1, 3, 1]
    model = model_of(SKIPS, compute)
    stage_of_unit, device_of_stage = solve_acyclic(model, stages, devices)
    assert_valid(model, stage_of_unit, stages)
    assert device_of_stage == [s % devices for s in range(stages)]  # looped placement
    prediction = model.evaluate(stage_of_unit, device_of_stage, schedule="auto")
    start = model.evaluate(solve_contiguous(model, stages), device_of_stage, schedule="auto")
    assert model.lower_bound(devices) == max(sum(compute) / devices, 3)
    assert prediction.lower_bound <= prediction.bottleneck <= start.bottleneck + 1e-12


def test_a_given_placement_is_kept():
    model = model_of(SKIPS, [1] * 8)
    stage_of_unit, devices = solve_acyclic(model, 4, 2, placement=[0, 0, 1, 1])
    assert devices == [0, 0, 1, 1]
    assert_valid(model, stage_of_unit, 4)


def test_coarsening_levels_are_clusterings_within_stages():
    graph = chain_graph(32)
    model = CostModel(graph, profile(graph, [1] * 32))
    state = Assignment(model, solve_contiguous(model, 2), [0, 1])
    levels = coarsen_levels(state, target=4)
    assert levels, "32 units coarsen at least once"
    sizes = [len(level) for level in levels]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    for level in levels:
        assert sorted(u for cluster in level for u in cluster) == list(range(32))
        for cluster in level:
            assert len({state.stage[u] for u in cluster}) == 1  # never across stages
    assert len(levels[-1]) <= 0.9 * 32


def test_method_acyclic_through_partition():
    graph = dag_graph({"a": ["x"], "b": ["x"], "c": ["a"]})
    result = partition(graph, profile(graph, [1, 2, 1]), 2, method="acyclic").to_json()
    assert result["stage_of_unit"] in ([0, 1, 0], [1, 0, 1])
    assert result["device_of_stage"] == [0, 1]
    assert result["predicted"]["bottleneck"] == result["predicted"]["lower_bound"] == 2.0
