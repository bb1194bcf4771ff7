"""Capture users' custom ``torch.autograd.Function``s while ``torch.export`` traces a model.

A non-strict export runs a custom function's forward like any Python code and records only its
operators: the function's own backward would be lost. So while tracing, ``Function.apply`` of
every function defined outside torch is intercepted. The function's ``forward(ctx, *args)`` and
``backward(ctx, *grads)`` are traced with ``make_fx`` on fake tensors of this call's shapes, with
a recording stand-in for ``ctx`` (``save_for_backward`` / ``saved_tensors``, ``needs_input_grad``,
plain attributes, ``mark_non_differentiable``, ``set_materialize_grads``), into the two graphs of
an :class:`~autopipe.ir.autograd_function.FunctionDef`. The model's graph records the call as one
``autopipe.function`` operator; the generated stage calls a generated ``torch.autograd.Function``
with those graphs as its forward and backward.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import operator
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch._subclasses import FakeTensorMode
from torch.amp.autocast_mode import _enter_autocast, _exit_autocast
from torch.autograd.function import _SingleLevelFunction
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ..ir import autograd_function as ir
from ..checks import RESERVED, Namespace
from ..errors import TraceError
from ..ir import Graph, ModelFacts, Node, Ref, TensorMeta, Unit
from ..ir.codec import UnsupportedValue, encode_args, encode_tensor
from ..ir.types import dtype_name, value_meta
from ..ir.interpreter import resolve_target
from ..ir.ordering import alias_chain, written_values
from .user_line import in_stack_trace, in_traceback, on_stack

_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
#: Constants larger than this are not embedded in a function's graph.
_MAX_CONSTANT_ELEMENTS = 1 << 16
_DROPPED_OPS = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten._assert_async.msg",
}


class _Refused(Exception):
    """A custom function autopipe cannot reproduce; the message says why."""

    def __init__(self, reason: str, part: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.part = part


class _Unrepresentable(Exception):
    """A traced graph holds something the IR cannot; tracing again below autograd may help."""


class FunctionCapture:
    """The custom functions met while tracing one model, by the name the graph calls them."""

    def __init__(self) -> None:
        self.functions: dict[str, ir.FunctionDef] = {}
        self._by_content: dict[str, str] = {}
        self.capturing = False

    def call(self, cls: type[torch.autograd.Function], args: tuple, kwargs: dict) -> Any:
        """What ``cls.apply(*args, **kwargs)`` returns while tracing: the results of one
        ``autopipe.function`` operator, which the exported graph records."""
        try:
            bound, count = _bind(cls, args, kwargs)
            positions = [i for i, value in enumerate(bound) if isinstance(value, torch.Tensor)]
            _check_arguments(bound, positions, count)
            grad = torch.is_grad_enabled()
            needs = tuple(grad and i in positions and bound[i].requires_grad for i in range(count))
            self.capturing = True
            try:
                fdef, single = _trace_function(cls, bound, positions, count, needs)
            finally:
                self.capturing = False
        except _Refused as refusal:
            raise _refusal_error(cls, refusal) from None
        name = self._register(cls, fdef)
        results = []
        for n in fdef.forward.outputs[: fdef.outputs]:
            m = fdef.forward[n].tensor_meta
            assert m is not None  # a forward returns tensors (_results refuses anything else)
            results.append((m.shape, m.stride, m.dtype))
        ir.TRACING_OUTPUTS[name] = results
        outputs = torch.ops.autopipe.function.default(name, [bound[i] for i in positions])
        return outputs[0] if single else tuple(outputs)

    def _register(self, cls: type[torch.autograd.Function], fdef: ir.FunctionDef) -> str:
        """The name of ``fdef``: the one an identical earlier capture got, else a new one after
        the class (``GeLUFunction``, ``GeLUFunction_1`` for other shapes)."""
        content = json.dumps(fdef.to_json() | {"name": ""}, sort_keys=True)
        if content in self._by_content:
            return self._by_content[content]
        base = cls.__name__ if ir.is_function_name(cls.__name__) else f"Function_{cls.__name__}"
        base = base if ir.is_function_name(base) else "CustomFunction"
        name = Namespace(self.functions).claim(base)
        fdef.name = name
        self.functions[name] = fdef
        self._by_content[content] = name
        return name

    def definitions(self, nodes: list[Node]) -> dict[str, ir.FunctionDef]:
        """The functions ``nodes`` call, in order of first call, renamed away from the values'
        names where they clash (a stage's forward must not shadow the class it calls)."""
        taken = {n.name for n in nodes}
        used: dict[str, ir.FunctionDef] = {}
        renamed: dict[str, str] = {}
        for node in nodes:
            if node.target != ir.FUNCTION_TARGET:
                continue
            old = node.args[0]
            if old not in renamed:
                fdef = self.functions[old]
                new = old if old not in taken else Namespace(taken | set(self.functions)).claim(old)
                renamed[old] = fdef.name = new
                used[new] = fdef
            node.args = (renamed[old], *node.args[1:])
        return used


@contextlib.contextmanager
def custom_functions_captured() -> Iterator[FunctionCapture]:
    """Intercept ``Function.apply`` of user functions while tracing (functions defined in torch
    keep torch's behaviour); yields the :class:`FunctionCapture` that records them."""
    capture = FunctionCapture()
    original = inspect.getattr_static(torch.autograd.Function, "apply")

    def apply(cls, *args, **kwargs):
        if cls.__module__.startswith("torch.") or capture.capturing:
            return original.__func__(cls, *args, **kwargs)
        return capture.call(cls, args, kwargs)

    # patching torch's class deliberately (restored below)
    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield capture
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]
        ir.TRACING_OUTPUTS.clear()


