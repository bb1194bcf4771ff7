"""What no split a partitioner makes can beat: the least memory a plan's fullest device needs
(:func:`memory_floor`) and the least time a pipeline run takes (:func:`run_floor`), what the
plan search prunes candidates with before partitioning them (their step's bound is
:func:`.search.step_lower_bound`).

The bounds hold for every partition into the candidate's stages, as the cost model counts
memory and the simulator runs the schedule, so pruning with them never drops a plan that fits
(tests/test_bounds.py checks them against partitions, the flow cut against every boundary of
small graphs, the run floor against the linear program's optimum, and the search against the
exhaustive one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import dinitz
import numpy as np

from ..runtime.core.schedules import SPLIT_BACKWARD
from .cost import CostModel

__all__ = ["Crossings", "crossings", "memory_floor", "run_floor", "MOST_CUTS"]

#: the most minimum cuts :func:`crossings` makes (first units' patterns x last units); a graph
#: needing more gets no memory bound from its boundaries
MOST_CUTS = 32


@dataclass(frozen=True)
class Crossings:
    """The least bytes a boundary between two stages holds per microbatch of a step (the
    activations crossing it, the next stage's receive buffer, their gradients, the previous
    stage's receive buffer, and where the schedule keeps them to the end of the step, the next
    stage's gradients of its inputs once more), by the first units before it: ``(bytes, at
    most this many boundaries)``, cheapest first (None: any number)."""

    least: tuple[tuple[float, int | None], ...]

    def total(self, boundaries: int) -> float:
        """The least bytes ``boundaries`` boundaries of one split hold in all, per microbatch."""
        left, total = boundaries, 0.0
        for size, most in self.least:
            taken = left if most is None else min(left, most)
            total, left = total + taken * size, left - taken
            if not left:
                break
        return total


def crossings(model: CostModel, *, input_gradients_kept: bool) -> Crossings:
    """:class:`Crossings` of ``model``'s graph, over every partition, for a schedule keeping the
    gradients of received inputs to the end of the step or not (``input_gradients_kept``; see
    :data:`~autopipe.runtime.core.schedules.INPUT_GRADIENTS_FREED`). The units before a
    boundary hold every predecessor of theirs, some of the first units (those without
    predecessors) and not some last unit. Those holding exactly the first units ``P`` lie among
    the units all of whose first units are in ``P``, so a split has at most that many less
    ``|P|``, plus one, such boundaries (any number when ``P`` is every first unit); each holds
    at least the least cut of a flow network where the units before it hold ``P``, not the
    other first units, nor one last unit, and a value costs its bytes where its producer is
    before the boundary and its last reader after it."""
    n = model.num_units
    dag = model.dag
    firsts = [u for u in range(n) if dag.in_degree(u) == 0]
    lasts = [u for u in range(n) if dag.out_degree(u) == 0]
    patterns = (1 << len(firsts)) - 1
    if n < 2 or patterns * len(lasts) > MOST_CUTS:
        return Crossings(((0.0, None),))
    # each unit's first units, as a bit mask
    reached = [0] * n
    for bit, u in enumerate(firsts):
        reached[u] = 1 << bit
    for u in nx.topological_sort(dag):
        for v in dag.successors(u):
            reached[v] |= reached[u]
    network = nx.DiGraph()
    network.add_nodes_from(range(n))
    for u, v in dag.edges:  # a unit before the boundary has its predecessors before it too
        network.add_edge(v, u)
    for e, ex in enumerate(model.exchanges):
        held = ex.activation + (2 if input_gradients_kept else 1) * ex.gradient
        network.add_edge(("value", e), ("crossed", e), capacity=held)
        network.add_edge(ex.producer if ex.producer >= 0 else "source", ("value", e))
        # a value crosses every boundary from its producer's stage to its last reader's (as
        # the cost model counts it, :meth:`.cost.CostModel.pipeline_costs`)
        network.add_edge(("crossed", e), ex.last if ex.last < n else "sink")
    least: list[tuple[float, int | None]] = []
    for pattern in range(1, patterns + 1):
        every = pattern == patterns
        within = sum(1 for u in range(n) if reached[u] & ~pattern == 0)
        most = None if every else within - bin(pattern).count("1") + 1
        cheapest = math.inf
        for last in lasts:
            pinned = network.copy()
            for bit, first in enumerate(firsts):
                pinned.add_edge(*(("source", first) if pattern >> bit & 1 else (first, "sink")))
            pinned.add_edge(last, "sink")
            try:
                # Dinitz's algorithm: twice as fast as networkx's default on these networks
                cut = nx.minimum_cut_value(pinned, "source", "sink", flow_func=dinitz)
            except nx.NetworkXUnbounded:  # no boundary has these units before and ``last`` after
                continue
            cheapest = min(cheapest, cut)
        if math.isfinite(cheapest):
            least.append((cheapest, most))
    if not any(most is None for _, most in least):  # every pattern capped: no bound past them
        least.append((0.0, None))
    return Crossings(tuple(sorted(least, key=lambda entry: entry[0])))


def memory_floor(
    model: CostModel,
    stages: int,
    ranks: int,
    microbatches: int,
    crossed: Crossings,
    schedule: str | None = None,
) -> float:
    """Bytes the fullest of ``ranks`` devices holds at least, whatever the split into
    ``stages`` stages: at the optimizer step every device holds its stages' training state
    (``model``'s share under its ``--dp-shard``), their receive buffers of every microbatch and
    (but where ``schedule`` frees them as it goes) the gradients of their received inputs, so
    all devices together hold at least the whole model's state and ``microbatches`` x what the
    ``stages - 1`` boundaries hold (:meth:`Crossings.total`: ``crossed`` must be of a schedule
    like ``schedule``); under a split-backward ``schedule`` with sharding, FSDP2 keeps
    every stage's parameters and gradients gathered for the step as well (every parameter in
    at least one stage). The fullest device holds at least the average."""
    params, trainable = sum(model.param_bytes), sum(model.trainable_bytes)
    held = model.state_bytes(params, trainable) + microbatches * crossed.total(stages - 1)
    if model.dp_shard > 1 and schedule in SPLIT_BACKWARD:
        held += params * model.gather_scale + trainable
    return held / ranks


def run_floor(placed: list[int], microbatches: int, lead: float) -> float:
    """The least time a pipeline run of ``microbatches`` microbatches takes, whatever the split,
    as a share of one microbatch's forward and backward over the whole model, with stage ``s``
    on rank ``placed[s]`` and at least ``lead`` of every stage's compute delaying the stages
    after it (1 where each backward is whole; the forward's least share where a schedule splits
    off the weight gradients, which may run last).

    Split the compute ``c_s`` over the stages (summing to 1). A rank cannot start its work on
    stage ``s`` or a later stage of its own, for any microbatch, before the first microbatch's
    forward has run through the stages before ``s``; and after its last action there (a whole
    backward) the backward of that microbatch still runs through them. So a run takes at least
    ``lead x sum(c_t, t < s) + microbatches x sum(c_t, t >= s on the rank of s)`` for every
    ``s``: the linear program "the least T over the splits meeting these" has the value
    ``1 / K``, ``K`` the most compute a run of length 1 can hold. Any ``y >= 0`` weighting the
    constraints so that every stage's compute is counted at least once bounds ``K`` by
    ``sum(y)`` (the dual); this takes the ``y`` that makes every weighting tight, clipped at 0
    and scaled back to feasibility where it is not, so the result is a valid floor even where
    that is not the optimum. One stage per rank gives ``1 - (1 - 1/m)^p``'s inverse."""
    stages = len(placed)
    m = float(microbatches)
    rank = np.asarray(placed)
    index = np.arange(stages)
    # row s: the constraint of stage s; column t: the weight of stage t's compute in it
    before = index[None, :] < index[:, None]
    mine = (index[None, :] >= index[:, None]) & (rank[None, :] == rank[:, None])
    constraints = lead * before + m * mine
    try:
        weights = np.linalg.solve(constraints.T, np.ones(stages))
    except np.linalg.LinAlgError:
        weights = np.zeros(stages)
    share = m / len(set(placed))  # each rank's share alone: the floor without a weighting
    if not np.isfinite(weights).all():
        return share
    weights = np.clip(weights, 0.0, None)
    counted = constraints.T @ weights
    if counted.min() <= 0.0:
        return share
    return max(float(counted.min() / weights.sum()), share)
