"""``autopipe partition``: split a profiled graph into stages (partition.json)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compiler import load_graph, partition_step
from ..profiling import Profile
from ..report.summary import format_partition
from .arguments import Subparsers, compile_options, partition_options
from .output_file import output_file

__all__ = ["add_parser", "cmd_partition"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "partition",
        help="split a profiled graph into stages (partition.json)",
        description="Partition a graph into pipeline stages.",
    )
    p.add_argument("graph", type=Path, help="graph.json from `autopipe trace`")
    p.add_argument(
        "profile_file", metavar="profile", type=Path, help="profile.json from `autopipe profile`"
    )
    p.add_argument(
        "-o",
        "--output",
        default="partition.json",
        type=output_file("partition.json"),
        help="partition artefact to write (default partition.json)",
    )
    partition_options(p)
    p.set_defaults(func=cmd_partition)


def cmd_partition(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    prof = Profile.load(args.profile_file)
    part = partition_step(graph, prof, compile_options(args))
    part.save(args.output)
    print(format_partition(graph, part))
    print(f"-> {args.output}")
