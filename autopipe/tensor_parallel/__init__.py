"""Tensor parallelism found in the graph (issue 45): the regions Megatron splits, for any model
(:mod:`.regions`), as an artefact of their own (:mod:`.artifact`), and what a package shards at a
degree (:mod:`.plan`)."""

from .artifact import ColumnShard, Region, TensorParallelRegions
from .plan import (
    COLWISE,
    EMBEDDING,
    LINEAR,
    ROWWISE,
    ShardedModule,
    ShardingPlan,
    sharding_plan,
)
from .regions import MAX_DEGREE, find_regions

__all__ = [
    "COLWISE",
    "EMBEDDING",
    "LINEAR",
    "MAX_DEGREE",
    "ROWWISE",
    "ColumnShard",
    "Region",
    "ShardedModule",
    "ShardingPlan",
    "TensorParallelRegions",
    "find_regions",
    "sharding_plan",
]
