"""Which regions a package shards at a tensor-parallel degree, and how its code does it (issue 45,
item 2).

A region found in the graph (:mod:`.regions`) is sharded at degree ``d`` when ``d`` divides it and
its projections can be held as modules of their own: each is a ``linear`` of a weight (and bias) of
its own, or an ``addmm`` / ``mm`` of a weight stored ``[in, out]`` (GPT-2's ``Conv1D``), held by a
module that holds nothing else. The generated stage holds it as a real ``nn.Linear`` (or the
runtime's ``TransposedLinear``) and ``parallelize_module`` applies torch's ``ColwiseParallel`` to
the column projections and ``RowwiseParallel`` to the row projection; a transposed projection takes
the runtime's ``SectionedColwiseParallel`` / ``TransposedRowwiseParallel``, and so does a fused one
(sections: GPT-2's ``c_attn``), whose equal sections are each split alike (torch's
``_StridedShard``); unequal sections keep the region replicated, with the reason. Grouped-query
attention at a degree above its key/value heads keeps its key and value projections whole on every
rank (the runtime's ``ReplicatedHeadsParallel``: each rank computes the head its query heads read,
and their gradients, partial, are summed over the ranks once per step). The sizes a view or an
expansion gives a sharded dimension become -1 in the generated code, so that one package runs at any
degree (a view that leaves another size to -1 gets that size written instead, where it is fixed),
and a split of a fused projection's output into equal sections becomes a ``chunk`` into as many. The
embedding is sharded by vocabulary rows (torch's ``RowwiseParallel`` on an ``nn.Embedding``) and the
output head by vocabulary columns, its logits gathered whole for the loss
(``ColwiseParallel(output_layouts=Replicate())``), where their weights are their own (not tied) and
the embedding has no padding index.

A region's column projections read their input through a module of its own, an ``nn.Identity``
at ``<scope>.tensor_parallel_input`` that torch's ``PrepareModuleInput`` turns into one
replicated DTensor, so that the backward sums the projections' input gradients in one
collective, not one each. With sequence parallelism (:mod:`.sequence`) that module gathers the
input whole along the sequence, the row projections and the embedding reduce-scatter along it
and the head gathers its input.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from ..errors import PartitionError
from ..ir import Graph, Node, Ref, Size
from ..ir.eval_mode import random_in_training
from ..ir.types import argument_value
from . import operators as ops
from .artifact import Region, TensorParallelRegions
from .sequence import SequenceRefused, SequenceSharding, sequence_sharding

__all__ = [
    "COLWISE",
    "EMBEDDING",
    "LINEAR",
    "ROWWISE",
    "INPUT_MODULE",
    "TRANSPOSED",
    "RegionInput",
    "ShardedModule",
    "ShardingPlan",
    "sharding_plan",
]

#: the styles of :class:`ShardedModule`: torch's ColwiseParallel and RowwiseParallel
COLWISE, ROWWISE = "colwise", "rowwise"
#: the kinds of :class:`ShardedModule`: ``nn.Linear``, ``nn.Embedding`` and the runtime's
#: ``TransposedLinear`` (a weight stored [in, out], computed by ``addmm`` / ``mm``)
LINEAR, EMBEDDING, TRANSPOSED = "linear", "embedding", "transposed"
_SPLITS = {"aten.split.Tensor", "aten.split_with_sizes.default"}
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"}
_EXPAND = "aten.expand.default"
#: the leaf name of a region's input module
INPUT_MODULE = "tensor_parallel_input"
#: torch's placement of a value sliced along the sequence
_SEQUENCE = "Shard(1)"
_LOSS = "aten.cross_entropy_loss.default"
#: operators that keep the logits split over the vocabulary (their last dimension) as they are,
#: each rank working on its part: views keeping the vocabulary last, casts, scaling by numbers
_KEEPS_VOCABULARY = _VIEWS | {
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.alias.default",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.tanh.default",
}


@dataclass(frozen=True)
class ShardedModule:
    """A projection the generated stage holds as a module at ``module`` (its original name) and
    calls, sharded in the ``style`` its place in the region gives it."""

    node: str  # the projection's node
    module: str  # the module holding its weight (and bias): ``model.layers.0.self_attn.q_proj``
    style: str  # COLWISE or ROWWISE
    in_features: int  # an embedding's: its rows (the vocabulary)
    out_features: int
    bias: bool
    region: str  # the region's scope
    kind: str = LINEAR  # LINEAR, EMBEDDING or TRANSPOSED
    gathered: bool = False  # a column projection whose output every rank gets whole (the head)
    #: the region input module it reads its input through (a column projection's), or ""
    entry: str = ""
    #: sequence parallel: its output reduce-scattered along the sequence (a row projection's,
    #: the embedding's), or its input gathered along it (the head's, or a column projection's
    #: that reads it without a region input module)
    sequence: bool = False
    #: a fused column projection's equal sections (query, key, value: 3), each split alike
    sections: int = 1
    #: a key or value projection of grouped-query attention at a degree above its ``heads``
    #: key/value heads: whole on every rank, which computes the one head its query heads read
    #: (0: split like any column)
    heads: int = 0
    #: the head's loss computed vocabulary-parallel (torch's ``loss_parallel``): its logits stay
    #: split over the vocabulary, a DTensor, to the cross-entropy, never gathered
    loss_parallel: bool = False

    @property
    def operator(self) -> ops.WeightedOperator:
        """The operator its node calls: ``embedding(weight, ids)``, ``linear(x, weight,
        bias)``, ``addmm(bias, x, weight)`` or ``mm(x, weight)``."""
        if self.kind == EMBEDDING:
            return ops.EMBEDDING
        if self.kind == TRANSPOSED:
            return ops.ADDMM if self.bias else ops.MM
        return ops.LINEAR

    @property
    def weight_at(self) -> int:
        """Where the node takes the weight."""
        return self.operator.weight_at

    @property
    def input_at(self) -> int:
        """Where the node takes its input (the ids of an embedding)."""
        return self.operator.input_at

    @property
    def bias_at(self) -> int | None:
        """Where the node takes its bias (None: it has none)."""
        return self.operator.bias_at if self.bias else None

    @property
    def uses_runtime_style(self) -> bool:
        """Whether the runtime's styles shard it (torch's do not: a transposed or fused
        projection)."""
        return self.kind == TRANSPOSED or self.sections > 1 or self.heads > 0

    @property
    def parameters(self) -> tuple[str, ...]:
        """The original names of the parameters it holds: its weight, and its bias if any."""
        return (f"{self.module}.weight",) + ((f"{self.module}.bias",) if self.bias else ())

    def rank_share(self, degree: int) -> float:
        """The part of its product (and of its output) each of ``degree`` ranks computes:
        ``1/degree``, or a replicated key/value projection's one head of its ``heads``."""
        return 1 / self.heads if self.heads else 1 / degree

    def constructor(self) -> str:
        """The module as generated code builds it (on the meta device: ``keep_whole`` gives it
        the stage's parameters)."""
        if self.kind == EMBEDDING:
            return f"nn.Embedding({self.in_features}, {self.out_features}, device='meta')"
        module = "TransposedLinear" if self.kind == TRANSPOSED else "nn.Linear"
        return f"{module}({self.in_features}, {self.out_features}, bias={self.bias}, device='meta')"

    def style_source(self) -> str:
        """The style that shards it, as generated code writes it: a column projection's
        output features split (whole heads; each section alike), a row projection's (and the
        vocabulary-parallel embedding's) partial sums all-reduced; the head's logits gathered
        whole."""
        sliced = f"output_layouts={_SEQUENCE}" if self.sequence else ""
        gather = f"input_layouts={_SEQUENCE}" if self.sequence else ""
        if self.kind == EMBEDDING:  # the token ids are whole on every rank
            return f"RowwiseParallel({_arguments('input_layouts=Replicate()', sliced)})"
        if self.style == ROWWISE:
            torch_style = "RowwiseParallel" if self.kind == LINEAR else "TransposedRowwiseParallel"
            return f"{torch_style}({sliced})"
        if self.heads:
            return f"ReplicatedHeadsParallel({_arguments(f'heads={self.heads}', gather)})"
        if self.uses_runtime_style:
            return f"SectionedColwiseParallel({_arguments(f'sections={self.sections}', gather)})"
        if self.gathered and self.loss_parallel:
            split = "output_layouts=Shard(-1), use_local_output=False"
            return f"ColwiseParallel({_arguments(gather, split)})"
        if self.gathered:
            return f"ColwiseParallel({_arguments(gather, 'output_layouts=Replicate()')})"
        return f"ColwiseParallel({gather})"  # through its region's input module: replicated


