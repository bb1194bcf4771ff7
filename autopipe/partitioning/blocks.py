"""Stage boundaries at block boundaries: a stage holds a block whole (as a submodule it can
shard, recompute or compile, see autopipe/codegen/blocks.py) unless splitting it pays."""

from __future__ import annotations

from collections.abc import Iterable

from .cost import CostModel

#: a boundary inside a block moves to a block boundary when that makes the predicted step at
#: most this much slower
TOLERANCE = 0.10


def align_to_blocks(
    model: CostModel, stage_of_unit: list[int], device_of_stage: list[int], schedule: str
) -> list[int]:
    """``stage_of_unit`` with every block cut by a stage boundary moved whole into one of the
    stages it spans (the one predicting the fastest step), where the order stays valid, no stage
    empties, no device runs out of memory that did not before, and the step is at most
    ``TOLERANCE`` slower than the given assignment's."""
    stage_of_unit = list(stage_of_unit)
    num_stages = max(stage_of_unit) + 1
    base = model.evaluate(stage_of_unit, device_of_stage, schedule)
    limit = base.step_time * (1 + TOLERANCE)
    capacity = model.device.memory
    fits = [m <= capacity for m in base.device_memory]
    if not _ordered(model, stage_of_unit, range(model.num_units)):
        return stage_of_unit  # no move can make it valid: the caller's problem
    for units in model.block_call_units:
        spanned = sorted({stage_of_unit[u] for u in units})
        if len(spanned) < 2:
            continue
        best = None
        for stage in spanned:
            candidate = list(stage_of_unit)
            for unit in units:
                candidate[unit] = stage
            if len(set(candidate)) < num_stages or not _ordered(model, candidate, units):
                continue
            step, memory = model.step_and_memory(candidate, device_of_stage, schedule)
            room = all(m <= capacity or not ok for m, ok in zip(memory, fits))
            if room and step <= limit:
                if best is None or step < best[0]:
                    best = (step, candidate)
        if best is not None:
            stage_of_unit = best[1]
    return stage_of_unit


def _ordered(model: CostModel, stage_of_unit: list[int], units: Iterable[int]) -> bool:
    """Does no edge of the unit DAG at one of ``units`` point to an earlier stage? (Checking
    the moved units' edges is enough once the assignment they moved in is ordered.)"""
    dag = model.dag
    return all(
        all(stage_of_unit[p] <= stage_of_unit[u] for p in dag.predecessors(u))
        and all(stage_of_unit[u] <= stage_of_unit[s] for s in dag.successors(u))
        for u in units
    )
