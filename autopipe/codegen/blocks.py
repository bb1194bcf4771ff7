"""Blocks as real submodules of a generated stage, one generated class per block structure.

Every whole call of a block module (autopipe/ir/analysis.py) that a stage runs becomes a child
module of the stage at the block's original name, an instance of a class of the package's
``blocks.py``; the stage's forward calls it. Blocks whose code reads the same, up to the names of
values (the 48 layers of GPT2-XL), share one class. A block stays inline in the stage when it is
cut by a stage boundary, reads state held under another module's name (a tied weight), or calls
``torch.cond`` or a custom autograd function (their code lives in the stage file).

.. code-block:: python

    class GPT2Block(Block):
        \"\"\"transformer.h.0 (GPT2Block), as traced: 41 operators.\"\"\"

        def forward(self, x, expand):
            # ln_1 (LayerNorm)
            layer_norm = aten.layer_norm.default(x, [128], self.ln_1.weight, ...)
            ...
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..ir import COND, FUNCTION_TARGET, MODULE_TARGET, Graph, Node, Ref, TensorMeta
from ..ir.analysis import BlockCall
from ..tensor_parallel import ShardingPlan
from . import emit
from .names import identifier, namespace, operator_name
from .sizes import size_lines, symbol_names, used_symbols

#: the comment above the tensor-parallel modules a block or stage holds
TENSOR_PARALLEL_MODULES = "tensor-parallel modules over the parameters above (and region inputs)"


@dataclass
class Submodule:
    """A block call a stage holds as a submodule."""

    call: BlockCall
    nodes: list[Node]
    inputs: list[str]  # values computed outside the block (or model inputs), in first-use order
    constants: list[str]  # constant tensors the block reads, passed in by the stage
    outputs: list[str]  # values read after the block, or model outputs, in program order
    source: str = ""  # the class's forward (its name is the same for identical blocks)
    class_name: str = ""

    @property
    def fqn(self) -> str:
        return self.call.fqn

    @property
    def arguments(self) -> list[str]:
        return self.inputs + self.constants


def stage_submodules(
    graph: Graph, nodes: list[Node], state_names: dict[str, str], calls: list[BlockCall]
) -> list[Submodule]:
    """The block calls among a stage's ``nodes`` it can hold whole, in program order."""
    position = {node.name: i for i, node in enumerate(nodes)}
    submodules = []
    for call in calls:
        if not all(name in position for name in call.nodes):
            continue
        first = position[call.nodes[0]]
        if [position[name] for name in call.nodes] != list(range(first, first + len(call.nodes))):
            continue  # interleaved with other code: keep the program order as traced
        body = nodes[first : first + len(call.nodes)]
        submodule = _submodule(graph, call, body, state_names)
        if submodule is not None:
            submodules.append(submodule)
    return submodules


def _submodule(
    graph: Graph, call: BlockCall, body: list[Node], state_names: dict[str, str]
) -> Submodule | None:
    inside = {node.name for node in body}
    inputs: dict[str, None] = {}
    constants: dict[str, None] = {}
    for node in body:
        if node.target in (COND, FUNCTION_TARGET, MODULE_TARGET):
            return None
        for src in node.inputs:
            kind = graph[src].kind
            if kind in ("param", "buffer"):
                if not state_names[src].startswith(call.fqn + "."):
                    return None  # held under another module's name
            elif kind == "constant":
                constants[src] = None
            elif src not in inside:
                inputs[src] = None
    tensors = [name for name in inputs if isinstance(graph[name].meta, TensorMeta)]
    if emit.uses_device(body) and not tensors:
        return None  # no tensor to take the device from
    if tensors:  # the device comes from the first argument
        inputs = {tensors[0]: None, **inputs}
    model_outputs = set(graph.outputs)
    outputs = [
        node.name
        for node in body
        if node.name in model_outputs or any(u not in inside for u in graph.users(node.name))
    ]
    return Submodule(call, body, list(inputs), list(constants), outputs)


