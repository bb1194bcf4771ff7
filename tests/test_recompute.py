"""Recomputation planning (autopipe/partitioning/recompute.py) against the plan made one device
at a time, and the fact it rests on: a device's memory depends on its own stages only."""

from __future__ import annotations

import dataclasses

import pytest

from autopipe.compiler import CompileOptions, trace_step
from autopipe.errors import DeviceMemoryError
from autopipe.partitioning import CostModel, partition
from autopipe.partitioning.recompute import blocks_by_value, plan_recompute
from autopipe.profiling import device_spec, profile
from autopipe.spec import load_example

from conftest import spec


@pytest.fixture(scope="module")
def gpt2():
    """A 24-block GPT-2 split into 4 balanced stages under 1F1B, 8 microbatches: the graph, its
    roomy profile, the split and its memory per device without recomputation."""
    graph = trace_step(load_example(spec("gpt2_meta_24")), CompileOptions(stages=1))
    roomy = profile(graph, "analytic", device_spec("h100"))
    part = partition(graph, roomy, 4, microbatches=8)
    assert part.predicted is not None
    return graph, roomy, part, part.predicted.device_memory


def one_device_at_a_time(model, stage_of_unit, device_of_stage, schedule):
    """The plan as recompute.py made it before it bisected every device at once: each short
    device in turn, the fewest of its ranked blocks that fit (bisected), else its stages."""
    capacity = model.device.memory

    def memory(stages, blocks):
        return model.evaluate(
            stage_of_unit, device_of_stage, schedule, stages, blocks
        ).device_memory

    short = [d for d, m in enumerate(memory(frozenset(), frozenset())) if m > capacity]
    stages, blocks = frozenset(), frozenset()
    for device in short:
        ranked = blocks_by_value(model, stage_of_unit, device_of_stage, device)

        def fits(count):
            return memory(stages, blocks | frozenset(ranked[:count]))[device] <= capacity

        if ranked and fits(len(ranked)):
            low, high = 0, len(ranked)
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (low, middle) if fits(middle) else (middle, high)
            blocks |= frozenset(ranked[:high])
        else:
            stages |= {s for s, d in enumerate(device_of_stage) if d == device}
    return stages, blocks


@pytest.mark.parametrize("share", [0.97, 0.8, 0.6, 0.4, 0.3])
def test_every_device_bisected_at_once_plans_as_one_at_a_time(gpt2, share):
    """From one short device (1 block recomputed) to all four (23 blocks), and past what any
    recomputation makes fit (whole stages tried, then refused): the same stages, blocks and
    prediction as one device at a time, or the same refusal."""
    graph, roomy, part, memory = gpt2
    capacity = share * max(memory)
    small = dataclasses.replace(roomy, device=dataclasses.replace(roomy.device, memory=capacity))
    model = CostModel(graph, small, schedule="1f1b", microbatches=8)
    args = (model, part.stage_of_unit, part.device_of_stage, "1f1b")
    stages, blocks = one_device_at_a_time(*args)
    try:
        plan = plan_recompute(*args)
    except DeviceMemoryError:
        final = model.evaluate(*args[1:], stages, blocks).device_memory
        assert max(final) > capacity
        return
    assert (plan.stages, plan.blocks) == (stages, blocks)
    assert plan.prediction == model.evaluate(*args[1:], stages, blocks)
    assert all(m <= capacity for m in plan.prediction.device_memory)
    assert sum(m > capacity for m in memory) >= 1


def test_a_device_memory_depends_on_its_own_stages_only(gpt2):
    """Recomputing device 0's blocks or device 2's stage changes those devices' memory and no
    other's (what lets recompute.py bisect every device at once)."""
    graph, roomy, part, memory = gpt2
    model = CostModel(graph, roomy, schedule="1f1b", microbatches=8)
    placed = (part.stage_of_unit, part.device_of_stage, "1f1b")
    blocks = frozenset(blocks_by_value(model, *placed[:2], 0))
    recomputing = model.evaluate(*placed, frozenset({2}), blocks).device_memory
    assert blocks and recomputing[0] < memory[0] and recomputing[2] != memory[2]
    assert [recomputing[d] for d in (1, 3)] == [memory[d] for d in (1, 3)]
