"""Plain-text summaries of a partition for the terminal."""

from __future__ import annotations

import dataclasses

import math
from collections import Counter

from ..codegen.plan import plan_stages
from ..ir import MODULE_TARGET, Graph, TensorMeta
from ..ir.eval_mode import random_in_eval
from ..ir.kept_module import kept_calls
from ..ir.sizes import planned_sizes
from ..runtime.core.pipeline import PIPELINE_INNERMOST
from ..runtime.core.shapes import evaluate
from ..partitioning import Partition
from ..partitioning.cost import Throughput, block_costs
from ..partitioning.recomputed_values import closures
from ..partitioning.search import plan_table
from ..tensor_parallel import find_regions, sharding_plan
from ..tracing.causal_mask import attention_masking
from ..tracing.grouped_query import grouped_query


def stage_span(graph: Graph, stage_of_unit: list[int], stage: int) -> tuple[str, str]:
    """Labels of the first and last unit of a stage."""
    units = [u for u, s in enumerate(stage_of_unit) if s == stage]
    return graph.units[units[0]].label, graph.units[units[-1]].label


def format_partition(graph: Graph, part: Partition) -> str:
    """A table of the stages with their predicted times, against the lower bound."""
    predicted = part.predicted
    assert predicted is not None  # a partition's summary needs its prediction
    rows = [
        f"{'stage':>5} {'device':>6} {'units':>5} {'params':>9} {'fwd ms':>9} {'bwd ms':>9} "
        f"{'comm ms':>8} {'time ms':>9} {'mem GiB':>8}  first .. last unit"
    ]
    for s, cost in enumerate(predicted.stages):
        first, last = stage_span(graph, part.stage_of_unit, s)
        units = part.stage_of_unit.count(s)
        rows.append(
            f"{s:>5} {part.device_of_stage[s]:>6} {units:>5} {cost.parameters / 1e6:>7.1f}MB "
            f"{cost.forward * 1e3:>9.3f} {cost.backward * 1e3:>9.3f} {cost.communication * 1e3:>8.3f} "
            f"{cost.time * 1e3:>9.3f} {cost.memory / 1024**3:>8.2f}  {first} .. {last}"
        )
    bottleneck, bound = predicted.bottleneck, predicted.lower_bound
    over = max((bottleneck / bound - 1) * 100, 0.0) if bound else 0.0  # float error: not -0.0
    settings = part.settings
    rows.append(
        f"bottleneck {bottleneck * 1e3:.3f} ms, lower bound {bound * 1e3:.3f} ms (+{over:.1f}%); "
        f"pipeline run {predicted.step_time * 1e3:.3f} ms for {settings.microbatches} microbatches "
        "(the plan's step adds accumulation and the optimizer), "
        f"{predicted.bubble * 100:.0f}% bubble ({settings.schedule} schedule, "
        f"{part.profile_source}, method {part.method})"
    )
    rows += memory_lines(part)
    rows.append(throughput_line(graph, part))
    rows += network_lines(part)
    regions = find_regions(graph)
    rows.append(regions.summary())
    if (settings.tp or 1) > 1:
        plan = sharding_plan(graph, regions, settings.tp or 1, settings.sequence_parallel or None)
        plan = plan.on_stages(part.stage_of_nodes(graph))
        if plan.sequence is not None and not settings.sequence_parallel:
            plan = dataclasses.replace(plan, sequence=None, sequence_off="--sequence-parallel off")
        rows.append(plan.summary())
    rows += tensor_parallel_choice_lines(part)
    if graph.model.symbols:
        rows.append(f"dynamic dimensions: {dimensions_text(graph, part)}")
    rows += batch_dims_lines(graph)
    rows += attention_lines(graph)
    rows += batch_input_lines(graph, part)
    rows += recompute_lines(graph, part)
    rows += requested_lines(part)
    rows += kept_whole_lines(graph, part)
    rows += random_in_eval_lines(graph)
    rows += trace_settings_lines(graph)
    return "\n".join(rows)


