"""The typed contexts the package templates are rendered with.

Every template of a package receives the :class:`PackageContext` variables; a stage module
(``stage.py.j2``) receives a :class:`StageContext`, and the SLURM script (``slurm.sbatch.j2``) a
:class:`LaunchContext`, one field per template variable, built in one place
(``codegen/package.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..partitioning.network import node_layout
from .plan import StagePlan

__all__ = ["LaunchContext", "PackageContext", "StageContext", "node_layout"]


@dataclass(frozen=True)
class PackageContext:
    """What every template of a generated package is rendered with."""

    model_class: str  # the model's class name, without its module
    num_stages: int
    #: pipeline ranks x data-parallel shards x tensor-parallel ranks (torchrun's --nproc-per-node)
    num_processes: int
    stage_classes: list[str]  # ``Stage0``, ``Stage1``, ...

    def variables(self) -> dict[str, Any]:
        """The template variables, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class StageContext:
    """What ``stage.py.j2`` is rendered with: the package's variables and one stage's."""

    package: PackageContext
    stage: StagePlan
    summary: str  # ``N operators, from <scope> to <scope>``
    inputs: list[str]  # the values it receives, under their generated names
    outputs: list[str]  # ... and returns
    cloned_inputs: list[str]  # inputs written in place, cloned first
    sizes: list[str]  # lines computing dynamic dimensions from the inputs
    returns: list[str]  # the return expressions
    operators: dict[str, str]  # operators from outside torch -> the module registering them
    functions: list[str]  # module-level definitions: autograd functions, then cond branches
    formats: dict[str, str]  # inputs restored to the model's memory layout -> the format
    uses_device: bool  # whether the forward body names ``device``
    blocks: list[tuple[str, str]]  # submodules: (original name, block class)
    kept: list[tuple[str, str]]  # torch modules kept whole: (original name, constructor)
    #: tensor parallelism: the stage's own modules (original name, constructor) and every
    #: module it shards, its blocks' too: (original name, torch style), region inputs first
    tensor_parallel_modules: list[tuple[str, str]]
    tensor_parallel: list[tuple[str, str]]
    tensor_parallel_imports: list[str]  # import lines of the torch styles it uses
    #: sequence parallelism: the parameters whose gradients train.py sums over the "tp" ranks
    sequence_parallel_parameters: list[str]
    #: grouped key/value projections replicated over the "tp" ranks: their parameters, whose
    #: gradients (each rank's query heads' part) train.py sums over the ranks
    replicated_heads_parameters: list[str]
    support: list[str]  # the runtime.support helpers it imports
    parameters: list[dict[str, Any]]  # its own parameter rows (its blocks hold the rest)
    buffers: list[dict[str, Any]]
    body: list[str]  # the forward body's lines (spliced in after formatting)

    def variables(self, body: list[str]) -> dict[str, Any]:
        """The template variables, by name, with ``body`` standing for the forward body."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "package"}
        return self.package.variables() | own | {"body": body}


@dataclass(frozen=True)
class LaunchContext:
    """What ``slurm.sbatch.j2`` is rendered with: the package's variables and the nodes its
    planned processes (pipeline ranks x planned --dp-shard) take."""

    package: PackageContext
    num_ranks: int  # ranks of one pipeline replica
    dp_shard: int  # the partition's planned --dp-shard
    nodes: int
    processes_per_node: int
    tp: int = 1  # the package's tensor-parallel degree
    cpu: bool = False  # planned for CPU nodes (gloo, threads per process) instead of GPUs

    @classmethod
    def for_plan(
        cls,
        package: PackageContext,
        num_ranks: int,
        dp_shard: int,
        gpus_per_node: int,
        tp: int = 1,
        cpu: bool = False,
    ) -> LaunchContext:
        nodes, per_node = node_layout(package.num_processes, gpus_per_node, tp)
        return cls(package, num_ranks, dp_shard, nodes, per_node, tp, cpu)

    def variables(self) -> dict[str, Any]:
        """The template variables, by name."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "package"}
        return self.package.variables() | own
