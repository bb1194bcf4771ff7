"""``--method metis``: pymetis k-way on the unit graph, repaired into acyclic stages.

METIS balances vertex weights (compute) and minimises the weight of cut edges (bytes moved), but it
ignores direction, so its parts may form cycles between stages. The repair is deterministic: parts
are ranked by the mean program position of their units, every unit goes to its part's rank or the
latest stage among its predecessors, whichever is later (moving border units forward breaks every
cycle), empty stages are refilled by splitting the heaviest, and multilevel border moves (as in
``--method acyclic``) refine the result.
"""

from __future__ import annotations

import pymetis

from .cost import CostModel
from .acyclic import multilevel_refine
from .refine import Assignment, exact_stage_count, looped_devices, monotone

#: METIS wants integer weights; costs are scaled to about this many units in total.
_WEIGHT_SCALE = 1_000_000


def solve_metis(
    model: CostModel, num_stages: int, num_devices: int, placement: list[int] | None = None
) -> tuple[list[int], list[int]]:
    n = model.num_units
    devices = placement or looped_devices(num_stages, num_devices)
    if num_stages == 1:
        return [0] * n, devices
    parts = _metis_parts(model, num_stages)
    position: dict[int, list[int]] = {}
    for unit, part in enumerate(parts):
        position.setdefault(part, []).append(unit)
    order = sorted(position, key=lambda p: (sum(position[p]) / len(position[p]), p))
    rank = {part: r for r, part in enumerate(order)}
    stage = exact_stage_count(model, monotone(model, [rank[p] for p in parts]), num_stages)
    state = Assignment(model, stage, devices)
    multilevel_refine(state)
    return state.stage, devices


def _metis_parts(model: CostModel, num_parts: int) -> list[int]:
    n = model.num_units
    total_compute = sum(model.compute) or 1.0
    vweights = [max(1, round(c / total_compute * _WEIGHT_SCALE)) for c in model.compute]
    neighbours: list[dict[int, float]] = [{} for _ in range(n)]
    for u, v, data in model.dag.edges(data=True):
        weight = data["bytes"] / model.link_bandwidth  # seconds, comparable with compute
        for a, b in ((u, v), (v, u)):
            neighbours[a][b] = neighbours[a].get(b, 0.0) + weight
    xadj, adjncy, eweights = [0], [], []
    for u in range(n):
        for v in sorted(neighbours[u]):
            adjncy.append(v)
            eweights.append(max(1, round(neighbours[u][v] / total_compute * _WEIGHT_SCALE)))
        xadj.append(len(adjncy))
    result = pymetis.part_graph(
        num_parts,
        xadj=xadj,
        adjncy=adjncy,
        vweights=vweights,
        eweights=eweights,
        options=pymetis.Options(seed=0),
    )
    return list(result.vertex_part)