def batch_input_lines(graph: Graph, part: Partition) -> list[str]:
    """The model inputs later stages read from the batch on their own ranks (``labels`` in the
    last stage), and the values they recompute from sizes and constants (a Llama's rotary
    tables), where the stages between would otherwise carry them (autopipe/codegen/plan.py)."""
    readers: dict[str, list[int]] = {}
    recomputers: dict[str, list[int]] = {}
    plans = plan_stages(graph, part.stage_of_unit, part.device_of_stage, part.recomputed_values)
    for plan in plans:
        for name in plan.data_inputs:
            readers.setdefault(name, []).append(plan.index)
        for name in plan.recomputed:
            recomputers.setdefault(name, []).append(plan.index)

    def listed(where: dict[str, list[int]]) -> str:
        def scope(name: str) -> str:
            label = graph[name].scope_label if graph[name].kind == "call" else ""
            return f" of {label}" if label else ""

        return ", ".join(
            f"{name}{scope(name)} (stage{'s' if len(stages) > 1 else ''} "
            f"{', '.join(map(str, stages))})"
            for name, stages in where.items()
        )

    lines = []
    if readers:
        lines.append(
            "read from the batch by the stages that use them, not sent between stages: "
            + listed(readers)
        )
    if recomputers:
        operators = {n for nodes in closures(graph, recomputers).values() for n in nodes or ()}
        lines.append(
            "recomputed by the stages that use them, not sent between stages (computed from "
            f"sizes and constants by {len(operators)} operators, cheaper than a transfer on "
            f"{part.settings.link or 'the link'}): {listed(recomputers)}"
        )
    return lines


def batch_dims_lines(graph: Graph) -> list[str]:
    """The inputs whose batch is not along dimension 0, as the package records them."""
    dims = graph.model.batch_dims
    if not dims:
        return []
    listed = ", ".join(f"{name} {dim}" for name, dim in dims.items())
    return [
        f"batch dimensions: {listed} (train.py splits batches along them, other inputs along "
        "0; --batch-dims NAME=DIM changes them)"
    ]


def attention_lines(graph: Graph) -> list[str]:
    """How the attention calls mask: causal ones (``is_causal=True``: no mask is built, nor sent
    between stages; autopipe/tracing/causal_mask.py recognises the masks models build), those
    with an explicit mask (it reads input values or is not causal), those with neither; and
    those taking grouped-query keys and values unrepeated (``enable_gqa=True``,
    autopipe/tracing/grouped_query.py)."""
    kinds = Counter(attention_masking(n) for n in graph.calls)
    grouped = sum(grouped_query(n) for n in graph.calls)
    if not kinds.keys() - {None}:
        return []

    def calls(count: int) -> str:
        return f"{count} call{'s' if count != 1 else ''}"

    parts = [
        f"{calls(kinds['causal'])} causal (no mask built or sent between stages)",
        f"{kinds['mask']} with an explicit mask",
    ]
    if kinds["none"]:
        parts.append(f"{kinds['none']} without a mask")
    if grouped:
        parts.append(f"{grouped} with enable_gqa (keys and values not repeated per query head)")
    return ["attention: " + ", ".join(parts)]


def trace_settings_lines(graph: Graph) -> list[str]:
    """What was set on a Hugging Face model's configuration for the trace, as ``transformers``
    trains it (its saved configuration keeps the model's own values)."""
    settings = graph.model.trace_settings
    if not settings:
        return []
    listed = ", ".join(f"{name}={value!r}" for name, value in sorted(settings.items()))
    return [
        f"traced as transformers trains: {listed} (the model's configuration is left as it "
        "is, and so is the config.json the package writes)"
    ]


def random_in_eval_lines(graph: Graph) -> list[str]:
    """The modules whose operators draw random numbers in eval mode too (randomness no mode
    argument switches off: a stochastic depth written as ``if self.training:``), which the
    stages run in eval mode as they do in training."""
    places = Counter(
        n.scope_label or f"{graph.model.cls.rsplit('.', 1)[-1]} (model)"
        for n in random_in_eval(graph.calls)
    )
    if not places:
        return []
    listed = "; ".join(
        f"{where}: {count} operator{'s' if count > 1 else ''}"
        for where, count in sorted(places.items())
    )
    return [
        "note: these draw random numbers in eval mode too, as in training: "
        + listed
        + ". The model decides them in Python (a stochastic depth or noise under "
        "`if self.training:`), which the trace fixes to training; if it skips them in eval "
        "mode, evaluate with them off in the model's config (drop_path_rate=0, ...)"
    ]


