"""autopipe/runtime/core/region_rng.py: inside tensor-parallel regions each rank draws from a
stream of its own, derived from the shared stream, which stays in step on every rank; without
tensor parallelism nothing changes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from autopipe.runtime.core.region_rng import on_rank_stream, set_tensor_parallel_rank


@pytest.fixture(autouse=True)
def _one_rank():
    yield
    set_tensor_parallel_rank(0, 1)


def _draws(rank: int, degree: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """What a region draws on ``rank``, and what the shared stream draws after it."""
    set_tensor_parallel_rank(rank, degree)
    torch.manual_seed(seed)
    inside = on_rank_stream(torch.rand, 8)
    return inside, torch.rand(8)


def test_each_rank_draws_its_own_and_the_shared_stream_stays_in_step():
    (first, after_first), (second, after_second) = _draws(0, 2), _draws(1, 2)
    assert not torch.equal(first, second)  # heads h and h + H/2: not the same mask
    assert torch.equal(after_first, after_second)  # the replicated code's draws agree
    again, _ = _draws(1, 2)
    assert torch.equal(again, second)  # the same shared state: the same stream


def test_two_regions_draw_differently():
    set_tensor_parallel_rank(0, 2)
    torch.manual_seed(0)
    one, two = on_rank_stream(torch.rand, 8), on_rank_stream(torch.rand, 8)
    assert not torch.equal(one, two)


def test_without_tensor_parallelism_it_draws_what_the_model_draws():
    torch.manual_seed(0)
    plain = torch.rand(8), torch.rand(8)
    assert all(torch.equal(a, b) for a, b in zip(_draws(0, 1), plain))


def test_recomputation_draws_the_same_masks():
    """Activation checkpointing restores the shared stream's state to recompute: the region's
    stream, derived from it, gives the same dropout masks, so the gradients are those of the
    first forward's."""
    set_tensor_parallel_rank(1, 2)
    x = torch.randn(64, requires_grad=True)

    def region(value):
        return on_rank_stream(torch.nn.functional.dropout, value, 0.5, training=True)

    torch.manual_seed(3)
    out = region(x)
    out.sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    recomputed = checkpoint(region, x, use_reentrant=False)
    recomputed.sum().backward()
    assert torch.equal(recomputed, out) and torch.equal(x.grad, plain)


def test_compiled_code_calls_it_as_it_stands():
    """torch.compile leaves the call out of its graph: a compiled function draws each rank's
    own masks, as the eager one does."""
    set_tensor_parallel_rank(1, 2)

    def region(value):
        return on_rank_stream(torch.nn.functional.dropout, value * 2, 0.5, training=True)

    x = torch.randn(64)
    torch.manual_seed(5)
    eager = region(x)
    torch.manual_seed(5)
    compiled = torch.compile(region, backend="eager")(x)
    assert torch.equal(compiled, eager)


def test_a_rank_outside_its_degree_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel rank 2 is not one of 2"):
        set_tensor_parallel_rank(2, 2)
