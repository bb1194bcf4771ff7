"""The options the subcommands share: the compile options of :class:`CompileOptions` as argument
groups (tracing, profiling, partitioning, plan search), the options of a command that writes a
package, and the :class:`CompileOptions` a command line gives."""

from __future__ import annotations

import argparse
from typing import Any, TypeAlias

from ..compiler import CompileOptions
from ..options import COUNT, OPTIONS, flag_of

__all__ = [
    "ArgumentContainer",
    "PARTITIONING",
    "PLAN_SEARCH",
    "PROFILING",
    "SPEC_HELP",
    "Subparsers",
    "TRACING",
    "add_option",
    "add_options",
    "compile_options",
    "package_options",
    "partition_options",
    "profile_options",
    "search_options",
    "trace_options",
]

#: where ``add_argument`` adds an argument: a parser or one of its argument groups
ArgumentContainer = argparse.ArgumentParser | argparse._ArgumentGroup
#: what ``add_subparsers`` returns: each subcommand's module adds its parser to it
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: the help of a command's model spec argument
SPEC_HELP = (
    "model spec FILE.py:FUNCTION or package.module:FUNCTION returning (model, args[, kwargs])"
)

#: the compile options of each argument group, in the order --help lists them
TRACING = ("depth", "basic_blocks", "keep_whole", "inline_blocks", "dynamic", "batch_dims")
PROFILING = ("profile", "bf16", "expected", "device_spec", "link", "network")
PARTITIONING: tuple[str, ...] = ("stages", "devices", "method", "split_points", "optimizer")
PARTITIONING += ("schedule", "microbatches", "dp_shard", "tp", "sequence_parallel", "gpus_per_node")
PLAN_SEARCH = (
    "global_batch",
    "memory_margin",
    "max_stages_per_device",
    "search_seconds",
    "search_workers",
)


def add_option(container: ArgumentContainer, name: str, **overrides: Any) -> None:
    """Add compile option ``name`` as :class:`CompileOptions` declares it (``overrides``
    replacing some of ``add_argument``'s keywords)."""
    container.add_argument(flag_of(name), **(OPTIONS[name].arguments() | overrides))


def add_options(container: ArgumentContainer, names: tuple[str, ...]) -> None:
    for name in names:
        add_option(container, name)


def trace_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing")
    add_options(group, TRACING)
    group.add_argument(
        "--loss",
        metavar="FILE.py:FN",
        help="loss FN(output, target) to train with; the model function then returns (model, args, kwargs, target)",
    )


def profile_options(parser: argparse.ArgumentParser) -> None:
    add_options(parser.add_argument_group("profiling"), PROFILING)


def partition_options(parser: argparse.ArgumentParser, *, stages_required: bool = True) -> None:
    group = parser.add_argument_group("partitioning")
    add_option(group, "stages", required=stages_required)
    add_options(group, PARTITIONING[1:])


def search_options(parser: argparse.ArgumentParser) -> ArgumentContainer:
    group = parser.add_argument_group("plan search")
    add_options(group, PLAN_SEARCH)
    return group


def compile_options(args: argparse.Namespace, **overrides: Any) -> CompileOptions:
    """The compile options given on the command line (the defaults for those not given)."""
    given = {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}
    given.update(overrides)
    given.setdefault("stages", 1)
    return CompileOptions(**given)


def package_options(p: argparse.ArgumentParser) -> None:
    """The options of a command that writes a package: replacing it, the launch script's nodes."""
    p.add_argument(
        "--force", action="store_true", help="replace --out if it is a pipeline autopipe generated"
    )
    p.add_argument(
        "--gpus-per-node",
        type=COUNT.parse,
        metavar="G",
        help="GPUs per node the package's launch/slurm.sbatch asks for (default: the node "
        "size the partition's network was costed for, else 8)",
    )