def kept_whole_lines(graph: Graph, part: Partition) -> list[str]:
    """The torch modules the stages call whole (torch.export cannot trace them), where and why."""
    kept = []
    for path, calls in kept_calls(graph.calls).items():
        if "packed" in calls.forms:
            why = "over a packed sequence"
        elif "rnn" in calls.forms and _dynamic_input(graph, path):
            why = "over a dynamic size"  # kept whole whether named or not
        else:
            why = "--keep-whole"
        stages = sorted({part.stage_of_unit[u] for u in calls.units})
        where = f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, stages))}"
        kept.append(f"{path} (nn.{calls.spec.cls}, {why}) in {where}")
    if not kept:
        return []
    return [f"kept whole, as one call of the torch module each: {'; '.join(kept)}"]


def _dynamic_input(graph: Graph, path: str) -> bool:
    """Whether a call of the kept module ``path`` is given a tensor of a dynamic size."""
    for node in graph.calls:
        if node.target == MODULE_TARGET and node.args[0] == path:
            meta = graph[node.args[3][0].name].meta
            if isinstance(meta, TensorMeta) and meta.sizes:
                return True
    return False


def tensor_parallel_choice_lines(part: Partition) -> list[str]:
    """Why a searched plan has its tensor-parallel degree: the best step of each degree the
    search tried (none without a search over more than one degree)."""
    best: dict[int, str] = {}  # degree -> its best plan's step, or why none runs
    for plan in part.settings.plans or ():  # best first
        degree, step = int(plan.get("tp", 1)), plan.get("step_time")
        if degree not in best:
            best[degree] = (
                f"{step * 1e3:.4g} ms" if step is not None else plan["problem"].split(",")[0]
            )
    if len(best) < 2:
        return []
    chosen = part.settings.tp or 1
    others = ", ".join(f"tp {d}: {best[d]}" for d in sorted(best) if d != chosen)
    return [
        f"tensor-parallel degree {chosen} chosen: {best.get(chosen, '?')} per step; the best "
        f"plan of each other degree searched: {others}"
    ]


def requested_lines(part: Partition) -> list[str]:
    """How the stages the model's pipe_split() markers ask for (one per device, so many
    devices) compare with the partition's (none where it has no markers, or its stages are
    theirs)."""
    theirs, predicted = part.requested, part.predicted
    if theirs is None or predicted is None:
        return []
    shards = part.settings.dp_shard or 1
    stages = _count(theirs.stages, "stage")
    if theirs.step_time is None or theirs.bottleneck is None:
        return [f"{theirs.asked} ask for {stages}, which cannot run: {theirs.problem}"]
    ours = predicted.step_time
    change = (theirs.step_time / ours - 1) * 100
    their_devices = theirs.stages * shards
    our_devices = len(set(part.device_of_stage)) * shards
    keep = f"--split-points markers --stages {theirs.stages}"
    if part.settings.schedule == "gpipe":  # the markers' split ran the partition's schedule
        keep += " --schedule gpipe"
    if shards > 1:
        keep += f" --dp-shard {shards}"
    return [
        f"{theirs.asked} ask for {stages}: on {their_devices} devices (one stage each), "
        f"bottleneck {theirs.bottleneck * 1e3:.3f} ms, predicted step "
        f"{theirs.step_time * 1e3:.3f} ms for the same microbatches ({change:+.1f}% against this "
        f"partition's {predicted.bottleneck * 1e3:.3f} ms and {ours * 1e3:.3f} ms on "
        f"{our_devices} devices; compile with {keep} to keep them)"
    ]