def refuse_lost_backwards(exported: torch.export.ExportedProgram) -> None:
    """Refuse a custom function that TorchDynamo traced instead of autopipe: ``torch.cond``
    traces its branches with Dynamo, which turns a call into ``autograd_function_apply`` and
    torch.export then keeps only the forward, so its backward would be lost silently."""
    modules = [exported.graph_module, *exported.graph_module.modules()]
    for module in modules:
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, fx.Graph) else ():
            trace = node.meta.get("stack_trace") or ""
            if "autograd_function_apply" not in trace:
                continue
            line = in_stack_trace(trace)
            where = line.where if line else "a torch.cond branch"
            code = line.code_block if line else ""
            raise TraceError(
                f"the model calls a custom autograd function inside a torch.cond branch at "
                f"{where}:{code}\ntorch.cond traces its branches with TorchDynamo, which keeps only "
                "the function's forward there, so the pipeline would train with another gradient. "
                "Call the function outside the torch.cond (autopipe then runs its own backward), "
                "or write the branch with differentiable torch operations."
            )


# -- the call ---------------------------------------------------------------------------------
def _has_setup_context(cls: type[torch.autograd.Function]) -> bool:
    return cls.setup_context is not _SingleLevelFunction.setup_context


def _bind(cls: type[torch.autograd.Function], args: tuple, kwargs: dict) -> tuple[list, int]:
    """The arguments ``forward`` receives (defaults filled in, ctx left out) and how many of them
    autograd counts as inputs (backward returns a gradient, or None, for each)."""
    signature = inspect.signature(cls.forward)
    style = () if _has_setup_context(cls) else (None,)  # classic forward takes ctx first
    try:
        bound = signature.bind(*style, *args, **kwargs)
    except TypeError as exc:
        raise _Refused(f"its arguments do not match its forward ({exc})") from None
    bound.apply_defaults()
    if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(bound.kwargs)):
        raise _Refused("it is given a tensor as a keyword-only argument")
    values = list(bound.args[len(style) :])
    return values, len(values) if style == () else len(args)


def _check_arguments(bound: list, positions: list[int], count: int) -> None:
    if not positions:
        raise _Refused("it takes no tensor argument")
    late = [i for i in positions if i >= count]
    if late:
        raise _Refused(f"its argument {late[0]} is a tensor taken from a default value")
    for i, value in enumerate(bound):
        if i not in positions and any(
            isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)
        ):
            raise _Refused(
                f"its argument {i} holds tensors inside a {type(value).__name__}; pass them as "
                "arguments of their own"
            )


def _refusal_error(cls: type[torch.autograd.Function], refusal: _Refused) -> TraceError:
    call = on_stack()
    where = call.where if call else "the model's forward"
    code = call.code_block if call else ""
    return TraceError(
        f"the model calls the custom autograd function {cls.__qualname__} at {where}:{code}\n"
        f"autopipe cannot reproduce {f'its {refusal.part}' if refusal.part else 'it'}: "
        f"{refusal.reason}.\n"
        "autopipe runs a custom function's own forward and backward in the generated stages, "
        "traced into torch operators on the shapes of this call. Write them with torch "
        "operations on their tensor arguments, with no Python branch on tensor values, no "
        ".item() or .tolist(), and no code outside torch (numpy, C extensions, Triton); or, "
        "when autograd's derivative is right, drop the custom backward and call the "
        "differentiable forward directly."
    )


