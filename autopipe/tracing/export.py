"""Capture a model with ``torch.export`` (non-strict) and convert it into the graph IR.

This module holds the ``torch.export`` call and the translation of its failures into
:class:`TraceError`s naming the user's line; the conversion itself is
:class:`~autopipe.tracing.converter.Converter`'s."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config as fconfig
import torch._subclasses.meta_utils as meta_utils
from torch import fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ..ir import DynamicSymbol, Graph, ModelFacts
from ..ir.sizes import symbolic_sizes
from .meta import state_as_fake
from ..runtime.core.errors import first_line
from ..spec import Example
from .autograd_function import custom_functions_captured, refuse_lost_backwards
from .kept_modules import modules_kept_whole, remove_packed_stand_ins
from .cond import cond_grad_mode_checked, convert_cond
from .converter import READS_A_NUMBER, Converter, HigherOrderConverter
from .dynamic import DynamicDim, export_shapes, resolve
from .huggingface import huggingface_configs, traced_as_transformers_trains
from .model_tables import (
    bound_inputs,
    buffer_table,
    check_state_known,
    fixed_inputs,
    forward_signature,
    integer_input_ranges,
    parameter_table,
    state_tensors,
)
from .causal_mask import recognise_causal_masks
from .grouped_query import use_enable_gqa
from .eval_mode import mark_eval_arguments
from .passes import propagate_requires_grad
from .units import group_units
from .user_line import UserLine, at_node, every_user_frame_recorded, in_traceback, on_stack
from .value_checks import ValueCheck, value_check
from .values import data_dependent_error, symbolic_size_error

__all__ = ["guards_recorded", "partial_graph_held_back", "trace"]

#: Higher-order operators converted into one node of their own (others are inlined or refused).
_HIGHER_ORDER: dict[str, HigherOrderConverter] = {"cond": convert_cond}


def trace(
    example: Example,
    *,
    depth: int | None = None,
    basic_blocks: tuple[str, ...] = (),
    inline_blocks: bool = False,
    source: str | None = None,
    dynamic: tuple[DynamicDim, ...] = (),
    keep_whole: tuple[str, ...] = (),
) -> Graph:
    """Trace ``example.model`` on its example microbatch into a :class:`Graph`.

    The model is traced in training mode (that is the graph a pipeline trains); ``depth`` and
    ``basic_blocks`` decide how nodes are grouped into units; ``basic_blocks`` and
    ``inline_blocks`` which module calls stages hold as submodules (autopipe/ir/analysis.py).
    ``dynamic`` dimensions of the inputs are traced as such: sizes computed from them become
    formulas, and metadata is for their planned sizes: the upper bounds, else the example's
    (autopipe/tracing/dynamic.py). The submodules ``keep_whole`` names, and RNNs over packed
    sequences, are kept as one call each (autopipe/tracing/kept_modules.py). An attention mask
    built from sizes and constants alone that is causal becomes ``is_causal=True``, as eager
    calls attention (autopipe/tracing/causal_mask.py); an attention call without a mask over keys
    and values repeated for grouped-query attention takes them unrepeated with
    ``enable_gqa=True``, as eager calls it (autopipe/tracing/grouped_query.py).
    """
    model = example.model
    on_meta = any(t.is_meta for t in state_tensors(model))
    bound = bound_inputs(example)
    input_ranges = integer_input_ranges(bound)
    dims = resolve(dynamic, bound, forward_signature(model, len(example.args)))
    buffers = buffer_table(model)  # before tracing: buffers may move to meta for it
    args, kwargs = _unaliased(example.args, example.kwargs)
    was_training = model.training
    model.train()
    guards = None
    try:
        # weights are not needed to trace: a model built on meta is traced with fake tensors on
        # the CPU, so that its device-dependent code takes the branch a CPU (or GPU) run takes
        with (
            (
                state_as_fake(model, torch.device("cpu")) if on_meta else contextlib.nullcontext()
            ) as fake,
            custom_functions_captured() as functions,
            modules_kept_whole(model, keep_whole),
            partial_graph_held_back(),
            traced_as_transformers_trains(model) as settings,
        ):
            if fake is not None:
                args, kwargs = fake((args, kwargs))
            with (
                cond_grad_mode_checked(),
                every_user_frame_recorded(),
                guards_recorded(active=bool(dims)) as guards,
                warnings.catch_warnings(),
            ):
                # an RNN refreshes its list of weights in forward; export warns of it, harmlessly
                warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights")
                # (torch.export drops no_grad around a cond; guards name specialising lines)
                exported, checks = _export(
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
    remove_packed_stand_ins(exported)
    symbols = _symbols(exported, dims, args, kwargs, model)
    converter = Converter(exported, symbols, higher_order=_HIGHER_ORDER, checks=checks)
    with symbolic_sizes(converter.size) if dims else contextlib.nullcontext():
        nodes = converter.convert()
    mark_eval_arguments(nodes)
    recognise_causal_masks(nodes, converter.constants, converter.outputs, dims)
    use_enable_gqa(nodes, converter.outputs)
    graph = Graph(
        nodes,
        inputs=converter.inputs,
        outputs=converter.outputs,
        signature=forward_signature(model, len(example.args)),
        params=parameter_table(model),
        buffers=buffers,
        constants=converter.constants,
        model=ModelFacts(
            cls=f"{type(model).__module__}.{type(model).__qualname__}",
            source=source,
            on_meta=on_meta,
            input_ranges={k: v for k, v in input_ranges.items() if k in converter.inputs},
            depth=depth,
            basic_blocks=tuple(basic_blocks),
            inline_blocks=inline_blocks,
            operators=dict(sorted(converter.operators.items())),
            symbols=_symbol_table(dims),
            split_markers=converter.split_markers(nodes),
            huggingface=huggingface_configs(model),
            fixed_inputs=fixed_inputs(model, bound),
            trace_settings=settings,
        ),
        functions=functions.definitions(nodes),
    )
    check_state_known(graph)
    graph.units = group_units(graph, depth=depth, basic_blocks=basic_blocks)
    propagate_requires_grad(graph)
    return graph


def _export(
    model: torch.nn.Module, args: tuple, kwargs: dict, real: bool, shapes: dict
) -> tuple[torch.export.ExportedProgram, dict[str, ValueCheck]]:
    """``torch.export`` (non-strict), with the dynamic ``shapes`` of its inputs, and the model's
    checks on tensor values by the name of the node reading each. A model whose sizes or
    branches depend on tensor values (``nonzero``, ``.item()``) is exported again with real
    tensors propagated beside the fake ones (``real``: the model has weights), which gives every
    such value on the example; the converter specialises the graph to them and checks them at
    run time. A branch on a value is refused unless it is the model's check (its other side only
    raises: tracing/value_checks.py). The model's buffers and the RNG are left as they were."""
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
        if not (real and _reads_values(exported)):
            return exported, {}
        failure = None
    buffers = [(b, b.clone()) for b in model.buffers()]
    rng = torch.get_rng_state()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)  # it warns of every value it reads from real tensors
    try:
        with fconfig.patch(fake_tensor_propagate_real_tensors=True), parameters_given_values():
            exported = export()
    except Exception as again:
        if failure is not None:
            failure.add_note(  # shown with the traceback the TraceError chains
                f"exporting again with real values failed too: {type(again).__name__}: "
                + (str(again).strip().splitlines() or [""])[0][:300]
            )
            raise failure from None
        raise
    finally:
        shapes_log.setLevel(level)
        torch.set_rng_state(rng)
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
    checks: dict[str, ValueCheck] = {}
    reads: dict[tuple[str, tuple], int] = {}  # (check, scope) -> values it read
    for node in exported.graph.nodes:
        if not _decides_a_branch(node):
            continue
        # a size can be specialised and checked, a check kept; other branches on values cannot
        truth = isinstance(node.meta.get("val"), (bool, torch.SymBool))
        check = value_check(node) if truth else None
        if check is not None and check.one_read:
            key = (check.where, tuple(node.meta.get("nn_module_stack") or {}))
            reads[key] = reads.get(key, 0) + 1
            if reads[key] > 1:
                raise TraceError(
                    f"the check at {check.where}:\n    {check.code}\nreads more than one value "
                    "from tensors and combines them (and / or / a conditional expression) so "
                    "that one can change without the check failing; autopipe keeps a check "
                    "on the example's values, which would refuse batches the model takes. "
                    "Write one check per value."
                )
        if check is None:
            if failure is not None:
                raise failure
            error = None if truth else symbolic_size_error(node)
            if error is not None:  # a float read from tensors
                raise error
            where, code = at_node(node)
            raise data_dependent_error(
                "control flow",
                where,
                code,
                "the branch reads a truth value from a tensor; a branch whose other side only "
                "raises is a check, which autopipe keeps as a run-time check",
            )
        checks[node.name] = check
    return exported, checks


