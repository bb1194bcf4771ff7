"""Python source for graph nodes: the body of a generated stage's ``forward``."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Sequence

import black
import torch

from ..ir import Graph, Node, Ref, Size
from ..ir.codec import decode_tensor
from ..ir.eval_mode import mode_slots
from ..ir.kinds import kind_of
from ..ir.types import argument_value, dtype_name
from ..runtime.core.region_rng import on_rank_stream
from ..tensor_parallel import ShardingPlan

BLACK_MODE = black.Mode(line_length=100)
#: the runtime's call of an operator on a tensor-parallel rank's own random stream
RANK_STREAM_CALL = on_rank_stream.__name__

#: Writes the statement of one higher-order node (:mod:`autopipe.ir.kinds`), as black lays it out:
#: ``emitter(graph, node, ref, indent, target)`` -> lines assigning the node's value to ``target``.
Emitter = Callable[[Graph, Node, Callable[[Ref], str], int, str], list[str]]

#: the emitter of each higher-order node kind, by target: registered by the kind's codegen module
#: (codegen/cond.py, codegen/autograd_function.py)
_EMITTERS: dict[str, Emitter] = {}


def register_emitter(target: str, emitter: Emitter) -> None:
    """Let :func:`forward_body` write nodes calling ``target`` with ``emitter``."""
    if target in _EMITTERS:
        raise ValueError(f"an emitter for {target!r} is registered already")
    _EMITTERS[target] = emitter


_TORCH_CONSTANTS: dict[Any, str] = {
    torch.strided: "torch.strided",
    torch.contiguous_format: "torch.contiguous_format",
    torch.channels_last: "torch.channels_last",
    torch.channels_last_3d: "torch.channels_last_3d",
    torch.preserve_format: "torch.preserve_format",
}


def literal(value: Any, ref: Callable[[Ref], str]) -> str:
    """Source text for an argument value."""
    if isinstance(value, Ref):
        return ref(value)
    if isinstance(value, Size):  # computed from dynamic dimensions (see codegen/sizes.py)
        return value.formula
    if isinstance(value, str) and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'  # black's quotes
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return repr(value)
    if isinstance(value, float):  # black writes exponents without "+"
        return repr(value).replace("e+", "e") if math.isfinite(value) else f'float("{value}")'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(literal(v, ref) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {literal(v, ref)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.dtype):
        return f"torch.{dtype_name(value)}"
    if isinstance(value, torch.device):
        return "device"
    if value in _TORCH_CONSTANTS:
        return _TORCH_CONSTANTS[value]
    raise TypeError(f"cannot write {value!r} as source")


def operator_call(node: Node, ref: Callable[[Ref], str]) -> tuple[str, list[str]]:
    """The callable and the argument sources of one call node: ``("aten.addmm.default",
    ["bias", "x", "weight"])``; a ``getitem`` is ``("x[0]", [])``. Higher-order nodes are written
    by their kind's emitter (:func:`register_emitter`)."""
    if node.target == "getitem":
        source, index = node.args
        return f"{ref(source)}[{index}]", []
    namespace, name, overload = node.target.split(".")
    fn = (
        f"aten.{name}.{overload}"
        if namespace == "aten"
        else f"torch.ops.{namespace}.{name}.{overload}"
    )
    modes = mode_slots(node)
    parts = [
        mode_literal(*modes[i]) if i in modes else literal(a, ref) for i, a in enumerate(node.args)
    ]
    parts += [
        f"{k}={mode_literal(*modes[k]) if k in modes else literal(v, ref)}"
        for k, v in node.kwargs.items()
    ]
    return fn, parts


def mode_literal(train: Any, eval_value: Any) -> str:
    """Source of an argument that depends on the module's mode (:mod:`autopipe.ir.eval_mode`):
    ``self.training`` for a flag that is the mode itself, else ``0.1 if self.training else 0.0``."""
    if train is True and eval_value is False:
        return "self.training"
    if train is False and eval_value is True:
        return "not self.training"
    return f"{literal(train, str)} if self.training else {literal(eval_value, str)}"


