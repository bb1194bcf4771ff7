"""``autopipe generate``: write the pipeline package of a graph and its partition."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..compiler import generate_step, load_graph
from ..partitioning import Partition
from ..profiling import Profile
from .arguments import Subparsers, package_options

__all__ = ["add_parser", "cmd_generate"]


def add_parser(subparsers: Subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="write the pipeline package",
        description="Generate the pipeline package from a graph and a partition.",
    )
    p.add_argument("graph", type=Path, help="graph.json from `autopipe trace`")
    p.add_argument("partition", type=Path, help="partition.json from `autopipe partition`")
    p.add_argument(
        "--out", required=True, type=Path, help="directory of the generated pipeline package"
    )
    p.add_argument(
        "--profile-file", type=Path, help="profile.json to keep beside the package (optional)"
    )
    package_options(p)
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> None:
    graph = load_graph(args.graph)
    part = Partition.load(args.partition)
    prof = Profile.load(args.profile_file) if args.profile_file else None
    out = generate_step(
        graph, part, args.out, prof=prof, force=args.force, gpus_per_node=args.gpus_per_node
    )
    print(f"wrote {part.num_stages}-stage pipeline to {out}")