def _decides_a_branch(node: fx.Node) -> bool:
    """Whether ``node`` reads a truth value or a float from tensor values (``if x.sum() > 0``):
    specialising to the example's would make the pipeline fail on any other batch."""
    value = node.meta.get("val")
    reads = str(node.target) in READS_A_NUMBER or bool(node.meta.get("unbacked_bindings"))
    return reads and isinstance(value, (bool, float, torch.SymBool, torch.SymFloat))


def _is_data_dependent(exc: BaseException) -> bool:
    name = type(exc).__name__
    return "data-dependent" in str(exc) or "DataDependent" in name


def _reads_values(exported: torch.export.ExportedProgram) -> bool:
    """Whether the program reads sizes or numbers from tensor values (a ``torch._check`` on one
    may have fixed it, leaving no symbol)."""
    return any(
        node.meta.get("unbacked_bindings") or str(node.target) in READS_A_NUMBER
        for node in exported.graph.nodes
    )


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


@contextlib.contextmanager
def parameters_given_values() -> Iterator[None]:
    """While the block runs, the real tensors that torch's fake tensors of a module's
    parameters carry (``fake_tensor_propagate_real_tensors``) hold the parameters' values.
    torch 2.13 copies a tensor's values into the real tensor beside its fake one only when the
    tensor is exactly a ``torch.Tensor`` (``meta_utils._safe_copy`` / ``_safe_clone``), which an
    ``nn.Parameter`` is not: the real weights were uninitialised memory (often the values freed
    there by the export before, so that the model's checks passed or failed by chance, and
    ``fill_uninitialized_memory`` made them fail every time). A parameter is given as its plain
    tensor (``detach()``: the same storage). Without those functions, nothing changes."""
    copy, clone = (getattr(meta_utils, name, None) for name in ("_safe_copy", "_safe_clone"))
    if copy is None or clone is None:
        yield
        return

    def plain(src: Any) -> Any:
        return src.detach() if isinstance(src, torch.nn.Parameter) else src

    meta_utils._safe_copy = lambda dst, src: copy(dst, plain(src))
    meta_utils._safe_clone = lambda src: clone(plain(src))
    try:
        yield
    finally:
        meta_utils._safe_copy, meta_utils._safe_clone = copy, clone