def assignment(target: str, fn: str, args: list[str] | None, indent: int) -> list[str]:
    """``target = fn(args)`` laid out exactly as black lays it out, at ``indent`` spaces: on one
    line; with the arguments on a line of their own; or one argument per line with a trailing
    comma. Statements this cannot be sure of go through black itself. ``args`` None:
    ``target = fn`` (an expression that is not a call). Lines are relative to ``indent``."""
    limit = BLACK_MODE.line_length
    if args is None:
        line = f"{target} = {fn}"
        return [line] if indent + len(line) <= limit else black_statement(line, indent)
    joined = ", ".join(args)
    one_line = f"{target} = {fn}({joined})"
    head = f"{target} = {fn}("
    if any("'" in a or "\\" in a for a in args) or indent + len(head) > limit:
        return black_statement(one_line, indent)  # string escapes, or a head too long to hang
    if indent + len(one_line) <= limit:
        return [one_line]
    if indent + 4 + len(joined) <= limit:
        return [head, f"    {joined}", ")"]
    if all(indent + 5 + len(a) <= limit for a in args):
        return [head, *(f"    {a}," for a in args), ")"]
    return black_statement(one_line, indent)


def black_statement(statement: str, indent: int) -> list[str]:
    """One statement as black formats it at ``indent`` (a multiple of 4) spaces."""
    depth = indent // 4
    frame = "".join(f"{'    ' * i}if x{i}:\n" for i in range(depth))
    formatted = black.format_str(f"{frame}{'    ' * depth}{statement}\n", mode=BLACK_MODE)
    return [line[indent:] for line in formatted.splitlines()[depth:]]


def attribute_path(fqn: str, root: str = "self") -> str:
    """``transformer.h.0.attn.weight`` -> ``self.transformer.h[0].attn.weight``."""
    out = root
    for part in fqn.split("."):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}"
        else:
            out += f"[{part!r}]"
    return out


def context_managers(context: tuple) -> str:
    """``torch.no_grad()`` / ``torch.autocast(...)`` for a node's grad and autocast modes."""
    managers = []
    for entry in context:
        if entry[0] == "grad":
            managers.append("torch.enable_grad()" if entry[1] else "torch.no_grad()")
        else:
            _, _, dtype_, enabled = entry
            dtype_src = "None" if dtype_ is None else f"torch.{dtype_name(dtype_)}"
            managers.append(f"torch.autocast(device.type, dtype={dtype_src}, enabled={enabled})")
    return ", ".join(managers)


def uses_device(nodes: list[Node]) -> bool:
    def has_device(value: Any) -> bool:
        if isinstance(value, torch.device):
            return True
        if isinstance(value, (list, tuple)):
            return any(has_device(v) for v in value)
        if isinstance(value, dict):
            return any(has_device(v) for v in value.values())
        return False

    return any(
        has_device(n.args) or has_device(n.kwargs) or any(c[0] == "autocast" for c in n.context)
        for n in nodes
    )


def tensor_expression(data: dict) -> str:
    """Compact source that rebuilds a tensor literal: ``torch.full``/``torch.arange`` when the
    values allow it, the values themselves otherwise."""
    tensor = decode_tensor(data)
    dtype_src = f"torch.{dtype_name(tensor.dtype)}"
    shape = list(tensor.shape)
    flat = tensor.reshape(-1)
    if flat.numel() and bool((flat == flat[0]).all()):
        value = literal(flat[0].item(), str)
        return f"torch.full({shape}, {value}, dtype={dtype_src})"
    if not tensor.dtype.is_floating_point and flat.numel() > 1:
        start = int(flat[0])
        if torch.equal(flat, torch.arange(start, start + flat.numel(), dtype=flat.dtype)):
            return (
                f"torch.arange({start}, {start + flat.numel()}, dtype={dtype_src}).reshape({shape})"
            )
    values = literal(flat.tolist(), str)
    return f"torch.tensor({values}, dtype={dtype_src}).reshape({shape})"


@dataclass(frozen=True)
class ModuleCall:
    """A statement of a forward that calls a submodule: ``targets = module(args)``."""

    label: str  # the module's original scope, for the comment above the call
    targets: tuple[str, ...]
    module: str  # ``self.transformer.h[3]``
    args: tuple[str, ...]

    def statement(self, indent: int) -> list[str]:
        if len(self.targets) == 1:
            return assignment(self.targets[0], self.module, list(self.args), indent)
        call = f"{self.module}({', '.join(self.args)})"
        targets = f"{', '.join(self.targets)} = " if self.targets else ""
        return black_statement(targets + call, indent)