@dataclass(frozen=True)
class RegionInput:
    """The ``nn.Identity`` at ``module`` a region's column projections read ``value`` through:
    torch's ``PrepareModuleInput`` makes it one replicated DTensor (gathered whole along the
    sequence where ``sequence``), so the projections' input gradients are summed once."""

    value: str  # the node it reads
    module: str  # its original-looking name: ``model.layers.0.self_attn.tensor_parallel_input``
    sequence: bool = False

    def constructor(self) -> str:
        return "nn.Identity()"

    def style_source(self) -> str:
        given = _SEQUENCE if self.sequence else "Replicate()"
        return (
            f"PrepareModuleInput(input_layouts=({given},), desired_input_layouts=(Replicate(),),"
            " use_local_output=False)"
        )


def _arguments(*given: str) -> str:
    return ", ".join(a for a in given if a)


@dataclass(frozen=True)
class ShardingPlan:
    """What a package shards at tensor-parallel degree ``degree``: its modules, the sizes its
    code writes so that each rank computes its share (``(node, position in its sizes, size)``:
    -1 where a view gives the sharded dimension its size, the fixed size where that moves a -1
    elsewhere), the splits of fused projections' outputs it writes as chunks ``(node,
    sections)``, and the regions left replicated with their reasons."""

    degree: int
    modules: tuple[ShardedModule, ...]
    free_sizes: tuple[tuple[str, int, int], ...]
    replicated: tuple[tuple[str, str], ...]  # (region, why)
    inputs: tuple[RegionInput, ...] = ()
    #: sequence parallelism: the values sliced along the sequence, or None (off)
    sequence: SequenceSharding | None = None
    #: why sequence parallelism is off where it was not turned off ("" otherwise)
    sequence_off: str = ""
    chunks: tuple[tuple[str, int], ...] = ()
    #: the nodes sharded regions compute on each rank's heads or features
    interior: frozenset[str] = frozenset()
    #: the nodes that draw random numbers in training on each rank's share (inside sharded
    #: regions, or sequence parallel between them): generated code runs them under a random
    #: stream of each tensor-parallel rank's own
    drawing: frozenset[str] = frozenset()
    #: why the head's loss is not computed vocabulary-parallel, where the head is sharded ("":
    #: it is, or there is no sharded head)
    loss_gathered: str = ""
    #: the nodes from the head to its loss (and what scales the loss), computed on each rank's
    #: split of the vocabulary when the loss is vocabulary-parallel
    loss_chain: frozenset[str] = frozenset()

    def within(self, nodes: Collection[str]) -> list[RegionInput | ShardedModule]:
        """The modules the code of ``nodes`` holds: the projections among them, each region
        input they read through first."""
        modules = [m for m in self.modules if m.node in nodes]
        entries = {m.entry for m in modules if m.entry}
        return [i for i in self.inputs if i.module in entries] + modules

    def on_stages(self, stage_of_node: Mapping[str, int]) -> ShardingPlan:
        """This plan as a partition runs it (``stage_of_node``: each node's stage): the head's
        logits gathered whole for the loss where the loss, or what the logits pass through to
        it, runs in another stage than the head (a value split over the vocabulary would cross
        a stage boundary as a DTensor)."""
        head = next((m for m in self.modules if m.loss_parallel), None)
        if head is None:
            return self
        stage = stage_of_node[head.node]
        elsewhere = sorted(n for n in self.loss_chain if stage_of_node.get(n) != stage)
        if not elsewhere:
            return self
        return replace(
            self,
            modules=tuple(replace(m, loss_parallel=False) for m in self.modules),
            interior=self.interior - self.loss_chain,
            loss_chain=frozenset(),
            loss_gathered=(
                f"{elsewhere[0]} runs in stage {stage_of_node.get(elsewhere[0])}, the head "
                f"{head.module} in stage {stage}"
            ),
        )

    @property
    def loss_parallel(self) -> bool:
        """Whether the head's loss is computed vocabulary-parallel (train.py runs the steps under
        torch's ``loss_parallel``)."""
        return any(m.loss_parallel for m in self.modules)

    @property
    def sequence_values(self) -> frozenset[str]:
        return self.sequence.values if self.sequence is not None else frozenset()

    @property
    def module_nodes(self) -> frozenset[str]:
        """The projection nodes generated code calls as modules."""
        return frozenset(m.node for m in self.modules)

    @property
    def sharded_regions(self) -> int:
        return len({m.region for m in self.modules})

    def summary(self) -> str:
        """One line: ``tensor parallel 2: 8 regions sharded (24 projections); replicated: ...``."""
        runtime = [
            what
            for what, used in (
                (
                    "transposed or fused",
                    any(m.kind == TRANSPOSED or m.sections > 1 for m in self.modules),
                ),
                ("grouped key/value", any(m.heads for m in self.modules)),
            )
            if used
        ]
        line = (
            f"tensor parallel {self.degree}: {self.sharded_regions} region(s) sharded "
            f"({len(self.modules)} projections, torch's ColwiseParallel / RowwiseParallel"
            + (f", the runtime's for {' and '.join(runtime)} ones)" if runtime else ")")
        )
        if self.loss_parallel:
            line += "; the loss computed vocabulary-parallel (torch's loss_parallel)"
        elif self.loss_gathered:
            line += f"; the head's logits gathered for the loss: {self.loss_gathered}"
        grouped = [m for m in self.modules if m.heads]
        if grouped:
            line += (
                f"; key/value heads replicated: {len(grouped)} projections of "
                f"{grouped[0].heads} head(s), each rank computing the one its query heads read"
            )
        if self.replicated:
            shown = "; ".join(f"{scope}: {why}" for scope, why in self.replicated[:3])
            more = f" (and {len(self.replicated) - 3} more)" if len(self.replicated) > 3 else ""
            line += f"; replicated: {shown}{more}"
        if self.sequence is not None:
            line += (
                "; sequence parallel: the values between regions sliced along the sequence "
                f"({len(self.sequence.parameters)} parameters' gradients summed over the ranks)"
            )
        elif self.sequence_off:
            line += f"; not sequence parallel: {self.sequence_off}"
        return line