# -- tracing forward and backward -------------------------------------------------------------
class _Context:
    """Stands for ``ctx`` while a function's forward or backward is traced."""

    def __init__(self, needs_input_grad: tuple, saved: tuple | None = None):
        object.__setattr__(self, "_autopipe", {"saved": saved, "marked": [], "to_save": None})
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True

    @property
    def _state(self) -> dict:
        return object.__getattribute__(self, "_autopipe")

    def save_for_backward(self, *tensors: Any) -> None:
        if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
            raise _Refused("it saves something other than tensors with ctx.save_for_backward")
        self._state["to_save"] = tensors

    def save_for_forward(self, *tensors: Any) -> None:
        """Forward-mode AD only: training never reads it."""

    @property
    def saved_tensors(self) -> tuple:
        saved = self._state["saved"]
        if saved is None:
            raise _Refused("its forward reads ctx.saved_tensors")
        return saved

    saved_variables = saved_tensors

    def mark_dirty(self, *tensors: Any) -> None:
        raise _Refused(
            "it modifies its arguments in place (ctx.mark_dirty); return new tensors instead"
        )

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self._state["marked"].extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        # The generated backward always receives gradients, zeros for unused results, as with
        # the default; a backward treats None as zeros, so its results are the same.
        self.materialize_grads = bool(value)

    def attributes(self) -> dict[str, Any]:
        skip = {"needs_input_grad", "materialize_grads"}
        return {k: v for k, v in vars(self).items() if k not in skip and k != "_autopipe"}


def _trace_function(
    cls: type[torch.autograd.Function], bound: list, positions: list[int], count: int, needs: tuple
) -> tuple[ir.FunctionDef, bool]:
    """Trace ``cls``'s forward and backward on fake tensors like ``bound``'s tensors. Returns the
    definition (named after the class, renamed on registration) and whether forward returns one
    tensor rather than a tuple."""
    fake = FakeTensorMode()
    with outside_export(), torch.no_grad():
        with fake:
            examples = [
                torch.empty_strided(
                    bound[i].shape, bound[i].stride(), dtype=bound[i].dtype, device=bound[i].device
                )
                for i in positions
            ]
        record: dict[str, Any] = {}

        def forward(*tensors):
            args = list(bound)
            for i, tensor in zip(positions, tensors):
                args[i] = tensor
            ctx = _Context(needs)
            if _has_setup_context(cls):
                out = cls.forward(*args)
                cls.setup_context(ctx, tuple(args), out)
            else:
                out = cls.forward(ctx, *args)
            results, record["single"] = _results(out)
            marked = ctx._state["marked"]
            record["non_differentiable"] = [
                i for i, r in enumerate(results) if any(r is m for m in marked)
            ]
            saved = ctx._state["to_save"] or ()
            attributes = ctx.attributes()
            leaves, record["attributes"] = pytree.tree_flatten(attributes)
            record["saved"] = [s is not None for s in saved]
            record["attribute_tensors"] = [isinstance(x, torch.Tensor) for x in leaves]
            record["leaves"] = [None if isinstance(x, torch.Tensor) else x for x in leaves]
            record["results"] = len(results)
            tensors_kept = [s for s in saved if s is not None]
            tensors_kept += [x for x in leaves if isinstance(x, torch.Tensor)]
            return (*results, *tensors_kept)

        names = _argument_names(cls.forward, skip=0 if _has_setup_context(cls) else 1)
        input_names = [names[i] if i < len(names) else f"arg_{i}" for i in positions]
        qualname, source = _origin(cls)
        try:
            forward_graph, forward_values = _graph_of(
                forward, examples, input_names, qualname, fake
            )
        except _Refused as refusal:
            refusal.part = refusal.part or "forward"
            raise
        outputs = record["results"]
        saved_values = forward_values[outputs:]
        grad_examples = []
        with fake:
            for value in forward_values[:outputs]:
                grad_examples.append(torch.empty_like(value))

        def backward(*values):
            kept, grads = list(values[: len(saved_values)]), values[len(saved_values) :]
            saved = tuple(kept.pop(0) if present else None for present in record["saved"])
            leaves = [
                kept.pop(0) if is_tensor else value
                for is_tensor, value in zip(record["attribute_tensors"], record["leaves"])
            ]
            ctx = _Context(needs, saved)
            for key, value in pytree.tree_unflatten(leaves, record["attributes"]).items():
                setattr(ctx, key, value)
            returned = cls.backward(ctx, *grads)
            returned = returned if isinstance(returned, tuple) else (returned,)
            record["grads"] = _gradients(returned, bound, positions, count)
            return tuple(g for g in returned[:count] if isinstance(g, torch.Tensor))

        saved_names = [forward_graph.outputs[outputs + i] for i in range(len(saved_values))]
        grad_names = _argument_names(cls.backward, skip=1)
        grad_names = [grad_names[i] if i < len(grad_names) else f"grad_{i}" for i in range(outputs)]
        try:
            with _autocast_off():  # backward runs outside the forward's autocast regions
                backward_graph, _ = _graph_of(
                    backward,
                    [*saved_values, *grad_examples],
                    saved_names + grad_names,
                    qualname,
                    fake,
                )
        except _Refused as refusal:
            refusal.part = "backward"
            raise
    _check_not_writing_inputs(forward_graph)
    fdef = ir.FunctionDef(
        name=cls.__name__,
        qualname=qualname,
        source=source,
        forward=forward_graph,
        backward=backward_graph,
        outputs=outputs,
        grads=record["grads"],
        non_differentiable=record["non_differentiable"],
        amp=_amp_decorators(cls),
    )
    return fdef, record["single"]