def forward_body(
    graph: Graph,
    items: Sequence[Node | ModuleCall],
    ref: Callable[[Ref], str],
    label: Callable[[Node], str],
    base: int = 8,
    target: Callable[[str], str] = str,
    sharding: ShardingPlan | None = None,
) -> list[str]:
    """Source lines of a forward pass over ``items`` (to be indented by ``base``): operators
    assigned to ``target(node.name)``, commented with ``label(node)`` (their module scope) and
    wrapped in the grad / autocast modes they were traced under, and submodule calls. With a
    tensor-parallel ``sharding``, its projections call the module holding their weight, the
    sizes it leaves to each rank are -1 (and the fixed sizes they displace written) and the
    splits of fused projections are chunks; its operators that draw random numbers on a rank's
    share run under that rank's own stream."""
    modules = {m.node: m for m in sharding.modules} if sharding is not None else {}
    entered: set[str] = set()  # the region input modules called so far
    free: dict[str, dict[int, int]] = {}
    for name, position, size in sharding.free_sizes if sharding is not None else ():
        free.setdefault(name, {})[position] = size
    chunks = dict(sharding.chunks) if sharding is not None else {}
    drawing = sharding.drawing if sharding is not None else frozenset()
    lines: list[str] = []
    current = None
    context: tuple = ()
    indent = ""
    for item in items:
        if isinstance(item, ModuleCall):
            context, indent = (), ""
            lines.append(f"# {item.label}")
            lines.extend(item.statement(base))
            current = None
            continue
        node = item
        if node.context != context:
            context = node.context
            indent = "    " if context else ""
            if context:
                lines.append(f"with {context_managers(context)}:")
            current = None
        node_label = label(node)
        if node_label != current:
            lines.append(f"{indent}# {node_label}")
            current = node_label
        emitter = _EMITTERS.get(node.target)
        if node.name in free:
            node = _freed(node, free[node.name])
        if node.name in chunks:
            node = _chunked(node, chunks[node.name])
        if node.name in modules:  # linear(x, module.weight, ...) / embedding(...): module(x)
            sharded = modules[node.name]
            module = ref(node.args[sharded.weight_at]).removesuffix(".weight")
            given = [ref(node.args[sharded.input_at])]
            statement = []
            if sharded.entry:  # through the region's input module, called once
                entry = _sibling(module, sharded.entry.rpartition(".")[2])
                value, given = given[0], [f"{given[0]}_tp"]
                if sharded.entry not in entered:
                    entered.add(sharded.entry)
                    where = entry.removeprefix("self.")
                    statement += [f"# {where} (tensor-parallel region input)"]
                    statement += assignment(given[0], entry, [value], base + len(indent))
            statement += assignment(target(node.name), module, given, base + len(indent))
        elif emitter is not None:  # torch.cond, a custom autograd function, ...
            statement = emitter(graph, node, ref, base + len(indent), target(node.name))
        elif kind_of(node.target) is not None:
            raise TypeError(f"no emitter is registered for the node kind {node.target}")
        else:
            fn, args = operator_call(node, ref)
            call_args = args if node.target != "getitem" else None
            if node.name in drawing:  # random numbers on a rank's share: its own stream
                fn, call_args = RANK_STREAM_CALL, [fn, *args]
            statement = assignment(target(node.name), fn, call_args, base + len(indent))
        lines.extend(indent + line for line in statement)
    return lines


def _sibling(path: str, leaf: str) -> str:
    """``self.attn.q_proj`` / ``self.mlp[0]`` -> ``self.attn.<leaf>`` / ``self.<leaf>``."""
    return re.sub(r"(\.\w+|\[[^\]]*\])$", "", path) + f".{leaf}"


def _freed(node: Node, sizes: dict[int, int]) -> Node:
    """``node`` (a view or expansion) with the sizes at the positions of ``sizes`` written as
    given."""
    written = [sizes.get(i, size) for i, size in enumerate(node.args[1])]
    return dataclasses.replace(node, args=(node.args[0], written, *node.args[2:]))


def _chunked(node: Node, sections: int) -> Node:
    """``node`` (a split into ``sections`` equal sections) as the chunk into as many, which
    splits each rank's share of the sections alike."""
    dim = argument_value(node, "dim") or 0
    return dataclasses.replace(
        node, target="aten.chunk.default", args=(node.args[0], sections, dim), kwargs={}
    )


def scope_label(node: Node, model_class: str) -> str:
    """``fqn (Class)`` of a node's innermost module; ``Model (model)`` for the model's own code."""
    return node.scope_label or f"{model_class} (model)"
