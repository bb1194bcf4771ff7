"""Capture a model with ``torch.export`` (non-strict) and convert it into the graph IR."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config as fconfig
from torch import fx
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument
from torch.utils import _pytree as pytree

from ..checks import RESERVED, Namespace
from .dynamic import DynamicDim, UnwritableSize, export_shapes, formula, resolve
from ..errors import TraceError
from ..ir.graph import (
    BufferInfo,
    Graph,
    Node,
    ParamInfo,
    Ref,
    Scope,
    Size,
    TensorMeta,
    UnsupportedValue,
    encode_args,
    encode_tensor,
    symbolic_sizes,
    value_meta,
)
from ..ir.interpreter import resolve_target
from ..meta import state_as_fake
from ..runtime.data import first_line
from ..runtime.support import SPECIALISED_SIZE
from ..spec import Example
from .autograd_function import custom_functions_captured, refuse_lost_backwards
from .operators import operator_provider
from .cond import cond_grad_mode_checked
from .units import group_units, replay

#: Operators dropped from the graph: they only check metadata recorded at trace time (and would
#: pin the traced device into the generated code).
_DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten._assert_async.msg",
    "aten.sym_constrain_range_for_size.default",
    "aten.sym_constrain_range.default",
}
#: Operators that read a number from a tensor's value (``.item()``).
_READS_A_NUMBER = {"aten.item.default", "aten._local_scalar_dense.default"}
#: Operators that only check a value at run time (emitted for specialised sizes); kept.
_RUNTIME_CHECKS = {"aten._assert_async.msg"}
#: Constants larger than this are not embedded in the graph (they would bloat the generated code).
_MAX_CONSTANT_ELEMENTS = 1 << 16


def trace(
    example: Example,
    *,
    depth: int | None = None,
    basic_blocks: tuple[str, ...] = (),
    inline_blocks: bool = False,
    source: str | None = None,
    dynamic: tuple[DynamicDim, ...] = (),
) -> Graph:
    """Trace ``example.model`` on its example microbatch into a :class:`Graph`.

    The model is traced in training mode (that is the graph a pipeline trains); ``depth`` and
    ``basic_blocks`` decide how nodes are grouped into units; ``basic_blocks`` and
    ``inline_blocks`` which module calls stages hold as submodules (autopipe/ir/analysis.py).
    ``dynamic`` dimensions of the inputs are traced as such: sizes computed from them become
    formulas, and metadata is for their planned sizes: the upper bounds, else the example's
    (autopipe/tracing/dynamic.py).
    """
    model = example.model
    on_meta = any(t.is_meta for t in _state_tensors(model))
    bound = _bound_inputs(example)
    input_ranges = _integer_input_ranges(bound)
    dims = resolve(dynamic, bound, _forward_signature(model))
    buffers = _buffer_table(model)  # before tracing: buffers may move to meta for it
    args, kwargs = _unaliased(example.args, example.kwargs)
    was_training = model.training
    model.train()
    guards = None
    try:
        # weights are not needed to trace: a model built on meta is traced with fake tensors on
        # the CPU, so that its device-dependent code takes the branch a CPU (or GPU) run takes
        with (
            state_as_fake(model, torch.device("cpu")) if on_meta else contextlib.nullcontext()
        ) as fake, custom_functions_captured() as functions, partial_graph_held_back():
            if fake is not None:
                args, kwargs = fake((args, kwargs))
            with cond_grad_mode_checked(), guards_recorded(active=bool(dims)) as guards:
                # (torch.export drops no_grad around a cond; guards name specialising lines)
                exported = _export(
                    model,
                    tuple(args),
                    dict(kwargs),
                    real=fake is None,
                    shapes=export_shapes(dims, bound),
                )
    except TraceError:
        raise
    except Exception as exc:  # torch raises many types here; all become one clear error
        raise _trace_error(exc, model, dims, guards) from exc
    finally:
        model.train(was_training)

    refuse_lost_backwards(exported)
    converter = _Converter(exported, _symbols(exported, dims, args, kwargs, model))
    with symbolic_sizes(converter.size) if dims else contextlib.nullcontext():
        nodes = converter.convert()
    graph = Graph(
        nodes,
        inputs=converter.inputs,
        outputs=converter.outputs,
        signature=_forward_signature(model),
        params=_parameter_table(model),
        buffers=buffers,
        constants=converter.constants,
        model={
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "source": source,
            "on_meta": on_meta,
            "input_ranges": {k: v for k, v in input_ranges.items() if k in converter.inputs},
            "depth": depth,
            "basic_blocks": list(basic_blocks),
            "inline_blocks": inline_blocks,
            "operators": dict(sorted(converter.operators.items())),
        }
        | ({"symbols": _symbol_table(dims)} if dims else {}),
        functions=functions.definitions(nodes),
    )
    _check_parameters_known(graph)
    graph.units = group_units(graph, depth=depth, basic_blocks=basic_blocks)
    _propagate_requires_grad(graph)
    return graph


def _export(
    model: torch.nn.Module, args: tuple, kwargs: dict, real: bool, shapes: dict
) -> torch.export.ExportedProgram:
    """``torch.export`` (non-strict), with the dynamic ``shapes`` of its inputs. A model whose
    sizes or branches depend on tensor values (``nonzero``, ``.item()``) is exported again with
    real tensors propagated beside the fake ones (``real``: the model has weights), which gives
    every such value on the example; the converter specialises the graph to them and checks them
    at run time. The model's buffers and the RNG are left as they were."""
    export = functools.partial(
        torch.export.export,
        model,
        args,
        kwargs,
        strict=False,
        dynamic_shapes=shapes if any(shapes.values()) else None,
    )
    try:
        with partial_graph_held_back():
            exported = export()
    except Exception as exc:  # noqa: BLE001 - re-raised unless real values resolve it
        if not (real and _is_data_dependent(exc)):
            raise
        failure: Exception | None = exc
    else:
        if not (real and _unbacked_bindings(exported)):
            return exported
        failure = None
    buffers = [(b, b.clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)  # it warns of every value it reads from real tensors
    try:
        with fconfig.patch(fake_tensor_propagate_real_tensors=True):
            exported = export()
    except Exception:
        if failure is not None:
            raise failure from None
        raise
    finally:
        shapes_log.setLevel(level)
        torch.set_rng_state(rng)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    branch = next((n for n in exported.graph.nodes if _decides_a_branch(n)), None)
    if branch is not None:  # a size can be specialised and checked; a branch on values cannot
        raise failure if failure is not None else _symbolic_size_error(branch)
    return exported


def _decides_a_branch(node: fx.Node) -> bool:
    """Whether ``node`` reads a truth value or a float from tensor values (``if x.sum() > 0``):
    specialising to the example's would make the pipeline fail on any other batch."""
    value = node.meta.get("val")
    reads = str(node.target) in _READS_A_NUMBER or bool(node.meta.get("unbacked_bindings"))
    return reads and isinstance(value, (bool, float, torch.SymBool, torch.SymFloat))


def _is_data_dependent(exc: BaseException) -> bool:
    name = type(exc).__name__
    return "data-dependent" in str(exc) or "DataDependent" in name


def _unbacked_bindings(exported: torch.export.ExportedProgram) -> bool:
    return any(node.meta.get("unbacked_bindings") for node in exported.graph.nodes)


def _unaliased(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The example inputs with every tensor that shares memory with an earlier one cloned.
    ``torch.export`` merges aliased inputs into one (``(ids,), {"labels": ids}`` would give a
    graph reading ``labels`` alone); each model input must stay its own pipeline input."""
    seen: set[int] = set()

    def own(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_meta or tensor.numel() == 0:
            return tensor
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            return tensor.clone()
        seen.add(storage)
        return tensor

    return pytree.tree_map_only(torch.Tensor, own, (tuple(args), dict(kwargs)))


# -- export errors ----------------------------------------------------------------------------
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (torch, inspect, pytree)  # torch, the standard library
) + (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)


@contextlib.contextmanager
def partial_graph_held_back() -> Iterator[None]:
    """Pass on what ``torch.export`` writes to stderr, less the partial graph it prints when
    tracing fails: the :class:`TraceError` names the user's line instead."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException as exc:
        partial = getattr(exc, "partial_fx_graph", None)
        sys.stderr.write(
            held.getvalue().replace(f"{partial}\n", "") if partial else held.getvalue()
        )
        raise
    sys.stderr.write(held.getvalue())


def _is_user_file(filename: str) -> bool:
    return not os.path.abspath(filename).startswith(_LIBRARY_DIRS) and not filename.startswith("<")


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame in user code (not torch, autopipe or the standard library)."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if _is_user_file(frame.filename):
            return frame
    return None


class _GuardRecorder(logging.Handler):
    """Keeps, for each guard ``torch.export`` adds on a symbolic size, the user's line that
    made it (the innermost user frame on the stack when it is logged)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.guards: list[tuple[str, traceback.FrameSummary]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if "[guard added]" not in str(record.msg) or len(args) < 2:
            return
        frame = next(
            (f for f in reversed(traceback.extract_stack()) if _is_user_file(f.filename)), None
        )
        if frame is not None:
            self.guards.append((str(args[1]), frame))


@contextlib.contextmanager
def guards_recorded(active: bool = True) -> Iterator[_GuardRecorder]:
    """Record the guards torch.export adds on sizes while the block runs, if ``active`` (see
    :class:`_GuardRecorder`); its size log is shown nowhere else meanwhile."""
    recorder = _GuardRecorder()
    if not active:
        yield recorder
        return
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    saved = log.handlers, log.level, log.propagate
    log.handlers, log.propagate = [recorder], False
    log.setLevel(logging.INFO)
    try:
        yield recorder
    finally:
        log.handlers, log.propagate = saved[0], saved[2]
        log.setLevel(saved[1])


def _dynamic_error(
    exc: Exception, dims: tuple[DynamicDim, ...], guards: _GuardRecorder
) -> TraceError | None:
    """The error for a dynamic dimension the model fixes or bounds (torch.export's constraint
    violations), naming the user's line that did, or None for another error."""
    message = str(exc)
    if "Constraints violated" not in message:
        return None
    names = [d.name for d in dims if re.search(rf"\b{re.escape(d.name)}\b", message)]
    declared = ", ".join(d.declaration() for d in dims if d.name in names) or "--dynamic"
    fixed = re.search(r"specialized it to be a constant \((\d+)\)", message)
    where = ""
    if guards.guards:  # the guard fixing the size, else the first
        constant = re.compile(rf"\b{fixed[1]}\b") if fixed else None
        guard, frame = next(
            (g for g in guards.guards if constant and constant.search(g[0])), guards.guards[0]
        )
        where = (
            f" at {_short_path(frame.filename)}:{frame.lineno}:\n    {(frame.line or '').strip()}"
            f"\n(torch.export's guard: {guard})"
        )
    if fixed:
        what = f"the model fixes {' and '.join(names) or 'a dynamic dimension'} to {fixed[1]}"
        advice = (
            "a dimension the model computes with a fixed size (a position table, a view to a "
            "literal shape) cannot vary: remove it from --dynamic, or change the model so "
            "that the size follows its input"
        )
    else:
        what = f"the model only works for part of the range {declared}"
        fixes = message.split("Suggested fixes:", 1)[1:] or [""]
        hint = " ".join(line.strip() for line in fixes[0].splitlines() if "=" in line)
        advice = "narrow the bounds to what the model accepts" + (
            f" (torch.export suggests: {hint})" if hint else ""
        )
    return TraceError(f"--dynamic {declared}: {what}{where}\n{advice}.")


def _trace_error(
    exc: Exception,
    model: torch.nn.Module,
    dims: tuple[DynamicDim, ...] = (),
    guards: _GuardRecorder | None = None,
) -> TraceError:
    if dims and guards is not None:
        dynamic = _dynamic_error(exc, dims, guards)
        if dynamic is not None:
            return dynamic
    frame = user_frame(exc)
    where = (
        f"{frame.filename}:{frame.lineno}" if frame else f"the forward of {type(model).__name__}"
    )
    code = f"\n    {frame.line.strip()}" if frame and frame.line else ""
    message = first_line(exc)
    name = type(exc).__name__
    if _is_data_dependent(exc):
        return _data_dependent("control flow", where, code, f"torch.export: {message}")
    return TraceError(
        f"torch.export cannot trace the model at {where}:{code}\n{name}: {message}\n"
        "Make this code traceable (see https://pytorch.org/docs/stable/export.html), or build the "
        "model so that it does not run it."
    )


def _data_dependent(what: str, where: str, code: str, detail: str) -> TraceError:
    """The error for control flow or shapes that depend on tensor values, at the user's line."""
    cond = (
        "write the branch as torch.cond(pred, true_fn, false_fn, (operands,)) with a tensor "
        "predicate: autopipe compiles both branches and runs the one pred picks (each branch "
        "returning tensors of the same shapes); "
        if what == "control flow"
        else ""
    )
    return TraceError(
        f"the model has data-dependent {what} at {where}:{code}\n"
        "autopipe captures one graph for all inputs, so a Python branch or size cannot depend "
        "on tensor values. Options: compute both sides and select with torch.where (a mask "
        f"instead of nonzero or boolean indexing); {cond}pass the value that decides the branch "
        "or size as a fixed (non-tensor) input of the example; or move the code out of the "
        "model's forward. --basic-blocks only groups traced operators: it cannot hide a branch "
        f"from the tracer. ({detail})"
    )


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in .*\n(?P<code>.*)')


def _symbolic_size_error(node: fx.Node, known: Any = frozenset()) -> TraceError | None:
    """A :class:`TraceError` naming the user's line if ``node`` produces a value whose size
    depends on tensor values (``nonzero``, boolean indexing, ``.item()``), else None. Sizes of
    the ``known`` symbols (dynamic dimensions) are no such size."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    if not any(_is_symbolic(v, known) for v in values):
        return None
    where, code = _user_line(node)
    detail = (
        f"the size or value {node.target} returns depends on the input's values; with real "
        "weights (not a model built on meta) autopipe compiles it for the example's value"
    )
    return _data_dependent("shapes", where, code, detail)


def _user_line(node: fx.Node) -> tuple[str, str]:
    """Where in the user's code ``node`` was traced: ``("file.py:12", "\\n    code")``."""
    frames = [
        m for m in _FRAME.finditer(node.meta.get("stack_trace") or "") if _is_user_file(m["file"])
    ]
    where = (
        f"{_short_path(frames[-1]['file'])}:{frames[-1]['line']}"
        if frames
        else "the model's forward"
    )
    code = f"\n    {frames[-1]['code'].strip()}" if frames and frames[-1]["code"].strip() else ""
    return where, code


def _short_path(filename: str) -> str:
    """A source file as generated code may name it (no absolute paths in generated files):
    within an installed package from the package on, else relative to the working directory,
    else its name."""
    path = os.path.abspath(filename)
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else os.path.basename(path)


def _unbacked_values(exported: torch.export.ExportedProgram) -> dict:
    """The example's values of the symbols torch.export could not know (sizes and numbers
    computed from tensor values), when it propagated real tensors; else empty."""
    for node in exported.graph.nodes:
        value = node.meta.get("val")
        mode = getattr(value, "fake_mode", None)
        if mode is not None and mode.shape_env is not None:
            return dict(mode.shape_env.real_tensor_prop_unbacked_vals)
    return {}


def _is_symbolic(value: Any, known: Any = frozenset()) -> bool:
    """A number, or a tensor size, that torch.export only knows as a symbol other than the
    ``known`` ones (dynamic dimensions)."""
    if isinstance(value, torch.Tensor):
        return any(_is_symbolic(size, known) for size in value.shape)
    if isinstance(value, torch.SymInt):  # (one of known symbols alone is a dynamic size)
        free = value.node.expr.free_symbols
        return not (free and free <= known)
    return isinstance(value, (torch.SymFloat, torch.SymBool))


# -- dynamic dimensions -----------------------------------------------------------------------
def _symbols(
    exported: torch.export.ExportedProgram,
    dims: tuple[DynamicDim, ...],
    args: tuple,
    kwargs: dict,
    model: torch.nn.Module,
) -> dict[Any, DynamicDim]:
    """torch.export's symbol of each dynamic dimension (read off the input it sizes)."""
    if not dims:
        return {}
    signature = _forward_signature(model)
    leaves = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]
    user = [
        spec.arg.name
        for spec in exported.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT
    ]
    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    by_input: dict[str, torch.Tensor] = {}
    for (path, _), placeholder in zip(leaves, user):
        first, second = path[0], path[1] if len(path) > 1 else None
        if getattr(first, "idx", None) == 0 and second is not None and len(path) == 2:
            name = signature[second.idx] if second.idx < len(signature) else None
        elif getattr(first, "idx", None) == 1 and second is not None and len(path) == 2:
            name = second.key
        else:
            continue  # an input nested in a container: not one --dynamic can name
        value = placeholders[placeholder].meta.get("val") if placeholder in placeholders else None
        if name is not None and isinstance(value, torch.Tensor):
            by_input[name] = value
    symbols: dict[Any, DynamicDim] = {}
    for dim in dims:
        for name, index in dim.sources:
            size = by_input[name].shape[index] if name in by_input else None
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is None or not expr.is_Symbol:
                raise TraceError(
                    f"--dynamic {dim.declaration()}: torch.export traced {name}:{index} with "
                    f"the fixed size {size}; the model does not let this dimension vary"
                )
            symbols[expr] = dim
    return symbols


def _symbol_table(dims: tuple[DynamicDim, ...]) -> dict[str, dict[str, Any]]:
    """The graph's record of its dynamic dimensions (``Graph.model["symbols"]``)."""
    return {
        d.name: {
            "min": d.min,
            "max": d.max,
            "planned": d.planned,
            "sources": [list(s) for s in d.sources],
        }
        for d in dims
    }


# -- conversion -------------------------------------------------------------------------------
class _Converter:
    """Turns an ``ExportedProgram`` into IR nodes: placeholders first, then calls in program
    order, with higher-order wrappers (no_grad, autocast regions) inlined."""

    def __init__(
        self, exported: torch.export.ExportedProgram, symbols: dict[Any, DynamicDim] | None = None
    ):
        self.exported = exported
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
        #: symbol -> its value on the example, for sizes and numbers computed from tensor values:
        #: the graph is specialised to them and checks them at run time
        self.specialised = _unbacked_values(exported)

    def fresh(self, name: str) -> str:
        base = name if name.isidentifier() and name not in RESERVED else f"v_{name}"
        return self.taken.claim("".join(c if c.isalnum() or c == "_" else "_" for c in base))

    def convert(self) -> list[Node]:
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
                self._call(node, self.exported.graph_module, (), preferred.get(node))
            elif node.op == "output":
                self.outputs = [self.names[v].name for v in out_values]
            elif (
                node.op != "get_attr"
            ):  # get_attr: submodules of higher-order ops, read when inlined
                raise TraceError(f"unsupported node {node.op} {node.target} in the exported graph")
        _move_getitems_after_sources(self.nodes)
        return _drop_dead(self.nodes, set(self.outputs))

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

    def _placeholder(self, node: fx.Node, spec) -> None:
        if spec is None:
            return  # a non-tensor input: torch.export specialised it to its example value
        meta = _tensor_meta(node)
        if spec.kind == InputKind.USER_INPUT:
            name = self.fresh(node.name)
            self.inputs.append(name)
            ir = Node(name, "input", meta=meta)
        elif spec.kind == InputKind.PARAMETER:
            ir = Node(self.fresh(node.name), "param", target=spec.target, meta=meta)
        elif spec.kind == InputKind.BUFFER:
            ir = Node(self.fresh(node.name), "buffer", target=spec.target, meta=meta)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            value = self.exported.constants[spec.target]
            name = self.fresh(node.name)
            self.constants[name] = _constant_literal(spec.target, value)
            ir = Node(name, "constant", target=name, meta=meta)
        else:
            raise TraceError(f"unsupported input {node.name} of kind {spec.kind.name}")
        self.names[node] = Ref(ir.name)
        self.nodes.append(ir)

    def _call(
        self, node: fx.Node, owner: torch.nn.Module, context: tuple, preferred: str | None
    ) -> None:
        target = node.target
        name = str(target)
        if name in _DROPPED_OPS:
            return
        if isinstance(target, torch._ops.HigherOrderOperator):
            self._inline(node, owner, context)
            return
        if target is _getitem and isinstance(self.names.get(node.args[0]), tuple):
            self.names[node] = self.names[node.args[0]][node.args[1]]  # output of an inlined region
            return
        value = node.meta.get("val")
        if name in _READS_A_NUMBER:  # .item(): specialised to the example's value, and checked
            number = self._concrete(value) if _is_symbolic(value) else value
            if type(number) is not int:
                raise _symbolic_size_error(node)
            self.names[node] = number  # a Python number in the generated code
            self._check(node, self.names[node.args[0]], number, _scope(node), context)
            return
        if isinstance(value, torch.SymInt) and self._is_dynamic(value):
            self.names[node] = self.size(value)  # a formula in the generated code
            return
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            number = self._concrete(value)  # a size, or arithmetic on sizes
            if number is None:
                raise _symbolic_size_error(node)
            self.names[node] = number  # a Python number in the generated code
            return
        known = self.symbol_names.keys()
        specialised = isinstance(value, torch.Tensor) and _is_symbolic(value, known)
        if specialised and self._concrete_meta(value) is None or not specialised:
            error = _symbolic_size_error(node, known)
            if error is not None:
                raise error
        if target is _getitem:
            name = "getitem"
        elif not isinstance(target, torch._ops.OpOverload):
            raise TraceError(
                f"the model calls {getattr(target, '__name__', target)!r} (node {node.name}), which "
                "autopipe cannot put in generated code; only torch operators are supported"
            )
        else:
            provider = operator_provider(target)
            if provider is not None:
                self.operators[target._schema.name] = provider
        try:
            args = encode_args(node.args, self.names)
            kwargs = encode_args(node.kwargs, self.names)
        except UnsupportedValue as exc:
            raise TraceError(
                f"operator {name} (node {node.name}) has an unsupported argument: {exc}"
            ) from None
        ir = Node(
            preferred or self.fresh(node.name),
            "call",
            target=name,
            args=tuple(args),
            kwargs=kwargs,
            meta=self._concrete_meta(value) if specialised else _value_meta(node),
            scope=_scope(node),
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
                raise _symbolic_size_error(node)
            # the element count, as a tensor: ones summed (sizes are plain ints in eager)
            meta = self._concrete_meta(node.meta["val"])
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
    ) -> None:
        """Nodes that fail loudly at run time unless tensor ``observed`` (one element) equals
        ``expected``, the example's value the graph was specialised to at ``node``."""
        where, code = _user_line(node)
        message = (
            f"{where}: {code.strip()} computes a size from tensor values "
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
        op = (
            node.target.name() if callable(getattr(node.target, "name", None)) else str(node.target)
        )
        if op == "wrap_with_set_grad_enabled":
            enabled, submod_node, *operands = node.args
            entry = ("grad", bool(enabled))
        elif op == "wrap_with_autocast":
            device_type, dtype_, enabled, _cache, submod_node, *operands = node.args
            entry = ("autocast", device_type, dtype_, bool(enabled))
        elif op == "cond":  # one node holding both branches
            from .cond import convert_cond

            convert_cond(self, node, owner, context)
            return
        else:
            raise TraceError(
                f"the model uses the higher-order operator {op} (node {node.name}); autopipe "
                "supports torch.cond, torch.no_grad / set_grad_enabled and autocast regions only"
            )
        submodule = getattr(owner, submod_node.target)
        inner_nodes = list(submodule.graph.nodes)
        placeholders = [n for n in inner_nodes if n.op == "placeholder"]
        for inner, outer in zip(placeholders, operands):
            self.names[inner] = self.names[outer] if isinstance(outer, fx.Node) else outer
        for inner in inner_nodes:
            if inner.op == "call_function":
                if "nn_module_stack" not in inner.meta and "nn_module_stack" in node.meta:
                    inner.meta["nn_module_stack"] = node.meta["nn_module_stack"]
                self._call(inner, submodule, context + (entry,), None)
            elif inner.op == "output":
                results = inner.args[0]
                self.names[node] = tuple(
                    self.names[r] if isinstance(r, fx.Node) else r for r in results
                )


_getitem = __import__("operator").getitem


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _tensor_meta(node: fx.Node) -> TensorMeta | None:
    value = node.meta.get("val")
    return TensorMeta.of(value, requires_grad=False) if isinstance(value, torch.Tensor) else None


def _value_meta(node: fx.Node) -> Any:
    return value_meta(node.meta.get("val"))


def _scope(node: fx.Node) -> tuple[Scope, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    scopes = []
    for key, (fqn, cls) in stack.items():
        if not fqn:
            continue  # the model itself
        cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        suffix = key.rpartition("@")[2] if "@" in key else ""
        scopes.append(Scope(f"{fqn}@{suffix}" if suffix else fqn, fqn, cls_name))
    return tuple(scopes)


def _constant_literal(name: str, value: Any) -> dict:
    if not isinstance(value, torch.Tensor):
        raise TraceError(
            f"constant {name} is a {type(value).__name__}; only tensor constants are supported"
        )
    if value.is_meta:
        raise TraceError(
            f"the value of {name} is unknown because the model was built on the meta device; "
            "create this tensor on a real device (it is not a parameter, so it is not loaded from "
            "a checkpoint), or build the model on CPU"
        )
    if value.numel() > _MAX_CONSTANT_ELEMENTS:
        raise TraceError(
            f"constant {name} has {value.numel()} elements; autopipe embeds constants in the "
            f"generated code and allows at most {_MAX_CONSTANT_ELEMENTS}. Make it a buffer of the model."
        )
    return encode_tensor(value)


def _move_getitems_after_sources(nodes: list[Node]) -> None:
    """Place each ``getitem`` right after its source (and earlier getitems of it), so that an
    operator returning several tensors is never split from its outputs."""
    position = {n.name: i for i, n in enumerate(nodes)}
    getitems = [n for n in nodes if n.target == "getitem"]
    if all(position[n.name] == position[n.args[0].name] + 1 + int(n.args[1]) for n in getitems):
        return
    by_source: dict[str, list[Node]] = {}
    for n in getitems:
        by_source.setdefault(n.args[0].name, []).append(n)
    ordered: list[Node] = []
    for n in nodes:
        if n.target == "getitem":
            continue
        ordered.append(n)
        ordered.extend(by_source.get(n.name, []))
    nodes[:] = ordered


def _drop_dead(nodes: list[Node], outputs: set[str]) -> list[Node]:
    """Remove calls whose values nobody reads, unless they mutate something."""
    used = set(outputs)
    keep: list[Node] = []
    for node in reversed(nodes):
        mutates = node.kind == "call" and (
            node.target in _RUNTIME_CHECKS or node.target != "getitem" and _is_mutating(node.target)
        )
        if node.kind != "call" or node.name in used or mutates:
            keep.append(node)
            used.update(node.inputs)
    return list(reversed(keep))


def _is_mutating(target: str) -> bool:
    schema = resolve_target(target)._schema
    return schema.is_mutable or any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


# -- tables of the model's state --------------------------------------------------------------
def _state_tensors(model: torch.nn.Module):
    yield from model.parameters()
    yield from model.buffers()


def _owner_class(model: torch.nn.Module, fqn: str) -> str:
    owner = model.get_submodule(fqn.rpartition(".")[0])
    return f"{type(owner).__module__}.{type(owner).__qualname__}"


def _parameter_table(model: torch.nn.Module) -> dict[str, ParamInfo]:
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    table = {}
    for key, names in groups.items():
        p = tensors[key]
        table[names[0]] = ParamInfo(
            tuple(names), tuple(p.shape), p.dtype, p.requires_grad, _owner_class(model, names[0])
        )
    return table


def _buffer_table(model: torch.nn.Module) -> dict[str, BufferInfo]:
    persistent = set(model.state_dict().keys())
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, buf in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(buf), []).append(name)
        tensors[id(buf)] = buf
    table = {}
    for key, names in groups.items():
        buf = tensors[key]
        is_persistent = names[0] in persistent
        value = None
        if not is_persistent and not buf.is_meta:
            value = encode_tensor(buf)
        table[names[0]] = BufferInfo(
            tuple(names),
            tuple(buf.shape),
            buf.dtype,
            is_persistent,
            _owner_class(model, names[0]),
            value,
        )
    return table


def _check_parameters_known(graph: Graph) -> None:
    for node in graph.nodes:
        if node.kind == "param":
            graph.param_of(node.target)
        elif node.kind == "buffer":
            info = next((b for b in graph.buffers.values() if node.target in b.names), None)
            if info is None:
                raise TraceError(
                    f"buffer {node.target} is used by the graph but not found in the model"
                )
            if not info.persistent and info.value is None:
                raise TraceError(
                    f"non-persistent buffer {node.target} has no value because the model was built "
                    "on the meta device, and it is not saved in checkpoints, so the generated "
                    "pipeline could not rebuild it. Build the model inside `with "
                    "autopipe.empty_weights():` instead of `torch.device('meta')` (parameters stay "
                    "on meta, buffers keep their values), or build it on CPU."
                )


def _forward_signature(model: torch.nn.Module) -> list[str]:
    params = inspect.signature(model.forward).parameters.values()
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _bound_inputs(example: Example) -> dict[str, Any]:
    """The example's inputs by the name of the forward parameter each one is."""
    sig = inspect.signature(example.model.forward)
    try:
        return dict(sig.bind(*example.args, **example.kwargs).arguments)
    except TypeError as exc:
        raise TraceError(
            f"the example inputs do not match {type(example.model).__name__}.forward: {exc}"
        ) from None


def _integer_input_ranges(bound: dict[str, Any]) -> dict[str, int]:
    """Largest value of each integer example input, for synthetic data of the same range."""
    ranges = {}
    for name, value in bound.items():
        if (
            isinstance(value, torch.Tensor)
            and not value.is_meta
            and not value.is_floating_point()
            and value.numel()
        ):
            ranges[name] = int(value.max())
    return ranges


def _propagate_requires_grad(graph: Graph) -> None:
    """Find which values need gradients by running each unit on fake tensors with autograd, in
    program order (a unit's inputs already carry their flags). Doubles as a check that every
    node of the IR can run outside ``torch.export``."""

    def failure(node: Node, exc: Exception) -> TraceError:
        return TraceError(
            f"operator {node.target} (node {node.name}, in {node.scope_label or 'forward'}) "
            f"cannot be re-run from the captured graph: {type(exc).__name__}: {exc}"
        )

    for node, produced in replay(graph, failure):
        if isinstance(node.meta, TensorMeta):
            node.meta = _with_grad(node.meta, getattr(produced, "requires_grad", False))
        elif isinstance(node.meta, tuple):
            node.meta = tuple(
                (
                    _with_grad(m, getattr(p, "requires_grad", False))
                    if isinstance(m, TensorMeta)
                    else m
                )
                for m, p in zip(node.meta, produced)
            )


def _with_grad(meta: TensorMeta, requires_grad: bool) -> TensorMeta:
    return dataclasses.replace(meta, requires_grad=requires_grad)
