"""``--method mpipe``: Mixed-Pipe, after FTPipe.

1. Coarsen the units (already grouped by basic blocks and depth) into ``L`` clusters: zero-weight
   units join a neighbour, communication-bound units (moving their output costs more than computing
   it) join their consumer, then clusters grow from ``L`` centres spread over the program order,
   the lightest growing first, until every unit belongs to one. Clusters are intervals of the
   program order, so they never form cycles.
2. Bin-pack the clusters onto the devices, heaviest first onto the least loaded device that has
   memory left.
3. Cut each device's clusters into stages: consecutive clusters (in program order) on one device
   form a stage, so a device may run several non-adjacent stages; merge or split stages until
   there are exactly ``--stages`` of them.
4. Refine border units, then simulate a step; keep the best over several ``L`` (and over the
   placements a stage-level packing and a looped placement give, and the contiguous optimum),
   each judged by its step once recomputation makes it fit.
"""

from __future__ import annotations

from ..runtime.core.pipeline import default_microbatches
from .acyclic import solve_acyclic
from .cost import CostModel
from .dp import solve_contiguous
from .recompute import fastest_fitting
from .refine import Assignment, exact_stage_count, refine


def solve_mpipe(
    model: CostModel, num_stages: int, num_devices: int, placement: list[int] | None = None
) -> tuple[list[int], list[int]]:
    if placement is not None:  # the schedule fixes the placement: refine the stages on it
        return solve_acyclic(model, num_stages, num_devices, placement)
    candidates: list[tuple[list[int], list[int]]] = []
    n = model.num_units
    sizes = sorted({min(n, f * num_stages) for f in (1, 2, 4)})
    for size in sizes:
        clusters = coarsen(model, size)
        placement = pack(
            model,
            [_weight(model, c) for c in clusters],
            [_memory(model, c, num_stages) for c in clusters],
            num_devices,
        )
        if placement is None:
            continue
        stage, devices = _runs_to_stages(model, clusters, placement, num_stages, num_devices)
        candidates.append(_refined(model, stage, devices))
    acyclic, looped = solve_acyclic(model, num_stages, num_devices)
    candidates.append((solve_contiguous(model, num_stages), looped))
    candidates.append((acyclic, looped))
    if num_devices < num_stages:  # the acyclic stages, packed onto the devices by load
        stages = [[u for u, s in enumerate(acyclic) if s == k] for k in range(num_stages)]
        packed = pack(
            model,
            [_weight(model, c) for c in stages],
            [_memory(model, c, num_stages) for c in stages],
            num_devices,
        )
        if packed is not None:
            candidates.append(_refined(model, acyclic, _canonical(packed)))
    best = fastest_fitting(
        model,
        [(stage, devices, _schedule_for(devices, model.schedule)) for stage, devices in candidates],
    )
    return candidates[best]


def _schedule_for(devices: list[int], preferred: str) -> str:
    one_per_device = devices == list(range(len(devices)))
    return preferred if one_per_device and preferred in ("gpipe", "1f1b") else "auto"


def _refined(model: CostModel, stage: list[int], devices: list[int]) -> tuple[list[int], list[int]]:
    state = Assignment(model, stage, devices)
    refine(state)
    return state.stage, devices


def coarsen(model: CostModel, size: int) -> list[list[int]]:
    """At most ``size`` clusters, each an interval of the program order."""
    n = model.num_units
    link = model.pipeline_link
    cut_time = [link.transfer(a) + link.transfer(g) for a, g in zip(*model.boundary_bytes())]
    # zero-weight and communication-bound units join the next unit
    intervals: list[list[int]] = []
    pending: list[int] = []
    for unit in range(n):
        pending.append(unit)
        weight = sum(model.compute[u] for u in pending)
        communication_bound = unit < n - 1 and cut_time[unit] > weight
        if weight > 0 and not communication_bound:
            intervals.append(pending)
            pending = []
    if pending:
        if intervals:
            intervals[-1].extend(pending)
        else:
            intervals.append(pending)
    if len(intervals) <= size:
        return intervals
    weights = [sum(model.compute[u] for u in c) for c in intervals]
    # centres at equal steps of cumulative compute, then round-robin growth, lightest first
    total, running = sum(weights), 0.0
    centres: list[int] = []
    for i, w in enumerate(weights):
        if running + w / 2 >= total * len(centres) / size and len(centres) < size:
            centres.append(i)
        running += w
    owner = [-1] * len(intervals)
    spans: list[tuple[int, int, float]] = []  # (first interval, last interval, compute)
    for c, i in enumerate(centres):
        owner[i] = c
        spans.append((i, i, weights[i]))
    while -1 in owner:
        grown = False
        for c in sorted(range(len(spans)), key=lambda c: (spans[c][2], c)):
            low, high, weight = spans[c]
            options = [j for j in (low - 1, high + 1) if 0 <= j < len(intervals) and owner[j] == -1]
            if not options:
                continue
            j = min(options, key=lambda j: (weights[j], j))
            owner[j] = c
            spans[c] = (min(low, j), max(high, j), weight + weights[j])
            grown = True
            break
        if not grown:  # cannot happen: every unowned interval touches an owned one
            raise AssertionError("cluster growth stalled")
    return [
        [u for i in range(low, high + 1) for u in intervals[i]] for low, high, _ in sorted(spans)
    ]


