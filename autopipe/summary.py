"""Plain-text summaries of a partition for the terminal."""

from __future__ import annotations

from .graph import Graph
from .partitioning import Partition


def stage_span(graph: Graph, stage_of_unit: list[int], stage: int) -> tuple[str, str]:
    """Labels of the first and last unit of a stage."""
    units = [u for u, s in enumerate(stage_of_unit) if s == stage]
    return graph.units[units[0]].label, graph.units[units[-1]].label


def format_partition(graph: Graph, part: Partition) -> str:
    """A table of the stages with their predicted times, against the lower bound."""
    predicted = part.predicted
    rows = [
        f"{'stage':>5} {'device':>6} {'units':>5} {'params':>9} {'fwd ms':>9} {'bwd ms':>9} "
        f"{'comm ms':>8} {'time ms':>9} {'mem GiB':>8}  first .. last unit"
    ]
    for s, cost in enumerate(predicted["stages"]):
        first, last = stage_span(graph, part.stage_of_unit, s)
        units = part.stage_of_unit.count(s)
        rows.append(
            f"{s:>5} {part.device_of_stage[s]:>6} {units:>5} {cost['parameters'] / 1e6:>7.1f}MB "
            f"{cost['forward'] * 1e3:>9.3f} {cost['backward'] * 1e3:>9.3f} {cost['communication'] * 1e3:>8.3f} "
            f"{cost['time'] * 1e3:>9.3f} {cost['memory'] / 1024**3:>8.2f}  {first} .. {last}"
        )
    bottleneck, bound = predicted["bottleneck"], predicted["lower_bound"]
    over = (bottleneck / bound - 1) * 100 if bound else 0.0
    settings = part.settings
    rows.append(
        f"bottleneck {bottleneck * 1e3:.3f} ms, lower bound {bound * 1e3:.3f} ms (+{over:.1f}%); "
        f"predicted step {predicted['step_time'] * 1e3:.3f} ms with {settings.get('microbatches')} microbatches, "
        f"{predicted.get('bubble', 0) * 100:.0f}% bubble ({settings.get('schedule')} schedule, "
        f"{part.profile_source}, method {part.method})"
    )
    if part.recompute:
        rows.append(
            f"stages {', '.join(map(str, part.recompute))} recompute their activations in backward "
            f"to fit the {settings.get('device')}'s memory (train.py --recompute auto)"
        )
    return "\n".join(rows)
