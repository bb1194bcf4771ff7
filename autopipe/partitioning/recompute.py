"""Recomputation: which blocks (or whole stages) recompute their activations in backward so that
every device fits its memory, and what it costs.

On each device short of memory, the blocks saving the most bytes per second of forward
recompute first; the fewest such blocks that make the device fit are found by bisection over
that order (a device's peak only falls as more of its blocks recompute), every short device
bisected at once. Where all of a device's blocks are not enough, its stages recompute whole.
The partitioners count the cost of recomputation too (:func:`.dp.recompute_seconds`,
:func:`fastest_fitting`), so that recomputing to balance the stages competes with shrinking
the stages that hold the most microbatches in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .byte_units import format_bytes, format_bytes_each
from ..errors import DeviceMemoryError
from .cost import CostModel, Prediction

__all__ = [
    "RecomputePlan",
    "plan_recompute",
    "recompute_need",
    "blocks_by_value",
    "step_fitting",
    "fastest_fitting",
]


@dataclass(frozen=True)
class RecomputePlan:
    """What recomputes its activations in backward: whole stages, and blocks of other stages."""

    stages: frozenset[int]
    blocks: frozenset[str]
    prediction: Prediction


def plan_recompute(
    model: CostModel, stage_of_unit: list[int], device_of_stage: list[int], schedule: str
) -> RecomputePlan:
    """The cheapest recomputation that makes every device fit its memory: on each device short
    of it, the fewest of its blocks, those saving the most bytes per second of forward first,
    that make it fit; where all its blocks are not enough, its whole stages. Raises when even
    that does not make them fit.

    A device's memory depends on its own stages' costs only (it runs its actions in its own
    order, see :meth:`.action_graph.ActionGraph.memory_peaks`), so every short device is
    bisected at once: each evaluation tries each device's own middle."""
    capacity = model.device.memory

    def evaluate(stages: frozenset[int], blocks: frozenset[str]) -> Prediction:
        return model.evaluate(stage_of_unit, device_of_stage, schedule, stages, blocks)

    prediction = evaluate(frozenset(), frozenset())
    short = [d for d, m in enumerate(prediction.device_memory) if m > capacity]
    ranked = {d: blocks_by_value(model, stage_of_unit, device_of_stage, d) for d in short}
    every = frozenset(fqn for d in short for fqn in ranked[d])

    def memory_of(blocks: frozenset[str]) -> list[float]:
        return model.device_memory(stage_of_unit, device_of_stage, schedule, frozenset(), blocks)

    memory = memory_of(every) if every else None
    # devices whose blocks are enough: bisect the fewest (fits at high, not at low); the others
    # recompute their stages whole
    bounds = {d: (0, len(ranked[d])) for d in short if memory and memory[d] <= capacity}
    stages = frozenset(s for s, d in enumerate(device_of_stage) if d in short and d not in bounds)
    while any(high - low > 1 for low, high in bounds.values()):
        middles = {d: (low + high) // 2 for d, (low, high) in bounds.items()}
        tried = frozenset(fqn for d, middle in middles.items() for fqn in ranked[d][:middle])
        memory = memory_of(tried)
        bounds = {
            d: (
                (low, high)
                if high - low <= 1
                else (low, middles[d]) if memory[d] <= capacity else (middles[d], high)
            )
            for d, (low, high) in bounds.items()
        }
    blocks = frozenset(fqn for d, (_low, high) in bounds.items() for fqn in ranked[d][:high])
    prediction = evaluate(stages, blocks)
    needed = prediction.device_memory
    worst = max(range(len(needed)), key=needed.__getitem__)
    if needed[worst] > capacity:
        raise DeviceMemoryError(recompute_need(model, prediction), peak=needed[worst])
    return RecomputePlan(stages, blocks, prediction)


def step_fitting(
    model: CostModel,
    stage_of_unit: list[int],
    device_of_stage: list[int],
    schedule: str,
    prediction: Prediction | None = None,
) -> float:
    """The predicted step once recomputation makes every device fit (its ``prediction``
    without recomputation, if known, where that fits already); infinite where nothing fits."""
    if prediction is None:
        prediction = model.evaluate(stage_of_unit, device_of_stage, schedule)
    if all(m <= model.device.memory for m in prediction.device_memory):
        return prediction.step_time
    try:
        return plan_recompute(model, stage_of_unit, device_of_stage, schedule).prediction.step_time
    except DeviceMemoryError:
        return math.inf


def fastest_fitting(model: CostModel, candidates: list[tuple[list[int], list[int], str]]) -> int:
    """The index of the (stage_of_unit, device_of_stage, schedule) candidate predicting the
    fastest step once recomputation makes it fit (the first among equals; the first of all if
    none fits). Recomputing only adds time, so a candidate whose step without it is no faster
    than the best found is not planned. A model that does not recompute to balance
    (``recomputes_to_balance``) prefers the candidates that fit without, then the fastest."""
    predictions = [model.evaluate(*candidate) for candidate in candidates]
    if not model.recomputes_to_balance:  # fitting without first, then the step
        return min(
            range(len(candidates)),
            key=lambda c: (
                any(m > model.device.memory for m in predictions[c].device_memory),
                predictions[c].step_time,
                c,
            ),
        )
    order = sorted(range(len(candidates)), key=lambda c: (predictions[c].step_time, c))
    best, best_step = 0, math.inf
    for c in order:
        if predictions[c].step_time >= best_step:
            break
        step = step_fitting(model, *candidates[c], prediction=predictions[c])
        if step < best_step or (step == best_step and c < best):
            best, best_step = c, step
    return best


def recompute_need(model: CostModel, prediction: Prediction) -> str:
    """What each rank of ``prediction`` needs against the device's capacity, and what the fullest
    one holds at its peak (some do not fit even recomputing)."""
    needed = prediction.device_memory
    fullest = max(range(len(needed)), key=needed.__getitem__)
    peak = prediction.memory_peaks[fullest]
    microbatches = f"{peak.in_flight} microbatch{'' if peak.in_flight == 1 else 'es'}"
    parts = [
        (peak.state, "of parameters, gradients and optimizer state"),
        (peak.activations, f"of activations for {microbatches}"),
        (peak.buffers, "of receive buffers"),
        (peak.input_gradients, "of gradients of received inputs"),
        (peak.transient, "of temporaries"),
    ]
    held = ", ".join(f"{format_bytes(size)} {what}" for size, what in parts if size > 0)
    moment = "the optimizer step" if peak.moment == "optimizer" else f"action {peak.moment}"
    return (
        f"no partition into {len(prediction.device_of_stage)} stages on {len(needed)} devices "
        f"fits the memory of {model.device.name} ({format_bytes(model.device.memory)} per "
        f"device) even recomputing the activations of every rank short of memory: they need "
        f"{format_bytes_each(needed, 'rank')} (rank {fullest} at its peak, {moment}: {held})"
    )


def blocks_by_value(
    model: CostModel, stage_of_unit: list[int], device_of_stage: list[int], device: int
) -> list[str]:
    """The whole blocks of a device's stages that recomputing saves memory on, the most bytes
    saved per second of forward recomputed first."""
    ranked = []
    for fqn, block in model.blocks.items():
        stage = block.stage(stage_of_unit)
        if stage is None or device_of_stage[stage] != device:
            continue
        saved = sum(model.activations[u] for u in block.units) - block.inputs
        seconds = sum(model.forward[u] for u in block.units)
        if saved > 0:
            ranked.append((-saved / max(seconds, 1e-12), fqn))
    return [fqn for _, fqn in sorted(ranked)]