def _amp_decorators(cls: type[torch.autograd.Function]) -> dict[str, Any]:
    """The ``torch.amp.custom_fwd`` / ``custom_bwd`` decorators of a function's forward and
    backward, which the generated class repeats (they switch autocast inside the function)."""
    amp: dict[str, Any] = {}
    for part, wrapper in (("forward", "decorate_fwd"), ("backward", "decorate_bwd")):
        fn = getattr(cls, part)
        code = getattr(fn, "__code__", None)
        if code is None or code.co_name != wrapper or not code.co_filename.startswith(_TORCH):
            continue
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        device_type = cells.get("device_type")
        if not isinstance(device_type, str) or not device_type.isidentifier():
            raise _Refused(f"its {part} has a torch.amp decorator autopipe cannot read")
        if part == "backward":
            amp[part] = device_type
            continue
        cast = cells.get("cast_inputs")
        if cast is not None and not isinstance(cast, torch.dtype):
            raise _Refused("its forward has a torch.amp.custom_fwd autopipe cannot read")
        amp[part] = [device_type, None if cast is None else dtype_name(cast)]
    return amp


def _results(out: Any) -> tuple[list[torch.Tensor], bool]:
    if isinstance(out, torch.Tensor):
        return [out], True
    if isinstance(out, tuple) and out and all(isinstance(o, torch.Tensor) for o in out):
        return list(out), False

    def kind(value: Any) -> str:
        return "Tensor" if isinstance(value, torch.Tensor) else type(value).__name__

    kinds = ", ".join(map(kind, out)) if isinstance(out, tuple) else kind(out)
    raise _Refused(
        f"its forward returns {kinds or 'an empty tuple'}; autopipe supports a tensor or a tuple "
        "of tensors"
    )


def _gradients(returned: tuple, bound: list, positions: list[int], count: int) -> list[bool]:
    """Per tensor argument, whether backward returns a gradient for it; checks the rest."""
    if len(returned) < count or any(g is not None for g in returned[count:]):
        raise _Refused(
            f"its backward returns {len(returned)} values for {count} arguments", "backward"
        )
    for i, grad in enumerate(returned[:count]):
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor):
            raise _Refused(f"its backward returns a {type(grad).__name__} for argument {i}")
        if i not in positions:
            raise _Refused(f"its backward returns a gradient for argument {i}, not a tensor")
    return [isinstance(returned[i], torch.Tensor) for i in positions]