def sharding_plan(
    graph: Graph,
    regions: TensorParallelRegions,
    degree: int,
    sequence_parallel: bool | None = None,
) -> ShardingPlan:
    """The plan of ``graph`` at ``degree`` (1: nothing sharded, nothing said), sequence
    parallel where the graph allows it (``sequence_parallel`` None), asked (True: refused
    with the reason where it does not) or not (False)."""
    plan = _plan(graph, regions, degree, sequence_parallel)
    shares = plan.interior | plan.sequence_values
    drawing = frozenset(n.name for n in random_in_training(graph[name] for name in shares))
    return replace(plan, drawing=drawing)


def _plan(
    graph: Graph,
    regions: TensorParallelRegions,
    degree: int,
    sequence_parallel: bool | None,
) -> ShardingPlan:
    if degree == 1:
        return ShardingPlan(1, (), (), ())
    projections = _projections(graph)
    modules: list[ShardedModule] = []
    free: list[tuple[str, int, int]] = []
    chunks: list[tuple[str, int]] = []
    replicated: list[tuple[str, str]] = []
    for region in regions.regions:
        scope = region.scope or region.kind
        why = region.why_not(degree)
        if not why:
            try:
                found = _modules(graph, region, projections, degree)
                sizes, split = (
                    _local_sizes(graph, region) if region.kind in ("attention", "mlp") else ([], [])
                )
            except _Replicated as reason:
                why = str(reason)
            else:
                modules += found
                free += sizes
                chunks += split
                continue
        replicated.append((scope, why))
    modules, inputs = _region_inputs(graph, modules)
    interior = _interior(graph, modules)
    loss_gathered = ""
    loss_chain: frozenset[str] = frozenset()
    for index, module in enumerate(modules):
        if module.gathered:  # the head: its loss vocabulary-parallel where nothing else reads it
            loss_chain, loss_gathered = _loss_chain(graph, module.node)
            if not loss_gathered:
                modules[index] = replace(module, loss_parallel=True)
                interior |= loss_chain
    plan = ShardingPlan(
        degree,
        tuple(modules),
        tuple(free),
        tuple(replicated),
        tuple(inputs),
        chunks=tuple(chunks),
        interior=interior,
        loss_gathered=loss_gathered,
        loss_chain=loss_chain,
    )
    if sequence_parallel is False or not modules:
        return plan
    off = _sequence_parallel_refusal(plan)
    if not off:
        try:
            return _sequence_parallel(graph, plan)
        except SequenceRefused as refused:
            off = str(refused)
            if plan.replicated:  # what usually feeds a whole value into the sliced ones
                scope, why = plan.replicated[0]
                off += f" (a replicated region, {scope}, computes it whole: {why})"
    if sequence_parallel:
        raise PartitionError(
            f"--sequence-parallel on: {graph.model.cls.rsplit('.', 1)[-1]} cannot run "
            f"sequence parallel at --tp {degree}: {off}; use --sequence-parallel auto or off"
        )
    return replace(plan, sequence_off=off)


