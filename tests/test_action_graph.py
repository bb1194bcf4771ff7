"""The compiled event times (issue 23, item 2): an ActionGraph times every schedule's orders
exactly as the reference walk (runtime/core/schedules.event_times) does, to the last bit and in
the same listing, and the simulation's figures (busy time, memory peaks, microbatches in flight)
derived from its arrays equal the reference's from the listed events, for every fixed schedule, placement and microbatch count, on random costs
(zero-length actions and free links included); orders only the reference can run are left to it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from autopipe.errors import PartitionError
from autopipe.partitioning import simulator
from autopipe.partitioning.action_graph import compile_orders
from autopipe.partitioning.simulator import (
    Simulation,
    reference_simulation,
    schedule_orders,
    simulate,
    simulate_schedule,
)
from autopipe.runtime.core.schedules import (
    COMPILE_SCHEDULES,
    MULTI_STAGE,
    V_SHAPED,
    Action,
    PipelineCosts,
    device_memory,
    event_times,
    placement,
    schedule_problem_for,
)


def _costs(rng: random.Random, device_of_stage: list[int]) -> PipelineCosts:
    stages = len(device_of_stage)

    def seconds() -> float:  # ties and zero-length actions are where listings could differ
        return rng.choice([0.0, 0.5, 1.0, rng.random(), rng.random() * 1e-3])

    return PipelineCosts(
        forward=[seconds() for _ in range(stages)],
        backward=[seconds() for _ in range(stages)],
        activations=[rng.random() * 1e6 for _ in range(stages)],
        static_memory=[rng.random() * 1e6 for _ in range(stages)],
        send_forward=[seconds() for _ in range(stages - 1)],
        send_backward=[seconds() for _ in range(stages - 1)],
        device_of_stage=device_of_stage,
        gradients=[rng.random() * 1e5 for _ in range(stages)],
        buffers=[rng.random() * 1e5 for _ in range(stages)],
        input_gradients=[rng.random() * 1e4 for _ in range(stages)],
        transient_forward=[rng.random() * 1e4 for _ in range(stages)],
        transient_backward=[rng.random() * 1e4 for _ in range(stages)],
        transient_optimizer=[rng.random() * 1e4 for _ in range(stages)],
        # every other case waits on its receives (a calibrated CPU's receive_overhead)
        receive_forward=[seconds() for _ in range(stages)] if rng.random() < 0.5 else [],
        receive_backward=[seconds() for _ in range(stages)] if rng.random() < 0.5 else [],
    )


def _shapes():
    """(schedule, ranks, stages) for every fixed schedule on 1 to 4 ranks."""
    for schedule in COMPILE_SCHEDULES:
        if schedule == "auto":
            continue
        for ranks in (1, 2, 3, 4):
            for per_rank in (1,) if schedule not in MULTI_STAGE else (2, 3):
                if schedule in V_SHAPED and per_rank != 2:
                    continue  # a V places two stages on each rank
                yield schedule, ranks, ranks * per_rank


def assert_same_simulation(fast: Simulation, reference: Simulation) -> None:
    """Every figure to the last bit: the step time, each rank's busy time and memory peak (what
    it holds and at which action), each stage's microbatches in flight; the fast path derives
    them without listing the events, then the events listed on demand."""
    assert fast.step_time == reference.step_time
    assert fast.busy == reference.busy
    assert fast.memory_peaks == reference.memory_peaks
    assert fast.held == reference.held
    assert fast.bubble == reference.bubble
    assert fast.events == reference.events


@pytest.mark.parametrize("schedule, ranks, stages", list(_shapes()))
def test_compiled_times_equal_the_reference(schedule, ranks, stages):
    rng = random.Random(f"{schedule}-{ranks}-{stages}")
    placed = placement(schedule, stages, ranks) if schedule in MULTI_STAGE else list(range(stages))
    checked = 0
    for microbatches in (1, 2, 3, 4, 5, 8, 12):
        if schedule_problem_for(schedule, placed, ranks, microbatches):
            continue
        for _ in range(3):
            costs = _costs(rng, placed)
            try:
                orders = schedule_orders(schedule, costs, microbatches)
            except PartitionError:
                continue  # torch's schedule does not take this shape
            graph = compile_orders(orders, stages)
            assert graph is not None, f"{schedule} {microbatches} microbatches not compiled"
            assert graph.events(costs) == event_times(orders, costs)  # bit for bit, same order
            fast = simulate_schedule(schedule, costs, microbatches)
            assert_same_simulation(fast, simulate(orders, costs.for_schedule(schedule)))
            for freed in (False, True):  # input gradients kept to the step's end, or freed
                flagged = dataclasses.replace(costs, input_gradients_freed=freed)
                walked = device_memory(event_times(orders, flagged), flagged)
                assert graph.memory_peaks(flagged) == walked
            checked += 1
    assert checked


def test_reference_simulation_bypasses_the_compiled_graphs(monkeypatch):
    """What benchmarks/plan_speed.py compares with: within the block every simulation walks the
    events, with equal results."""
    walks = []

    def counted(orders, costs):
        walks.append(len(orders))
        return event_times(orders, costs)

    monkeypatch.setattr(simulator, "event_times", counted)
    costs = _costs(random.Random(2), [0, 1, 2])
    fast = simulate_schedule("1f1b", costs, 6)
    assert not walks
    with reference_simulation():
        walked = simulate_schedule("1f1b", costs, 6)
    assert walks == [3]
    assert_same_simulation(fast, walked)


def test_orders_only_the_reference_runs_are_left_to_it():
    costs = _costs(random.Random(0), [0, 1])
    f0, f1, b0, b1 = Action(0, "F", 0), Action(1, "F", 0), Action(0, "B", 0), Action(1, "B", 0)
    # a deadlock: device 0 waits for the backward of microbatch 0 before running its forward
    deadlock = {0: [b0, f0], 1: [f1, b1]}
    assert compile_orders(deadlock, 2) is None
    with pytest.raises(PartitionError, match="deadlocks"):
        simulate(deadlock, costs)
    # an action waiting for one that no order runs
    assert compile_orders({0: [f0, b0], 1: [b1]}, 2) is None
    # both a full and an input backward of one microbatch: resolved by whichever ends first
    both = {0: [f0, b0], 1: [f1, Action(1, "I", 0), b1, Action(1, "W", 0)]}
    assert compile_orders(both, 2) is None
    # the greedy schedule's orders depend on the costs: simulated by the reference, equal
    greedy = _costs(random.Random(1), [0, 1, 0, 1])
    assert_same_simulation(
        simulate_schedule("auto", greedy, 4), simulate(schedule_orders("auto", greedy, 4), greedy)
    )
