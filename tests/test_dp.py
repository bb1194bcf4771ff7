"""autopipe/partitioning/dp.py: the exact contiguous partitioner on hand-built chains whose
optimum is worked out by hand (compute, communication, memory)."""

from __future__ import annotations

import pytest

from autopipe.errors import DeviceMemoryError, PartitionError
from autopipe.partitioning import CostModel, partition
from autopipe.partitioning.dp import (
    BLOCK_TOLERANCE,
    ContiguousSplits,
    between_blocks_or_anywhere,
    solve_contiguous,
)

from graphs import chain_graph, device, profile

GiB = 2**30


def model_of(compute, **options) -> CostModel:
    graph = chain_graph(len(compute), shapes=options.pop("shapes", None))
    return CostModel(graph, profile(graph, compute, **options))


def contiguous(stage_of_unit: list[int], stages: int) -> bool:
    return stage_of_unit == sorted(stage_of_unit) and sorted(set(stage_of_unit)) == list(
        range(stages)
    )


@pytest.mark.parametrize(
    "compute, stages, expected",
    [
        # the heavy last unit alone; any other cut puts 6 in the last stage
        ([1, 1, 1, 1, 1, 5], 2, [0, 0, 0, 0, 0, 1]),
        # bottleneck 5 either way; 3 | 3 | 5 is the most balanced (least sum of squares)
        ([1, 2, 1, 1, 1, 5], 3, [0, 0, 1, 1, 1, 2]),
        # 4 | 4 | 4: the only split reaching the lower bound
        ([2, 2, 1, 3, 4, 0], 3, [0, 0, 1, 1, 2, 2]),
        ([3, 1, 1, 1], 1, [0, 0, 0, 0]),
        ([3, 1, 1, 1], 4, [0, 1, 2, 3]),
    ],
)
def test_bottleneck_optimal_cut(compute, stages, expected):
    model = model_of(compute)
    assert solve_contiguous(model, stages) == expected


def test_ties_keep_the_invariants_and_reach_the_lower_bound():
    """1,1,1,1,1,5 into 3: 5 is the lower bound; the five light units split 2 | 3 or 3 | 2."""
    model = model_of([1, 1, 1, 1, 1, 5])
    stage_of_unit = solve_contiguous(model, 3)
    assert contiguous(stage_of_unit, 3)
    assert stage_of_unit[4:] == [1, 2]  # the heavy unit alone, its neighbour before it
    assert sorted(stage_of_unit.count(s) for s in (0, 1)) == [2, 3]
    prediction = model.evaluate(stage_of_unit)
    assert model.lower_bound(3) == 5.0  # max(10 / 3, 5)
    assert prediction.bottleneck == pytest.approx(5.0, rel=1e-9)


def test_a_slow_link_moves_the_cut_off_a_large_value():
    """1,3,1,3 splits 4 | 4 after u1, unless u1's output (8 MB) crosses a 1 MB/s link: 8 s
    each way. Then 5 | 3 after u2 beats 1 | 7 after u0."""
    shapes = {"u1": (2000, 1000)}
    assert solve_contiguous(model_of([1, 3, 1, 3], shapes=shapes), 2) == [0, 0, 1, 1]
    slow = model_of([1, 3, 1, 3], shapes=shapes, spec=device(link_bandwidth=1e6))
    assert slow.boundary_bytes() == ([32.0, 8e6, 32.0], [32.0, 8e6, 32.0])
    assert solve_contiguous(slow, 2) == [0, 0, 0, 1]
    assert slow.evaluate([0, 0, 0, 1]).bottleneck == pytest.approx(5.0, rel=1e-4)
    assert slow.evaluate([0, 0, 1, 1]).bottleneck == pytest.approx(16.0, rel=1e-4)


def test_memory_excludes_the_balanced_cut():
    """Four equal units of 1 GiB of activations on 2 stages (1F1B): stage 0 holds 2 microbatches
    in flight, stage 1 one. On 3.5 GiB, stage 0 can take one unit (2 GiB), not two (4 GiB)."""
    roomy = model_of([1, 1, 1, 1], activations=[GiB] * 4)
    assert solve_contiguous(roomy, 2) == [0, 0, 1, 1]
    tight = model_of([1, 1, 1, 1], activations=[GiB] * 4, spec=device(memory=3.5 * GiB))
    assert solve_contiguous(tight, 2) == [0, 1, 1, 1]


def test_no_split_fits_without_recomputing_but_one_does_recomputing():
    """On 1.5 GiB no split keeps its activations (the least needs 2 GiB on stage 0 and 3 GiB on
    stage 1): refused where recomputation is only the last resort; recomputing to balance,
    stages that recompute make the split (the activations need no room then)."""
    model = model_of([1, 1, 1, 1], activations=[GiB] * 4, spec=device(memory=1.5 * GiB))
    with pytest.raises(DeviceMemoryError, match="no split into 2 stages fits the memory of A100"):
        solve_contiguous(model.without_balancing_recomputation(), 2)
    assert contiguous(solve_contiguous(model, 2), 2)