def _region_inputs(
    graph: Graph, modules: Sequence[ShardedModule]
) -> tuple[list[ShardedModule], list[RegionInput]]:
    """The column projections of each attention and MLP region, reading their input through
    one :class:`RegionInput` per region and value they read, beside them (where they are
    submodules of one module; otherwise each reads it on its own, as torch's
    ``ColwiseParallel`` alone does)."""
    readers: dict[tuple[str, str], list[ShardedModule]] = {}
    for module in modules:
        if module.style == COLWISE and not module.gathered:
            value = graph[module.node].args[module.input_at]
            assert isinstance(value, Ref)  # a product of a value (_projections)
            readers.setdefault((value.name, module.region), []).append(module)
    entry_of: dict[str, str] = {}
    inputs: list[RegionInput] = []
    taken: set[str] = set()
    for (value, _), columns in readers.items():
        parents = {c.module.rpartition(".")[0] for c in columns}
        if len(parents) != 1:
            continue
        (parent,) = parents
        name = f"{parent}.{INPUT_MODULE}" if parent else INPUT_MODULE
        base, n = name, 0
        while name in taken:
            n += 1
            name = f"{base}_{n}"
        taken.add(name)
        inputs.append(RegionInput(value, name))
        entry_of.update(dict.fromkeys((c.node for c in columns), name))
    out = [replace(m, entry=entry_of[m.node]) if m.node in entry_of else m for m in modules]
    return out, inputs