def _argument_names(fn: Callable, skip: int) -> list[str]:
    """Names of a forward's or backward's arguments after ``ctx`` (``*args`` stops them)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return []
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return names


def _origin(cls: type[torch.autograd.Function]) -> tuple[str, str]:
    """``module.Qualname`` and ``FILE:LINE`` of a class, both without absolute paths: the file
    relative to the package root its module name gives, else the file's name alone."""
    code = getattr(cls.forward, "__code__", None)
    try:
        source_file = inspect.getsourcefile(cls)
    except (TypeError, AttributeError):
        source_file = None
    path = source_file if source_file else getattr(code, "co_filename", "unknown.py")
    try:
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        line = getattr(getattr(cls.forward, "__code__", None), "co_firstlineno", 0)
    module = cls.__module__
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    dotted = module.split(".")
    tail = parts[-len(dotted) :]
    if tail[:-1] == dotted[:-1] and tail[-1] == f"{dotted[-1]}.py":
        relative = "/".join(tail)
    elif parts[-len(dotted) - 1 : -1] == dotted and parts[-1] == "__init__.py":
        relative = "/".join(parts[-len(dotted) - 1 :])
    else:
        relative = parts[-1]
        stem = re.sub(r"\W", "_", relative.rsplit(".", 1)[0]) or "module"
        module = stem if stem.isidentifier() else f"m_{stem}"
    relative = re.sub(r"[^\w.\-/]", "_", relative)
    return f"{module}.{cls.__qualname__}", f"{relative}:{line}"


@contextlib.contextmanager
def outside_export() -> Iterator[None]:
    """Leave torch.export's dispatch and function modes aside while tracing a function on its
    own (they would record its operators into the model's graph)."""
    stack = torch.overrides._get_current_function_mode_stack()
    for _ in stack:
        torch.overrides._pop_mode()
    try:
        with _disable_current_modes():
            yield
    finally:
        for mode in stack:
            torch.overrides._push_mode(mode)


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Trace without autocast: the generated function runs under the modes of its call site."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if device_type == "cpu" or torch.cuda.is_available():
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def _graph_of(
    fn: Callable, examples: list, input_names: list[str], qualname: str, fake: FakeTensorMode
) -> tuple[Graph, list]:
    """``fn`` traced into a graph of torch operators, and the fake values it returns. Traced
    above autograd first, as torch.export does (``x.contiguous()`` and ``reshape`` stay what they
    are); below autograd when ``fn`` runs autograd itself (``torch.autograd.grad`` in a backward).
    """
    last: Exception | None = None
    for pre_dispatch in (True, False):
        try:
            with fake:
                traced = make_fx(fn, pre_dispatch=pre_dispatch)(*examples)
        except _Refused:
            raise
        except Exception as exc:  # the user's code failed on fake tensors: say why
            raise _Refused(_failure(exc)) from exc
        try:
            return _convert(traced, input_names, qualname)
        except _Unrepresentable as exc:
            last = exc
    raise _Refused(str(last))


def _failure(exc: Exception) -> str:
    name = type(exc).__name__
    text = str(exc).strip()
    message = (text.splitlines()[0] if text else name).rstrip(".")
    if "data-dependent" in text or "DataDependent" in name or "GuardOnDataDependent" in name:
        message = f"Python code depends on tensor values ({message})"
    else:
        message = f"{name}: {message}"
    line = in_traceback(exc)
    if line is not None:
        code = f": {line.code}" if line.code else ""
        message += f" (at {line.where}{code})"
    return message