def recompute_lines(graph: Graph, part: Partition) -> list[str]:
    """What recomputes its activations, and why it beats the fastest split without (or that
    none fits without)."""
    predicted = part.predicted
    assert predicted is not None  # a partition's summary needs its prediction
    device = part.settings.device
    rows = []
    if part.recompute:
        rows.append(
            f"stages {', '.join(map(str, part.recompute))} recompute their activations in backward "
            f"to fit the {device}'s memory (train.py --recompute auto)"
        )
    if part.recompute_blocks:
        blocks = block_costs(graph)
        by_stage = Counter(blocks[name].stage(part.stage_of_unit) for name in part.recompute_blocks)
        where = ", ".join(f"stage {s}: {n}" for s, n in sorted(by_stage.items()))
        rows.append(
            f"{_count(len(part.recompute_blocks), 'block')} recompute their activations in "
            f"backward ({where}; train.py --recompute auto)"
        )
    other = part.compared
    if other is None:
        return rows
    step = predicted.step_time
    slower = f"{other.step_time * 1e3:.3f} ms (+{(other.step_time / step - 1) * 100:.1f}%)"
    if other.recomputed < part.recomputed:
        only = (
            f", itself recomputing {_count(other.recomputed, 'block')} where nothing fits"
            if other.recomputed
            else ""
        )
        rows.append(
            f"why: pipeline run {step * 1e3:.3f} ms recomputing to balance the stages, "
            f"against {slower} for the split that shrinks the stages short of memory "
            f"instead{only}: recomputing costs less than the imbalance"
        )
    elif other.recomputed > part.recomputed:
        rows.append(
            f"why: pipeline run {step * 1e3:.3f} ms, against {slower} for the split that "
            f"recomputes {_count(other.recomputed, 'block')} to balance the stages: "
            "recomputing would cost more than the imbalance"
        )
    else:
        rows.append(
            f"why: pipeline run {step * 1e3:.3f} ms, against {slower} for the split that "
            "shrinks the stages short of memory instead (recomputing as much)"
        )
    return rows


def memory_lines(part: Partition) -> list[str]:
    """Each rank's predicted peak and what it holds then (the fullest ranks, if many)."""
    predicted = part.predicted
    assert predicted is not None  # a partition's summary needs its prediction
    peaks = predicted.memory_peaks or ()
    capacity = part.costs.memory_capacity if part.costs else None
    margin = part.settings.memory_margin or 0.0
    of = f" of {capacity / GiB:.2f} GiB" if capacity else ""
    if capacity and margin:
        of = f" of {capacity / (1 - margin) / GiB:.2f} GiB less the {margin:.0%} margin"
    if capacity and part.settings.device_type == "cpu" and part.processes_per_node > 1:
        of += f" (a node's memory over its {part.processes_per_node} processes)"  # shared_by
    totals = predicted.device_memory  # each rank's peak: its parts summed
    rows = []
    shown = sorted(range(len(peaks)), key=lambda r: -totals[r])
    for rank in sorted(shown[:MEMORY_RANKS]):
        peak, total = peaks[rank], totals[rank]
        parts = ", ".join(
            f"{label} {getattr(peak, k) / GiB:.3f}"
            + (f" ({_count(peak.in_flight, 'microbatch')})" if k == "activations" else "")
            for k, label in MEMORY_PARTS.items()
        )
        rows.append(f"rank {rank} peak {total / GiB:.3f} GiB{of} at {peak.moment}: {parts}")
    return rows


def throughput_line(graph: Graph, part: Partition) -> str:
    """The plan's predicted step, rate and model FLOPs utilisation."""
    settings, predicted = part.settings, part.predicted
    assert predicted is not None  # a partition's summary needs its prediction
    figures = Throughput.of(predicted, settings, len(set(part.device_of_stage)))
    tokens = tokens_per_microbatch(graph, settings.timed_at or {})
    rate = figures.microbatches / figures.step_time if figures.step_time else 0.0
    line = (
        f"plan: {settings.microbatches} microbatches x "
        f"{settings.accumulate or 1} accumulation x "
        f"{_count(settings.dp_shard or 1, 'shard')} per step on "
        f"{_count(figures.devices, 'device')}: {figures.step_time * 1e3:.3f} ms, "
        f"{rate:.1f} microbatches/s"
    )
    if tokens:
        line += f", {rate * tokens:,.0f} tokens/s"
    if figures.mfu is not None:
        line += f", MFU {figures.mfu * 100:.3g}% of {settings.device}"
    if settings.calibrated is False and settings.profile == "analytic":
        line += " (uncalibrated spec: datasheet peaks; `autopipe calibrate` measures one)"
    return line


