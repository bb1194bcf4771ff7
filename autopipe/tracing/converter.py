"""The exported program -> graph IR converter: placeholders first, then calls in program order,
with higher-order wrappers (no_grad, autocast regions) inlined and other higher-order operators
(``torch.cond``) handed to the converter registered for them."""

from __future__ import annotations

import copy
import functools
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from ..checks import RESERVED, Namespace
from ..errors import TraceError
from ..ir import Node, Ref, Size, TensorMeta
from ..ir.codec import UnsupportedValue, encode_args
from ..runtime.core.errors import SPECIALISED_SIZE
from .dynamic import DynamicDim, UnwritableSize, formula
from .operators import operator_provider
from .passes import drop_dead, move_getitems_after_sources
from .user_line import at_node
from .value_checks import ValueCheck
from .values import (
    constant_literal,
    data_dependent_error,
    is_symbolic,
    scope_of,
    symbolic_size_error,
    tensor_meta_of,
    value_meta_of,
)

__all__ = ["Converter", "HigherOrderConverter", "READS_A_NUMBER"]

#: Operators dropped from the graph: they only check metadata recorded at trace time (and would
#: pin the traced device into the generated code).
_DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten._assert_async.msg",
    "aten.sym_constrain_range_for_size.default",
    "aten.sym_constrain_range.default",
}
#: torch.distributed.pipelining's stage-boundary marker (``pipe_split()``): no operator of the
#: generated code, a requested stage boundary (``ModelFacts.split_markers``)
PIPE_SPLIT = "pippy._pipe_split.default"
#: Operators that read a number from a tensor's value (``.item()``).
READS_A_NUMBER = {"aten.item.default", "aten._local_scalar_dense.default"}

_getitem = operator.getitem

#: what to do instead of a higher-order operator autopipe does not compile, by its name
_HIGHER_ORDER_ADVICE = {
    "while_loop": "write the loop in Python with a fixed trip count (torch.export unrolls it), "
    "or as torch.cond steps",
    "scan": "write the loop in Python over the sequence (torch.export unrolls it)",
    "associative_scan": "write the scan in Python or with torch.cumsum / torch.cumprod",
    "map": "write the loop in Python over the first dimension (torch.export unrolls it)",
    "flex_attention": "use torch.nn.functional.scaled_dot_product_attention with an attention "
    "mask (HF models: attn_implementation='sdpa' or 'eager')",
    "invoke_subgraph": "call the function directly instead of through torch.compile's "
    "nested_compile_region",
}
_OTHER_HIGHER_ORDER = (
    "call the function the operator wraps directly, or build the model so that it does not "
    "use it"
)


#: Converts one node of a higher-order operator (``torch.cond``) of ``owner``'s graph into the
#: converter's nodes: ``(converter, node, owner, context)``.
HigherOrderConverter = Callable[["Converter", fx.Node, torch.nn.Module, tuple], None]