def _convert(traced: fx.GraphModule, input_names: list[str], qualname: str) -> tuple[Graph, list]:
    space = Namespace({*RESERVED, "ctx", "self"})
    names: dict[fx.Node, Any] = {}
    nodes: list[Node] = []
    inputs: list[str] = []
    constants: dict[str, Any] = {}
    values: list = []

    def fresh(base: str) -> str:
        base = re.sub(r"\W", "_", base) or "v"
        return space.claim(base if base.isidentifier() and base not in RESERVED else f"v_{base}")

    placeholders = iter(input_names)
    modes: list[tuple] = []  # the autocast / grad modes the next operators run under
    for node in traced.graph.nodes:
        value = node.meta.get("val")
        if node.op == "call_function" and _switch_mode(node, modes):
            continue
        if node.op == "placeholder":
            name = fresh(next(placeholders))
            inputs.append(name)
            nodes.append(Node(name, "input", meta=TensorMeta.of(value, requires_grad=False)))
            names[node] = Ref(name)
        elif node.op == "get_attr":
            constant = getattr(traced, node.target)
            if not isinstance(constant, torch.Tensor) or isinstance(
                constant, torch._subclasses.FakeTensor
            ):
                raise _Unrepresentable(f"it computes a tensor autopipe cannot hold ({node.target})")
            if constant.numel() > _MAX_CONSTANT_ELEMENTS:
                raise _Refused(f"it builds a constant tensor of {constant.numel()} elements")
            name = fresh("constant")
            constants[name] = encode_tensor(constant)
            nodes.append(Node(name, "constant", target=name, meta=TensorMeta.of(constant, False)))
            names[node] = Ref(name)
        elif node.op == "call_function":
            target = node.target
            if target is operator.getitem and isinstance(node.args[0], fx.Node):
                op = "getitem"
            elif isinstance(target, torch._ops.OpOverload):
                op = str(target)
                if op in _DROPPED_OPS:
                    continue
            else:
                raise _Unrepresentable(
                    f"it calls {getattr(target, '__name__', target)}, which is not a torch operator"
                )
            try:
                args = encode_args(node.args, names)
                kwargs = encode_args(node.kwargs, names)
            except UnsupportedValue as exc:
                raise _Unrepresentable(f"operator {op} has an argument autopipe cannot hold: {exc}")
            meta = value_meta(value)
            name = fresh(node.name)
            node_ = Node(name, "call", target=op, args=tuple(args), kwargs=kwargs, meta=meta)
            node_.context = tuple(modes)
            nodes.append(node_)
            names[node] = Ref(name)
        elif node.op == "output":
            results = pytree.tree_leaves(node.args[0])
            outputs = []
            for result in results:
                ref = names.get(result) if isinstance(result, fx.Node) else None
                if ref is None or not isinstance(result.meta.get("val"), torch.Tensor):
                    raise _Unrepresentable("it returns something other than a tensor")
                outputs.append(ref.name)
                values.append(result.meta["val"])
    calls = _live_calls(nodes, outputs)
    nodes = [n for n in nodes if n.kind != "call" or n.name in calls]
    for n in nodes:
        if n.kind == "call":
            n.unit = 0
    graph = Graph(
        nodes,
        inputs=inputs,
        outputs=outputs,
        signature=list(inputs),
        params={},
        buffers={},
        constants={k: v for k, v in constants.items() if k in {n.name for n in nodes}},
        model=ModelFacts.of_subgraph(qualname),
        units=[Unit(0, qualname, [n.name for n in nodes if n.kind == "call"])] if calls else [],
    )
    return graph, values


def _switch_mode(node: fx.Node, modes: list[tuple]) -> bool:
    """Apply a node that enters or leaves an autocast region, or switches grad mode, to the
    list of modes (traced under no_grad); False for any other node."""
    if node.target is _enter_autocast:
        device_type, dtype, enabled = (list(node.args) + [None, None, True])[:3]
        if not isinstance(device_type, str) or not isinstance(enabled, bool):
            raise _Unrepresentable(f"it enters an autocast region autopipe cannot read {node.args}")
        modes.append(("autocast", device_type, dtype, enabled))
        node.meta["autopipe_mode"] = modes[-1]
        return True
    if node.target is _exit_autocast:
        entered = getattr(node.args[0], "meta", {}).get("autopipe_mode")
        if entered not in modes:
            raise _Unrepresentable("it leaves an autocast region it did not enter")
        del modes[len(modes) - 1 - modes[::-1].index(entered)]
        return True
    if node.target is torch._C._set_grad_enabled:
        modes[:] = [m for m in modes if m[0] != "grad"]
        if node.args[0]:
            modes.append(("grad", True))
        return True
    return False


def _live_calls(nodes: list[Node], outputs: list[str]) -> set[str]:
    """Calls whose values reach the outputs, or that write in place to a value that does."""
    used = set(outputs)
    live: set[str] = set()
    for node in reversed(nodes):
        if node.kind != "call":
            continue
        # OpOverload._schema: torch's internal record of an operator's signature
        mutates = node.target != "getitem" and bool(
            resolve_target(node.target)._schema.is_mutable  # type: ignore[attr-defined]
        )
        if node.name in used or mutates:
            live.add(node.name)
            used.update(node.inputs)
    return live


def _check_not_writing_inputs(graph: Graph) -> None:
    """Refuse a forward that writes to its arguments (or views of them) in place: the call
    would look pure to autopipe, which could then reorder or share its inputs."""
    inputs = set(graph.inputs)
    for node in graph.calls:
        for written in written_values(node):
            owner = next((n for n in alias_chain(graph, written) if n in inputs), None)
            if owner is not None:
                raise _Refused(
                    f"its forward modifies its argument {owner} in place ({node.target}); "
                    "return a new tensor instead"
                )