def class_source(
    graph: Graph,
    submodule: Submodule,
    state_names: dict[str, str],
    parameters: list[dict[str, Any]],
    buffers: list[dict[str, Any]],
    sharding: ShardingPlan | None = None,
) -> str:
    """The source of the block's class body below its ``class`` line (docstring excepted): its
    state tables (``parameters`` / ``buffers``: rows named within the block), the ``nn.Linear``
    modules a tensor-parallel ``sharding`` holds in it, and forward. The same text for blocks
    that compute the same thing on the same state, whatever their names."""
    scope = submodule.call.scope
    local = _local_names(graph, submodule)
    prefix = scope.fqn + "."

    def ref(r: Ref) -> str:
        if r.name in state_names:
            return emit.attribute_path(state_names[r.name].removeprefix(prefix))
        return local[r.name]

    def label(node: Node) -> str:
        inner = node.scope[-1]
        if inner.fqn == scope.fqn:
            return scope.class_name
        return f"{inner.fqn.removeprefix(prefix)} ({inner.class_name})"

    arguments = [local[name] for name in submodule.arguments]
    lines = [
        "#: Parameters: name within the block -> (shape, dtype, requires_grad, initialisation).",
        *_table("PARAMETERS", parameters, "requires_grad", lambda row: json.dumps(row["init"])),
        "#: Buffers: name within the block -> (shape, dtype, persistent, initialisation or value).",
        *_table("BUFFERS", buffers, "persistent", lambda row: row["init"]),
        "",
    ]
    inside = {node.name for node in submodule.nodes}
    modules = [(m.module, m.constructor()) for m in sharding.within(inside)] if sharding else []
    if modules:
        lines += [
            'def __init__(self, device="cpu", meta_state=False):',
            "    super().__init__(device, meta_state)",
            f"    # {TENSOR_PARALLEL_MODULES}",
            *(
                f"    keep_whole(self, {json.dumps(fqn.removeprefix(prefix))}, {constructor})"
                for fqn, constructor in modules
            ),
            "",
        ]
    lines.append(f"def forward(self, {', '.join(arguments)}):")
    if emit.uses_device(submodule.nodes):
        lines.append(f"    device = {arguments[0]}.device")
    needed = used_symbols(graph, submodule.nodes)
    given = [(local[name], graph[name].meta) for name in submodule.arguments]
    lines += [f"    {line}" for line in size_lines(needed, given, f"block {submodule.fqn}")]
    body = emit.forward_body(
        graph, submodule.nodes, ref, label, base=8, target=local.__getitem__, sharding=sharding
    )
    lines += [f"    {line}" if line else "" for line in body]
    returned = [local[name] for name in submodule.outputs]
    if len(returned) == 1:
        lines.append(f"    return {returned[0]}")
    elif returned:
        lines.append(f"    return ({', '.join(returned)})")
    return "\n".join(f"    {line}" if line else "" for line in lines) + "\n"


def _table(
    name: str, rows: list[dict[str, Any]], flag: str, init: Callable[[dict], str]
) -> list[str]:
    """``NAME = {"row name": (shape, dtype, flag, initialisation), ...}`` as source lines."""
    if not rows:
        return [f"{name} = {{}}"]
    entries = [
        f"    {json.dumps(row['name'])}: ({row['shape']}, {row['dtype']}, {row[flag]}, "
        f"{init(row)}),"
        for row in rows
    ]
    return [f"{name} = {{", *entries, "}"]


def _local_names(graph: Graph, submodule: Submodule) -> dict[str, str]:
    """Readable names inside the block's forward, numbered locally (``view``, ``view_1``):
    model inputs keep their names, the first argument is ``x``, other arguments and values are
    named for the operator producing them."""
    space = namespace(symbol_names(graph))
    local: dict[str, str] = {}
    for position, name in enumerate(submodule.arguments):
        if graph[name].kind == "input":
            local[name] = space.claim(identifier(name))
        else:
            local[name] = space.claim("x" if position == 0 else operator_name(graph[name]))
    for node in submodule.nodes:
        local[node.name] = space.claim(operator_name(node))
    return local


def name_classes(submodules: list[Submodule]) -> list[tuple[str, Submodule]]:
    """Give every submodule its class name: one class per distinct source, named for the
    original class (``GPT2Block``, ``GPT2Block_2`` for a variant), in program order. Returns the
    classes as (name, first instance)."""
    classes: dict[str, tuple[str, Submodule]] = {}
    variants: dict[str, int] = {}
    for submodule in submodules:
        if submodule.source not in classes:
            original = identifier(submodule.call.scope.class_name)
            variants[original] = variants.get(original, 0) + 1
            count = variants[original]
            name = original if count == 1 else f"{original}_{count}"
            classes[submodule.source] = (name, submodule)
        submodule.class_name = classes[submodule.source][0]
    return list(classes.values())


def class_definition(name: str, first: Submodule, instances: list[str]) -> str:
    """The full ``class`` statement of a block class."""
    scope = first.call.scope
    count = len(first.nodes)
    used = instances[0] if len(instances) == 1 else f"{len(instances)} blocks: {_span(instances)}"
    doc = (
        f'    """{scope.fqn} ({scope.class_name}) as traced: {count} operators.\n\n'
        f"    Used for {used}.\n"
        '    """\n\n'
    )
    return f"class {name}(Block):\n{doc}{first.source}"


def _span(names: list[str]) -> str:
    """``transformer.h.0`` ... ``transformer.h.47`` as ``transformer.h.0-47`` where they are
    one numbered run, or the names joined."""
    parents = {n.rpartition(".")[0] for n in names}
    numbers = [n.rpartition(".")[2] for n in names]
    if len(parents) == 1 and all(n.isdigit() for n in numbers):
        values = [int(n) for n in numbers]
        if values == list(range(values[0], values[0] + len(values))):
            return f"{parents.pop()}.{values[0]}-{values[-1]}"
    return ", ".join(names)


def call_statement(
    submodule: Submodule, ref: Callable[[str], str], target: Callable[[str], str]
) -> emit.ModuleCall:
    """The stage's call of a submodule."""
    scope = submodule.call.scope
    return emit.ModuleCall(
        label=f"{scope.fqn} ({scope.class_name})",
        targets=tuple(target(name) for name in submodule.outputs),
        module=emit.attribute_path(scope.fqn),
        args=tuple(ref(name) for name in submodule.arguments),
    )
