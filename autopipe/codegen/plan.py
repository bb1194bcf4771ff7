"""From a graph and a unit -> stage assignment to what each generated stage holds and exchanges.

Values are *relayed*: a value produced in stage ``p`` and read in stage ``c > p + 1`` passes through
every stage between, so stage ``i`` receives only from stage ``i - 1``. That is the shape every
``torch.distributed.pipelining`` schedule accepts. The last stage returns the model's outputs.

Two kinds of values are not relayed. Values computed from sizes and constants alone that the
partition chose to recompute (a Llama's rotary tables: autopipe/partitioning/recomputed_values.py)
are computed again by every stage reading them, which holds their operators beside its own. A
model input a later stage reads (``labels`` in the last stage, a padding mask in every layer) is
read from the step's batch on that stage's rank (its *data inputs*), and the stages between carry
nothing for it. Only where a stage would then receive nothing from the stage before does the plan
fall back: to sending the values, then to relaying the model inputs too (a model of independent
parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import PartitionError
from ..ir import Graph, Node, TensorMeta
from ..ir.ordering import alias_chain, written_values
from ..partitioning.recomputed_values import closures


@dataclass
class StagePlan:
    """Everything the code generator needs for one stage."""

    index: int
    device: int
    nodes: list[Node]
    inputs: list[str]
    outputs: list[str]
    #: placeholder node name -> the original name the stage holds it under
    state_names: dict[str, str] = field(default_factory=dict)
    #: original names of parameters / buffers held although no node of the stage reads them
    extra_params: list[str] = field(default_factory=list)
    extra_buffers: list[str] = field(default_factory=list)
    #: stage inputs that the stage mutates in place, cloned on entry
    cloned_inputs: list[str] = field(default_factory=list)
    #: of its inputs, the model inputs it reads from the batch, not from the stage before
    data_inputs: list[str] = field(default_factory=list)
    #: values of earlier stages it computes again instead of receiving them
    recomputed: list[str] = field(default_factory=list)

    @property
    def held_names(self) -> list[str]:
        return sorted(
            set(self.state_names.values()) | set(self.extra_params) | set(self.extra_buffers)
        )


def plan_stages(
    graph: Graph,
    stage_of_unit: list[int],
    device_of_stage: list[int],
    recomputed: Sequence[str] = (),
) -> list[StagePlan]:
    """Split ``graph`` into stages; ``stage_of_unit[u]`` must never decrease along data edges.
    Each stage reading a value of ``recomputed`` computes it again instead of receiving it."""
    num_stages = len(device_of_stage)
    stage_of: dict[str, int] = {}
    for node in graph.calls:
        stage_of[node.name] = stage_of_unit[node.unit]
    for name in graph.inputs:
        stage_of[name] = -1
    order = {name: i for i, name in enumerate(graph.dag.nodes)}
    held = _held(graph, stage_of, recomputed)
    boundary, data = _crossings(graph, stage_of, held, num_stages, relay_inputs=False)
    if recomputed and _starved(boundary):  # a stage would compute only what others recompute
        recomputed = ()
        held = _held(graph, stage_of, recomputed)
        boundary, data = _crossings(graph, stage_of, held, num_stages, relay_inputs=False)
    if _starved(boundary):  # a model of independent parts: relay its inputs too
        boundary, data = _crossings(graph, stage_of, held, num_stages, relay_inputs=True)
    plans = []
    for s in range(num_stages):
        nodes = [n for n in graph.calls if s in held[n.name]]
        if not nodes:
            raise PartitionError(f"stage {s} is empty")
        inputs = sorted(boundary[s] + data[s], key=order.__getitem__)
        outputs = (
            list(graph.outputs)
            if s == num_stages - 1
            else sorted(boundary[s + 1], key=order.__getitem__)
        )
        if not inputs:
            raise PartitionError(
                f"stage {s} receives no values from the stages before it; a pipeline stage needs "
                "at least one input. Use fewer stages."
            )
        plans.append(StagePlan(s, device_of_stage[s], nodes, inputs, outputs))
        plans[-1].data_inputs = sorted(data[s], key=order.__getitem__)
        plans[-1].recomputed = [
            name for name in recomputed if s in held[name] and stage_of[name] != s
        ]
    for name in (n for p in plans for n in p.inputs + p.outputs):
        if not isinstance(graph[name].meta, TensorMeta):
            raise PartitionError(f"value {name} crosses a stage boundary but is not a tensor")
    _assign_state(graph, plans)
    for plan in plans:
        plan.cloned_inputs = _mutated_inputs(graph, plan)
    return plans


def _held(graph: Graph, stage_of: dict[str, int], recomputed: Sequence[str]) -> dict[str, set[int]]:
    """The stages computing each call node: its own, and every later stage that recomputes a
    value of ``recomputed`` it helps compute (one its stage reads)."""
    held = {node.name: {stage_of[node.name]} for node in graph.calls}
    for name, nodes in closures(graph, recomputed).items():
        if nodes is None:
            raise PartitionError(
                f"the partition recomputes {name}, which is not computed from sizes and "
                "constants alone in this graph; run `autopipe partition` on this graph again"
            )
        for user in graph.users(name):
            stage = stage_of.get(user)
            if stage is not None and stage != stage_of[name]:
                for node in nodes:
                    held[node].add(stage)
    return held


def _crossings(
    graph: Graph,
    stage_of: dict[str, int],
    held: dict[str, set[int]],
    num_stages: int,
    relay_inputs: bool,
) -> tuple[list[list[str]], list[list[str]]]:
    """The values entering each stage from the stage before, and the model inputs each later
    stage reads from the batch (none with ``relay_inputs``: they are relayed like values).
    ``held``: the stages computing each call node (:func:`_held`)."""
    last_use: dict[str, int] = {}
    readers: dict[str, set[int]] = {}  # model input -> the stages reading it
    for node in graph.calls:
        for stage in sorted(held[node.name]):
            for src in node.inputs:
                if stage != stage_of.get(src) and stage in held.get(src, ()):
                    continue  # recomputed by this stage
                if graph[src].kind == "call" and stage_of[src] > stage:
                    raise PartitionError(
                        f"node {node.name} (stage {stage}) reads {src} from the later "
                        f"stage {stage_of[src]}: the stage order is not topological"
                    )
                last_use[src] = max(last_use.get(src, -1), stage)
                if stage_of.get(src) == -1 and not relay_inputs:
                    readers.setdefault(src, set()).add(stage)
    for name in graph.outputs:
        if graph[name].kind not in ("call", "input"):
            raise PartitionError(
                f"model output {name} is a {graph[name].kind}, not a computed value"
            )
        last_use[name] = num_stages  # returned by the last stage
        readers.pop(name, None)  # a model input the model returns is relayed to the end
    return _boundaries(stage_of, last_use, readers, num_stages), _data_inputs(readers, num_stages)


def _starved(boundary: list[list[str]]) -> bool:
    """Whether a stage would receive nothing: from the stage before, or (the first) from the
    batch (its operators read only sizes and constants)."""
    return any(not entering for entering in boundary)


def _boundaries(
    stage_of: dict[str, int],
    last_use: dict[str, int],
    read_from_batch: dict[str, set[int]],
    num_stages: int,
) -> list[list[str]]:
    """The values entering each stage from the stage before: each from the stage after its
    producer's to its last reader (a model input: from the first stage's, unless the stages
    reading it read it from the batch: ``read_from_batch`` names those, with their stages)."""
    boundary: list[list[str]] = [[] for _ in range(num_stages)]
    for name, last in last_use.items():
        if name not in stage_of:
            continue  # parameters, buffers, constants: held, not communicated
        if name in read_from_batch:
            if 0 in read_from_batch[name]:
                boundary[0].append(name)
            continue
        for s in range(stage_of[name] + 1, min(last, num_stages - 1) + 1):
            boundary[s].append(name)
    return boundary


def _data_inputs(readers: dict[str, set[int]], num_stages: int) -> list[list[str]]:
    """The model inputs each later stage reads from the batch (none for the first stage, which
    takes its inputs from the batch anyway)."""
    data: list[list[str]] = [[] for _ in range(num_stages)]
    for name, stages in readers.items():
        for s in stages - {0}:
            data[s].append(name)
    return data


def _assign_state(graph: Graph, plans: list[StagePlan]) -> None:
    """Name each parameter / buffer a stage reads, and give unread ones a home stage.

    A tied parameter read in several stages is held by each of them, under the alias that belongs
    to the module reading it there (``lm_head.weight`` in the last stage of GPT-2, for example).
    """
    held: set[str] = set()  # canonical names held by some stage
    for plan in plans:
        chosen_by_canonical: dict[str, str] = {}
        for node in plan.nodes:
            for src in node.inputs:
                placeholder = graph[src]
                if placeholder.kind not in ("param", "buffer") or src in plan.state_names:
                    continue
                names = _state_names(graph, placeholder)
                consumer = node.scope[-1].fqn if node.scope else ""
                preferred = next((n for n in names if n.rpartition(".")[0] == consumer), names[0])
                plan.state_names[src] = chosen_by_canonical.setdefault(names[0], preferred)
                held.add(names[0])
    for canonical in graph.params:
        if canonical not in held:
            _home(plans, canonical).extra_params.append(canonical)
    for canonical, info in graph.buffers.items():
        if canonical not in held and info.persistent:
            _home(plans, canonical).extra_buffers.append(canonical)


def _state_names(graph: Graph, placeholder: Node) -> tuple[str, ...]:
    if placeholder.kind == "param":
        return graph.param_of(placeholder.target).names
    return next(b.names for b in graph.buffers.values() if placeholder.target in b.names)


def _home(plans: list[StagePlan], name: str) -> StagePlan:
    """The stage holding the most closely related state (longest common name prefix)."""

    def shared(plan: StagePlan) -> int:
        best = 0
        for other in plan.held_names:
            common = 0
            for a, b in zip(name.split("."), other.split(".")):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return best

    return max(plans, key=lambda p: (shared(p), -p.index))


def _mutated_inputs(graph: Graph, plan: StagePlan) -> list[str]:
    """Stage inputs an in-place operator of the stage writes to (directly or through a view).
    A stage input owns its storage within the stage, even when it aliases an earlier stage's
    value, so the alias chain is followed only up to the first input."""
    inputs = set(plan.inputs)
    mutated: list[str] = []
    for node in plan.nodes:
        for written in written_values(node):
            owner = next((n for n in alias_chain(graph, written) if n in inputs), None)
            if owner is not None and owner not in mutated:
                mutated.append(owner)
    return mutated
