"""``autopipe generate``: write the pipeline package of a graph and its partition."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..compiler import generate_step, load_graph
from ..partitioning import Partition
from ..profiling import Profile
from .arguments import Subparsers, package_options

__all__ = ["add_parser", "cmd_generate", "node_size"]


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
        graph,
        part,
        args.out,
        prof=prof,
        force=args.force,
        gpus_per_node=node_size(args.gpus_per_node, part),
    )
    print(f"wrote {part.num_stages}-stage pipeline to {out}")


def node_size(given: int | None, part: Partition) -> int:
    """``--gpus-per-node`` of a command writing ``part``'s package: the one given, else the
    node size its network was costed for (8 for partitions from before it); a size other than
    that one is said on stderr."""
    costed = part.settings.gpus_per_node
    if given is not None and costed is not None and given != costed:
        print(
            f"note: --gpus-per-node {given}: the launch script asks for nodes of {given} GPUs, "
            f"but the partition's network was costed for nodes of {costed} (partition again "
            f"with --gpus-per-node {given} to cost it for them)",
            file=sys.stderr,
        )
    return given or costed or 8
