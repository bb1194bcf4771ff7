"""Tensor parallelism found in the graph (issue 45): the regions Megatron splits, for any model
(:mod:`.regions`), as an artefact of their own (:mod:`.artifact`), and what a package shards at a
degree (:mod:`.plan`), sequence parallel between regions where the graph allows it
(:mod:`.sequence`)."""

from .artifact import ColumnShard, Region, TensorParallelRegions
from .plan import (
    COLWISE,
    EMBEDDING,
    INPUT_MODULE,
    LINEAR,
    ROWWISE,
    TRANSPOSED,
    RegionInput,
    ShardedModule,
    ShardingPlan,
    sharding_plan,
)
from .regions import MAX_DEGREE, find_regions
from .sequence import SEQUENCE_DIM, SequenceSharding

__all__ = [
    "COLWISE",
    "EMBEDDING",
    "INPUT_MODULE",
    "LINEAR",
    "MAX_DEGREE",
    "ROWWISE",
    "SEQUENCE_DIM",
    "TRANSPOSED",
    "ColumnShard",
    "Region",
    "RegionInput",
    "SequenceSharding",
    "ShardedModule",
    "ShardingPlan",
    "TensorParallelRegions",
    "find_regions",
    "sharding_plan",
]