def test_more_stages_than_units():
    with pytest.raises(PartitionError, match="5 stages need at least 5 units, but the graph has 4"):
        solve_contiguous(model_of([1, 1, 1, 1]), 5)


def test_solutions_are_memoised_per_stage_count():
    model = model_of([1, 1, 1, 1, 1, 5])
    first = solve_contiguous(model, 2)
    assert model.contiguous_optimum == {2: [0, 0, 0, 0, 0, 1]}
    first[0] = 7  # the caller gets a copy
    assert solve_contiguous(model, 2) == [0, 0, 0, 0, 0, 1]


def test_method_dp_through_partition():
    """``--method dp`` is the contiguous optimum on devices 0..k-1 (1F1B, one stage each)."""
    graph = chain_graph(6)
    result = partition(graph, profile(graph, [1, 1, 1, 1, 1, 5]), 2, method="dp").to_json()
    assert result["stage_of_unit"] == [0, 0, 0, 0, 0, 1]
    assert result["device_of_stage"] == [0, 1]
    assert result["settings"]["schedule"] == "1f1b"
    assert result["settings"]["microbatches"] == 4
    assert result["predicted"]["bottleneck"] == 5.0
    assert result["predicted"]["lower_bound"] == 5.0


# -- solving on block boundaries (issue 23) ------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_model():
    """GPT-2 with 24 blocks (each layer's units stay together unless cutting inside pays),
    built on the meta device."""
    from autopipe.profiling import profile as profile_graph
    from autopipe.spec import load_example
    from autopipe.tracing import trace

    from conftest import spec

    graph = trace(load_example(spec("gpt2_meta_24")))
    return graph, profile_graph(graph)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule, shard", [("1f1b", 1), ("gpipe", 2)])
def test_a_solve_on_the_cut_positions_alone_equals_the_masked_one(
    gpt2_model, stages, schedule, shard
):
    """Solving on the block boundaries alone (the runs of units between them as single units)
    gives the same split and bottleneck as masking every other position, with and without a
    reserve and a bound, on a device that makes some stages recompute."""
    graph, prof = gpt2_model
    for capacity in (None, 0.25):
        used = prof if capacity is None else _smaller(prof, capacity)
        model = CostModel(graph, used, schedule=schedule, microbatches=8, dp_shard=shard)
        split = ContiguousSplits(model, stages)
        assert int(split.between_blocks.sum()) < model.num_units + 1  # some positions masked
        reserve = [float(2**20 * (k + 1)) for k in range(stages)]
        full = split.solve_masked()
        for arguments in ((), (reserve,), (None, full.bottleneck * 1.5), (reserve, 1e-12)):
            fast = split.solve(split.between_blocks, *arguments)
            masked = split.solve_masked(split.between_blocks, *arguments)
            assert (fast is None) == (masked is None)
            if fast is not None:
                assert fast.stage_of_unit == masked.stage_of_unit
                assert fast.bottleneck == masked.bottleneck


def _smaller(prof, fraction):
    """``prof`` on a device with ``fraction`` of the memory the first stage of a 1-stage split
    would need: stages must recompute or shrink."""
    import dataclasses

    need = sum(u.activations for u in prof.units) * 8 + 16 * sum(u.parameters for u in prof.units)
    return dataclasses.replace(
        prof, device=dataclasses.replace(prof.device, memory=need * fraction)
    )


def test_the_block_split_is_kept_exactly_when_the_old_rule_keeps_it(gpt2_model):
    """Solving the split between blocks first and the one cut anywhere only below its
    tolerance decides as solving both in full did: the block split when its bottleneck is
    within BLOCK_TOLERANCE of cutting anywhere (few stages here), else cutting anywhere (more
    stages than the 24 blocks share evenly)."""
    graph, prof = gpt2_model
    kept = []
    for stages in (2, 3, 4, 5, 16, 20):
        model = CostModel(graph, prof, schedule="1f1b", microbatches=8)
        split = ContiguousSplits(model, stages)
        anywhere = split.solve_masked()
        blocks = split.solve_masked(
            split.between_blocks,
            within=None if anywhere is None else anywhere.bottleneck * (1 + BLOCK_TOLERANCE),
        )
        chosen, cuts = between_blocks_or_anywhere(split)
        expected = blocks if blocks is not None else anywhere
        assert chosen.stage_of_unit == expected.stage_of_unit
        assert chosen.bottleneck == expected.bottleneck
        assert (cuts is not None) == (blocks is not None)
        kept.append(blocks is not None)
    assert any(kept) and not all(kept)  # both ways decided
