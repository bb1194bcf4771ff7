"""What tensor parallelism costs and saves, as a profile the partitioners and the cost model read
(issue 45, item 3).

At degree ``t`` a unit's sharded work (its sharded projections' products and the attention of
the heads they split: :class:`~autopipe.tensor_parallel.ShardingPlan`) runs on ``t`` ranks at
once, each a ``1/t`` share, and its other operators (norms, residual additions, replicated
regions) on each of them whole: the unit's times scale by ``1 - s + s / t``, ``s`` the share of
its FLOPs that is sharded (its products and attention dominate a transformer block's time). Its
collectives are added where torch's styles run them: in the forward, one all-reduce of each row
projection's (and the embedding's) output and an all-gather of the head's logits, which every
rank then holds whole; in the backward, one all-reduce of each column projection's input
gradient (torch's ``ColwiseParallel`` reduces each one's own). They run within a node over the spec's
link, costed by :class:`~.network.Network` and not overlapped. Each rank holds ``1/t`` of the
sharded projections' parameters (gradients and optimizer state follow) and of the activations
of the sharded work. FLOPs stay the model's (what model FLOPs utilisation counts, over every
device of the plan).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..ir import Graph, Node, Ref, TensorMeta
from ..profiling import Profile
from ..tensor_parallel import EMBEDDING, ROWWISE, ShardingPlan
from .network import Network

__all__ = ["TensorParallelCost", "sharded_profile"]

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
    regions = {m.region for m in plan.modules}  # the scopes of the sharded regions
    group = list(range(t))  # within a node: tensor-parallel ranks are innermost
    units = []
    saved = communication = parameters_saved = 0.0
    for unit, cost in zip(graph.units, profile.units):
        sharded_flops = 0.0
        forward_comm = backward_comm = 0.0
        held = gathered = 0.0
        for name in unit.nodes:
            node = graph[name]
            module = by_node.get(name)
            if module is not None:
                out = float(graph.value_bytes(name))  # its output
                held += _bytes_of(graph, node.args[module.weight_at])
                if module.kind == EMBEDDING:  # a lookup: no FLOPs; its partial sums reduced
                    forward_comm += network.collective("all_reduce", out, group)
                    continue
                sharded_flops += _product_flops(graph, node)
                held += _bytes_of(graph, node.args[2] if len(node.args) > 2 else None)
                if module.style == ROWWISE:
                    forward_comm += network.collective("all_reduce", out, group)
                    continue
                moved = _bytes_of(graph, node.args[0])
                backward_comm += network.collective("all_reduce", moved, group)
                if module.gathered:  # the head's logits, gathered whole on every rank
                    gathered += out
                    forward_comm += network.collective("all_gather", out, group)
            elif node.target == _ATTENTION and node.scope:
                inner = node.scope[-1].fqn
                if any(inner == r or inner.startswith(f"{r}.") for r in regions):
                    sharded_flops += _attention_flops(graph, node)
        share = min(1.0, sharded_flops / cost.flops_forward) if cost.flops_forward > 0 else 0.0
        keep = 1 - share + share / t
        # memory: the unit's sharded share, but gathered logits are whole on every rank
        whole = min(1.0, gathered / cost.activations) if cost.activations else 0.0
        kept = max(keep, whole)
        forward, backward = cost.forward * keep, cost.backward * keep
        saved += cost.forward + cost.backward - forward - backward
        communication += forward_comm + backward_comm
        parameters_saved += held * (1 - 1 / t)
        units.append(
            dataclasses.replace(
                cost,
                forward=forward + forward_comm,
                backward=backward + backward_comm,
                activations=int(cost.activations * kept),
                temporaries=int(cost.temporaries * kept),
                backward_memory=int(cost.backward_memory * kept),
                parameters=max(0, int(cost.parameters - held * (1 - 1 / t))),
            )
        )
    changed = dataclasses.replace(profile, units=units)
    return changed, TensorParallelCost(t, saved, communication, parameters_saved)


def _bytes_of(graph: Graph, value: object) -> float:
    """Bytes of the value a node argument refers to (0 for anything else)."""
    return float(graph.value_bytes(value.name)) if isinstance(value, Ref) else 0.0


def _metas(graph: Graph, node: Node) -> tuple[TensorMeta | None, TensorMeta | None]:
    """The tensor facts of ``node``'s first two arguments (None where one is not a value)."""
    first, second = (
        graph[a.name].tensor_meta if isinstance(a, Ref) else None
        for a in (*node.args, None, None)[:2]
    )
    return first, second


def _product_flops(graph: Graph, node: Node) -> float:
    """FLOPs of ``linear(x, weight)``: 2 x rows of x x the weight's elements."""
    x, weight = _metas(graph, node)
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
