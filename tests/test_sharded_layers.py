"""autopipe/runtime/core/sharded_layers.py in this process, on a fake group: a transposed
projection computes what GPT-2's Conv1D computes; a fused projection's weight is split section
by section (rank 0 holds the first half of each of query, key and value); FSDP2 is told to shard
a fused nn.Linear's weight along its input features; checkpoints see the plain layout; a
replicated key/value projection computes its rank's head. The
training runs against PyTorch are in tests/test_tensor_parallel_training.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers.pytorch_utils import Conv1D

from autopipe.runtime.core.sharded_layers import (
    ReplicatedHeadsParallel,
    SectionedColwiseParallel,
    TransposedLinear,
    TransposedRowwiseParallel,
    fsdp_placement,
    plain_placement,
    sectioned,
    is_split,
)


@pytest.fixture
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_a_transposed_projection_computes_what_conv1d_computes():
    torch.manual_seed(0)
    conv = Conv1D(12, 8)  # GPT-2's: 8 features in, 12 out, weight [8, 12]
    nn.init.normal_(conv.bias)
    projection = TransposedLinear(8, 12)
    projection.load_state_dict(conv.state_dict())
    x = torch.randn(5, 8)
    assert torch.equal(projection(x), conv(x))
    assert [n for n, _ in projection.named_parameters()] == ["weight", "bias"]
    unbiased = TransposedLinear(8, 12, bias=False)
    assert unbiased.bias is None and torch.equal(unbiased(x), x @ unbiased.weight)


def test_a_fused_projection_is_split_section_by_section(mesh):
    """Rank 0 of 2 holds columns 0-1, 4-5 and 8-9 of a [in, 12] weight of 3 sections (the
    first half of each), its bias whole; a row projection its first input features."""
    projection = TransposedLinear(4, 12)
    with torch.no_grad():
        projection.weight.copy_(torch.arange(48.0).reshape(4, 12))
        projection.bias.copy_(torch.arange(12.0))
    SectionedColwiseParallel(sections=3)._apply(projection, mesh)
    weight, bias = projection.weight, projection.bias
    assert weight.placements == (sectioned(1, 3),) and bias.placements == (Replicate(),)
    assert weight.to_local()[0].tolist() == [0.0, 1.0, 4.0, 5.0, 8.0, 9.0]
    row = TransposedLinear(12, 4)
    TransposedRowwiseParallel()._apply(row, mesh)
    assert row.weight.placements == (Shard(0),) and row.weight.to_local().shape == (6, 4)
    assert row.bias.placements == (Replicate(),)
    linear = nn.Linear(4, 12)
    SectionedColwiseParallel(sections=3)._apply(linear, mesh)
    assert linear.weight.placements == (sectioned(0, 3),)
    with pytest.raises(NotImplementedError, match="not a Embedding"):
        SectionedColwiseParallel(sections=3)._apply(nn.Embedding(4, 4), mesh)


def test_placements_fsdp2_and_checkpoints_see(mesh):
    fused = distribute_tensor(torch.zeros(12, 4), mesh, [sectioned(0, 3)])
    transposed = distribute_tensor(torch.zeros(4, 12), mesh, [sectioned(1, 3)])
    plain = distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)])
    # FSDP2 splits a rank's part along dimension 0 as one block: a fused nn.Linear's weight
    # (split by sections along 0) is sharded along its input features instead
    assert fsdp_placement(nn.Parameter(fused)) == Shard(1)
    assert fsdp_placement(nn.Parameter(transposed)) is None
    assert fsdp_placement(nn.Parameter(plain)) is None
    assert is_split(sectioned(0, 3)) and is_split(Shard(0)) and not is_split(Replicate())
    assert not sectioned(0, 3).is_shard()  # what is_split() is for
    assert plain_placement(sectioned(1, 3)) == Shard(1)
    assert plain_placement(Replicate()) == Replicate()
    assert sectioned(0, 1) == Shard(0)


@pytest.mark.parametrize("rank, head", [(0, 0), (3, 0), (4, 1), (7, 1)])
def test_replicated_heads_compute_the_head_each_ranks_queries_read(rank, head):
    """2 key/value heads at degree 8: ranks 0-3 compute head 0, ranks 4-7 head 1 (the head
    their query heads read), from the whole projection each holds as plain parameters."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        dense = nn.Linear(16, 2 * 4)
        projection = nn.Linear(16, 2 * 4)
        projection.load_state_dict(dense.state_dict())
        ReplicatedHeadsParallel(heads=2)._apply(projection, mesh)
        assert type(projection.weight) is nn.Parameter  # not a DTensor: held whole
        x = torch.randn(3, 16)
        assert torch.equal(projection(x), dense(x)[:, head * 4 : (head + 1) * 4])
        with pytest.raises(ValueError, match="cannot be shared among 8"):
            ReplicatedHeadsParallel(heads=3)._apply(nn.Linear(16, 12), mesh)
    finally:
        dist.destroy_process_group()