def _sequence_parallel(graph: Graph, plan: ShardingPlan) -> ShardingPlan:
    """``plan`` sequence parallel (raises :class:`SequenceRefused` where it cannot be)."""
    sources = [m.node for m in plan.modules if m.style == ROWWISE]
    readers = [m.node for m in plan.modules if m.style == COLWISE]
    sharding = sequence_sharding(graph, sources, readers, plan.degree)
    values = sharding.values
    modules = tuple(
        replace(m, sequence=m.style == ROWWISE or (not m.entry and _reads(graph, m, values)))
        for m in plan.modules
    )
    inputs = tuple(replace(i, sequence=i.value in values) for i in plan.inputs)
    return replace(plan, modules=modules, inputs=inputs, sequence=sharding)


def _interior(graph: Graph, modules: Sequence[ShardedModule]) -> frozenset[str]:
    """The nodes sharded regions compute on each rank's heads or features: those computed from
    their column projections' outputs before a projection reads them (the region pass lets
    nothing else read them)."""
    stops = {m.node for m in modules}
    seen: set[str] = set()
    frontier = [m.node for m in modules if m.style != ROWWISE and not m.gathered]
    while frontier:
        for user in graph.users(frontier.pop()):
            if user not in seen and user not in stops:
                seen.add(user)
                frontier.append(user)
    return frozenset(seen)


