"""``--method acyclic``: multilevel refinement of an acyclic partition.

The initial partition is the best contiguous cut of a topological order (the program order, solved
exactly by :func:`.dp.solve_contiguous`). Units of one stage are then coarsened by matching along
DAG edges, in levels, as long as a merged pair cannot create a cycle (one is the other's only
successor or only predecessor); Fiduccia-Mattheyses refinement with rollback moves whole clusters
between adjacent stages at the coarsest level, then ever finer clusters, then single units, always
keeping every edge pointing to the same or a later stage.
"""

from __future__ import annotations

from .cost import CostModel
from .dp import solve_contiguous
from .refine import Assignment, looped_devices, refine


def solve_acyclic(
    model: CostModel, num_stages: int, num_devices: int, placement: list[int] | None = None
) -> tuple[list[int], list[int]]:
    devices = placement or looped_devices(num_stages, num_devices)
    state = Assignment(model, solve_contiguous(model, num_stages), devices)
    multilevel_refine(state)
    return state.stage, devices


def multilevel_refine(state: Assignment) -> None:
    """Refine from the coarsest clustering of each stage's units down to single units."""
    for groups in reversed(coarsen_levels(state, target=4 * state.num_stages)):
        refine(state, groups)
    refine(state)


def coarsen_levels(state: Assignment, target: int) -> list[list[list[int]]]:
    """Successively coarser clusterings of the units (each a list of clusters), finest first."""
    levels = []
    clusters = [[u] for u in range(state.model.num_units)]
    while len(clusters) > target:
        merged = _match(state, clusters)
        if len(merged) > 0.9 * len(clusters):
            break
        clusters = merged
        levels.append(clusters)
    return levels


def _match(state: Assignment, clusters: list[list[int]]) -> list[list[int]]:
    """One round of heavy-edge matching between clusters of the same stage."""
    cluster_of = {u: c for c, members in enumerate(clusters) for u in members}
    succ: list[set[int]] = [set() for _ in clusters]
    pred: list[set[int]] = [set() for _ in clusters]
    weight: dict[tuple[int, int], float] = {}
    for u, v, data in state.model.dag.edges(data=True):
        a, b = cluster_of[u], cluster_of[v]
        if a != b:
            succ[a].add(b)
            pred[b].add(a)
            weight[(a, b)] = weight.get((a, b), 0.0) + data["bytes"]
    matched: set[int] = set()
    partner: dict[int, int] = {}
    for (a, b), _w in sorted(weight.items(), key=lambda item: (-item[1], item[0])):
        if a in matched or b in matched:
            continue
        if state.stage[clusters[a][0]] != state.stage[clusters[b][0]]:
            continue
        if len(succ[a]) == 1 or len(pred[b]) == 1:  # no other path a -> b: merging keeps a DAG
            matched |= {a, b}
            partner[a] = b
    result, absorbed = [], set(partner.values())
    for c, members in enumerate(clusters):
        if c in absorbed:
            continue
        result.append(sorted(members + clusters[partner[c]]) if c in partner else members)
    return result
