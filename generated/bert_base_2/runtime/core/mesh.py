"""Where each global rank of a run sits on its device mesh.

Copied into every generated pipeline as ``runtime/core/mesh.py``; it needs only the standard
library. The world of a run is a mesh of the pipeline ranks (``pp``), the replicas of each
stage (``dp_replicate``) and its shards (``dp_shard``), and within each of those places the
tensor-parallel ranks (``tp``, always innermost: they exchange every layer's activations, so
they share a node). The package's ``pipeline.json`` says in which order the first three go
(``Pipeline.mesh``, outermost first), and the global ranks number the mesh row-major in that
order, then ``tp``, as ``init_device_mesh`` numbers a mesh of those dimensions: the innermost
dimension's ranks are consecutive, and torchrun starts consecutive ranks on one node. Pipeline
innermost (the default), a pipeline's ranks share a node when they fit; shards innermost, the
shards of a stage do, and the pipeline runs across nodes.

:class:`RankMesh` is the one place a global rank is computed from its place (pipeline rank,
data-parallel rank) and back. A data-parallel rank is replica x dp_shard + shard, in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

from .pipeline import MESH_DIMENSIONS, PIPELINE_INNERMOST, Pipeline

__all__ = ["RankMesh"]


@dataclass(frozen=True)
class RankMesh:
    """The mesh of a run: ``pp`` pipeline ranks, ``dp_replicate`` replicas of ``dp_shard``
    shards each, in the ``order`` (outermost first, a permutation of ``MESH_DIMENSIONS``) that
    numbers the global ranks."""

    pp: int
    dp_replicate: int = 1
    dp_shard: int = 1
    order: tuple[str, ...] = PIPELINE_INNERMOST
    tp: int = 1  # tensor-parallel ranks per place, innermost

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(MESH_DIMENSIONS):
            raise ValueError(
                f"a mesh order is an order of {', '.join(MESH_DIMENSIONS)}, got {self.order}"
            )
        if min(self.pp, self.dp_replicate, self.dp_shard, self.tp) < 1:
            raise ValueError(
                f"a mesh has 1 or more ranks on each dimension, got pp {self.pp}, dp_replicate "
                f"{self.dp_replicate}, dp_shard {self.dp_shard}, tp {self.tp}"
            )

    @classmethod
    def of(cls, pipeline: Pipeline, dp: int = 1, dp_shard: int = 1) -> RankMesh:
        """The mesh of ``pipeline`` run with ``--dp`` replicas of ``--dp-shard`` shards (and
        its tensor-parallel degree)."""
        return cls(pipeline.num_ranks, dp, dp_shard, pipeline.mesh, pipeline.tp)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks per pipeline rank: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.pp * self.dp_size * self.tp

    def size(self, dimension: str) -> int:
        """The ranks along ``dimension`` (one of ``MESH_DIMENSIONS``)."""
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "pp": self.pp}
        return sizes[dimension]

    @property
    def sizes(self) -> tuple[int, ...]:
        """The size of each dimension, in :attr:`order` (``tp`` not included: it follows)."""
        return tuple(self.size(dimension) for dimension in self.order)

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int = 0) -> int:
        """The global rank of pipeline rank ``pp_rank`` in data-parallel rank ``dp_rank``, its
        tensor-parallel rank ``tp_rank``."""
        _check_index(pp_rank, self.pp, "pipeline rank")
        _check_index(dp_rank, self.dp_size, "data-parallel rank")
        _check_index(tp_rank, self.tp, "tensor-parallel rank")
        place = {
            "dp_replicate": dp_rank // self.dp_shard,
            "dp_shard": dp_rank % self.dp_shard,
            "pp": pp_rank,
        }
        rank = 0
        for dimension in self.order:
            rank = rank * self.size(dimension) + place[dimension]
        return rank * self.tp + tp_rank

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where global rank ``rank`` sits on each dimension (``tp`` included), by name."""
        _check_index(rank, self.world, "global rank")
        rank, tp_rank = divmod(rank, self.tp)
        place = {"tp": tp_rank}
        for dimension in reversed(self.order):
            rank, place[dimension] = divmod(rank, self.size(dimension))
        return place

    def tp_rank_of(self, rank: int) -> int:
        """The tensor-parallel rank of global rank ``rank``: which shard of each projection."""
        return rank % self.tp

    def pp_rank_of(self, rank: int) -> int:
        """The pipeline rank of global rank ``rank``: which stages it runs."""
        return self.coordinates(rank)["pp"]

    def dp_rank_of(self, rank: int) -> int:
        """The data-parallel rank of global rank ``rank``: which part of each batch it reads."""
        place = self.coordinates(rank)
        return place["dp_replicate"] * self.dp_shard + place["dp_shard"]

    def dp_ranks(self, pp_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The global ranks of pipeline rank ``pp_rank``'s data-parallel ranks (its replicas and
        shards, which run the same stages), by data-parallel rank, at ``tp_rank``."""
        return tuple(self.global_rank(pp_rank, d, tp_rank) for d in range(self.dp_size))

    def pipeline_ranks(self, dp_rank: int, tp_rank: int = 0) -> tuple[int, ...]:
        """The global ranks of data-parallel rank ``dp_rank``'s pipeline, by pipeline rank, at
        ``tp_rank`` (each tensor-parallel rank sends to its peers)."""
        return tuple(self.global_rank(p, dp_rank, tp_rank) for p in range(self.pp))

    def tp_ranks(self, pp_rank: int, dp_rank: int) -> tuple[int, ...]:
        """The global ranks a place's projections are sharded over, by tensor-parallel rank."""
        return tuple(self.global_rank(pp_rank, dp_rank, t) for t in range(self.tp))

    def place(self, pp_rank: int, dp_rank: int) -> int:
        """A number for the place (``pp_rank``, ``dp_rank``) that is the same in every mesh
        order: its global rank in the default order (pipeline innermost), data-parallel rank x
        pp + pipeline rank. It seeds the place's random streams and names its random states in
        a checkpoint, so that a package trains and resumes alike whatever its order. The
        tensor-parallel ranks of a place share it: their replicated computations draw the same
        random numbers."""
        return RankMesh(self.pp, self.dp_replicate, self.dp_shard).global_rank(pp_rank, dp_rank)

    def describe(self) -> str:
        """The mesh in words: ``mesh pp 2 x dp_replicate 1 x dp_shard 2, outermost first``
        (the innermost dimension's ranks consecutive; ``x tp N`` last with tensor
        parallelism)."""
        dimensions = [f"{d} {self.size(d)}" for d in self.order]
        if self.tp > 1:
            dimensions.append(f"tp {self.tp}")
        return f"mesh {' x '.join(dimensions)}, outermost first"


def _check_index(value: int, size: int, what: str) -> None:
    """Refuses ``value`` outside ``0 .. size - 1``."""
    if not 0 <= value < size:
        raise ValueError(f"{what} {value} is outside 0 .. {size - 1}")
