"""The bounds the plan search prunes with (autopipe/partitioning/bounds.py): the flow cuts
against every boundary of small graphs, the memory floor against the memory partitions
predict, a search pruning with it against the exhaustive one, and the run floor against the
linear program's optimum and the simulated runs of random splits."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from autopipe.compiler import CompileOptions, profile_step, trace_step
from autopipe.errors import PartitionError
from autopipe.partitioning import CostModel, partition
from autopipe.partitioning.bounds import crossings, memory_floor, run_floor
from autopipe.partitioning.search import PRUNED, search
from autopipe.partitioning.simulator import simulate_schedule
from autopipe.runtime.core.schedules import (
    INPUT_GRADIENTS_FREED,
    MULTI_STAGE,
    SPLIT_BACKWARD,
    V_SHAPED,
    PipelineCosts,
    placement,
)
from autopipe.spec import load_example

from conftest import spec
from graphs import dag_graph, device, profile

#: two first units (a, b), a skip (a -> e) and values of different sizes
READS = {"a": ["x"], "b": ["x"], "c": ["a"], "d": ["b", "c"], "e": ["d", "a"], "f": ["e"]}
SHAPES = {"a": (64,), "b": (2,), "c": (16,), "d": (32,), "e": (8,), "f": (4,)}


@pytest.fixture(scope="module")
def small():
    graph = dag_graph(READS, shapes=SHAPES)
    return CostModel(graph, profile(graph, [1.0] * len(READS), spec=device()), microbatches=1)


def held(model: CostModel, before: frozenset[int]) -> float:
    """Bytes a boundary with the units ``before`` it holds (``model`` runs one microbatch), as
    the cost model counts the pipeline (the next stage's receive buffer and gradients of its
    inputs, the previous stage's gradient buffer): from a two-stage split's costs."""
    assert model.microbatches == 1
    stage_of_unit = [0 if u in before else 1 for u in range(model.num_units)]
    costs = model.pipeline_costs(stage_of_unit, [0, 1])
    return sum(costs.buffers) + costs.input_gradients[1]


def boundaries(model: CostModel) -> list[frozenset[int]]:
    """Every set of units a boundary can have before it: non-empty, not all, holding each
    unit's predecessors."""
    found = []
    for size in range(1, model.num_units):
        for units in itertools.combinations(range(model.num_units), size):
            before = frozenset(units)
            if all(u in before for v in before for u in model.dag.predecessors(v)):
                found.append(before)
    return found


def test_cuts_are_the_least_any_boundaries_hold(small):
    """For every number k of boundaries one split can have (nested, distinct), the least the
    cuts say k boundaries hold is at most the least any k such boundaries hold, and for one
    boundary it is exactly the least (found by enumerating every boundary)."""
    every = boundaries(small)
    size = {before: held(small, before) for before in every}
    # the least total of k nested boundaries ending at each boundary, by the number of units
    ordered = sorted(every, key=len)
    least = {before: size[before] for before in ordered}
    found = crossings(small, input_gradients_kept=True)
    assert found.total(1) == pytest.approx(min(size.values()))
    for k in range(2, small.num_units):
        least = {
            later: size[later]
            + min(
                (least[earlier] for earlier in ordered if earlier < later and earlier in least),
                default=float("inf"),
            )
            for later in ordered
        }
        least = {b: v for b, v in least.items() if v != float("inf")}
        if not least:
            break
        assert found.total(k) <= min(least.values()) * (1 + 1e-12)
    # three patterns of the first units a and b (a alone, b alone, both): only the one holding
    # both may stand before any number of boundaries
    assert [most for _, most in found.least].count(None) == 1


def test_a_split_holds_what_its_boundaries_hold(small):
    """The per-boundary bytes the test reads from the costs add up over a split's boundaries to
    what all its stages hold in receive buffers and gradients of received inputs."""
    model = CostModel(small.graph, profile(small.graph, [1.0] * 6, spec=device()), microbatches=3)
    split = [0, 0, 1, 1, 2, 2]  # a b | c d | e f
    costs = model.pipeline_costs(split, [0, 1, 2])
    total = sum(costs.buffers) + 3 * sum(costs.input_gradients)
    per_boundary = [
        held(small, frozenset(u for u, s in enumerate(split) if s <= b)) for b in (0, 1)
    ]
    assert total == pytest.approx(3 * sum(per_boundary)) and total > 0


@pytest.fixture(scope="module")
def gpt2():
    example = load_example(spec("gpt2"))
    options = CompileOptions(stages=2)
    graph = trace_step(example, options)
    return graph, profile_step(graph, options, example)


@pytest.mark.parametrize(
    "stages, devices, schedule, microbatches, shard",
    [
        (2, 2, "1f1b", 4, 1),
        (4, 4, "gpipe", 8, 1),
        (4, 2, "interleaved-1f1b", 4, 2),
        (4, 2, "zbv", 4, 1),
        (4, 2, "zbv", 4, 2),  # FSDP2 keeps every stage gathered for the step
        (4, 2, "interleaved-zero-bubble", 4, 4),
        (3, 3, "1f1b", 6, 4),
    ],
)
def test_no_partition_needs_less_than_the_floor(
    gpt2, stages, devices, schedule, microbatches, shard
):
    """The partition each method makes, and every contiguous split of a coarse grid, predicts
    its fullest device holding at least the floor."""
    graph, prof = gpt2
    model = CostModel(graph, prof, schedule=schedule, microbatches=microbatches, dp_shard=shard)
    kept = schedule not in INPUT_GRADIENTS_FREED  # 1F1B frees received inputs' gradients
    crossed = crossings(model, input_gradients_kept=kept)
    floor = memory_floor(model, stages, devices, microbatches, crossed, schedule)
    assert floor > 0
    for method in ("dp", "mpipe"):
        part = partition(
            graph, prof, stages, num_devices=devices, schedule=schedule,
            microbatches=microbatches, dp_shard=shard, method=method, compare=False,
        )  # fmt: skip
        assert part.predicted is not None
        assert max(part.predicted.device_memory) >= floor
    n = model.num_units
    placed = part.device_of_stage
    for cuts in itertools.combinations(range(1, n, max(1, n // 8)), stages - 1):
        bounds = (0, *cuts, n)
        split = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
        peak = max(model.evaluate(split, placed, schedule).device_memory)
        assert peak >= floor


def test_pruning_by_memory_keeps_every_plan_that_fits():
    """A chain of 16 units passing 256 KiB values (receive buffers dominate its memory), on 4
    devices with 16 microbatches a step, on a device between the least and the most the
    candidates' floors say: the floor prunes candidates before partitioning them, none of which
    fits in the exhaustive search, and the best plan is the exhaustive search's."""
    reads = {f"u{i}": [f"u{i - 1}" if i else "x"] for i in range(16)}
    graph = dag_graph(reads, shapes={name: (256, 256) for name in reads})
    floors = []
    for plan in search(graph, profile(graph, [1.0] * 16, spec=device()), 4, global_batch=16,
                       method="dp", margin=0.0, prune=False):  # fmt: skip
        c = plan.candidate
        model = CostModel(graph, profile(graph, [1.0] * 16, spec=device()), dp_shard=c.dp_shard)
        kept = c.schedule not in INPUT_GRADIENTS_FREED
        crossed = crossings(model, input_gradients_kept=kept)
        floors.append(memory_floor(model, c.stages, c.ranks, c.microbatches, crossed, c.schedule))
    tight = profile(graph, [1.0] * 16, spec=device(sorted(floors)[len(floors) // 2]))
    every = search(graph, tight, 4, global_batch=16, method="dp", margin=0.0, prune=False)
    pruned = search(graph, tight, 4, global_batch=16, method="dp", margin=0.0)
    assert every[0].fits and pruned[0].to_json() == every[0].to_json()
    floored = {p.candidate for p in pruned if "whatever the split" in p.problem}
    assert floored, "the floor prunes"
    assert not any(p.fits for p in every if p.candidate in floored)
    assert not any(p.problem.startswith(PRUNED) for p in every)


def _all_tight(placed: list[int], microbatches: int, lead: float) -> np.ndarray:
    """The split (compute per stage, for runs of length 1) meeting every constraint of
    :func:`run_floor`'s linear program with equality: its optimum where it is non-negative."""
    rank, index = np.asarray(placed), np.arange(len(placed))
    before = index[None, :] < index[:, None]
    mine = (index[None, :] >= index[:, None]) & (rank[None, :] == rank[:, None])
    return np.linalg.solve(lead * before + microbatches * mine, np.ones(len(placed)))


@pytest.mark.parametrize("ranks, microbatches", [(1, 4), (2, 2), (4, 8), (8, 8), (32, 64)])
def test_run_floor_of_one_stage_per_rank_is_the_pipeline_fill(ranks, microbatches):
    assert run_floor(list(range(ranks)), microbatches, 1.0) == pytest.approx(
        1 / (1 - (1 - 1 / microbatches) ** ranks)
    )


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("ranks, per_rank, microbatches", [(2, 2, 4), (4, 2, 8), (8, 4, 16)])
def test_run_floor_is_the_linear_programs_optimum(schedule, ranks, per_rank, microbatches):
    """Where the split meeting every constraint is a split (no stage below 0), primal and dual
    agree: the floor is the program's optimum, not only a bound; it is above each rank's share
    (the fill) and falls as the stages ahead delay the others less."""
    if schedule in V_SHAPED and per_rank != 2:
        pytest.skip("V-shaped schedules run two stages per rank")
    placed = placement(schedule, ranks * per_rank, ranks)
    tight = _all_tight(placed, microbatches, 1.0)
    assert tight.min() >= -1e-12
    floor = run_floor(placed, microbatches, 1.0)
    assert floor == pytest.approx(1 / tight.sum())
    assert floor > microbatches / ranks
    assert run_floor(placed, microbatches, 0.3) < floor


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", *MULTI_STAGE])
def test_no_simulated_run_beats_the_run_floor(schedule):
    """Splits simulated under each schedule, each stage's forward at least a given share of its
    compute: the linear program's own optimum (the split the floor is tightest for) and random
    ones (idle stages among them). No run is shorter than the floor of its compute, with the
    whole compute delaying the stages after it, or where the schedule splits its backward, the
    forward's least share."""
    rng = random.Random(schedule)
    per_rank = 1 if schedule in ("1f1b", "gpipe") else 2
    ran = 0
    for trial in range(30):
        ranks = rng.choice([2, 4, 8])
        stages, microbatches = ranks * per_rank, ranks * rng.choice([1, 2, 3])
        placed = placement(schedule, stages, ranks)
        share = rng.uniform(0.1, 0.6)  # the least forward share of any stage
        lead = share if schedule in SPLIT_BACKWARD else 1.0
        if trial % 3 == 0:  # the program's optimum, each stage's forward at the least share
            compute = np.clip(_all_tight(placed, microbatches, lead), 0.0, None).tolist()
            parts = [share] * stages
        else:
            compute = [rng.choice([0.0, rng.uniform(0, 1), rng.uniform(0, 10)]) for _ in placed]
            parts = [rng.uniform(share, 0.9) for _ in placed]
        costs = PipelineCosts(
            forward=[c * part for c, part in zip(compute, parts)],
            backward=[c * (1 - part) for c, part in zip(compute, parts)],
            activations=[0.0] * stages,
            static_memory=[0.0] * ranks,
            send_forward=[0.0] * stages,
            send_backward=[0.0] * stages,
            device_of_stage=placed,
        )
        try:
            run = simulate_schedule(schedule, costs, microbatches).step_time
        except PartitionError:  # a shape torch's schedule refuses (dualpipev's fewest)
            continue
        ran += 1
        floor = sum(compute) * run_floor(placed, microbatches, lead)
        assert run >= floor * (1 - 1e-9), (trial, placed, microbatches)
    assert ran >= 20