def _weight(model: CostModel, units: list[int]) -> float:
    return sum(model.compute[u] for u in units)


def _memory(model: CostModel, units: list[int], num_stages: int) -> float:
    """Static memory plus activations of as many microbatches as a first 1F1B stage holds."""
    in_flight = min(num_stages, model.microbatches or default_microbatches(num_stages))
    return sum(model.unit_state[u] + model.activations[u] * in_flight for u in units)


def pack(
    model: CostModel, weights: list[float], memory: list[float], num_devices: int
) -> list[int] | None:
    """Longest-processing-time bin packing: each item, heaviest first, onto the least loaded
    device with memory left (lowest index on ties); None if an item fits nowhere."""
    loads = [0.0] * num_devices
    used = [0.0] * num_devices
    placement = [0] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        fitting = [d for d in range(num_devices) if used[d] + memory[item] <= model.device.memory]
        if not fitting:
            return None
        device = min(fitting, key=lambda d: (loads[d], d))
        placement[item] = device
        loads[device] += weights[item]
        used[device] += memory[item]
    return placement


def _canonical(devices: list[int]) -> list[int]:
    """Devices renumbered in order of first use, so stage 0 is on device 0."""
    mapping: dict[int, int] = {}
    for d in devices:
        mapping.setdefault(d, len(mapping))
    return [mapping[d] for d in devices]


def _runs_to_stages(
    model: CostModel,
    clusters: list[list[int]],
    placement: list[int],
    num_stages: int,
    num_devices: int,
) -> tuple[list[int], list[int]]:
    """Consecutive clusters on one device become one stage; then exactly ``num_stages`` stages."""
    stage_of_unit = [0] * model.num_units
    devices: list[int] = []
    for cluster, device in zip(clusters, placement):
        if not devices or devices[-1] != device:
            devices.append(device)
        for unit in cluster:
            stage_of_unit[unit] = len(devices) - 1
    while len(devices) > num_stages:  # merge the adjacent pair whose merge loads devices least
        loads = [0.0] * len(devices)
        for unit, s in enumerate(stage_of_unit):
            loads[s] += model.compute[unit]
        device_load = [0.0] * (max(devices) + 1)
        for s, d in enumerate(devices):
            device_load[d] += loads[s]
        best: tuple[float, int, int] | None = None
        for s in range(len(devices) - 1):
            for keep in (devices[s], devices[s + 1]):
                moved = loads[s + 1] if keep == devices[s] else loads[s]
                after = list(device_load)
                after[keep] += moved
                after[devices[s + 1] if keep == devices[s] else devices[s]] -= moved
                key = (max(after), s, keep)
                if best is None or key < best:
                    best = key
        assert best is not None  # two devices or more: there is a pair to merge
        _, s, keep = best
        stage_of_unit = [x - 1 if x > s else x for x in stage_of_unit]
        devices[s : s + 2] = [keep]
    if len(devices) < num_stages:  # split stages on their own device
        before = stage_of_unit
        stage_of_unit = exact_stage_count(model, stage_of_unit, num_stages)
        # a split stage stays on its device: map each new stage through its first unit
        devices = [devices[before[stage_of_unit.index(s)]] for s in range(num_stages)]
    return stage_of_unit, _spread(model, stage_of_unit, devices, num_devices)


def _spread(
    model: CostModel, stage_of_unit: list[int], devices: list[int], num_devices: int
) -> list[int]:
    """Give idle devices a stage: while some device has none and another has several, the
    busiest such device hands its lightest stage over."""
    loads = [0.0] * len(devices)
    for unit, s in enumerate(stage_of_unit):
        loads[s] += model.compute[unit]
    devices = list(devices)
    while True:
        idle = [d for d in range(num_devices) if d not in devices]
        shared = [d for d in set(devices) if devices.count(d) > 1]
        if not idle or not shared:
            return _canonical(devices)
        device_load = {
            d: sum(loads[s] for s in range(len(devices)) if devices[s] == d) for d in shared
        }
        busiest = max(shared, key=lambda d: (device_load[d], -d))
        lightest = min(
            (s for s in range(len(devices)) if devices[s] == busiest), key=lambda s: (loads[s], s)
        )
        devices[lightest] = idle[0]
