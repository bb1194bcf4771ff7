"""The cluster's network (autopipe/partitioning/network.py): transfers and collectives against
hand-computed ring and tree figures within a node, across two and across many; where the mesh
order puts ranks; and the cost model and the partitioner reading it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from autopipe.compiler import CompileOptions, partition_step, plan_step, trace_step
from autopipe.partitioning import CostModel, Partition, partition
from autopipe.partitioning.network import Network
from autopipe.partitioning.simulator import simulate_schedule
from autopipe.profiling import device_spec, profile, with_link
from autopipe.profiling.devices import DeviceSpec, RateTable
from autopipe.report.summary import format_partition
from autopipe.runtime.core.mesh import RankMesh
from autopipe.runtime.core.pipeline import PIPELINE_INNERMOST, SHARDS_INNERMOST
from autopipe.runtime.core.schedules import Action
from autopipe.spec import load_example

from conftest import spec

H100 = device_spec("h100")
NVLINK, NVLINK_LATENCY = 450e9, 2e-6
IB, IB_LATENCY = 50e9, 5e-6
GB = 1e9


def test_h100_nodes_have_nvlink_inside_and_a_400_gbit_nic_per_gpu():
    network = Network(H100, 8)
    assert (network.node_link.bandwidth, network.node_link.latency) == (NVLINK, NVLINK_LATENCY)
    assert (network.nic.bandwidth, network.nic.latency) == (IB, IB_LATENCY)
    assert "400 Gb/s" in network.nic.name


def test_transfers_cross_the_link_between_the_two_ranks():
    network = Network(H100, 8)
    assert network.transfer(GB, 3, 3) == 0.0
    assert network.transfer(GB, 0, 7) == pytest.approx(NVLINK_LATENCY + GB / NVLINK)
    assert network.transfer(GB, 7, 8) == pytest.approx(IB_LATENCY + GB / IB)  # next node


def test_ring_within_one_node():
    """8 ranks of one node: 7 steps, each rank receiving 7/8 of the bytes over NVLink."""
    network = Network(H100, 8)
    ranks = list(range(8))
    assert network.collective("all_gather", GB, ranks) == pytest.approx(
        7 * NVLINK_LATENCY + 7 / 8 * GB / NVLINK
    )
    assert network.collective("reduce_scatter", GB, ranks) == network.collective(
        "all_gather", GB, ranks
    )
    # all-reduce of a large message: the ring (reduce-scatter, then all-gather)
    assert network.collective("all_reduce", GB, ranks) == pytest.approx(
        2 * (7 * NVLINK_LATENCY + 7 / 8 * GB / NVLINK)
    )


def test_collectives_measured_between_two_ranks_cost_a_group_within_a_node():
    """A calibrated spec's ``collectives`` (bus bandwidth by the bytes a rank sends, measured
    between two ranks) cost a group within one node: an all-reduce of n bytes over 2 ranks
    sends n at the table's rate for n; over 4 ranks 3/2 n at its rate for that, plus the 2 x 2
    ring steps past the two ranks' own at the node's latency; a gather sends (k - 1) / k of
    its bytes; in 3 calls each call pays its own; a message below the table's smallest takes
    that one's time; a collective the table lacks, and a group
    across nodes, take the ring as before."""
    slow, fast = 1e9, 2e9  # bytes/s at 1 MB sent and at 4 MB and more
    rates = RateTable(((1e6, slow), (4e6, fast)))
    measured = replace(H100, collectives={"all_reduce": rates, "all_gather": rates})
    network, plain = Network(measured, 8), Network(H100, 8)
    assert network.collective("all_reduce", 1e6, [0, 1]) == pytest.approx(1e6 / slow)
    # below the table's smallest message: that one's time, its latencies
    assert network.collective("all_reduce", 4, [0, 1]) == pytest.approx(1e6 / slow)
    assert network.collective("all_reduce", 8e6, [0, 1, 2, 3]) == pytest.approx(
        12e6 / fast + 4 * NVLINK_LATENCY
    )
    assert network.collective("all_gather", 8e6, [0, 1]) == pytest.approx(4e6 / fast)
    ring = network.ring([0, 1])
    assert ring.time("all_gather", 6e6, calls=3) == pytest.approx(3 * 1e6 / slow)
    for kind, ranks in (("reduce_scatter", [0, 1]), ("all_reduce", [0, 8])):
        assert network.collective(kind, 8e6, ranks) == plain.collective(kind, 8e6, ranks)
    # --link: the collectives measured over the old link go with it
    relinked = Network(with_link(measured, "nvlink4"), 8)
    assert relinked.collective("all_reduce", 8e6, [0, 1]) == plain.collective(
        "all_reduce", 8e6, [0, 1]
    )


def test_ring_across_two_full_nodes_runs_over_every_nic():
    """16 ranks, 8 on each of two nodes: one ring per NIC, 8 x 50 GB/s leave each node (below
    NVLink's 450); of a chunk's 15 steps 2 cross between the nodes, 13 stay within one."""
    network = Network(H100, 8)
    assert network.collective("all_gather", GB, list(range(16))) == pytest.approx(
        2 * IB_LATENCY + 13 * NVLINK_LATENCY + 15 / 16 * GB / (8 * IB)
    )


def test_a_node_with_one_nic_shares_it():
    """Servers of PCIe cards with one Ethernet NIC per node: the 8 ranks of a node share its
    12.5 GB/s across nodes."""
    l40s = device_spec("l40s")
    assert l40s.nics_per_node == 1
    network = Network(l40s, 8)
    latency = 2 * network.nic.latency + 13 * network.node_link.latency
    assert network.collective("all_gather", GB, list(range(16))) == pytest.approx(
        latency + 15 / 16 * GB / 12.5e9
    )


def test_ring_with_one_rank_per_node_has_one_nic_per_rank():
    """64 ranks, one on each of 64 nodes (a shard group strided across nodes): everything
    crosses one NIC per rank."""
    network = Network(H100, 8)
    ranks = [8 * n for n in range(64)]
    expected = 63 * IB_LATENCY + 63 / 64 * GB / IB
    assert network.collective("all_gather", GB, ranks) == pytest.approx(expected)
    # ranks on two nodes, 2 each: the slowest link is min(2 NICs, NVLink)
    assert network.collective("all_gather", GB, [0, 1, 8, 9]) == pytest.approx(
        2 * IB_LATENCY + NVLINK_LATENCY + 3 / 4 * GB / (2 * IB)
    )


def test_all_reduce_takes_the_tree_for_small_messages_over_many_nodes():
    """NCCL's tuner takes the double binary tree where its log(nodes) latencies beat the
    ring's 2 (k - 1); the ring where bandwidth dominates."""
    network = Network(H100, 8)
    ranks = [8 * n for n in range(64)]  # 64 nodes, one rank each
    small = 1e3
    tree = 2 * (6 * IB_LATENCY) + 2 * small / IB
    ring = 2 * (63 * IB_LATENCY + 63 / 64 * small / IB)
    assert tree < ring
    assert network.collective("all_reduce", small, ranks) == pytest.approx(tree)
    large = 10 * GB
    assert network.collective("all_reduce", large, ranks) == pytest.approx(
        2 * (63 * IB_LATENCY + 63 / 64 * large / IB)
    )
    with pytest.raises(ValueError, match="unknown collective"):
        network.collective("broadcast", small, ranks)


def test_mesh_orders_place_shards_or_pipelines_together():
    """pp innermost: a pipeline's 8 ranks fill a node and each stage's 8 shards are 8 apart,
    one per node; shards innermost: the reverse (train.py builds its mesh in this order)."""
    assert RankMesh(8, 1, 8, PIPELINE_INNERMOST).global_rank(5, 3) == 3 * 8 + 5
    assert RankMesh(8, 1, 8, SHARDS_INNERMOST).global_rank(5, 3) == 5 * 8 + 3
    inner = Network(H100, 8, PIPELINE_INNERMOST)
    outer = Network(H100, 8, SHARDS_INNERMOST)
    assert inner.shard_group(5, 8, 8) == [5 + 8 * d for d in range(8)]  # 8 nodes
    assert outer.shard_group(5, 8, 8) == list(range(40, 48))  # node 5
    assert not outer.ring(outer.shard_group(5, 8, 8)).crosses_nodes
    assert inner.ring(inner.shard_group(5, 8, 8)).crosses_nodes
    assert inner.hop(4, 5, 8, 8) == inner.node_link
    assert outer.hop(4, 5, 8, 8) == outer.nic


def test_a_spec_without_a_network_joins_its_nodes_by_its_link(tmp_path):
    """A spec file from before networks (no network fields) reads, and costs every rank as
    before: nodes joined by its link."""
    old = {k: v for k, v in H100.to_json().items() if not k.startswith("network")}
    old.pop("link_latency")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    spec_ = device_spec(str(path))
    assert spec_.network_bandwidth is None and spec_.link_latency == 0.0
    network = Network(spec_, 8)
    assert network.nic == network.node_link
    ranks = [8 * n for n in range(4)]
    assert network.collective("all_gather", GB, ranks) == pytest.approx(3 / 4 * GB / NVLINK)


def test_specs_round_trip_and_flags_change_the_links():
    assert DeviceSpec.from_json(H100.to_json()) == H100
    changed = with_link(H100, "pcie5", "ethernet-100g")
    assert (changed.link_bandwidth, changed.network_bandwidth) == (64e9, 12.5e9)
    assert changed.network_latency == 15e-6
    bare = with_link(H100, None, "25")  # a bare bandwidth keeps the latency
    assert (bare.network_bandwidth, bare.network_latency) == (25e9, IB_LATENCY)
    with pytest.raises(Exception, match="--network 'fast' is neither a known link"):
        with_link(H100, None, "fast")
    bad = H100.to_json() | {"network_latency": -1}
    with pytest.raises(Exception, match="network_latency must be"):
        DeviceSpec.from_json(bad)


# -- the cost model and the partitioner ---------------------------------------------------------
@pytest.fixture(scope="module")
def gpt2_graph():
    return trace_step(load_example(spec("gpt2_meta_24")), CompileOptions(stages=1))


@pytest.fixture(scope="module")
def gpt2_profile(gpt2_graph):
    return profile(gpt2_graph, "analytic", H100)


def test_fsdp_collectives_cost_the_links_their_shard_group_crosses(gpt2_graph, gpt2_profile):
    """One stage's gather over 8 shards: NVLink when the shards share a node, one NIC per rank
    when they are 8 pipeline ranks apart on 8 nodes; the FSDP2 units each pay the latency."""
    inner = CostModel(
        gpt2_graph, gpt2_profile, dp_shard=8, network=Network(H100, 8, PIPELINE_INNERMOST)
    )
    outer = CostModel(
        gpt2_graph, gpt2_profile, dp_shard=8, network=Network(H100, 8, SHARDS_INNERMOST)
    )
    device_of_stage = list(range(8))
    params = [1e9] * 8
    across = inner.collective_time(params, device_of_stage, "all_gather", [3] * 8)
    within = outer.collective_time(params, device_of_stage, "all_gather", [3] * 8)
    assert across == pytest.approx([3 * 7 * IB_LATENCY + 7 / 8 * 1e9 / IB] * 8)
    assert within == pytest.approx([3 * 7 * NVLINK_LATENCY + 7 / 8 * 1e9 / NVLINK] * 8)
    # one pipeline of 8 ranks alone (no sharding): the same node, nothing collective
    assert CostModel(gpt2_graph, gpt2_profile).collective_time(params, device_of_stage) == [0.0] * 8


def test_the_partition_puts_the_heavier_traffic_inside_nodes(gpt2_graph):
    """GPT-2 in 4 stages x 8 shards on nodes of 8 joined by a slow network (0.5 GB/s per GPU,
    so that this small model's traffic shows): FSDP2 moves far more than the pipeline, so the
    plan keeps each stage's shards in a node and crosses nodes with the pipeline; the summary
    says where the ranks sit and what crosses nodes. On nodes of 32 (one node) the order
    changes nothing and the default stays."""
    slow = profile(gpt2_graph, "analytic", with_link(H100, None, "0.5"))
    part = partition(gpt2_graph, slow, 4, dp_shard=8, microbatches=8, gpus_per_node=8)
    assert part.settings.mesh == SHARDS_INNERMOST and part.settings.gpus_per_node == 8
    assert part.predicted is not None
    kinds = {(t.kind, t.crosses_nodes) for t in part.predicted.traffic}
    # the tied embedding and head sum their gradients between the first and the last stage
    assert kinds == {("fsdp2", False), ("pipeline", True), ("tied", True)}
    fsdp = next(t for t in part.predicted.traffic if t.kind == "fsdp2")
    pipe = next(t for t in part.predicted.traffic if t.kind == "pipeline")
    assert fsdp.bytes > pipe.bytes and fsdp.link == "NVLink 4" and pipe.link == "0.5 GB/s"
    forced = partition(
        gpt2_graph,
        slow,
        4,
        dp_shard=8,
        microbatches=8,
        gpus_per_node=8,
        mesh=PIPELINE_INNERMOST,
    )
    assert forced.predicted is not None
    assert forced.predicted.step_time > part.predicted.step_time
    assert {(t.kind, t.crosses_nodes) for t in forced.predicted.traffic} == {
        ("fsdp2", True),
        ("pipeline", False),
        ("tied", False),
    }
    summary = format_partition(gpt2_graph, part)
    line = next(row for row in summary.splitlines() if row.startswith("network: "))
    assert "32 ranks on 4 nodes of 8 GPUs" in line and "pp x dp_replicate x dp_shard" in line
    assert "fsdp2 within a node over NVLink 4" in line and "pipeline across nodes" in line
    assert Partition.from_json(part.to_json()) == part
    one_node = partition(gpt2_graph, slow, 4, dp_shard=8, microbatches=8, gpus_per_node=32)
    assert one_node.settings.mesh is None
    assert all(not t.crosses_nodes for t in one_node.predicted.traffic)


def test_a_cpu_plans_ranks_are_processes(gpt2_graph):
    """Costed on a CPU's spec, the summary places the ranks on nodes of processes, not GPUs, and
    the partition records the device type (absent for a GPU's)."""
    cpu = replace(H100, name="a test CPU", device_type="cpu")
    part = partition(gpt2_graph, profile(gpt2_graph, "analytic", cpu), 2, dp_shard=2)
    assert part.settings.device_type == "cpu"
    assert Partition.from_json(part.to_json()) == part
    line = next(r for r in format_partition(gpt2_graph, part).splitlines() if "network: " in r)
    assert "4 ranks on 1 node of 8 processes" in line and "GPU" not in line
    gpu = partition(gpt2_graph, profile(gpt2_graph, "analytic", H100), 2, dp_shard=2)
    assert gpu.settings.device_type is None and "device_type" not in gpu.settings.to_json()


def test_a_cpus_ranks_share_its_memory(gpt2_graph):
    """A CPU's memory is the node's: each of the processes a node runs plans with its share
    (the plan's ranks x --dp-shard, placed on nodes of --gpus-per-node as the launch script
    places them; every device a search plans for), and the summary says so; a GPU's ranks each
    have the GPU's."""
    cpu = replace(H100, name="a test CPU", device_type="cpu")
    prof = profile(gpt2_graph, "analytic", cpu)
    for options, share in (
        (CompileOptions(stages=2, dp_shard=2), 4),
        (CompileOptions(stages=2, dp_shard=2, gpus_per_node=2), 2),
        (CompileOptions(stages=3, dp_shard=2, gpus_per_node=4), 3),  # 2 nodes of 3, as launched
        (CompileOptions(stages=1), 1),
    ):
        part = partition_step(gpt2_graph, prof, options)
        assert part.costs is not None and part.costs.memory_capacity == cpu.memory / share
        summary = format_partition(gpt2_graph, part)
        assert (f"(a node's memory over its {share} processes)" in summary) == (share > 1)
    best, *_ = plan_step(gpt2_graph, prof, CompileOptions(stages=1, devices=4, search=True))
    assert best.partition is not None and best.partition.costs is not None
    assert best.partition.costs.memory_capacity == cpu.memory * (1 - 0.1) / 4  # less the margin
    sharded = CompileOptions(stages=2, dp_shard=2)
    gpu = partition_step(gpt2_graph, profile(gpt2_graph, "analytic", H100), sharded)
    assert gpu.costs is not None and gpu.costs.memory_capacity == H100.memory


def test_no_step_is_faster_than_its_traffic(gpt2_graph, gpt2_profile):
    """A pipeline run takes at least as long as the busiest rank's transfers and collectives
    that the schedule cannot hide behind the step (each kind on its link alone)."""
    for gpus_per_node in (1, 8):
        for dp_shard in (1, 4):
            part = partition(
                gpt2_graph, gpt2_profile, 4, dp_shard=dp_shard, gpus_per_node=gpus_per_node
            )
            predicted = part.predicted
            assert predicted is not None
            for traffic in predicted.traffic:
                assert predicted.step_time + predicted.once_per_step >= traffic.seconds * (
                    1 - 1e-9
                ), (gpus_per_node, dp_shard, traffic)
            moved = sum(t.bytes for t in predicted.traffic)
            assert math.isfinite(moved) and moved > 0


def test_tied_parameters_sum_their_gradients_once_per_step(gpt2_graph, gpt2_profile):
    """GPT-2's embedding and head are one parameter held by the first and the last stage: each
    step sums its gradient between their ranks (an all-reduce over 2 ranks of a node: two
    latencies and the bytes once over NVLink), which the prediction charges once per step and
    lists as tied traffic; the step also all-reduces the gradient norm (one float) over the 4
    pipeline ranks and checks that it is finite over every rank: 2 x 3 latencies each."""
    part = partition(gpt2_graph, gpt2_profile, 4, microbatches=8)
    predicted = part.predicted
    assert predicted is not None
    wte = next(p for p in gpt2_graph.params.values() if len(p.names) > 1)
    expected = 2 * NVLINK_LATENCY + wte.nbytes / NVLINK
    tied = [t for t in predicted.traffic if t.kind == "tied"]
    assert len(tied) == 1 and not tied[0].crosses_nodes
    assert tied[0].seconds == pytest.approx(expected)
    # and the step's numbers: the norm over the 4 pipeline ranks, the finite check over them
    norm = 2 * 3 * NVLINK_LATENCY + 2 * 3 / 4 * 4 / NVLINK
    assert predicted.data_parallel_time == pytest.approx(expected + 2 * norm)


def test_a_rank_holding_two_copies_of_a_tied_parameter_sums_them(gpt2_graph, gpt2_profile):
    """Where one rank holds GPT-2's embedding and head (the first and last stage of a V), it
    sums their gradients on its own: a stack of the two, a sum of the stack and a copy back
    into each (hand-computed from the spec's rates), and no collective; a rank with one copy
    all-reduces it where it lies (the tie's all-reduce alone, above)."""
    model = CostModel(gpt2_graph, gpt2_profile)
    stage_of_unit = partition(gpt2_graph, gpt2_profile, 4).stage_of_unit
    wte = next(p for p in gpt2_graph.params.values() if len(p.names) > 1)
    n, elements, spec = wte.nbytes, wte.nbytes / 4, gpt2_profile.device
    by_hand = (
        spec.operator_seconds("stack", torch.float32, 2 * elements, 4 * n)
        + spec.operator_seconds("sum", torch.float32, elements, 3 * n)
        + 2 * spec.operator_seconds(None, torch.float32, elements, 2 * n)
    )
    v_shape = [0, 1, 1, 0]
    assert model.tied_local_times(stage_of_unit, v_shape) == pytest.approx([by_hand, 0.0])
    assert model.tie_rings(stage_of_unit, v_shape) == []
    assert model.tied_local_times(stage_of_unit, [0, 1, 2, 3]) == [0.0] * 4
    predicted = model.evaluate(stage_of_unit, v_shape, "zbv")
    norm = model.scalar_reduce_time(v_shape)  # the norm's and the finite check's, 2 ranks
    assert norm == pytest.approx(2 * (2 * NVLINK_LATENCY + 4 / NVLINK))
    assert predicted.data_parallel_time == pytest.approx(by_hand + norm)


def test_a_step_all_reduces_its_numbers_over_each_group(gpt2_graph):
    """After its pipeline runs, train.py all-reduces a number or two at a time: the gradient
    norm's squares over the tensor-parallel group, the pipeline ranks and the shard group, the
    loss's mean over the last stage's shard group, and the finite check over every rank; each
    takes its group's latencies over the links it crosses (4 pipeline ranks x 4 shards, pipeline
    innermost: the shards of a pipeline rank are 4 ranks apart, over two nodes); one rank alone
    waits on none."""
    network = Network(H100, 8)
    H100_profile = profile(gpt2_graph, "analytic", H100)

    def reduced(ranks: list[int]) -> float:
        return network.collective("all_reduce", 4, ranks)

    assert CostModel(gpt2_graph, H100_profile).scalar_reduce_time([0]) == 0.0
    sharded = CostModel(gpt2_graph, H100_profile, dp_shard=4, network=network)
    pipelines = [[network.rank(p, d, 4, 4) for p in range(4)] for d in range(4)]
    shards = [network.shard_group(p, 4, 4) for p in range(4)]
    assert network.ring(shards[0]).crosses_nodes and not network.ring(pipelines[0]).crosses_nodes
    by_hand = (
        max(map(reduced, pipelines))
        + 2 * max(map(reduced, shards))  # the norm, then the loss's mean
        + reduced(list(range(16)))  # the finite check
    )
    assert sharded.scalar_reduce_time([0, 1, 2, 3]) == pytest.approx(by_hand)
    split = replace(H100_profile, divided={name: 2 for name in gpt2_graph.params})
    tensor_parallel = CostModel(gpt2_graph, split, dp_shard=4, network=network)
    assert tensor_parallel.scalar_reduce_time([0, 1, 2, 3]) == pytest.approx(
        by_hand + reduced([0, 1])
    )


def test_a_rank_waits_on_each_tensor_it_receives(gpt2_graph, gpt2_profile):
    """A spec's ``receive_overhead`` (a CPU's, which ``autopipe calibrate`` measures while the
    sender computes) is a wait of each forward that receives tensors from another rank and of
    each backward that receives gradients, once per action (an action's receives are one
    batch), apart from their compute; stages sharing a rank receive nothing; the simulated
    step waits too."""
    waiting = CostModel(
        gpt2_graph, replace(gpt2_profile, device=replace(H100, receive_overhead=1e-3))
    )
    plain = CostModel(gpt2_graph, gpt2_profile)
    stage_of_unit = partition(gpt2_graph, gpt2_profile, 4).stage_of_unit
    apart = [model.pipeline_costs(stage_of_unit, [0, 1, 2, 3]) for model in (plain, waiting)]
    assert apart[0].receive_forward == apart[0].receive_backward == []
    assert apart[1].receive_forward == [0.0, 1e-3, 1e-3, 1e-3]
    assert apart[1].receive_backward == [1e-3, 1e-3, 1e-3, 0.0]
    assert apart[1].forward == apart[0].forward and apart[1].backward == apart[0].backward
    forward, backward = Action(2, "F", 0), Action(2, "B", 0)
    assert apart[1].duration(forward) == pytest.approx(apart[0].duration(forward) + 1e-3)
    assert apart[1].duration(backward) == pytest.approx(apart[0].duration(backward) + 1e-3)
    steps = [simulate_schedule("1f1b", costs, 8).step_time for costs in apart]
    assert steps[1] > steps[0] + 8 * 2e-3  # a middle rank waits on 8 forwards and 8 backwards
    together = waiting.pipeline_costs(stage_of_unit, [0, 0, 0, 0])
    assert together.receive_forward == together.receive_backward == [0.0] * 4
