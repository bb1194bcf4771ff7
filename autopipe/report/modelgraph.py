"""The model graph coloured by stage, collapsed to module scopes a reader can take in at once.

Units are merged into *blocks*: runs of units of one stage inside the same module call, cut at a
depth chosen so the picture keeps at most :data:`MAX_BLOCKS` blocks (GPT-2: its blocks, or their
attention / MLP parts). Edges are the data flowing between blocks. Stages are columns, blocks run
down each column in program order, so every edge runs down a column or to a column on the right.

The layout is computed here and drawn with matplotlib rather than Graphviz: ``dot`` reorders the
blocks inside a stage (it does not keep program order within a rank), and its output depends on
the installed Graphviz and fonts, where this picture is the same bytes everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Graph, Scope
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .data import ReportData
from .figures import WIDTH, stage_colour, style

#: the deepest scope depth is drawn that keeps at most this many blocks, and per stage ...
MAX_BLOCKS = 60
#: ... at most this many
MAX_ROWS = 12


@dataclass
class Block:
    """Consecutive units of one stage within one module call (or of one top-level operator)."""

    name: str  # module fqn, or the op label (``<to>``) for ops outside any module
    cls: str  # module class, "" for ops
    stage: int
    units: list[int] = field(default_factory=list)


@dataclass
class CollapsedGraph:
    depth: int
    blocks: list[Block]  # in order of their first unit
    edges: dict[tuple[int, int], int]  # (block, block) -> bytes moved forward
    inputs: dict[str, list[int]]  # model input -> blocks reading it
    outputs: dict[str, int]  # model output -> block producing it


def unit_scopes(graph: Graph) -> list[tuple[Scope, ...]]:
    """The module scope every node of a unit shares."""
    scopes = []
    for unit in graph.units:
        nodes = graph.unit_nodes(unit.index)
        common = nodes[0].scope
        for node in nodes[1:]:
            n = 0
            while n < min(len(common), len(node.scope)) and common[n] == node.scope[n]:
                n += 1
            common = common[:n]
        scopes.append(common)
    return scopes


def collapse(graph: Graph, stage_of_unit: list[int], depth: int) -> CollapsedGraph:
    """Blocks and edges at one scope depth: a block is a run of consecutive units (in program
    order) of one stage inside one module call, or of one top-level operator; so every edge goes
    from a block to a later one."""
    blocks: list[Block] = []
    block_of_unit = []
    previous = None
    for unit, scope in enumerate(unit_scopes(graph)):
        scope = scope[:depth]
        label = graph.units[unit].label
        key = (scope[-1].key if scope else label, stage_of_unit[unit])
        if key != previous:
            name, cls = (scope[-1].fqn, scope[-1].class_name) if scope else (label, "")
            blocks.append(Block(name, cls, stage_of_unit[unit]))
            previous = key
        blocks[-1].units.append(unit)
        block_of_unit.append(len(blocks) - 1)
    edges: dict[tuple[int, int], int] = {}
    inputs: dict[str, list[int]] = {name: [] for name in graph.inputs}
    for node in graph.calls:
        reader = block_of_unit[node.unit]
        for src in node.inputs:
            producer = graph[src]
            if producer.kind == "call" and block_of_unit[producer.unit] != reader:
                pair = (block_of_unit[producer.unit], reader)
                edges[pair] = edges.get(pair, 0) + graph.value_bytes(src)
            elif src in inputs and reader not in inputs[src]:
                inputs[src].append(reader)
    outputs = {
        name: block_of_unit[graph[name].unit]
        for name in graph.outputs
        if name in graph.dag and graph[name].kind == "call"
    }
    return CollapsedGraph(depth, blocks, edges, inputs, outputs)


def columns(collapsed: CollapsedGraph, num_stages: int) -> list[list[int]]:
    """Blocks per stage, in program order."""
    stages: list[list[int]] = [[] for _ in range(num_stages)]
    for b, block in enumerate(collapsed.blocks):
        stages[block.stage].append(b)
    return stages


def collapse_readable(graph: Graph, stage_of_unit: list[int]) -> CollapsedGraph:
    """The deepest collapse within :data:`MAX_BLOCKS` and :data:`MAX_ROWS` (depth 1 at least)."""
    deepest = max((len(s) for s in unit_scopes(graph)), default=1)
    num_stages = max(stage_of_unit) + 1
    best = collapse(graph, stage_of_unit, 1)
    for depth in range(2, deepest + 1):
        candidate = collapse(graph, stage_of_unit, depth)
        rows = max(len(c) for c in columns(candidate, num_stages))
        if len(candidate.blocks) > MAX_BLOCKS or rows > MAX_ROWS:
            break
        best = candidate
    return best


# -- drawing ----------------------------------------------------------------------------------
ROW = 0.5  # inches per block row
BOX_WIDTH, BOX_HEIGHT = 0.78, 0.78  # of a column, of a row
BOX_SHIFT = 0.06  # boxes sit right of their column's centre, leaving room for skip brackets
FONT_SIZE = 6.5


def block_label(block: Block, collapsed: CollapsedGraph, chars: int) -> str:
    """Name (its tail when too long), class and units; model inputs and outputs it touches."""
    name = block.name if len(block.name) <= chars else "…" + block.name[-chars + 1 :]
    units = f"{len(block.units)} unit{'s' if len(block.units) > 1 else ''}"
    lines = [name, f"{block.cls} · {units}" if block.cls else units]
    b = collapsed.blocks.index(block)
    inputs = [name for name, readers in collapsed.inputs.items() if b in readers]
    outputs = [name for name, producer in collapsed.outputs.items() if producer == b]
    extra = ([f"in: {', '.join(inputs)}"] if inputs else []) + (
        [f"out: {', '.join(outputs)}"] if outputs else []
    )
    if extra:
        lines[1] += "  " + "  ".join(extra)
    return "\n".join(line if len(line) <= chars else line[: chars - 1] + "…" for line in lines)


def model_graph_figure(data: ReportData) -> tuple[Figure, str]:
    """The collapsed model graph (a column per stage) and a caption saying how it was collapsed."""
    collapsed = collapse_readable(data.graph, data.partition.stage_of_unit)
    stage_blocks = columns(collapsed, data.num_stages)
    rows = max(len(c) for c in stage_blocks)
    width = max(WIDTH, 1.9 * data.num_stages)
    chars = int(BOX_WIDTH * width * 72 / data.num_stages / (0.58 * FONT_SIZE))
    half_w, half_h = BOX_WIDTH / 2, BOX_HEIGHT / 2
    # block centres: column = stage, row r at y = -r
    where: dict[int, tuple[float, float]] = {
        b: (s + BOX_SHIFT, -r) for s, col in enumerate(stage_blocks) for r, b in enumerate(col)
    }
    gap = (0.47 - half_w + BOX_SHIFT) * width * 72 / data.num_stages  # points left of a box
    with style():
        fig = Figure(figsize=(width, ROW * (rows + 1.2)))
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(-0.52, data.num_stages - 0.48)
        ax.set_ylim(-rows + 0.4, 1.05)
        ax.axis("off")
        for s, col in enumerate(stage_blocks):
            colour = stage_colour(s)
            ax.add_patch(
                FancyBboxPatch(
                    (s - 0.47, -len(col) + 0.5),
                    0.94,
                    len(col) + 0.45,
                    boxstyle="round,pad=0,rounding_size=0.1",
                    fill=False,
                    edgecolor=colour,
                    linewidth=1.2,
                )
            )
            device = data.partition.device_of_stage[s]
            label = f"stage {s} · device {device}"
            ax.text(s, 0.68, label, ha="center", va="center", color=colour, fontsize=8.5)
        for src, dst in sorted(collapsed.edges):
            (x0, y0), (x1, y1) = where[src], where[dst]
            if x0 != x1:  # to a later stage: right side to left side
                start, end, how = (x0 + half_w, y0), (x1 - half_w, y1), "arc3"
            elif y0 - y1 == 1:  # to the next block down
                start, end, how = (x0, y0 - half_h), (x1, y1 + half_h), "arc3"
            else:  # skipping blocks: a bracket on the left of the column
                arm = round(gap * min(y0 - y1 + 1, 8) / 9, 1)
                start, end = (x0 - half_w, y0), (x1 - half_w, y1)
                how = f"arc,angleA=180,angleB=180,armA={arm},armB={arm},rad=3"
            crossing = x0 != x1
            ax.add_patch(
                FancyArrowPatch(
                    start,
                    end,
                    connectionstyle=how,
                    arrowstyle="-|>",
                    mutation_scale=6,
                    shrinkA=0,
                    shrinkB=0.5,
                    color="#333333" if crossing else "#8c8c8c",
                    linewidth=1.0 if crossing else 0.6,
                    zorder=1,
                )
            )
        for b, (x, y) in where.items():
            colour = stage_colour(collapsed.blocks[b].stage)
            ax.add_patch(
                FancyBboxPatch(
                    (x - half_w, y - half_h),
                    BOX_WIDTH,
                    BOX_HEIGHT,
                    boxstyle="round,pad=0,rounding_size=0.06",
                    facecolor=_hex(colour, 0.72),
                    edgecolor=colour,
                    linewidth=0.8,
                    zorder=2,
                )
            )
            text = block_label(collapsed.blocks[b], collapsed, chars)
            ax.text(x, y, text, ha="center", va="center", fontsize=FONT_SIZE, zorder=3)
    caption = (
        f"{len(data.graph.units)} units collapsed to {len(collapsed.blocks)} blocks "
        f"(module scopes down to depth {collapsed.depth})"
    )
    return fig, caption


def _hex(colour: tuple, lighten: float = 0.0) -> str:
    """``#rrggbb`` of an RGB(A) colour, mixed with white by ``lighten``."""
    r, g, b = (c + (1 - c) * lighten for c in colour[:3])
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
