"""Stage boundaries a user asks for, as ``torch.distributed.pipelining`` users ask for them.

A model written for torch's ``pipeline()`` marks its boundaries with ``pipe_split()`` calls in
its forward (recorded by tracing as ``ModelFacts.split_markers``) or carries a ``split_spec``:
module names, each split at its beginning or its end. ``--split-points markers`` or
``--split-points layers.4,layers.8:end`` (the split spec as text, :func:`split_spec_text`) turn
them into the stage of every unit; :func:`requested_split` checks that every boundary falls
between units and that no stage is empty.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PartitionError
from ..ir import Graph

__all__ = ["SplitPoint", "SplitPoints", "requested_split", "split_spec_text", "SPLIT_POINTS_SYNTAX"]

#: what ``--split-points`` takes: ``markers``, or module names each with ``:begin`` (the
#: default) or ``:end``, comma-separated
SPLIT_POINTS_SYNTAX = re.compile(
    r"markers|[A-Za-z_][\w]*(\.[\w]+)*(:(begin|end))?(,[A-Za-z_][\w]*(\.[\w]+)*(:(begin|end))?)*"
)


@dataclass(frozen=True)
class SplitPoint:
    """A stage boundary at the beginning (before its first operator) or the end (after its
    last) of the module ``module`` (its original name)."""

    module: str
    where: str  # "begin" or "end"

    def __str__(self) -> str:
        return self.module if self.where == "begin" else f"{self.module}:end"


@dataclass(frozen=True)
class SplitPoints:
    """The boundaries asked for: the model's ``pipe_split()`` markers, or split points."""

    markers: bool = False
    points: tuple[SplitPoint, ...] = ()

    @classmethod
    def parse(cls, text: str) -> SplitPoints:
        """``markers`` or ``MODULE[:begin|end],...`` (:data:`SPLIT_POINTS_SYNTAX`)."""
        if not SPLIT_POINTS_SYNTAX.fullmatch(text):
            raise PartitionError(
                f"--split-points takes 'markers' (the model's pipe_split() calls) or module "
                f"names each with :begin (the default) or :end, comma-separated "
                f"(layers.4,layers.8:end), got {text!r}"
            )
        if text == "markers":
            return cls(markers=True)
        points = []
        for item in text.split(","):
            module, _, where = item.partition(":")
            points.append(SplitPoint(module, where or "begin"))
        return cls(points=tuple(points))

    def __str__(self) -> str:
        """In words, for the summary."""
        if self.markers:
            return "the model's pipe_split() markers"
        return "the split points " + ", ".join(map(str, self.points))


def split_spec_text(split_spec: Mapping[str, Any]) -> str:
    """A ``torch.distributed.pipelining`` ``split_spec`` (``{"layers.4": SplitPoint.BEGINNING,
    ...}``) as ``--split-points`` text."""
    items = []
    for module, point in split_spec.items():
        name = getattr(point, "name", str(point))
        if name not in ("BEGINNING", "END"):
            raise PartitionError(
                f"split_spec[{module!r}] is {point!r}; torch's SplitPoint is BEGINNING or END"
            )
        items.append(module if name == "BEGINNING" else f"{module}:end")
    return ",".join(items)


def requested_split(graph: Graph, asked: SplitPoints) -> list[int]:
    """The stage of every unit when stages begin where ``asked`` says: a boundary before a
    call node of the program order (of ``graph.calls``), each between two units."""
    calls = graph.calls
    position = {node.name: index for index, node in enumerate(calls)}
    if asked.markers:
        if not graph.model.split_markers:
            raise PartitionError(
                "--split-points markers: the model calls no pipe_split() in its forward (or "
                "only before its first operator or after its last); mark the stage boundaries "
                "with torch.distributed.pipelining.pipe_split(), or name modules "
                "(--split-points layers.4,layers.8)"
            )
        starts = [position[name] for name in graph.model.split_markers]
        where = [f"pipe_split() before {name}" for name in graph.model.split_markers]
    else:
        starts, where = [], []
        for point in asked.points:
            inside, runs = [], set()  # its calls' positions, and its calls
            for index, node in enumerate(calls):
                levels = [level.key for level in node.scope if level.fqn == point.module]
                if levels:
                    inside.append(index)
                    runs.update(levels)
            if not inside:
                raise PartitionError(
                    f"--split-points {point}: the model runs no module {point.module!r} (split "
                    "points name modules by their original names, as the model's "
                    "named_modules() does)"
                )
            if len(runs) > 1:
                raise PartitionError(
                    f"--split-points {point}: the model calls {point.module!r} {len(runs)} times "
                    "(torch's split_spec would split at every call); name a module called once, "
                    "or mark the boundaries with pipe_split()"
                )
            starts.append(inside[0] if point.where == "begin" else inside[-1] + 1)
            where.append(str(point))
    boundaries = sorted(set(zip(starts, where)))
    cuts = [0, *(start for start, _ in boundaries), len(calls)]
    for (start, label), before, after in zip(boundaries, cuts, cuts[2:]):
        if not before < start < after:
            raise PartitionError(
                f"--split-points: {label} leaves a stage with no operator (a boundary at the "
                "model's very start or end, or two at one place); drop it"
            )
    stage_of_node = {}
    for stage, (first, end) in enumerate(zip(cuts, cuts[1:])):
        for node in calls[first:end]:
            stage_of_node[node.name] = stage
    stage_of_unit = []
    for unit in graph.units:
        stages = sorted({stage_of_node[name] for name in unit.nodes if name in stage_of_node})
        if len(stages) > 1:
            label = next(
                (label for start, label in boundaries if start in _starts(unit, position)),
                "a boundary",
            )
            raise PartitionError(
                f"--split-points: {label} falls inside the unit {unit.label}, which autopipe "
                "keeps in one stage; trace with a larger --depth (finer units) or move the "
                "boundary to a module's beginning or end"
            )
        stage_of_unit.append(stages[0] if stages else 0)
    return stage_of_unit


def _starts(unit: Any, position: Mapping[str, int]) -> set[int]:
    """The positions a boundary inside ``unit`` could have: after its first call, up to its
    last."""
    places = sorted(position[name] for name in unit.nodes if name in position)
    return set(range(places[0] + 1, places[-1] + 1)) if places else set()
