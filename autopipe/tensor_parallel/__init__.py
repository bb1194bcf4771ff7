"""Tensor parallelism found in the graph (issue 45): the regions Megatron splits, for any model
(:mod:`.regions`), as an artefact of their own (:mod:`.artifact`)."""

from .artifact import ColumnShard, Region, TensorParallelRegions
from .regions import MAX_DEGREE, find_regions

__all__ = ["MAX_DEGREE", "ColumnShard", "Region", "TensorParallelRegions", "find_regions"]