def _unbacked_values(exported: torch.export.ExportedProgram) -> dict:
    """The example's values of the symbols torch.export could not know (sizes and numbers
    computed from tensor values), when it propagated real tensors; else empty."""
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        mode = getattr(value, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return dict(mode.shape_env.real_tensor_prop_unbacked_vals)
    return {}


class Converter:
    """Turns an ``ExportedProgram`` into IR nodes: placeholders first, then calls in program
    order, with higher-order wrappers (no_grad, autocast regions) inlined and the higher-order
    operators ``higher_order`` names converted by their converters. ``symbols`` are torch's
    symbols of the dynamic dimensions. The cond tracer converts each branch of a ``torch.cond``
    with a copy of this converter (tracing/cond.py)."""

    def __init__(
        self,
        exported: torch.export.ExportedProgram,
        symbols: dict[Any, DynamicDim] | None = None,
        higher_order: Mapping[str, HigherOrderConverter] | None = None,
        checks: Mapping[str, ValueCheck] | None = None,
    ) -> None:
        self.exported = exported
        #: the reads of truth values from tensors that are the model's checks, by node name:
        #: specialised to the example's value, and checked at run time with the model's message
        self.checks: Mapping[str, ValueCheck] = checks or {}
        #: higher-order operator name -> what converts its nodes (other than inlined regions)
        self.higher_order: Mapping[str, HigherOrderConverter] = higher_order or {}
        #: whether this converter converts a branch of a ``torch.cond`` (see tracing/cond.py)
        self.cond_branch = False
        self.nodes: list[Node] = []
        self.names: dict[fx.Node, Any] = {}  # fx node -> Ref (or a Python value)
        #: torch's symbol of each dynamic dimension -> its name, and -> its planned size
        self.symbol_names = {s: d.name for s, d in (symbols or {}).items()}
        self.planned = {s: d.planned for s, d in (symbols or {}).items()}
        # value names handed out so far (the dimensions' names are the generated code's)
        self.taken = Namespace(self.symbol_names.values())
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.constants: dict[str, Any] = {}
        #: operators from outside torch ("ns::name") -> the module that registers them
        self.operators: dict[str, str] = {}
        #: the names of the nodes converted before each ``pipe_split()`` marker, in order
        self.markers: list[frozenset[str]] = []
        #: symbol -> its value on the example, for sizes and numbers computed from tensor values:
        #: the graph is specialised to them and checks them at run time
        self.specialised = _unbacked_values(exported)

    def subgraph_converter(self) -> Converter:
        """A converter doing the same conversion (the same program, dynamic dimensions, example
        values, higher-order converters and table of operators) into empty tables of nodes,
        names, inputs, outputs and constants: for a subgraph of its own (a ``torch.cond``
        branch)."""
        sub = copy.copy(self)
        sub.nodes, sub.names, sub.taken = [], {}, Namespace()
        sub.inputs, sub.outputs, sub.constants = [], [], {}
        return sub

    def fresh(self, name: str) -> str:
        """A new value name after ``name``, a Python identifier no other value has."""
        base = name if name.isidentifier() and name not in RESERVED else f"v_{name}"
        return self.taken.claim("".join(c if c.isalnum() or c == "_" else "_" for c in base))

    def convert(self) -> list[Node]:
        """The program's nodes (also fills ``inputs``, ``outputs``, ``constants`` and
        ``operators``)."""
        sig = self.exported.graph_signature
        for spec in sig.output_specs:
            if spec.kind != OutputKind.USER_OUTPUT:
                raise TraceError(
                    f"the exported graph has a {spec.kind.name.lower().replace('_', ' ')} output "
                    f"({spec.arg}); autopipe supports in-place buffer updates only as they appear "
                    "in training graphs. Please report this model."
                )
        specs = {
            spec.arg.name: spec for spec in sig.input_specs if isinstance(spec.arg, TensorArgument)
        }
        fx_nodes = list(self.exported.graph.nodes)
        out_values = [
            v
            for v in fx_nodes[-1].args[0]
            if isinstance(v, fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)
        ]
        # output values are named after their pytree keys: reserve those names first
        preferred: dict[fx.Node, str] = {}
        for value, leaf_name in zip(out_values, self._output_names()):
            if value.op != "placeholder" and value not in preferred:
                preferred[value] = self.fresh(leaf_name)
        for node in fx_nodes:
            if node.op == "placeholder":
                self._placeholder(node, specs.get(node.name))
            elif node.op == "call_function":
                self.call(node, self.exported.graph_module, (), preferred.get(node))
            elif node.op == "output":
                self.outputs = [self.names[v].name for v in out_values]
            elif (
                node.op != "get_attr"
            ):  # get_attr: submodules of higher-order ops, read when inlined
                raise TraceError(f"unsupported node {node.op} {node.target} in the exported graph")
        move_getitems_after_sources(self.nodes)
        return drop_dead(self.nodes, set(self.outputs))

    def split_markers(self, nodes: list[Node]) -> tuple[str, ...]:
        """The first call of ``nodes`` (:meth:`convert`'s) after each ``pipe_split()`` marker:
        where the model's author asks a stage to begin. A marker with no call before or after
        it, or right after another, asks for nothing."""
        firsts: list[str] = []
        for before in self.markers:
            if not any(n.kind == "call" and n.name in before for n in nodes):
                continue  # before the first operator: no stage would come before it
            first = next((n.name for n in nodes if n.kind == "call" and n.name not in before), None)
            if first is not None and first not in firsts:
                firsts.append(first)
        return tuple(firsts)

    def _output_names(self) -> list[str]:
        """One name per tensor leaf of the model output, from its pytree keys."""
        out_spec = self.exported.module_call_graph[0].signature.out_spec
        tree = pytree.tree_unflatten(list(range(out_spec.num_leaves)), out_spec)
        try:
            paths = [path for path, _ in pytree.tree_flatten_with_path(tree)[0]]
            names = ["_".join(_key_name(k) for k in path) or "output" for path in paths]
        except (ValueError, TypeError, NotImplementedError):
            names = [f"output_{i}" for i in range(out_spec.num_leaves)]
        names = [n if n[:1].isalpha() else f"output_{n}" for n in names]
        user = [
            s
            for s in self.exported.graph_signature.output_specs
            if s.kind == OutputKind.USER_OUTPUT
        ]
        return [name for name, spec in zip(names, user) if isinstance(spec.arg, TensorArgument)]

    def _placeholder(self, node: fx.Node, spec: InputSpec | None) -> None:
        if spec is None:
            return  # a non-tensor input: torch.export specialised it to its example value
        meta = tensor_meta_of(node)
        if spec.kind == InputKind.USER_INPUT:
            name = self.fresh(node.name)
            self.inputs.append(name)
            ir = Node(name, "input", meta=meta)
        elif spec.kind == InputKind.PARAMETER:
            assert spec.target is not None  # torch.export names every parameter
            ir = Node(self.fresh(node.name), "param", target=spec.target, meta=meta)
        elif spec.kind == InputKind.BUFFER:
            assert spec.target is not None  # torch.export names every buffer
            ir = Node(self.fresh(node.name), "buffer", target=spec.target, meta=meta)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            assert spec.target is not None  # torch.export names every constant
            value = self.exported.constants[spec.target]
            name = self.fresh(node.name)
            self.constants[name] = constant_literal(spec.target, value)
            ir = Node(name, "constant", target=name, meta=meta)
        else:
            raise TraceError(f"unsupported input {node.name} of kind {spec.kind.name}")
        self.names[node] = Ref(ir.name)
        self.nodes.append(ir)

    def call(
        self, node: fx.Node, owner: torch.nn.Module, context: tuple, preferred: str | None
    ) -> None:
        """Convert the call ``node`` of ``owner``'s graph, run under the grad / autocast modes
        ``context``, into the node named ``preferred`` (else a fresh name), or into a Python
        value the generated code uses in its place (a size, a number read from a tensor)."""
        target = node.target
        name = str(target)
        if name in _DROPPED_OPS:
            return
        if name == PIPE_SPLIT:
            if self.cond_branch or context:
                raise TraceError(
                    f"the model calls pipe_split() (node {node.name}) inside a branch or a "
                    "region run under another grad or autocast mode; a stage boundary can only "
                    "be asked for in the model's own forward: move the call there"
                )
            self.markers.append(frozenset(n.name for n in self.nodes))
            return
        if isinstance(target, torch._ops.HigherOrderOperator):
            self._inline(node, owner, context)
            return
        if target is _getitem:
            source = node.args[0]
            if isinstance(source, fx.Node) and isinstance(self.names.get(source), tuple):
                self.names[node] = self.names[source][node.args[1]]  # output of an inlined region
                return
        value: Any = node.meta.get("val")  # what torch recorded: a tensor, a number, a symbol
        if name in READS_A_NUMBER:  # .item(): specialised to the example's value, and checked
            number = self._concrete(value) if is_symbolic(value) else value
            check = self.checks.get(node.name)
            if check is not None and type(number) is bool:  # the model's check on values
                self.names[node] = number
                tensor = node.args[0]
                assert isinstance(tensor, fx.Node)  # the tensor .item() reads
                self._check(node, self.names[tensor], number, scope_of(node), context, check=check)
                return
            if type(number) is not int:
                error = symbolic_size_error(node)
                if error is None:  # a truth value read in a region (no_grad, autocast)
                    where, code = at_node(node)
                    error = data_dependent_error(
                        "control flow", where, code, "a truth value read from a tensor"
                    )
                raise error
            self.names[node] = number  # a Python number in the generated code
            tensor = node.args[0]
            assert isinstance(tensor, fx.Node)  # the tensor .item() reads
            self._check(node, self.names[tensor], number, scope_of(node), context)
            return
        if isinstance(value, torch.SymInt) and self._is_dynamic(value):
            self.names[node] = self.size(value)  # a formula in the generated code
            return
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            number = self._concrete(value)  # a size, or arithmetic on sizes
            if number is None:
                error = symbolic_size_error(node)
                assert error is not None  # a symbol unknown on the example is symbolic
                raise error
            self.names[node] = number  # a Python number in the generated code
            return
        known = self.symbol_names.keys()
        specialised = isinstance(value, torch.Tensor) and is_symbolic(value, known)
        if specialised and self._concrete_meta(value) is None or not specialised:
            error = symbolic_size_error(node, known)
            if error is not None:
                raise error
        if target is _getitem:
            name = "getitem"
        elif not isinstance(target, torch._ops.OpOverload):
            scope = scope_of(node)
            where = f"in {scope[-1].fqn}" if scope and scope[-1].fqn else "in the model's forward"
            raise TraceError(
                f"the model calls {getattr(target, '__name__', target)!r} (node {node.name}, "
                f"{where}), which is not a torch operator, so generated code could "
                "not call it; compute it with torch operators, or define it with "
                "torch.library.custom_op in an importable module"
            )
        else:
            provider = operator_provider(target)
            if provider is not None:
                self.operators[target._schema.name] = provider
        try:
            args = encode_args(node.args, self.names)
            kwargs = encode_args(node.kwargs, self.names)
        except UnsupportedValue as exc:
            where, code = at_node(node)
            raise TraceError(
                f"the model calls the operator {name} at {where}:{code}\nwith an argument "
                f"generated code cannot hold: {exc}. Pass tensors, numbers, strings, dtypes, "
                "devices or lists of them (make the value a tensor, or compute it from the "
                "inputs' sizes)"
            ) from None
        ir = Node(
            preferred or self.fresh(node.name),
            "call",
            target=name,
            args=tuple(args),
            kwargs=kwargs,
            meta=self._concrete_meta(value) if specialised else value_meta_of(node),
            scope=scope_of(node),
            context=context,
        )
        self.names[node] = Ref(ir.name)
        self.nodes.append(ir)
        if specialised:
            self._checks(node, ir.scope, context)

    # -- sizes of dynamic dimensions -------------------------------------------------------------
    def _is_dynamic(self, value: torch.SymInt) -> bool:
        return bool(value.node.expr.free_symbols & self.symbol_names.keys())

    def size(self, value: Any) -> int:
        """A traced size as the IR holds it: a plain int, or a :class:`Size` at the planned
        sizes when it depends on dynamic dimensions."""
        if not isinstance(value, torch.SymInt):
            return int(value)
        expr = value.node.expr
        if not expr.free_symbols:
            return int(expr)
        if not expr.free_symbols <= self.symbol_names.keys():
            raise TraceError(
                f"a size of the model ({expr}) depends on tensor values as well as on its "
                "dynamic dimensions; autopipe cannot compile such a size"
            )
        try:
            text = formula(expr, self.symbol_names)
        except UnwritableSize as exc:
            raise TraceError(
                f"the model computes a size from its dynamic dimensions that autopipe cannot "
                f"write as Python: {exc}"
            ) from None
        return Size(int(expr.xreplace(self.planned)), text)

    # -- values computed from tensor values, specialised to the example ------------------------
    def _concrete(self, value: Any) -> int | float | bool | None:
        """A symbolic number's value on the example, or None if it is not known."""
        expr = value.node.expr.xreplace(self.specialised)
        if expr.free_symbols:
            return None
        kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
        return kind(expr)

    def _concrete_meta(self, tensor: torch.Tensor) -> TensorMeta | None:
        sizes = [s if isinstance(s, int) else self._concrete(s) for s in tensor.shape]
        strides = [s if isinstance(s, int) else self._concrete(s) for s in tensor.stride()]
        if None in sizes or None in strides:
            return None
        return TensorMeta(tuple(sizes), tensor.dtype, tuple(strides), False)

    def _checks(self, node: fx.Node, scope: tuple, context: tuple) -> None:
        """Checks that the sizes of ``node``'s value computed from tensor values (the rows
        ``nonzero`` or a boolean mask yields) are the example's, which the graph is
        specialised to."""
        for symbol, path in sorted(node.meta.get("unbacked_bindings", {}).items(), key=str):
            keys = [getattr(k, "name", getattr(k, "idx", None)) for k in path]
            if not (len(keys) == 2 and keys[0] == "size" and isinstance(keys[1], int)):
                error = symbolic_size_error(node)
                assert error is not None  # node's value is specialised, so symbolic
                raise error
            # the element count, as a tensor: ones summed (sizes are plain ints in eager)
            meta = self._concrete_meta(node.meta["val"])
            assert meta is not None  # call() refused a value without one
            emit = functools.partial(self._emit, scope=scope, context=context)
            ones = emit("aten.ones_like.default", (self.names[node],), meta.shape, meta.dtype)
            count = emit("aten.sum.default", (ones,), (), meta.dtype)
            self._check(
                node, count, math.prod(meta.shape), scope, context, self.specialised[symbol]
            )

    def _check(
        self,
        node: fx.Node,
        observed: Ref,
        expected: int,
        scope: tuple,
        context: tuple,
        shown: int | None = None,
        check: ValueCheck | None = None,
    ) -> None:
        """Nodes that fail loudly at run time unless tensor ``observed`` (one element) equals
        ``expected``, the example's value the graph was specialised to at ``node``: with the
        model's own message where the value is its ``check``."""
        where, code = at_node(node)
        message = (
            check.failure()
            if check is not None
            else f"{where}: {code.strip()} computes a size from tensor values "
            f"({expected if shown is None else shown} on the example), and {SPECIALISED_SIZE}; "
            "this batch gives another. Compile with an example like your data, or compute the "
            "size without reading tensor values"
        )
        emit = functools.partial(self._emit, scope=scope, context=context)
        same = emit("aten.eq.Scalar", (observed, expected), (), torch.bool)
        emit("aten._assert_async.msg", (same, message), None, None)

    def _emit(
        self,
        target: str,
        args: tuple,
        shape: tuple | None,
        dtype: torch.dtype | None,
        *,
        scope: tuple,
        context: tuple,
    ) -> Ref:
        """Append a call node this converter makes itself, of a value ``shape`` x ``dtype``
        (None: no value)."""
        meta = None
        if shape is not None:
            meta = TensorMeta.of(
                torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False
            )
        name = self.fresh(target.split(".")[1])
        node = Node(name, "call", target=target, args=args, meta=meta, scope=scope, context=context)
        self.nodes.append(node)
        return Ref(name)

    def _inline(self, node: fx.Node, owner: torch.nn.Module, context: tuple) -> None:
        """Inline a ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` region."""
        name = getattr(node.target, "name", None)
        op = name() if callable(name) else str(node.target)
        entry: tuple[Any, ...]  # a grad / autocast mode, as Node.context holds it
        if op == "wrap_with_set_grad_enabled":
            enabled, submod_node, *operands = node.args
            entry = ("grad", bool(enabled))
        elif op == "wrap_with_autocast":
            device_type, dtype_, enabled, _cache, submod_node, *operands = node.args
            entry = ("autocast", device_type, dtype_, bool(enabled))
        elif op in self.higher_order:  # one node holding its subgraphs (torch.cond)
            self.higher_order[op](self, node, owner, context)
            return
        else:
            where, code = at_node(node)
            raise TraceError(
                f"the model uses torch's higher-order operator {op} at {where}:{code}\n"
                "autopipe compiles torch.cond, no_grad / set_grad_enabled and autocast regions, "
                f"and no other; {_HIGHER_ORDER_ADVICE.get(op, _OTHER_HIGHER_ORDER)}"
            )
        # the region's body: a get_attr node naming a submodule of owner
        assert isinstance(submod_node, fx.Node) and isinstance(submod_node.target, str)
        submodule = getattr(owner, submod_node.target)
        inner_nodes = list(submodule.graph.nodes)
        placeholders = [n for n in inner_nodes if n.op == "placeholder"]
        for inner, outer in zip(placeholders, operands):
            self.names[inner] = self.names[outer] if isinstance(outer, fx.Node) else outer
        for inner in inner_nodes:
            if inner.op == "call_function":
                if "nn_module_stack" not in inner.meta and "nn_module_stack" in node.meta:
                    inner.meta["nn_module_stack"] = node.meta["nn_module_stack"]
                self.call(inner, submodule, context + (entry,), None)
            elif inner.op == "output":
                results = inner.args[0]
                self.names[node] = tuple(
                    self.names[r] if isinstance(r, fx.Node) else r for r in results
                )


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
