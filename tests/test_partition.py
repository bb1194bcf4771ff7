"""The contiguous DP partitioner against brute force, and the cost model against hand computation."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.compiler import CompileOptions, trace_step
from autopipe.errors import PartitionError
from autopipe import partitioning
from autopipe.partitioning import CostModel, Partition, partition
from autopipe.partitioning.dp import ContiguousSplits, recompute_seconds, solve_contiguous
from autopipe.profiling import Profile, UnitCost, device_spec, profile, with_link
from autopipe.report.summary import format_partition
from autopipe.profiling.profile import graph_digest
from autopipe.spec import load_example

from conftest import spec

GRAPH = trace_step(load_example(spec("mlp")), CompileOptions(stages=1))  # 14 units, long skips
UNITS = len(GRAPH.units)


def random_profile(costs, activations, link_gbps, memory_gib=80.0) -> Profile:
    device = with_link(device_spec("h100"), str(link_gbps))
    device = type(device)(**(device.to_json() | {"memory": memory_gib * 1024**3}))
    units = [
        UnitCost(forward=c * 0.4, backward=c * 0.6, activations=a)
        for c, a in zip(costs, activations)
    ]
    return Profile("analytic", device, units, graph_digest(GRAPH))


def brute_force(model: CostModel, stages: int):
    best = None
    for cuts in itertools.combinations(range(1, model.num_units), stages - 1):
        bounds = (0, *cuts, model.num_units)
        assignment = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
        prediction = model.evaluate(assignment)
        if any(c.memory > model.device.memory for c in prediction.stages):
            continue
        key = (prediction.bottleneck, sum(c.time**2 for c in prediction.stages))
        if (
            best is None
            or key[0] < best[0] - 1e-12
            or (abs(key[0] - best[0]) <= 1e-12 * max(1, key[0]) and key[1] < best[1])
        ):
            best = key
    return best


@settings(max_examples=40, deadline=None)
@given(
    costs=st.lists(st.floats(0.0, 10.0), min_size=UNITS, max_size=UNITS),
    activations=st.lists(st.integers(0, 4), min_size=UNITS, max_size=UNITS),
    link=st.sampled_from([1e-7, 1e-6, 1e3]),
    stages=st.integers(1, 4),
)
def test_dp_matches_brute_force(costs, activations, link, stages):
    """Without recomputing to balance, the DP's optimum is the best split that fits, as the
    cost model evaluates it."""
    model = CostModel(
        GRAPH, random_profile(costs, [a * 1024**3 for a in activations], link, memory_gib=40)
    ).without_balancing_recomputation()
    expected = brute_force(model, stages)
    optimum = ContiguousSplits(model, stages).solve()
    if expected is None:
        assert optimum is None
        return
    assert optimum is not None
    assignment = optimum.stage_of_unit
    assert sorted(set(assignment)) == list(range(stages))
    assert assignment == sorted(assignment)  # contiguous, in program order
    prediction = model.evaluate(assignment)
    assert prediction.bottleneck == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
    assert optimum.bottleneck == pytest.approx(expected[0], rel=1e-9, abs=1e-12)
    assert sum(c.time**2 for c in prediction.stages) == pytest.approx(
        expected[1], rel=1e-6, abs=1e-9
    )


@settings(max_examples=40, deadline=None)
@given(
    costs=st.lists(st.floats(0.0, 10.0), min_size=UNITS, max_size=UNITS),
    activations=st.lists(st.integers(0, 4), min_size=UNITS, max_size=UNITS),
    stages=st.integers(1, 4),
    memory=st.sampled_from([4, 8, 40]),
)
def test_dp_recomputing_to_balance_is_exact_for_its_costs(costs, activations, stages, memory):
    """Recomputing to balance, the DP finds the split whose slowest stage (recomputation
    included) is the least of all contiguous splits, cut anywhere or between blocks only."""
    model = CostModel(
        GRAPH, random_profile(costs, [a * 1024**3 for a in activations], 1e3, memory_gib=memory)
    )
    splits = ContiguousSplits(model, stages)
    for cuts in (None, splits.between_blocks):
        best = math.inf
        for inner in itertools.combinations(range(1, model.num_units), stages - 1):
            bounds = (0, *inner, model.num_units)
            slowest = max(
                float(
                    splits.stage_costs(
                        k, splits.tile(slice(a, a + 1), slice(b, b + 1), cuts), model.device.memory
                    )
                )
                for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
            )
            best = min(best, slowest)
        optimum = splits.solve(cuts)
        if not math.isfinite(best):
            assert optimum is None
            continue
        assert optimum is not None
        assert optimum.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_recompute_seconds_drop_the_activations_that_do_not_fit():
    """A stage with 10 GB of activations in flight and 6 GB of room: its blocks can save 8 GB
    at 2 s of forward, so it recomputes half of them (4 GB) for 1 s; with 1 GB of room the
    blocks are not enough and the whole stage (3 s of forward) recomputes; with room, nothing."""
    GB = 1e9

    def seconds(room):
        return float(
            recompute_seconds(
                torch.tensor(room * GB),
                torch.tensor(10 * GB),
                torch.tensor(8 * GB),
                torch.tensor(2.0),
                torch.tensor(3.0),
            )
        )

    assert seconds(6) == pytest.approx(1.0)
    assert seconds(1) == 3.0
    assert seconds(10) == seconds(12) == 0.0


def test_recomputing_to_balance_beats_shrinking_the_stages_and_fits():
    """A 24-block GPT-2 on 4 devices under 1F1B with 8 microbatches, on a device slightly
    smaller than the balanced split's first stage needs (it holds 4 microbatches in flight):
    recomputing a block there predicts a faster step than shrinking the first stages, every
    device fits, and the summary says why."""
    graph = trace_step(load_example(spec("gpt2_meta_24")), CompileOptions(stages=1))
    roomy = profile(graph, "analytic", device_spec("h100"))
    balanced = partition(graph, roomy, 4, microbatches=8)
    assert balanced.recomputed == 0 and balanced.compared is None
    assert balanced.predicted is not None
    capacity = max(balanced.predicted.device_memory) * 0.97
    small = dataclasses.replace(roomy, device=dataclasses.replace(roomy.device, memory=capacity))
    part = partition(graph, small, 4, microbatches=8)
    assert part.predicted is not None and part.compared is not None
    assert part.recompute_blocks and not part.recompute
    assert all(m <= capacity for m in part.predicted.device_memory)
    assert part.compared.recomputed < part.recomputed
    assert part.compared.step_time > part.predicted.step_time
    assert part.stage_of_unit == balanced.stage_of_unit  # balanced: stages kept, not shrunk
    why = format_partition(graph, part).splitlines()[-1]
    assert why.startswith("why: pipeline run") and "recomputing costs less" in why
    assert Partition.from_json(part.to_json()) == part


def test_dp_is_deterministic():
    profile = random_profile([1.0] * UNITS, [0] * UNITS, 1e3)
    runs = {tuple(solve_contiguous(CostModel(GRAPH, profile), 3)) for _ in range(3)}
    assert len(runs) == 1


def test_lower_bound_and_hand_computed_costs():
    costs = [0.0] * UNITS
    costs[3], costs[10] = 6.0, 2.0
    model = CostModel(GRAPH, random_profile(costs, [0] * UNITS, 1e9))
    # each backward also adds its parameters' gradients into the step's (microseconds here)
    added = model.accumulation
    assert all(a > 0 for a, held in zip(added, model.trainable_bytes) if held)
    assert model.lower_bound(2) == 6.0 + added[3]  # the heaviest unit, not total / 2 = 4
    assert model.lower_bound(1) == pytest.approx(8.0 + sum(added))
    prediction = model.evaluate([0] * 5 + [1] * (UNITS - 5))
    first, second = 6.0 + sum(added[:5]), 2.0 + sum(added[5:])
    assert [s.forward + s.backward for s in prediction.stages] == pytest.approx([first, second])
    # communication: the bytes crossing the cut, both directions, over the link, each
    # message paying the link's latency
    crossing = model.boundary_bytes()[0][4] + model.boundary_bytes()[1][4]
    assert prediction.stages[0].communication == pytest.approx(
        crossing / model.device.link_bandwidth + 2 * model.device.link_latency
    )
    # 1F1B, 4 microbatches: the first stage (6 s per microbatch) never waits once started
    assert prediction.step_time == pytest.approx(4 * first, rel=1e-6)


def test_each_backward_adds_its_gradients_into_the_steps():
    """A profile's backward takes its gradients from autograd.grad; a step's adds them into
    .grad (two bytes read, one written, a launch each): charged to the unit reading each
    trained parameter first (GPT-2's tied embedding once), on a spec without tables at the
    memory rate. FSDP2 reducing every microbatch adds the shards itself; under a
    split-backward schedule it reduces once a step, and autograd adds whole gradients."""
    graph = trace_step(load_example(spec("gpt2")), CompileOptions(stages=1))
    h100 = device_spec("h100")
    prof = profile(graph, "analytic", h100)
    model = CostModel(graph, prof)
    seen: set[str] = set()
    for unit, held in enumerate(model.unit_params):
        first = [b for name, b in held.items() if name not in seen and name not in model.frozen]
        seen.update(held)
        expected = sum(3 * b / h100.memory_rate(3 * b) + h100.kernel_overhead for b in first)
        assert model.accumulation[unit] == pytest.approx(expected), unit
    assert sum(model.accumulation) > 0
    assert model.backward == pytest.approx(
        [u.backward + a for u, a in zip(prof.units, model.accumulation)]
    )
    assert not any(CostModel(graph, prof, dp_shard=2).accumulation)
    split = CostModel(graph, prof, dp_shard=2, schedule="zbv")
    assert split.accumulation == model.accumulation


def test_relayed_skip_connection_crosses_every_boundary():
    model = CostModel(GRAPH, random_profile([1.0] * UNITS, [0] * UNITS, 1e3))
    value_bytes = 4 * 16 * 4  # one activation of the MLP: batch 4 x width 16 x float32
    cuts = [a + g for a, g in zip(*model.boundary_bytes())]
    # the first layer's output is read by the last addition, so it is live across every cut
    # before that addition's unit, next to the running activation
    first = GRAPH.units[1].nodes[0]  # the first tanh
    last_reader = max(GRAPH[u].unit for u in GRAPH.users(first))
    assert last_reader > UNITS // 2
    assert all(c >= 2 * 2 * value_bytes for c in cuts[2:last_reader])  # (activation + gradient) x 2


def test_partition_reports_prediction():
    part = partition(GRAPH, random_profile([1.0] * UNITS, [0] * UNITS, 1e3), 3)
    assert part.num_stages == 3 and part.method == "mpipe"  # the default
    predicted = part.predicted
    assert predicted.bottleneck >= predicted.lower_bound
    assert len(predicted.stages) == 3
    assert math.isclose(predicted.bottleneck, max(s.time for s in predicted.stages))


def test_recomputation_switched_on_for_devices_short_of_memory():
    """1 GiB of activations per unit (7 GiB a stage's microbatch) overflow 10 GiB devices with
    1F1B (two microbatches in flight on the first); recomputing the short devices' stages
    (keeping only their inputs, one microbatch's activations rebuilt in backward) makes them
    fit; past that, a clear error."""
    profile = random_profile([1.0] * UNITS, [1024**3] * UNITS, 1e3, memory_gib=10)
    part = partition(GRAPH, profile, 2, schedule="1f1b", microbatches=4)
    assert part.recompute  # without it a device would need more than 10 GiB
    model = CostModel(GRAPH, profile, schedule="1f1b", microbatches=4)
    plain = model.evaluate(part.stage_of_unit, part.device_of_stage, "1f1b")
    assert max(plain.device_memory) > 10 * 1024**3
    assert max(part.predicted.device_memory) <= 10 * 1024**3
    stages = part.predicted.stages
    for s in part.recompute:  # backward pays for the forward again (and adds its gradients)
        added = sum(a for a, t in zip(model.accumulation, part.stage_of_unit) if t == s)
        assert stages[s].backward == pytest.approx(stages[s].forward / 0.4 + added)

    tiny = random_profile([1.0] * UNITS, [0] * UNITS, 1e3, memory_gib=1e-9)
    with pytest.raises(PartitionError, match="fits the memory of H100"):
        partition(GRAPH, tiny, 2, method="mpipe")


def test_schedules_of_one_placement_share_the_solvers_split(monkeypatch):
    """torch's looped schedules place stages alike and keep as many microbatches in flight:
    partitioning one profile under each runs the solver once, and each partition equals the
    one made from a fresh copy of the profile (nothing remembered)."""
    graph = trace_step(load_example(spec("gpt2")), CompileOptions(stages=1))
    prof = profile(graph, "analytic", device_spec("h100"))
    calls = []
    solver = partitioning.METHODS["mpipe"]
    monkeypatch.setitem(
        partitioning.METHODS, "mpipe", lambda *args: calls.append(args[1:]) or solver(*args)
    )
    looped = ("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble")
    made = [partition(graph, prof, 4, num_devices=2, schedule=s, microbatches=4) for s in looped]
    assert len(calls) == 1
    for schedule, part in zip(looped, made):
        fresh = dataclasses.replace(prof)  # another profile: solved again
        again = partition(graph, fresh, 4, num_devices=2, schedule=schedule, microbatches=4)
        assert again.to_json() == part.to_json()
    assert len(calls) == 1 + len(looped)
    partition(graph, prof, 4, num_devices=2, schedule="zbv", microbatches=4)  # V-shaped
    partition(graph, prof, 4, num_devices=2, schedule="interleaved-1f1b", microbatches=8)
    assert len(calls) == 3 + len(looped)