# -- export errors ----------------------------------------------------------------------------
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


class _GuardRecorder(logging.Handler):
    """Keeps, for each guard ``torch.export`` adds on a symbolic size, the user's line that
    made it (the innermost user frame on the stack when it is logged)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.guards: list[tuple[str, UserLine]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if "[guard added]" not in str(record.msg) or len(args) < 2:
            return
        line = on_stack()
        if line is not None:
            self.guards.append((str(args[1]), line))


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
        guard, line = next(
            (g for g in guards.guards if constant and constant.search(g[0])), guards.guards[0]
        )
        where = f" at {line.where}:\n    {line.code}\n(torch.export's guard: {guard})"
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
    line = in_traceback(exc)
    where = line.where if line else f"the forward of {type(model).__name__}"
    code = line.code_block if line else ""
    message = first_line(exc)
    name = type(exc).__name__
    if _is_data_dependent(exc):
        return data_dependent_error("control flow", where, code, f"torch.export: {message}")
    return TraceError(
        f"torch.export cannot trace the model at {where}:{code}\n{name}: {message}\n"
        "Make this code traceable (see https://pytorch.org/docs/stable/export.html), or build the "
        "model so that it does not run it."
    )


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
    signature = forward_signature(model, len(args))
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
            assert isinstance(second, pytree.SequenceKey)  # a positional argument
            name = signature[second.idx] if second.idx < len(signature) else None
        elif getattr(first, "idx", None) == 1 and second is not None and len(path) == 2:
            assert isinstance(second, pytree.MappingKey)  # a keyword argument
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


def _symbol_table(dims: tuple[DynamicDim, ...]) -> dict[str, DynamicSymbol]:
    """The graph's record of its dynamic dimensions (``Graph.model.symbols``)."""
    table = {}
    for d in dims:
        assert d.min is not None and d.planned is not None  # set by dynamic.resolve
        table[d.name] = DynamicSymbol(d.min, d.max, d.planned, tuple((s, i) for s, i in d.sources))
    return table