def network_lines(part: Partition) -> list[str]:
    """Where the plan's ranks sit (nodes, mesh order) and its traffic per pipeline run on the
    busiest rank, by kind and link, across nodes or within them (none without traffic)."""
    predicted, settings = part.predicted, part.settings
    assert predicted is not None  # a partition's summary needs its prediction
    if not predicted.traffic:
        return []
    ranks = len(set(part.device_of_stage)) * (settings.dp_shard or 1) * (settings.tp or 1)
    per_node = settings.gpus_per_node or 8
    nodes = -(-ranks // per_node)
    mesh = settings.mesh or PIPELINE_INNERMOST
    inner = "a pipeline's ranks" if mesh[-1] == "pp" else "each stage's shards"
    unit = "processes" if settings.device_type == "cpu" else "GPUs"
    where = f"{_count(ranks, 'rank')} on {_count(nodes, 'node')} of {per_node} {unit}"
    if nodes > 1 and (settings.dp_shard or 1) > 1 and len(set(part.device_of_stage)) > 1:
        where += f", mesh {' x '.join(mesh)} ({inner} next to each other)"
    moved = "; ".join(
        f"{t.kind} {'across nodes' if t.crosses_nodes else 'within a node'} over {t.link}: "
        f"{t.bytes / 1e9:.3g} GB, {t.seconds * 1e3:.3g} ms"
        for t in predicted.traffic
    )
    return [f"network: {where}; per pipeline run on the busiest rank: {moved}"]


def dimensions_text(graph: Graph, part: Partition) -> str:
    """The dynamic dimensions, their bounds and the sizes the predictions are for ("" if
    none): memory at the planned sizes (upper bounds, else the example's), time at the
    --expected sizes where given."""
    symbols = graph.model.symbols
    if not symbols:
        return ""
    bounds = ", ".join(
        f"{name} {s.min}..{'' if s.max is None else s.max}" for name, s in symbols.items()
    )
    planned = ", ".join(f"{name}={s.planned}" for name, s in symbols.items())
    open_ended = [name for name, s in symbols.items() if s.max is None]
    caveat = (
        f" ({', '.join(open_ended)} without an upper bound: planned at the example's size, "
        "longer batches need more memory than predicted)"
        if open_ended
        else ""
    )
    timed_at = part.settings.timed_at or {}
    if not timed_at:
        return f"{bounds}; time and memory predicted at {planned}{caveat}"
    timed = {name: timed_at.get(name, s.planned) for name, s in symbols.items()}
    at = ", ".join(f"{name}={size}" for name, size in timed.items())
    return f"{bounds}; time predicted at {at} (--expected), memory at {planned}{caveat}"


def tokens_per_microbatch(graph: Graph, sizes: dict[str, int] | None = None) -> int | None:
    """Tokens in the example microbatch for a language model: the size of its first integer
    (batch, sequence) input, for the dynamic dimensions' ``sizes`` where given (else at their
    planned sizes); None for other models."""
    values = planned_sizes(graph) | (sizes or {})
    for name in graph.inputs:
        meta = graph[name].meta
        if (
            isinstance(meta, TensorMeta)
            and len(meta.shape) == 2
            and not meta.dtype.is_floating_point
        ):
            return math.prod(evaluate(f, values) for f in meta.formulas)
    return None


def format_plans(part: Partition) -> str:
    """The plans a searched partition was chosen from, best (the chosen) first."""
    plans = list(part.settings.plans or ())
    return f"{len(plans)} best plans searched, #0 chosen:\n" + plan_table(plans)


GiB = 1024**3
MEMORY_RANKS = 8  # ranks whose peak the summary breaks down


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("h") else f"{n} {noun}s"


#: MemoryPeak fields -> labels, in the order a peak is told
MEMORY_PARTS = {
    "state": "state",
    "buffers": "buffers",
    "activations": "activations",
    "input_gradients": "input grads",
    "transient": "transient",
}
