"""Tensor-parallel regions found in the graph (issue 45, item 1): Megatron's structure, for any
model, from its operators.

A *region* runs between two residual additions: one or more *column* projections read the same
replicated input (a normalised hidden state) and are split along their output features, the
operators after them work on each rank's share of features or heads only, and one *row*
projection reads what they produce and is split along its input features, so that each rank
computes a partial sum the region's single all-reduce (or reduce-scatter, with sequence
parallelism) completes. Attention (query, key and value projections split by whole heads, the
output projection row-wise) and MLPs (up and gate column-wise, down row-wise, any activation
between) have that shape; so does a fused query-key-value projection (GPT-2's ``c_attn``,
whose output is split into its sections, each split by heads). The embedding is vocabulary-
parallel and the output head column-parallel over the vocabulary, its loss computed
vocabulary-parallel, when the vocabulary divides.

How a region is found: from each projection (``linear``, ``addmm`` / ``mm`` of a parameter) the
sharded dimension (its output features) is followed forward through the operators reading it:
elementwise operators keep it (their other operand replicated and broadcast over it, or sharded the
same way), views and reshapes move it (splitting features into heads needs whole heads per rank),
transposes and permutes carry it, splits along it give each section, attention keeps the heads
sharded (grouped-query key/value heads divide too, or are replicated: below), reductions and
normalisations over other dimensions keep it. It ends where a projection reads it as its input
features (the row projection). Anything else that reads a sharded value (a reduction over the
features, a value leaving the region, two row projections) leaves the region replicated, with the
reason.

Degrees: every power of two the region's sizes divide (heads, key/value heads, features,
sections, vocabulary), up to :data:`MAX_DEGREE`; and, for grouped-query attention whose key and
value projections are projections of their own, the degrees above its key/value heads that they
divide while the rest of the region's sizes divide them: there the key and value projections
are replicated (every rank computes the one head its query heads read; their columns are marked
``key_value``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..ir import Graph, Node, Ref
from ..ir.types import argument_value
from . import operators as ops
from .artifact import ColumnShard, Region, TensorParallelRegions

__all__ = ["MAX_DEGREE", "find_regions"]

#: the largest degree considered
MAX_DEGREE = 64
#: operators that keep every dimension of their (first) tensor argument
_ELEMENTWISE = {
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.div.Tensor",
    "aten.add.Scalar",
    "aten.mul.Scalar",
    "aten.div.Scalar",
    "aten.pow.Tensor_Scalar",
    "aten.neg.default",
    "aten.tanh.default",
    "aten.gelu.default",
    "aten.silu.default",
    "aten.relu.default",
    "aten.sigmoid.default",
    "aten.exp.default",
    "aten.erf.default",
    "aten.dropout.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten._to_copy.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.where.self",
    "aten.masked_fill.Scalar",
}
_VIEWS = {"aten.view.default", "aten.reshape.default", "aten._unsafe_view.default"}
_TRANSPOSES = {"aten.transpose.int"}
_PERMUTES = {"aten.permute.default"}
_SPLITS = {"aten.split.Tensor", "aten.split_with_sizes.default"}
_SLICES = {"aten.slice.Tensor"}
_CONCATENATIONS = {"aten.cat.default"}
_ATTENTION = {"aten.scaled_dot_product_attention.default"}
_LOSSES = {"aten.cross_entropy_loss.default"}


class _Refused(Exception):
    """Why a region is left replicated."""


@dataclass
class _Projection:
    node: Node
    weight: str  # the parameter's first name
    out_dim: int  # the weight's dimension of output features
    input: str  # the value it reads


def find_regions(graph: Graph) -> TensorParallelRegions:
    """The tensor-parallel regions of ``graph``, each with the degrees it allows or why it is
    left replicated (see the module's text)."""
    by_name = {node.name: node for node in graph.nodes}
    order = {name: position for position, name in enumerate(by_name)}
    projections = [p for node in graph.calls if (p := _projection(graph, node)) is not None]
    by_node = {p.node.name: p for p in projections}
    uses: dict[str, int] = {}
    for p in projections:
        uses[p.weight] = uses.get(p.weight, 0) + 1
    regions: list[Region] = []
    claimed: set[str] = set()  # projections already in a region
    # column projections reading the same value start one region together
    starts: dict[str, list[_Projection]] = {}
    for p in projections:
        starts.setdefault(p.input, []).append(p)
    for source, columns in starts.items():
        if any(c.node.name in claimed for c in columns):
            continue
        if len(columns) == 1 and _feeds_loss(graph, columns[0].node.name):
            continue  # the output head: a region of the vocabulary
        region = _region(graph, by_name, order, by_node, columns, uses)
        if region is None:
            continue
        regions.append(region)
        claimed.update(c.node.name for c in columns)
        if region.row:
            claimed.add(region.row_node)
    regions += _vocabulary_regions(graph, order, projections, claimed)
    return TensorParallelRegions(
        model=graph.model.cls,
        regions=tuple(sorted(regions, key=lambda r: r.order)),
    )


def _projection(graph: Graph, node: Node) -> _Projection | None:
    operator = ops.PROJECTIONS.get(node.target) if node.kind == "call" else None
    if operator is None or len(node.args) < operator.operands():
        return None
    data, weight = node.args[operator.input_at], node.args[operator.weight_at]
    if not isinstance(data, Ref) or not isinstance(weight, Ref):
        return None
    param = graph[weight.name]
    if param.kind != "param":
        return None
    return _Projection(node, graph.param_of(param.target).names[0], operator.out_dim, data.name)


def _region(
    graph: Graph,
    by_name: dict[str, Node],
    order: dict[str, int],
    by_node: dict[str, _Projection],
    columns: list[_Projection],
    uses: dict[str, int],
) -> Region | None:
    """The region starting at ``columns`` (projections reading one value): split, or left
    replicated with the reason; None where the sharded values lead to no row projection and
    nothing refuses them (a projection whose output is a model output)."""
    scope = _common_scope(c.node for c in columns)
    start = min(order[c.node.name] for c in columns)
    walk = _Walk(graph, by_name, by_node, columns)
    reason = ""
    try:
        for column in columns:
            walk.start(column)
        walk.run()
    except _Refused as why:
        reason = str(why)
    except Exception as exc:  # noqa: BLE001 - an operator this pass misreads: refused, said
        reason = f"not followed ({type(exc).__name__}: {exc})"
    if not walk.rows and (not reason or (len(columns) == 1 and not walk.attention)):
        return None  # a lone projection (a row of a region left replicated, a router, ...)
    sizes = tuple(sorted(walk.sizes))
    degrees: tuple[int, ...] = ()
    if not reason:
        row = walk.rows[0]
        shared = [p.weight for p in (*columns, row) if uses[p.weight] > 1]
        degrees = tuple(d for d in _powers() if all(size % d == 0 for size in sizes))
        degrees = tuple(sorted(set(degrees) | set(walk.replicated_heads_degrees())))
        if shared:
            degrees = ()
            reason = f"projection {shared[0]} is read twice (one weight, two splits)"
        elif not degrees:
            reason = f"no degree divides its sizes {', '.join(map(str, sizes))}"
    row_weight = walk.rows[0].weight if walk.rows else ""
    row_node = walk.rows[0].node.name if walk.rows else ""
    return Region(
        kind="attention" if walk.attention else "mlp",
        scope=scope,
        order=start,
        columns=tuple(
            ColumnShard(
                c.weight,
                c.out_dim,
                walk.sections.get(c.node.name, ()),
                key_value=c.node.name in walk.key_values,
            )
            for c in columns
        ),
        row=row_weight,
        row_node=row_node,
        heads=walk.heads,
        kv_heads=walk.kv_heads,
        sizes=sizes,
        degrees=degrees,
        reason=reason,
        reshapes=tuple(sorted(walk.reshapes.items(), key=lambda item: order[item[0]])),
    )


class _Walk:
    """Follows the sharded dimension forward from column projections (see the module)."""

    def __init__(
        self,
        graph: Graph,
        by_name: dict[str, Node],
        by_node: dict[str, _Projection],
        columns: list[_Projection],
    ) -> None:
        self.graph, self.by_name, self.by_node = graph, by_name, by_node
        self.sharded: dict[str, int] = {}  # value -> its sharded dimension
        self.pending: list[str] = []
        self.rows: list[_Projection] = []
        self.sizes: set[int] = set()  # what the degree must divide
        #: each of those sizes with the column projection it comes from ("": none)
        self.size_origins: set[tuple[int, str]] = set()
        #: grouped-query attention's key and value projections (when their own, not fused)
        self.key_values: set[str] = set()
        self.sections: dict[str, tuple[int, ...]] = {}  # fused column -> its sections
        self.heads = 0
        self.kv_heads = 0
        self.attention = False  # whether the region reaches an attention call
        self.origin: dict[str, str] = {}  # value -> the column projection it comes from
        #: views, expansions and splits of sharded values -> the sharded dimension of their
        #: result
        self.reshapes: dict[str, int] = {}
        #: every value the columns reach before a projection: sharded too, once visited
        self.reached = _reached(graph, [c.node.name for c in columns], set(by_node))

    def start(self, column: _Projection) -> None:
        meta = column.node.tensor_meta
        if meta is None or not meta.shape:
            raise _Refused(f"{column.node.name} returns no tensor of features")
        dim = len(meta.shape) - 1
        self._size(meta.shape[dim], column.node.name)
        self.sharded[column.node.name] = dim
        self.origin[column.node.name] = column.node.name
        self.pending.append(column.node.name)

    def run(self) -> None:
        while self.pending:
            name = self.pending.pop(0)
            for user in self.graph.users(name):
                node = self.by_name[user]
                try:
                    self._visit(node, name)
                except (TypeError, ValueError, IndexError, KeyError) as exc:
                    # arguments of a shape this pass does not read: not followed, and said
                    raise _Refused(f"{node.name} ({node.target}) is not followed: {exc}") from exc

    def _mark(self, node: Node, dim: int, source: str) -> None:
        if node.name in self.sharded:
            if self.sharded[node.name] != dim:
                raise _Refused(f"{node.name} would be sharded along two dimensions")
            return
        self.sharded[node.name] = dim
        self.origin[node.name] = self.origin[source]
        self.pending.append(node.name)

    def _visit(self, node: Node, source: str) -> None:
        dim = self.sharded[source]
        target = node.target
        if node.name in self.by_node:
            projection = self.by_node[node.name]
            meta = self.graph[source].tensor_meta
            if projection.input == source and meta is not None and dim == len(meta.shape) - 1:
                if projection not in self.rows:
                    if self.rows:
                        raise _Refused(
                            f"two projections read the sharded features ({self.rows[0].weight},"
                            f" {projection.weight})"
                        )
                    self.rows.append(projection)
                return
            raise _Refused(f"{node.name} ({target}) reads a sharded value other than as input")
        if node.kind != "call":
            raise _Refused(f"a sharded value ({source}) leaves the region as {node.name}")
        if target in _ELEMENTWISE:
            self._elementwise(node, source, dim)
        elif target in _VIEWS:
            self._view(node, source, dim)
        elif target in _TRANSPOSES:
            a, b = (int(x) for x in node.args[1:3])
            rank = len(self._shape(source))
            a, b = a % rank, b % rank
            self._mark(node, b if dim == a else a if dim == b else dim, source)
        elif target in _PERMUTES:
            order = [int(x) % len(self._shape(source)) for x in node.args[1]]
            self._mark(node, order.index(dim), source)
        elif target in _SPLITS:
            self._split(node, source, dim)
        elif target == "getitem":
            self._mark(node, dim, source)
        elif target in _SLICES:
            axis = int(argument_value(node, "dim") or 0) % len(self._shape(source))
            if axis == dim:
                raise _Refused(f"{node.name} ({target}) cuts along the sharded dimension")
            self._mark(node, dim, source)
        elif target in _CONCATENATIONS:
            self._concatenation(node, source, dim)
        elif target in _ATTENTION:
            self._attention(node, source, dim)
        elif target == "aten.unsqueeze.default":
            self._unsqueeze(node, source, dim)
        elif target == "aten.expand.default":
            self._expand(node, source, dim)
        else:
            raise _Refused(f"{node.name} ({target}) is not known to keep a shard")

    def _shape(self, name: str) -> tuple[int, ...]:
        meta = self.graph[name].tensor_meta
        if meta is None:
            raise _Refused(f"{name} is not one tensor")
        return meta.shape

    def _elementwise(self, node: Node, source: str, dim: int) -> None:
        out = self._shape(node.name) if node.tensor_meta is not None else None
        if out is None:
            raise _Refused(f"{node.name} returns no single tensor")
        offset = len(out) - len(self._shape(source))
        for ref in (a for a in node.args if isinstance(a, Ref)):
            if ref.name == source or ref.name in self.sharded or ref.name in self.reached:
                continue  # sharded the same way (checked when it is marked)
            other = self._shape(ref.name)
            at = dim + offset - (len(out) - len(other))
            if 0 <= at < len(other) and other[at] != 1:
                raise _Refused(
                    f"{node.name} ({node.target}) combines the shard with a full "
                    f"{ref.name} {list(other)}"
                )
        self._mark(node, dim + offset, source)

    def _view(self, node: Node, source: str, dim: int) -> None:
        before, after = self._shape(source), self._shape(node.name)
        outer, size = math.prod(before[:dim]), before[dim]
        running = 1
        for j, extent in enumerate(after):
            if running == outer and extent == 1 and size != 1:
                if tuple(after[j + 1 :]) != (size,):
                    continue  # a dimension of 1 before the shard's (a batch of one)
                # else the features as one head of them (multi-query attention's key and
                # value; an MLP's view adding a dimension of 1 there is read so too, and left
                # replicated: no degree divides one head)
            if running == outer:
                if extent == size:
                    self._reshaped(node, j, source)
                    return
                if extent < size and size % extent == 0:  # features into (heads, head size)
                    self._size(extent, self.origin[source])
                    self._reshaped(node, j, source)
                    return
                merged = size
                for following in before[dim + 1 :]:  # (heads, head size) into features
                    merged *= following
                    if merged == extent:
                        self._reshaped(node, j, source)
                        return
                break
            running *= extent
            if running > outer:
                break
        raise _Refused(
            f"{node.name} reshapes the sharded dimension: {list(before)} -> {list(after)}"
        )

    def _concatenation(self, node: Node, source: str, dim: int) -> None:
        """A concatenation along another dimension of tensors all sharded alike (rotary's
        halves): kept; with a full tensor (a learned prefix, a cache) or along the shard:
        refused."""
        axis = int(argument_value(node, "dim") or 0) % len(self._shape(source))
        if axis == dim:
            raise _Refused(f"{node.name} concatenates along the sharded dimension")
        parts = node.args[0] if node.args and isinstance(node.args[0], (list, tuple)) else ()
        for part in parts:
            if not isinstance(part, Ref) or part.name not in self.reached:
                raise _Refused(f"{node.name} concatenates the shard with a full value")
            if self.sharded.get(part.name, dim) != dim:
                raise _Refused(f"{node.name} concatenates values sharded along other dimensions")
        self._mark(node, dim, source)

    def _unsqueeze(self, node: Node, source: str, dim: int) -> None:
        rank = len(self._shape(node.name))
        at = int(node.args[1]) % rank
        self._mark(node, dim + 1 if at <= dim else dim, source)

    def _expand(self, node: Node, source: str, dim: int) -> None:
        before, after = self._shape(source), self._shape(node.name)
        offset = len(after) - len(before)
        if after[dim + offset] != before[dim]:
            raise _Refused(f"{node.name} expands the sharded dimension")
        self._reshaped(node, dim + offset, source)

    def _reshaped(self, node: Node, dim: int, source: str) -> None:
        """``node`` (a view or an expansion) gives its result's sharded dimension ``dim`` a
        size: a rank's is its share."""
        self.reshapes[node.name] = dim
        self._mark(node, dim, source)

    def _split(self, node: Node, source: str, dim: int) -> None:
        axis = int(argument_value(node, "dim") or 0) % len(self._shape(source))
        if axis != dim:
            self._mark(node, dim, source)
            return
        pieces = argument_value(node, "split_size") or argument_value(node, "split_sizes")
        shape = self._shape(source)
        total = shape[dim]
        if isinstance(pieces, (list, tuple)):
            sections = tuple(int(p) for p in pieces)
        else:
            whole, rest = divmod(total, int(pieces))
            sections = (int(pieces),) * whole + ((rest,) if rest else ())
        origin = self.origin[source]
        column = self.by_name[origin].tensor_meta
        if column is None or dim != len(shape) - 1 or total != column.shape[-1]:
            # split after the features became heads: the sections are not the weight's rows
            raise _Refused(f"{node.name} splits the projection's output after reshaping it")
        if self.sections.get(origin, sections) != sections:
            raise _Refused(f"{node.name} splits {origin} a second time, otherwise")
        self.sections[origin] = sections
        for section in sections:
            self._size(section, origin)
        self.reshapes[node.name] = dim  # its sections' sizes: each rank's share of each
        # each section's users are reached through getitem: the split's value stays sharded
        self.sharded[node.name] = dim
        self.origin[node.name] = self.origin[source]
        self.pending.append(node.name)

    def _attention(self, node: Node, source: str, dim: int) -> None:
        self.attention = True
        rank = len(self._shape(source))
        if rank != 4 or dim != 1:
            raise _Refused(
                f"{node.name}: attention reads a shard along dimension {dim} of {rank}, not heads"
            )
        for position in range(3):
            ref = node.args[position] if len(node.args) > position else None
            if not isinstance(ref, Ref) or ref.name not in self.reached:
                raise _Refused(f"{node.name}: query, key and value must all be split by heads")
            if self.sharded.get(ref.name, 1) != 1:
                raise _Refused(f"{node.name}: {ref.name} is split along another dimension")
        mask = argument_value(node, "attn_mask")
        if isinstance(mask, Ref):
            shape = self._shape(mask.name)
            heads_at = len(shape) - 3  # the mask's dimension broadcast over the heads
            if heads_at >= 0 and shape[heads_at] != 1:
                if mask.name not in self.reached:
                    raise _Refused(f"{node.name}: a mask per head ({list(shape)}) is not split")
                if self.sharded.get(mask.name, heads_at) != heads_at:
                    raise _Refused(f"{node.name}: the mask is split along another dimension")
        query, key = (self._shape(node.args[i].name) for i in (0, 1))
        self.heads, self.kv_heads = query[1], key[1]
        self.sizes.update({query[1], key[1]})
        # the projections each comes from, once all three are reached (a visit per input)
        origins = [self.origin.get(node.args[i].name, "") for i in range(3)]
        if all(origins):
            self._size(query[1], origins[0])
            self._size(key[1], origins[1])
            if key[1] < query[1] and origins[0] not in origins[1:]:  # grouped, not fused
                self.key_values.update(origins[1:])
        self._mark(node, 1, source)

    def _size(self, size: int, origin: str) -> None:
        self.sizes.add(size)
        self.size_origins.add((size, origin))

    def replicated_heads_degrees(self) -> list[int]:
        """The degrees above the key/value heads of grouped-query attention at which its key
        and value projections are replicated: multiples of the key/value heads that the query
        heads and every size not of the key and value projections divide."""
        if not self.key_values or not self.kv_heads:
            return []
        others = [size for size, origin in self.size_origins if origin not in self.key_values]
        return [
            d
            for d in _powers()
            if d > self.kv_heads
            and d % self.kv_heads == 0
            and self.heads % d == 0
            and all(size % d == 0 for size in others)
        ]


def _powers() -> Iterable[int]:
    degree = 2
    while degree <= MAX_DEGREE:
        yield degree
        degree *= 2


def _common_scope(nodes: Iterable[Node]) -> str:
    """The innermost module all ``nodes`` ran in (``model.layers.3.self_attn``)."""
    paths = [[s.fqn for s in node.scope] for node in nodes]
    common: list[str] = []
    for level in zip(*paths):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return common[-1] if common else ""


def _reached(graph: Graph, starts: list[str], projections: set[str]) -> set[str]:
    """The values computed from ``starts`` before any projection reads them."""
    seen = set(starts)
    frontier = list(starts)
    while frontier:
        name = frontier.pop()
        for user in graph.users(name):
            if user not in seen and user not in projections:
                seen.add(user)
                frontier.append(user)
    return seen


def _vocabulary_regions(
    graph: Graph,
    order: dict[str, int],
    projections: list[_Projection],
    claimed: set[str],
) -> list[Region]:
    """The embedding (vocabulary-parallel) and the output head (column-parallel over the
    vocabulary, its cross-entropy computed vocabulary-parallel)."""
    regions = []
    heads = []
    for p in projections:
        meta = p.node.tensor_meta
        if p.node.name in claimed or meta is None or not meta.shape:
            continue
        if not _feeds_loss(graph, p.node.name):
            continue
        heads.append(_vocabulary(order, p.node, "head", p.weight, meta.shape[-1], p.out_dim))
    tables = []
    for node in graph.calls:
        if node.target != ops.EMBEDDING.target:
            continue
        table, ids = node.args[ops.EMBEDDING.weight_at], node.args[ops.EMBEDDING.input_at]
        if not isinstance(table, Ref):
            continue
        param = graph[table.name]
        # the token embedding looks up the model's input ids; positions and token types are
        # computed (or absent), whatever their table's size
        if param.kind == "param" and _reads_an_input(graph, ids):
            tables.append((node, graph.param_of(param.target)))
    # the token embedding: the table of the head's vocabulary (tied or not), else the largest;
    # positions, token types and relative-position buckets stay replicated
    vocabularies = {region.sizes[0] for region in heads}
    largest = max((info.shape[0] for _, info in tables), default=0)
    for node, info in tables:
        rows = info.shape[0]
        if rows in vocabularies or (not vocabularies and rows == largest):
            regions.append(_vocabulary(order, node, "embedding", info.names[0], rows, 0))
    return regions + heads


def _reads_an_input(graph: Graph, value: object) -> bool:
    """Whether ``value`` is a model input, or a view of one (GPT-2 flattens its ids)."""
    while isinstance(value, Ref):
        node = graph[value.name]
        if node.kind == "input":
            return True
        if node.kind != "call" or node.target not in _VIEWS | {"aten.contiguous.default"}:
            return False
        value = node.args[0] if node.args else None
    return False


def _vocabulary(
    order: dict[str, int], node: Node, kind: str, weight: str, vocab: int, dim: int
) -> Region:
    degrees = tuple(d for d in _powers() if vocab % d == 0)
    return Region(
        kind=kind,
        scope=node.scope[-1].fqn if node.scope else "",
        order=order[node.name],
        columns=(ColumnShard(weight, dim, ()),),
        row="",
        row_node="",
        heads=0,
        kv_heads=0,
        sizes=(vocab,),
        degrees=degrees,
        reason="" if degrees else f"vocabulary {vocab} is odd",
    )


def _feeds_loss(graph: Graph, name: str, depth: int = 6) -> bool:
    """Whether ``name`` is logits: it reaches a cross-entropy loss as its input (argument 0)
    through at most ``depth`` operators that keep its last dimension (views, casts,
    elementwise operators), no projection between."""
    frontier = [name]
    for _ in range(depth):
        following = []
        for value in frontier:
            for user in graph.users(value):
                node = graph[user]
                if node.target in _LOSSES:
                    first = node.args[0] if node.args else None
                    if isinstance(first, Ref) and first.name == value:
                        return True
                elif node.target in _VIEWS or node.target in _ELEMENTWISE:
                    meta, before = node.tensor_meta, graph[value].tensor_meta
                    if (
                        meta is not None
                        and before is not None
                        and meta.shape[-1:] == before.shape[-1:]
                    ):
                        following.append(user)
        frontier = following
    return False