def _loss_chain(graph: Graph, head: str) -> tuple[frozenset[str], str]:
    """The nodes between the head ``head`` and its cross-entropy loss, and the loss (each rank
    computes them on its split of the vocabulary under torch's ``loss_parallel``), or why the
    logits must be gathered whole instead: another operator reads them (anything but views that
    keep the vocabulary last, casts and scaling by numbers), the loss takes class weights or
    label smoothing (which ``loss_parallel`` does not), or what reads the loss is more than
    scaling (a DTensor loss meets a plain tensor there). A model output among them is returned
    split (training reads only the loss)."""
    if graph.loss is not None:
        return frozenset(), "the loss function given at compile time reads the logits"
    chain: set[str] = set()
    losses: list[str] = []
    frontier = [head]
    while frontier:
        name = frontier.pop()
        for user in graph.users(name):
            if user in chain:
                continue
            node = graph[user]
            others = [a for a in node.inputs if a != name]
            if node.target == _LOSS:
                if node.args[0] != Ref(name) or others[1:]:
                    return frozenset(), f"{user} ({node.target}) reads the logits otherwise"
                if argument_value(node, "weight") is not None or argument_value(
                    node, "label_smoothing"
                ) not in (None, 0, 0.0):
                    return frozenset(), f"{user} weighs its classes or smooths its labels"
                losses.append(user)
            elif node.target not in _KEEPS_VOCABULARY or others:
                return frozenset(), f"{user} ({node.target}) reads the logits"
            elif node.target in _VIEWS and _last(graph, user) != _last(graph, name):
                return frozenset(), f"{user} reshapes the vocabulary dimension"
            chain.add(user)
            if node.target != _LOSS:
                frontier.append(user)
    if not losses:
        return frozenset(), "no cross-entropy reads the logits"
    frontier = list(losses)
    while frontier:  # what reads the loss: scaled, cast, returned
        for user in graph.users(frontier.pop()):
            node = graph[user]
            if node.target not in _KEEPS_VOCABULARY or node.target in _VIEWS:
                return frozenset(), f"{user} ({node.target}) reads the loss"
            chain.add(user)
            frontier.append(user)
    return frozenset(chain), ""


def _last(graph: Graph, name: str) -> int | None:
    meta = graph[name].tensor_meta
    return meta.shape[-1] if meta is not None and meta.shape else None


def _sequence_parallel_refusal(plan: ShardingPlan) -> str:
    """Why ``plan`` cannot run sequence parallel because a projection computes on positions
    flattened into one dimension (a transposed projection's ``addmm``: its partial sums have no
    sequence dimension to scatter along), or ""."""
    flat = next((m for m in plan.modules if m.kind == TRANSPOSED), None)
    if flat is None:
        return ""
    return (
        f"{flat.module} ({flat.node}) computes on the positions flattened into one dimension "
        "(an addmm of a [in, out] weight): its partial sums have no sequence dimension to "
        "scatter along"
    )


def _reads(graph: Graph, module: ShardedModule, values: frozenset[str]) -> bool:
    value = graph[module.node].args[module.input_at]
    return isinstance(value, Ref) and value.name in values


class _Replicated(Exception):
    """Why generated code keeps a region replicated."""


def _projections(graph: Graph) -> dict[str, Node]:
    """Each weight (first name) whose one reader is a ``linear``, an ``embedding`` or an
    ``addmm`` / ``mm`` of it (a weight stored [in, out]), -> that node: a weight another
    operator reads too (a transposed copy, a renormalisation) would meet a DTensor there, and
    stays replicated."""
    readers: dict[str, int] = {}
    for node in graph.nodes:
        if node.kind == "param":
            name = graph.param_of(node.target).names[0]
            readers[name] = readers.get(name, 0) + len(graph.users(node.name))
    found: dict[str, Node] = {}
    seen: set[str] = set()
    for node in graph.calls:
        operator = ops.WEIGHTED.get(node.target)
        if operator is None or len(node.args) <= operator.weight_at:
            continue
        weight = node.args[operator.weight_at]
        if not isinstance(weight, Ref) or graph[weight.name].kind != "param":
            continue
        name = graph.param_of(graph[weight.name].target).names[0]
        if name in seen or readers.get(name, 0) != 1:
            found.pop(name, None)
        else:
            found[name] = node
        seen.add(name)
    return found


