"""The pipeline simulator against schedules worked out by hand."""

from __future__ import annotations

import re

import pytest

from autopipe.errors import PartitionError
from autopipe.partitioning.simulator import (
    Action,
    PipelineCosts,
    schedule_memory,
    schedule_orders,
    simulate,
    simulate_schedule,
)
from autopipe.runtime.core.schedules import MULTI_STAGE, V_SHAPED, placement


def uniform(stages, forward=1.0, backward=2.0, send=0.0, devices=None, activations=1.0):
    return PipelineCosts(
        forward=[forward] * stages,
        backward=[backward] * stages,
        activations=[activations] * stages,
        static_memory=[10.0] * stages,
        send_forward=[send] * (stages - 1),
        send_backward=[send] * (stages - 1),
        device_of_stage=devices or list(range(stages)),
    )


def run(schedule, costs, microbatches):
    return simulate(schedule_orders(schedule, costs, microbatches), costs)


def test_gpipe_two_stages_by_hand():
    # device 0: F0 [0,1] F1 [1,2]            B0 [5,7] B1 [7,9]
    # device 1:          F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7]
    sim = run("gpipe", uniform(2), 2)
    assert sim.step_time == 9.0
    starts = {(d, str(a)): (s, e) for d, a, s, e in sim.events}
    assert starts[(1, "1B0")] == (3.0, 5.0) and starts[(0, "0B1")] == (7.0, 9.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 2), (3, 4), (4, 8)])
def test_uniform_stages_take_m_plus_k_minus_1_slots(schedule, stages, microbatches):
    sim = run(schedule, uniform(stages), microbatches)
    assert sim.step_time == pytest.approx((microbatches + stages - 1) * 3.0)
    assert sim.bubble == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_one_f_one_b_order_matches_torch():
    orders = schedule_orders("1f1b", uniform(3), 4)
    assert [str(a) for a in orders[0]] == ["0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3"]
    assert [str(a) for a in orders[1]] == ["1F0", "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1B3"]
    assert [str(a) for a in orders[2]] == ["2F0", "2B0", "2F1", "2B1", "2F2", "2B2", "2F3", "2B3"]


def test_memory_gpipe_holds_all_microbatches_1f1b_only_stages():
    gpipe = run("gpipe", uniform(3), 8)
    one_f_one_b = run("1f1b", uniform(3), 8)
    assert gpipe.peak_memory[0] == 10.0 + 8  # static + 8 microbatches of activations
    assert one_f_one_b.peak_memory[0] == 10.0 + 3  # static + (stages - 0) microbatches
    assert one_f_one_b.peak_memory[2] == 10.0 + 1


def test_link_latency_by_hand():
    # F0 [0,1] -> +0.5 -> F1 [1.5,2.5] -> B1 [2.5,3.5] -> +0.5 -> B0 [4,5]
    sim = run("gpipe", uniform(2, forward=1.0, backward=1.0, send=0.5), 1)
    assert sim.step_time == 5.0


def test_stages_on_one_device_do_not_pay_the_link():
    costs = uniform(2, send=100.0, devices=[0, 0])
    sim = run("auto", costs, 2)
    assert sim.step_time == pytest.approx(2 * 2 * 3.0)  # everything back to back on device 0
    with pytest.raises(PartitionError, match="one stage per device"):
        schedule_orders("1f1b", costs, 2)


def test_deadlock_is_reported():
    costs = uniform(2)
    orders = {0: [Action(0, "B", 0), Action(0, "F", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    with pytest.raises(PartitionError, match="deadlocks"):
        simulate(orders, costs)


def test_greedy_schedule_for_any_placement():
    costs = uniform(
        5, devices=[0, 1, 2, 1, 0]
    )  # Mixed-Pipe style: devices hold non-adjacent stages
    orders = schedule_orders("auto", costs, 6)
    assert {a.stage for a in orders[0]} == {0, 4} and {a.stage for a in orders[1]} == {1, 3}
    assert sorted(str(a) for o in orders.values() for a in o) == sorted(
        f"{s}{k}{m}" for s in range(5) for k in "FB" for m in range(6)
    )
    sim = simulate(orders, costs)
    assert sim.step_time >= 2 * 6 * 3.0  # devices 0 and 1 each run two stages' work


def test_torch_interleaved_schedule():
    costs = uniform(4, devices=[0, 1, 0, 1])
    sim = run("interleaved-1f1b", costs, 4)
    assert sim.step_time >= 2 * 4 * 3.0
    assert sim.step_time < run("auto", uniform(2, forward=2.0, backward=4.0), 4).step_time * 1.2
    with pytest.raises(PartitionError, match="places stage s on device"):
        schedule_orders("interleaved-1f1b", uniform(4, devices=[0, 0, 1, 1]), 4)


def test_zero_bubble_splits_backward():
    costs = uniform(4, devices=[0, 1, 1, 0])
    orders = schedule_orders("zbv", costs, 4)
    kinds = {a.kind for o in orders.values() for a in o}
    assert kinds == {"F", "I", "W"}
    assert simulate(orders, costs).step_time > 0


@pytest.mark.parametrize("schedule", sorted(MULTI_STAGE))
@pytest.mark.parametrize("devices, per_device, microbatches", [(2, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_multi_stage_orders_are_torchs(schedule, devices, per_device, microbatches):
    """The orders the simulator reads (torch's schedule class, not lowered to its runtime's
    communication) are the compute actions of torch's own ``get_schedule_ops``."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    stages = devices * per_device
    if schedule in V_SHAPED and per_device != 2:
        pytest.skip("V-shaped schedules run two stages per device")
    costs = uniform(stages, devices=placement(schedule, stages, devices))
    try:
        ops = get_schedule_ops(MULTI_STAGE[schedule], devices, microbatches, per_device)
    except Exception as exc:  # torch refuses this shape: so must the simulator
        with pytest.raises(PartitionError, match="does not fit"):
            schedule_orders(schedule, costs, microbatches)
        pytest.skip(f"torch refuses it: {exc}")
    expected = {
        device: [
            Action.parse(part)
            for action in row
            if action is not None
            for part in re.findall(r"\d+[FBIW]\d+", str(action))
        ]
        for device, row in enumerate(ops)
    }
    assert schedule_orders(schedule, costs, microbatches) == expected


@pytest.mark.parametrize("schedule, kept", [("1f1b", 0.0), ("gpipe", 400.0), ("auto", 400.0)])
@pytest.mark.parametrize("given", [False, True])
def test_received_input_gradients_are_freed_as_the_simulated_schedule_frees_them(
    schedule, kept, given
):
    """At the optimizer step (the peak here) the last stage holds the gradients of its 4
    microbatches' received inputs under GPipe and auto (torch waits for their sends at the end
    of the step), none under 1F1B (each freed once the next actions wait for its send): as the
    schedule simulated says, whatever the costs were made for."""
    costs = PipelineCosts(
        forward=[1.0, 1.0],
        backward=[2.0, 2.0],
        activations=[1.0, 1.0],
        static_memory=[10.0, 10.0],
        send_forward=[0.0],
        send_backward=[0.0],
        device_of_stage=[0, 1],
        input_gradients=[0.0, 100.0],
        transient_optimizer=[1e6, 1e6],
        input_gradients_freed=given,
    )
    for peaks in (
        schedule_memory(schedule, costs, 4),
        simulate_schedule(schedule, costs, 4).memory_peaks,
    ):
        assert peaks[1].moment == "optimizer" and peaks[1].input_gradients == kept
