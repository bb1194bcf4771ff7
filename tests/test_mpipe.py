"""autopipe/partitioning/mpipe.py: Mixed-Pipe on hand-built chains: coarsening into intervals,
bin packing, more stages than devices, and the memory of a deliberately small device."""

from __future__ import annotations

import pytest

from autopipe.errors import PartitionError
from autopipe.partitioning import CostModel, partition
from autopipe.partitioning.mpipe import coarsen, pack, solve_mpipe

from graphs import chain_graph, device, profile

GiB = 2**30
#: parameter bytes per unit in the memory tests: AdamW holds 4 of them (weight, gradient, two
#: moments) and one more of temporaries while it steps, 5 x 256 MiB = 1.25 GiB a unit
PARAMETER = 2**28
#: compute of the memory tests' chain: unit 0 is heavy, so with room to spare a device holds
#: three light stages
COMPUTE = [4, 1, 1, 1, 1, 1, 1, 2]
#: microbatches per step: fewer than the default (two per stage) keep the simulations short
MICROBATCHES = 8


def model_of(compute, **options) -> CostModel:
    graph = chain_graph(len(compute), shapes=options.pop("shapes", None))
    return CostModel(graph, profile(graph, compute, **options), microbatches=MICROBATCHES)


def chain_with_parameters():
    return chain_graph(8, params={f"u{i}": (PARAMETER // 4,) for i in range(8)})


def test_coarsen_joins_zero_weight_units_to_the_next():
    assert coarsen(model_of([0, 1, 1, 1, 1, 1]), 6) == [[0, 1], [2], [3], [4], [5]]
    assert coarsen(model_of([1, 0, 0, 1]), 4) == [[0], [1, 2, 3]]


def test_coarsen_joins_communication_bound_units_to_their_consumer():
    """u1's 8 MB output takes 16 s over a 1 MB/s link (forward and back), more than its 1 s of
    compute: cutting after it is never worth it."""
    slow = model_of([1, 1, 1, 1], shapes={"u1": (2000, 1000)}, spec=device(link_bandwidth=1e6))
    assert coarsen(slow, 4) == [[0], [1, 2], [3]]
    assert coarsen(model_of([1, 1, 1, 1], shapes={"u1": (2000, 1000)}), 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_coarsen_gives_at_most_size_intervals(size):
    clusters = coarsen(model_of([2, 1, 3, 1, 1, 4, 1, 1, 2, 1]), size)
    assert len(clusters) == size
    assert [u for cluster in clusters for u in cluster] == list(range(10))  # intervals, in order


def test_pack_longest_processing_time_first():
    """5 -> d0, 4 -> d1, 3 -> d1 (4 < 5), 3 -> d0 (5 < 7), 1 -> d1 (7 < 8)."""
    model = model_of([1, 1])
    assert pack(model, [5, 4, 3, 3, 1], [0] * 5, 2) == [0, 1, 1, 0, 1]
    assert pack(model, [1, 1, 1], [0] * 3, 3) == [0, 1, 2]


def test_pack_respects_memory():
    model = model_of([1, 1], spec=device(memory=10.0))
    assert pack(model, [5, 4, 1], [4, 6, 4], 2) == [0, 1, 1]  # d1 is the lighter, just fits
    assert pack(model, [5, 4, 1], [4, 6, 5], 2) == [0, 1, 0]  # d1 is full: onto d0
    assert pack(model, [5, 4, 1], [4, 6, 7], 2) is None  # 7 bytes fit on neither device


@pytest.mark.parametrize("stages, devices", [(6, 4), (5, 2), (4, 4)])
def test_more_stages_than_devices(stages, devices):
    model = model_of(COMPUTE)
    stage_of_unit, device_of_stage = solve_mpipe(model, stages, devices)
    assert sorted(set(stage_of_unit)) == list(range(stages))
    assert stage_of_unit == sorted(stage_of_unit)  # a chain admits contiguous stages only
    assert len(device_of_stage) == stages
    assert sorted(set(device_of_stage)) == list(range(devices))  # every device has work
    assert device_of_stage[0] == 0  # devices numbered in order of first use
    prediction = model.evaluate(stage_of_unit, device_of_stage, schedule="auto")
    assert prediction.bottleneck >= model.lower_bound(devices) - 1e-12


def test_memory_decides_the_placement():
    """Eight stages of one unit each on four devices. With room to spare, Mixed-Pipe gives the
    device of the heavy first stage nothing else and another device three light stages; a
    device of 3 GiB holds two units (2.5 GiB), not three (3.75 GiB): two stages each."""
    graph = chain_with_parameters()
    roomy = CostModel(graph, profile(graph, COMPUTE), microbatches=MICROBATCHES)
    stage_of_unit, devices = solve_mpipe(roomy, 8, 4)
    assert stage_of_unit == list(range(8))
    assert sorted(devices.count(d) for d in range(4)) == [1, 2, 2, 3]
    assert devices.count(devices[0]) == 1
    assert max(roomy.evaluate(stage_of_unit, devices, schedule="auto").device_memory) > 3 * GiB

    tight = profile(graph, COMPUTE, spec=device(memory=3 * GiB))
    result = partition(
        graph, tight, 8, num_devices=4, method="mpipe", microbatches=MICROBATCHES
    ).to_json()
    assert result["stage_of_unit"] == list(range(8))
    assert [result["device_of_stage"].count(d) for d in range(4)] == [2, 2, 2, 2]
    assert result["settings"]["schedule"] == "auto"  # several stages per device
    assert result["recompute"] == []  # it fits without recomputation
    peaks = result["predicted"]["device_memory"]
    assert 2.5 * GiB <= min(peaks) and max(peaks) <= 3 * GiB


def test_too_small_a_device_is_refused_clearly():
    """One unit's state takes 1.25 GiB: no placement fits a device of 1 GiB, even recomputing;
    the refusal gives each rank's need against the capacity, and that neither more devices nor
    sharding make it fit (what each still needs)."""
    graph = chain_with_parameters()
    small = profile(graph, COMPUTE, spec=device(memory=GiB))
    with pytest.raises(PartitionError) as failure:
        partition(graph, small, 8, num_devices=4, method="mpipe", microbatches=MICROBATCHES)
    message = str(failure.value)
    assert "fits the memory of A100 (1.00 GiB per device) even recomputing" in message
    assert "they need 2.50 GiB, 2.50 GiB, 2.50 GiB and 2.50 GiB on ranks 0 to 3" in message
    assert "no number of devices up to 8 does (on 8 a device still needs 1.25 GiB)" in message