def _modules(
    graph: Graph, region: Region, projections: dict[str, Node], degree: int
) -> list[ShardedModule]:
    held = [name for info in graph.params.values() for name in info.names]
    if region.kind in ("embedding", "head"):
        return [_vocabulary(graph, region, projections, held)]
    grouped = region.kv_heads if region.replicates_heads(degree) else 0
    modules = []
    for style, weight, sections, heads in [
        *((COLWISE, c.weight, c.sections, grouped if c.key_value else 0) for c in region.columns),
        (ROWWISE, region.row, (), 0),
    ]:
        if len(set(sections)) > 1:
            raise _Replicated(
                f"{weight} is a fused projection of unequal sections "
                f"({', '.join(map(str, sections))}): each rank would need a share of each, "
                "which a placement of equal sections (torch's _StridedShard) cannot give"
            )
        node = projections.get(weight)
        if node is None or node.target not in ops.PROJECTIONS or not weight.endswith(".weight"):
            raise _Replicated(
                f"{weight} is not the weight of a projection of its own (a linear, or an "
                "addmm / mm of a [in, out] weight, that no other operator reads)"
            )
        operator = ops.PROJECTIONS[node.target]
        kind = LINEAR if operator is ops.LINEAR else TRANSPOSED
        if heads and sections:
            raise _Replicated(
                f"{weight} is a fused key/value projection of {heads} head(s), fewer than "
                f"{degree}: a rank would need a head of each section, which no style gives"
            )
        if heads and kind != LINEAR:
            raise _Replicated(
                f"{weight} is a key/value projection of {heads} head(s), fewer than {degree}, "
                "stored [in, out]: only an nn.Linear is kept whole with a head per rank"
            )
        if operator is ops.ADDMM and any(
            argument_value(node, factor) not in (None, 1) for factor in ("beta", "alpha")
        ):
            raise _Replicated(f"{node.name} scales its product (addmm's beta or alpha)")
        module = weight.removesuffix(".weight")
        info = graph.param_of(graph[node.args[operator.weight_at].name].target)  # type: ignore[union-attr]
        at_bias = operator.bias_at
        bias = node.args[at_bias] if at_bias is not None and at_bias < len(node.args) else None
        names = {weight} | ({f"{module}.bias"} if isinstance(bias, Ref) else set())
        if operator is ops.ADDMM and not isinstance(bias, Ref):
            raise _Replicated(f"{node.name} adds a constant to its product, not a bias")
        if isinstance(bias, Ref):
            bias_info = graph[bias.name]
            if bias_info.kind != "param" or graph.param_of(bias_info.target).names != (
                f"{module}.bias",
            ):
                raise _Replicated(f"{module}'s bias is not a parameter of its own")
        inside = {name for name in held if name.startswith(f"{module}.")}
        if len(info.names) > 1 or inside != names:
            raise _Replicated(
                f"{module} holds {sorted(inside)} or shares its weight, not a projection's "
                "weight and bias alone"
            )
        out_features, in_features = info.shape if kind == LINEAR else info.shape[::-1]
        modules.append(
            ShardedModule(
                node.name,
                module,
                style,
                in_features,
                out_features,
                isinstance(bias, Ref),
                region.scope,
                kind,
                sections=len(sections) or 1,
                heads=heads,
            )
        )
    return modules


