"""What tensor parallelism costs and saves, as a profile the partitioners and the cost model read
(issue 45, item 3).

At degree ``t`` a unit's sharded work (its sharded projections' products and the attention of
the heads they split: :class:`~autopipe.tensor_parallel.ShardingPlan`) runs on ``t`` ranks at
once, each a ``1/t`` share (a grouped key or value projection replicated at a degree above its
``h`` key/value heads: each rank its one head, ``1/h``, and so the values computed from it
before attention); of its other operators, those inside sharded regions work on each
rank's heads or features and, sequence parallel, those between regions on ``1/t`` of the
positions, while the rest (replicated regions; norms and residual additions without sequence
parallelism) run whole on every rank. The unit's times scale by ``s r/t + (1-s)(1 - q + q/t)``:
``s`` the share of its FLOPs that is sharded (products and attention dominate a transformer
block's time), ``r`` how much slower a ``1/t`` share of those products runs than ``1/t`` of
their time (the device spec's calibrated GEMM and attention rates at the smaller size; 1 on a
spec without tables), ``q`` the share of the rest's written bytes that is divided.

Its collectives are added where torch's styles run them. Without sequence parallelism: in the
forward, an all-reduce of each row projection's (and the embedding's) output and either the
three all-reduces of a number a row of a loss computed vocabulary-parallel (torch's
``loss_parallel``: the logits stay split) or an all-gather of the head's logits, which every rank
then holds whole; in the backward, an all-reduce of each region
input's gradient (one per region input module, however many column projections read it; the head's
own). Sequence parallel, each of those all-reduces is a reduce-scatter one way and an all-gather the
other: row projections and the embedding reduce-scatter their output (all-gather its gradient),
region inputs and the head all-gather their input (reduce-scatter its gradient). They run within a
node over the spec's link, costed by :class:`~.network.Network` and not overlapped. Each rank holds
``1/t`` of the sharded projections' parameters (gradients and optimizer state follow), replicated
key/value projections whole. What a unit saves for backward scales as the bytes its operators write
do on a rank: ``1/t`` of those on a share (a column's features, attention's heads, a slice of the
sequence), all of the rest, and, sequence parallel, each region input's gathered value whole (the
projections keep it for their backward); its working memory scales as its time does without the
slowdown (an embedding's gradient is the size of its rows). FLOPs stay the model's (what model FLOPs
utilisation counts, over every device of the plan).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..ir import Graph, Node, Ref, TensorMeta
from ..profiling import Profile
from ..tensor_parallel import EMBEDDING, ROWWISE, ShardedModule, ShardingPlan
from .network import Network

__all__ = ["LOSS_REDUCTIONS", "TensorParallelCost", "sharded_profile"]

#: the all-reduces of a vocabulary-parallel cross-entropy over the vocabulary's splits, each of
#: one float32 a row: the largest logit, the sum of exponentials, the label's logit
LOSS_REDUCTIONS = 3

_ATTENTION = "aten.scaled_dot_product_attention.default"


@dataclass(frozen=True)
class TensorParallelCost:
    """What degree ``degree`` changes per microbatch on each rank (seconds and bytes)."""

    degree: int
    compute_saved: float  # forward and backward seconds the sharding takes off each rank
    communication: float  # seconds of its all-reduces, forward and backward
    parameters_saved: float  # parameter bytes each rank does not hold

    def describe(self) -> str:
        """``tensor parallel 2 saves 1.2 ms of compute per microbatch for 0.3 ms of
        all-reduces, and 1.1 GiB of parameters per rank``."""
        return (
            f"tensor parallel {self.degree} saves {self.compute_saved * 1e3:.3g} ms of compute "
            f"per microbatch for {self.communication * 1e3:.3g} ms of all-reduces within a "
            f"node, and {self.parameters_saved / 2**30:.3g} GiB of parameters per rank"
        )


def sharded_profile(
    graph: Graph, profile: Profile, plan: ShardingPlan, network: Network
) -> tuple[Profile, TensorParallelCost]:
    """``profile`` as each of ``plan.degree`` tensor-parallel ranks runs it, and what it
    changes (the module's text)."""
    t = plan.degree
    if t == 1 or not plan.modules:
        return profile, TensorParallelCost(t, 0.0, 0.0, 0.0)
    by_node = {m.node: m for m in plan.modules}
    sliced = plan.sequence_values
    entry_sliced = {i.module: i.sequence for i in plan.inputs}
    group = list(range(t))  # within a node: tensor-parallel ranks are innermost

    def collective(kind: str, nbytes: float) -> float:
        return network.collective(kind, nbytes, group)

    # sequence parallel, an all-reduce is a reduce-scatter (forward) and an all-gather
    # (backward), or the other way round; the forward's and the backward's kinds
    split = ("reduce_scatter", "all_gather") if plan.sequence else ("all_reduce", "")
    gather = ("all_gather", "reduce_scatter") if plan.sequence else ("", "all_reduce")
    entered: set[str] = set()
    heads = _head_values(graph, plan)  # values of replicated key/value heads: 1 head a rank
    divided: dict[str, int] = dict.fromkeys(sliced, t)  # what each rank holds 1/t of
    units = []
    saved = communication = parameters_saved = 0.0
    for unit, cost in zip(graph.units, profile.units):
        sharded_flops = 0.0
        # the sharded FLOPs each rank computes, and weighted by how much slower its smaller
        # share runs
        rank_flops = slower = 0.0
        comm = [0.0, 0.0]  # forward, backward
        held = 0.0
        rest = rest_rank = 0.0  # bytes written by the other operators: all, a rank's
        # memory: bytes the unit's operators write (what it saves for backward follows them),
        # all of them and what a rank writes of them
        written_all = written_rank = 0.0

        def writes(nbytes: float, parts: int) -> None:
            """``nbytes`` written, of which a rank writes ``1/parts``."""
            nonlocal written_all, written_rank
            written_all += nbytes
            written_rank += nbytes / parts

        def add(kinds: tuple[str, str], nbytes: float) -> None:
            for i, kind in enumerate(kinds):
                comm[i] += collective(kind, nbytes) if kind else 0.0

        for name in unit.nodes:
            node = graph[name]
            module = by_node.get(name)
            if module is not None:
                out = float(graph.value_bytes(name))  # its output
                parts = round(1 / module.rank_share(t))
                if not module.heads:  # a replicated key/value projection: whole on each rank
                    held += _bytes_of(graph, node.args[module.weight_at])
                    divided.update(dict.fromkeys(_parameters(graph, node, module), t))
                # a column's features, the head's logits split over the vocabulary for the loss
                column = module.style != ROWWISE and (not module.gathered or module.loss_parallel)
                if column:
                    divided[name] = parts  # a column's features (a key/value head)
                # a column's features are a share, a row's partial sums whole (a slice of the
                # sequence, sequence parallel), the head's logits gathered whole on every rank
                writes(out, parts if column or module.sequence and not module.gathered else 1)
                if module.style != ROWWISE and (
                    entry_sliced.get(module.entry, False)
                    and module.entry not in entered
                    or not module.entry
                    and module.sequence
                ):
                    # it (or its region input) gathers its input whole along the sequence and
                    # keeps it for its backward, where the graph holds a slice
                    written_rank += _input(graph, node, module) * (1 - 1 / t)
                if module.kind == EMBEDDING:  # a lookup: no FLOPs; its partial sums reduced
                    add(split, out)
                    continue
                flops = _product_flops(graph, node, module)
                sharded_flops += flops
                rank_flops += flops / parts
                slower += flops / parts * _slowdown(profile, "matmul", node, flops, parts)
                if module.bias_at is not None and _bias_split(module):
                    held += _bytes_of(graph, node.args[module.bias_at])
                elif module.bias_at is not None and module.style != ROWWISE:
                    # a fused projection's bias, whole on every rank: its gradient, each
                    # rank's share of each section, gathered (when the optimizer reads it)
                    comm[1] += collective("all_gather", _bytes_of(graph, node.args[module.bias_at]))
                if module.style == ROWWISE:
                    add(split, out)
                elif module.gathered:  # the head: its input gathered, its logits too
                    add(
                        gather if module.sequence else ("", "all_reduce"),
                        _input(graph, node, module),
                    )
                    if module.loss_parallel:  # the loss's three all-reduces of a number a row
                        rows = math.prod(node.tensor_meta.shape[:-1]) if node.tensor_meta else 0
                        comm[0] += LOSS_REDUCTIONS * collective("all_reduce", rows * 4)
                    else:
                        comm[0] += collective("all_gather", out)
                elif not module.entry:  # a column reading its input on its own
                    add(
                        gather if module.sequence else ("", "all_reduce"),
                        _input(graph, node, module),
                    )
                elif module.entry not in entered:  # a region input: once for its columns
                    entered.add(module.entry)
                    kinds = gather if entry_sliced.get(module.entry) else ("", "all_reduce")
                    add(kinds, _input(graph, node, module))
                continue
            inside = name in plan.interior
            if node.target == _ATTENTION and inside:
                flops = _attention_flops(graph, node)
                sharded_flops += flops
                rank_flops += flops / t
                kind = "causal_attention" if _causal(node) else "attention"
                slower += flops / t * _slowdown(profile, kind, node, flops, t)
                writes(float(graph.value_bytes(name)), t)
                continue
            written = float(graph.value_bytes(name))
            # a sharded region's heads or features (a replicated key/value head's), or a slice
            # of the sequence between regions, is a rank's share; the rest is whole
            parts = heads.get(name, t) if inside or name in sliced else 1
            writes(written, parts)
            rest += written
            rest_rank += written / parts
            if inside:
                divided[name] = parts
        share = min(1.0, sharded_flops / cost.flops_forward) if cost.flops_forward > 0 else 0.0
        # the part of the sharded work (and, at the device table's lower rate for a smaller
        # product, of its time: 1 on a spec without tables) a rank does
        rank_part = rank_flops / sharded_flops if sharded_flops else 0.0
        rank_part_slower = slower / sharded_flops if sharded_flops else 0.0
        others = (1 - share) * (rest_rank / rest if rest else 1.0)
        keep = share * rank_part_slower + others
        # memory: what the unit keeps for backward follows the bytes it writes, of which a
        # rank writes its share (a gathered region input whole); its working memory (an
        # embedding's gradient the size of its rows, a product's) follows the work it shares
        kept = written_rank / written_all if written_all else 1.0
        working = share * rank_part + others
        forward, backward = cost.forward * keep, cost.backward * keep
        saved += cost.forward + cost.backward - forward - backward
        communication += sum(comm)
        parameters_saved += held * (1 - 1 / t)
        # the share of its parameters a rank holds: of the bf16 copies of the weights (--bf16)
        # and of the time casting them
        held_share = 1 - held * (1 - 1 / t) / cost.parameters if cost.parameters else 0.0
        casts = int(cost.cast_parameters * held_share)
        units.append(
            dataclasses.replace(
                cost,
                forward=forward + comm[0],
                backward=backward + comm[1],
                activations=int((cost.activations - cost.cast_parameters) * kept) + casts,
                temporaries=int(cost.temporaries * working),
                backward_memory=int(cost.backward_memory * working),
                parameters=max(0, int(cost.parameters - held * (1 - 1 / t))),
                cast_parameters=casts,
                cast_time=cost.cast_time * held_share,
            )
        )
    changed = dataclasses.replace(profile, units=units, divided=divided)
    return changed, TensorParallelCost(t, saved, communication, parameters_saved)


def _slowdown(profile: Profile, kind: str, node: Node, flops: float, t: int) -> float:
    """How much longer than ``1/t`` of the time a ``1/t`` share of ``flops`` of ``kind`` takes
    at the device's rates (its calibrated table's rate falls with the size of a product)."""
    meta = node.tensor_meta
    dtype = meta.dtype if meta is not None else None
    device = profile.device
    if not flops:
        return 1.0
    return device.compute_rate(kind, dtype, flops) / device.compute_rate(kind, dtype, flops / t)


def _head_values(graph: Graph, plan: ShardingPlan) -> dict[str, int]:
    """The values computed from replicated key/value projections before attention reads them
    (their views into heads, rotary embeddings), each with the projection's heads: a rank holds
    one head of them, ``1/heads``."""
    stops = plan.module_nodes
    found: dict[str, int] = {}
    for module in plan.modules:
        if not module.heads:
            continue
        frontier = [module.node]
        while frontier:
            for user in graph.users(frontier.pop()):
                if user in found or user in stops or graph[user].target == _ATTENTION:
                    continue
                found[user] = module.heads
                frontier.append(user)
    return found


def _causal(node: Node) -> bool:
    """Whether an attention node is called causally (its ``is_causal`` argument)."""
    value = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    return value is True


def _parameters(graph: Graph, node: Node, module: ShardedModule) -> list[str]:
    """The first names of a sharded module's weight and bias (what each rank holds a part
    of)."""
    at = [module.weight_at] + (
        [module.bias_at] if module.bias_at is not None and _bias_split(module) else []
    )
    refs = [node.args[i] for i in at]
    return [
        graph.param_of(graph[r.name].target).names[0]
        for r in refs
        if isinstance(r, Ref) and graph[r.name].kind == "param"
    ]


def _bias_split(module: ShardedModule) -> bool:
    """Whether each rank holds a part of ``module``'s bias: a column projection's (a row
    projection adds its whole bias once; a fused one keeps it whole, slicing it for the
    product, and so does a replicated key/value projection)."""
    return module.style != ROWWISE and module.sections == 1 and not module.heads


def _input(graph: Graph, node: Node, module: ShardedModule) -> float:
    """Bytes of a projection's input (its whole value, gathered or reduced)."""
    return _bytes_of(graph, node.args[module.input_at])


def _bytes_of(graph: Graph, value: object) -> float:
    """Bytes of the value a node argument refers to (0 for anything else)."""
    return float(graph.value_bytes(value.name)) if isinstance(value, Ref) else 0.0


def _metas(
    graph: Graph, node: Node, at: tuple[int, int] = (0, 1)
) -> tuple[TensorMeta | None, TensorMeta | None]:
    """The tensor facts of ``node``'s arguments at the positions ``at`` (its first two by
    default; None where one is not a value)."""
    first, second = (
        graph[a.name].tensor_meta if isinstance(a, Ref) else None
        for a in ((*node.args, None, None)[i] for i in at)
    )
    return first, second


def _product_flops(graph: Graph, node: Node, module: ShardedModule) -> float:
    """FLOPs of ``linear(x, weight)`` (or ``addmm(bias, x, weight)``): 2 x rows of x x the
    weight's elements."""
    x, weight = _metas(graph, node, (module.input_at, module.weight_at))
    if x is None or weight is None:
        return 0.0
    return 2.0 * math.prod(x.shape[:-1]) * math.prod(weight.shape)


def _attention_flops(graph: Graph, node: Node) -> float:
    """FLOPs of attention's two products: 4 x batch x heads x queries x keys x head size."""
    query, key = _metas(graph, node)
    if query is None or key is None or len(query.shape) != 4:
        return 0.0
    batch, heads, queries, size = query.shape
    return 4.0 * batch * heads * queries * key.shape[-2] * size