def _vocabulary(
    graph: Graph, region: Region, projections: dict[str, Node], held: list[str]
) -> ShardedModule:
    """The embedding (torch's RowwiseParallel on an ``nn.Embedding``: each rank looks up its
    rows, the partial sums all-reduced) or the output head (ColwiseParallel on an ``nn.Linear``
    of the vocabulary, the logits gathered whole for the loss)."""
    weight = region.columns[0].weight
    node = projections.get(weight)
    wanted = ops.EMBEDDING if region.kind == "embedding" else ops.LINEAR
    if node is None or node.target != wanted.target or not weight.endswith(".weight"):
        raise _Replicated(
            f"{weight} is read by more than one operator (a tied weight) or not by an "
            f"nn.{'Embedding' if wanted is ops.EMBEDDING else 'Linear'}'s operator"
        )
    module = weight.removesuffix(".weight")
    info = graph.param_of(graph[node.args[wanted.weight_at].name].target)  # type: ignore[union-attr]
    inside = {name for name in held if name.startswith(f"{module}.")}
    if len(info.names) > 1:
        raise _Replicated(f"{weight} is tied to {', '.join(info.names[1:])}")
    if wanted is ops.EMBEDDING:
        # padding_idx, scale_grad_by_freq, sparse: only their defaults (-1, False, False)
        defaults = (-1, False, False)
        extra = [
            a
            for a, d in zip(node.args[2:], defaults)
            if not (a is d or type(a) is type(d) and a == d)
        ]
        extra += [v for v in node.kwargs.values() if v not in (None, -1) and v is not False]
        if inside != {weight} or extra:
            raise _Replicated(
                f"{module} is not a plain embedding (padding index, frequency scaling or sparse "
                "gradients, which a vocabulary-parallel lookup would apply to each rank's rows)"
            )
        rows, width = info.shape
        return ShardedModule(
            node.name, module, ROWWISE, rows, width, False, region.scope, EMBEDDING
        )
    bias = node.args[2] if len(node.args) > 2 else None
    if inside != {weight} | ({f"{module}.bias"} if isinstance(bias, Ref) else set()):
        raise _Replicated(f"{module} holds more than a linear projection's weight and bias")
    out_features, in_features = info.shape
    return ShardedModule(
        node.name,
        module,
        COLWISE,
        in_features,
        out_features,
        isinstance(bias, Ref),
        region.scope,
        gathered=True,
    )


def _local_sizes(
    graph: Graph, region: Region
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int]]]:
    """What the code of ``region`` writes so that each rank computes its share: ``(node,
    position, size)`` for each size a view or an expansion gives a sharded dimension (-1) and
    each -1 of such a view that moves elsewhere (the fixed size it stands for), and ``(node,
    sections)`` for each split of a fused projection's output into equal sections (a chunk
    into as many: each rank's share splits alike). Refused where no such writing keeps the
    code right at every degree."""
    free: list[tuple[str, int, int]] = []
    chunks: list[tuple[str, int]] = []
    for name, dim in region.reshapes:
        node = graph[name]
        if node.target in _SPLITS:
            chunks.append((name, _sections(node, graph, dim)))
            continue
        sizes = node.args[1] if len(node.args) > 1 else None
        if not isinstance(sizes, (list, tuple)) or dim >= len(sizes):
            raise _Replicated(f"{name} ({node.target}) gives its sizes otherwise")
        if sizes[dim] == -1:
            continue
        if isinstance(sizes[dim], Size) or not isinstance(sizes[dim], int):
            raise _Replicated(f"{name} computes the sharded size")
        if node.target not in _VIEWS and node.target != _EXPAND:
            raise _Replicated(f"{name} ({node.target}) is not a view or an expansion")
        if node.target in _VIEWS and -1 in sizes:
            other = list(sizes).index(-1)
            meta = node.tensor_meta
            fixed = meta.shape[other] if meta is not None else None
            dynamic = meta is not None and bool(meta.sizes) and not meta.sizes[other].isdigit()
            if not isinstance(fixed, int) or isinstance(fixed, bool) or dynamic:
                raise _Replicated(
                    f"{name} fixes the sharded size {sizes[dim]} and leaves another one, "
                    "computed at run time, to -1"
                )
            free.append((name, other, fixed))
        free.append((name, dim, -1))
    return free, chunks


def _sections(node: Node, graph: Graph, dim: int) -> int:
    """How many equal sections ``node`` (a split of a fused projection's output along its
    features) splits it into; refused for unequal ones."""
    value = node.args[0]
    meta = graph[value.name].tensor_meta if isinstance(value, Ref) else None
    pieces = argument_value(node, "split_size") or argument_value(node, "split_sizes")
    if meta is None or isinstance(pieces, (list, tuple)) and len(set(pieces)) != 1:
        raise _Replicated(f"{node.name} splits the projection into unequal sections")
    size = pieces[0] if isinstance(pieces, (list, tuple)) else pieces
    total = meta.shape[dim]
    if not isinstance(size, int) or not isinstance(total, int) or total % size:
        raise _Replicated(f"{node.name} splits the projection into unequal sections")
    return total // size
