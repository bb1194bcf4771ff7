"""The pass that gives generated graphs eager's causal fast path back (issue 43, item 2).

Under tracing, Hugging Face models (and others) build their causal mask from ``arange``,
``le``, ``&`` and pass an explicit boolean ``[batch, 1, S, S]`` ``attn_mask`` to
``scaled_dot_product_attention``, where eager calls it with ``is_causal=True`` and no mask: the
CPU's flash kernel skips the masked half and a GPU's flash backend needs no mask, and an
explicit mask is built on every microbatch and crosses stage boundaries (4 MB per microbatch at
S=2048).

For every attention call (the operators of :data:`autopipe.ir.eval_mode.ATTENTION` with a mask
argument and ``is_causal``) whose mask

- is computed from sizes and constants only: its producers, walked back, reach no model input,
  parameter or buffer (a ``new_ones``/``ones_like``-like operator reads only the dtype, device
  and size of its first argument), call only deterministic torch operators that mutate nothing,
  and nothing else writes into them; and
- is exactly causal: query and key lengths are equal and, evaluated with real tensors, the mask
  is ``torch.ones(L, S, dtype=torch.bool).tril()`` broadcast (a float mask: 0 there and ``-inf``
  or the dtype's lowest value elsewhere) over the attention's ``[..., L, S]``,

the call is rewritten to pass no mask and ``is_causal=True``, and the nodes that built the mask
and nobody else reads are removed. A mask computed so that masks nothing (all True: what
Hugging Face's encoders, ViT's and wav2vec2's, build under tracing without an attention mask) is
dropped the same way, ``is_causal`` left False, as eager passes none. ``scale`` is kept, and so
is dropout: the math kernel drops the same attention weights either way (and a GPU picks the
backend eager picks for the same call). A mask that reads input values (an ``attention_mask``
with padding, packed documents' positions), a parameter or a buffer, or that is not causal (a
sliding window shorter than the sequence) stays exactly as it is, as does one built with
in-place operators (``mask.masked_fill_(...)``).

With dynamic dimensions (``--dynamic``), a mask computed from them is evaluated at every size
within their bounds (the pipeline refuses others), which proves it causal at all of them; a mask
over an unbounded dimension, or whose sizes add up to more than :data:`MAX_ELEMENTS` elements,
stays explicit, as does one over more than :data:`MAX_SIZES` combinations of sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..checks import op_overload
from ..ir import Node, Ref, TensorMeta
from ..ir.codec import decode_tensor
from ..ir.eval_mode import ATTENTION
from ..ir.interpreter import run_node
from ..ir.ordering import computes_from_arguments
from ..ir.sizes import rebound_nodes
from ..ir.types import argument_value, iter_refs, sizes_in
from ..runtime.core.shapes import evaluate, names_in
from .dynamic import DynamicDim
from .passes import drop_dead

__all__ = [
    "MAX_ELEMENTS",
    "MAX_SIZES",
    "attention_masking",
    "CAUSAL",
    "FULL",
    "mask_kind",
    "recognise_causal_masks",
]

#: what a mask eager would not build does: lets each query see the keys at and before its
#: position (``"causal"``), or every key (``"full"``)
CAUSAL, FULL = "causal", "full"
#: the most mask elements evaluated to recognise one mask (summed over the sizes of its dynamic
#: dimensions): a larger mask stays explicit
MAX_ELEMENTS = 1 << 26
#: the most sizes of its dynamic dimensions a mask is evaluated at: with more, it stays explicit
MAX_SIZES = 1024
#: operators that read only the dtype, device (and size) of their first argument, not its values
_METADATA_ONLY = {
    "aten.new_ones.default",
    "aten.new_zeros.default",
    "aten.new_full.default",
    "aten.ones_like.default",
    "aten.zeros_like.default",
    "aten.full_like.default",
}
#: the names attention operators give their mask
_MASK_ARGUMENTS = ("attn_mask", "attn_bias")
_CPU = torch.device("cpu")


def recognise_causal_masks(
    nodes: list[Node],
    constants: Mapping[str, Any],
    outputs: Sequence[str],
    dims: Sequence[DynamicDim] = (),
) -> list[str]:
    """Rewrite the attention calls of ``nodes`` (a traced graph's, in program order) whose mask
    is computed from sizes and constants only and causal into ``is_causal=True`` without it (or
    masks nothing: into no mask), and remove the nodes that built it (``nodes`` is changed in
    place); ``constants`` are the graph's encoded tensor constants, ``outputs`` its output
    names, ``dims`` its dynamic dimensions (resolved: with lower bounds and planned sizes).
    Returns the names of the calls rewritten."""
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    written = _written(nodes, by_name)
    verdicts: dict[tuple[Any, ...], str | None] = {}
    rewritten = []
    for node in nodes:
        slots = _attention_slots(node)
        if slots is None:
            continue
        mask_slot, causal_slot = slots
        mask = argument_value(node, mask_slot[1])
        if not isinstance(mask, Ref) or argument_value(node, causal_slot[1]) is True:
            continue
        refs = (node.args + (None, None))[:2]
        if not all(isinstance(r, Ref) for r in refs):
            continue
        query, key = (by_name[r.name] for r in refs)
        key_of = (mask.name, _formulas(query), _formulas(key))
        if key_of not in verdicts:
            verdicts[key_of] = _recognised(
                mask.name, query, key, by_name, position, written, constants, dims
            )
        kind = verdicts[key_of]
        if kind is not None:
            _rewrite(node, mask_slot, causal_slot if kind == CAUSAL else None)
            rewritten.append(node.name)
    if rewritten:
        nodes[:] = drop_dead(nodes, set(outputs))
    return rewritten


def attention_masking(node: Node) -> str | None:
    """How an attention call masks: ``"causal"`` (``is_causal=True``, no mask built),
    ``"mask"`` (an explicit mask), ``"none"`` (neither: it attends to every key); None for
    other nodes."""
    slots = _attention_slots(node)
    if slots is None:
        return None
    mask_slot, causal_slot = slots
    if argument_value(node, causal_slot[1]) is True:
        return "causal"
    return "mask" if argument_value(node, mask_slot[1]) is not None else "none"


# -- the operators' arguments -----------------------------------------------------------------
Slot = tuple[int | None, str]  # the argument's position (None: keyword only), its name


def _attention_slots(node: Node) -> tuple[Slot, Slot] | None:
    """Where an attention call takes its mask and ``is_causal``; None for other nodes."""
    if node.kind != "call" or node.target not in ATTENTION:
        return None
    op = op_overload(node.target)
    if op is None:
        return None
    slots: dict[str, Slot] = {}
    for index, argument in enumerate(op._schema.arguments):
        slots[argument.name] = (None if argument.kwarg_only else index, argument.name)
    mask = next((slots[name] for name in _MASK_ARGUMENTS if name in slots), None)
    causal = slots.get("is_causal")
    return None if mask is None or causal is None else (mask, causal)


def _rewrite(node: Node, mask: Slot, causal: Slot | None) -> None:
    """No mask, and ``is_causal=True`` if ``causal`` is its slot: positionally where the call
    passes its arguments so (the arguments between with their defaults), else by name."""
    args, kwargs = list(node.args), dict(node.kwargs)
    index, name = mask
    if index is not None and index < len(args):
        args[index] = None
    else:
        kwargs.pop(name, None)
    if causal is None:
        node.args, node.kwargs = tuple(args), kwargs
        return
    index, name = causal
    if index is not None and index < len(args):
        args[index] = True
    else:
        op = op_overload(node.target)
        assert op is not None  # _attention_slots found its schema
        between = op._schema.arguments[len(args) : index]
        if (
            index is not None
            and not any(a.name in kwargs for a in between)
            and all(a.has_default_value() for a in between)
        ):
            args += [a.default_value for a in between] + [True]
            kwargs.pop(name, None)
        else:
            kwargs[name] = True
    node.args, node.kwargs = tuple(args), kwargs


# -- which nodes build the mask ---------------------------------------------------------------
def _mutates(target: str) -> bool:
    op = op_overload(target)
    return op is not None and (
        op._schema.is_mutable
        or any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
    )


def _written(nodes: list[Node], by_name: Mapping[str, Node]) -> set[str]:
    """The values an in-place operator writes into, and those they are views of."""
    written: set[str] = set()
    for node in nodes:
        op = op_overload(node.target) if node.kind == "call" else None
        if op is None or not _mutates(node.target):
            continue
        arguments = op._schema.arguments
        passed = [
            *zip(arguments, node.args),
            *((a, node.kwargs[a.name]) for a in arguments if a.name in node.kwargs),
        ]
        stack = [
            r.name
            for argument, value in passed
            if argument.alias_info is not None and argument.alias_info.is_write
            for r in iter_refs(value)
        ]
        while stack:
            name = stack.pop()
            if name in written:
                continue
            written.add(name)
            source = by_name[name]
            view = op_overload(source.target) if source.kind == "call" else None
            if source.target == "getitem" or (
                view is not None and any(r.alias_info is not None for r in view._schema.returns)
            ):
                stack += source.inputs  # a view (or an output) of its arguments
    return written


def _builders(
    mask: str, by_name: Mapping[str, Node], written: set[str]
) -> tuple[set[str], set[str]] | None:
    """The nodes that compute ``mask`` from sizes and constants only, and the nodes they read
    for their metadata only; None if it reads anything else."""
    builders: set[str] = set()
    stand_ins: set[str] = set()
    stack = [mask]
    while stack:
        name = stack.pop()
        if name in builders:
            continue
        node = by_name[name]
        if name in written:
            return None
        if node.kind == "constant":
            builders.add(name)
            continue
        if node.kind != "call" or not computes_from_arguments(node):
            return None  # a model input, a parameter or buffer; a random or in-place operator
        builders.add(name)
        reads = list(iter_refs((node.args, node.kwargs)))
        if node.target in _METADATA_ONLY and node.args and isinstance(node.args[0], Ref):
            stand_ins.add(node.args[0].name)
            reads = list(iter_refs((node.args[1:], node.kwargs)))
        stack += [r.name for r in reads]
    return builders, stand_ins - builders


# -- what the mask lets through ----------------------------------------------------------------
def _recognised(
    mask: str,
    query: Node,
    key: Node,
    by_name: Mapping[str, Node],
    position: Mapping[str, int],
    written: set[str],
    constants: Mapping[str, Any],
    dims: Sequence[DynamicDim],
) -> str | None:
    """:data:`CAUSAL` or :data:`FULL` where ``mask`` is computed from sizes and constants only
    and is that for the attention of ``query`` over ``key`` at every size the graph runs at;
    None otherwise."""
    found = _builders(mask, by_name, written)
    if found is None:
        return None
    builders, stand_ins = found
    program = sorted((by_name[n] for n in builders), key=lambda n: position[n.name])
    extras = [by_name[n] for n in stand_ins] + [query, key]
    sizes = _sizes(program, extras, by_name[mask], dims)
    if sizes is None:
        return None
    try:
        with torch.no_grad():
            kinds = {_kind_at(values, program, extras, mask, constants) for values in sizes}
    except Exception:  # noqa: BLE001 - a mask that cannot be evaluated here stays as it is
        return None
    return kinds.pop() if len(kinds) == 1 else None


def _formulas(node: Node) -> Any:
    meta = node.tensor_meta
    return None if meta is None else meta.formulas


def _sizes(
    program: list[Node], extras: list[Node], mask: Node, dims: Sequence[DynamicDim]
) -> list[dict[str, int]] | None:
    """The sizes of the dynamic dimensions to evaluate the mask at: every combination within
    the bounds of those it depends on (the others at their planned sizes); ``[{}]`` without
    any; None where that is unbounded or too much work."""
    formulas: set[str] = set()
    for node in (*program, *extras):
        formulas.update(s.formula for s in sizes_in((node.args, node.kwargs)))
        meta = node.meta if isinstance(node.meta, tuple) else (node.meta,)
        formulas.update(f for m in meta if isinstance(m, TensorMeta) for f in m.sizes)
    names = set().union(*(names_in(f) for f in formulas)) if formulas else set()
    used = [d for d in dims if d.name in names]
    mask_meta = mask.tensor_meta
    if mask_meta is None or names - {d.name for d in dims}:
        return None
    if not used:
        return [{}] if mask_meta.numel <= MAX_ELEMENTS else None
    if any(d.max is None or d.min is None or d.planned is None for d in used):
        return None  # unbounded: the mask cannot be checked at every size
    planned = {d.name: d.planned for d in dims if d.planned is not None}
    ranges = [range(d.min, d.max + 1) for d in used]  # type: ignore[arg-type,operator]
    if math.prod(len(r) for r in ranges) > MAX_SIZES:
        return None
    combinations = [
        planned | dict(zip((d.name for d in used), chosen)) for chosen in itertools.product(*ranges)
    ]
    work = sum(math.prod(evaluate(f, c) for f in mask_meta.formulas) for c in combinations)
    return combinations if work <= MAX_ELEMENTS else None


def _kind_at(
    values: dict[str, int],
    program: list[Node],
    extras: list[Node],
    mask: str,
    constants: Mapping[str, Any],
) -> str | None:
    """What the mask does (:func:`mask_kind`) with the dynamic dimensions at ``values`` (none:
    as traced)."""
    if values:
        program, extras = rebound_nodes(program, values), rebound_nodes(extras, values)
    *stand_ins, query, key = extras
    env: dict[str, Any] = {}
    for node in stand_ins:
        meta = node.tensor_meta
        if meta is None:
            return None
        env[node.name] = torch.zeros(meta.shape, dtype=meta.dtype)
    for node in program:
        if node.kind == "constant":
            env[node.name] = decode_tensor(constants[node.name])
        else:
            env[node.name] = run_node(node, env, _CPU)
        meta = node.tensor_meta
        value = env[node.name]
        if meta is not None and (
            not isinstance(value, torch.Tensor) or tuple(value.shape) != meta.shape
        ):
            return None  # not what was traced: a size the graph fixed
    q, k = query.tensor_meta, key.tensor_meta
    if q is None or k is None or len(q.shape) < 2 or len(k.shape) < 2:
        return None
    return mask_kind(env[mask], q.shape[:-1] + (k.shape[-2],))


def mask_kind(mask: Any, scores: tuple[int, ...]) -> str | None:
    """What ``mask``, broadcast over attention scores of shape ``scores`` (``[..., L, S]``),
    does: :data:`FULL` if it lets every query see every key (a boolean mask all True, a float
    one all 0), :data:`CAUSAL` if it lets each query see exactly the keys at and before its
    position, with L == S (``torch.ones(L, S, dtype=torch.bool).tril()``; a float mask 0 there
    and ``-inf`` or the dtype's lowest value elsewhere); None otherwise."""
    if not isinstance(mask, torch.Tensor) or len(scores) < 2:
        return None
    if not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        return None
    try:
        if tuple(torch.broadcast_shapes(mask.shape, scores)) != tuple(scores):
            return None  # it would make the scores larger
    except RuntimeError:
        return None
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if bool(allowed.all()):
        return FULL
    length = scores[-1]
    if scores[-2] != length:
        return None
    full = mask.reshape((1,) * max(0, 2 - mask.dim()) + tuple(mask.shape))
    full = full.expand(*full.shape[:-2], length, length)
    positions = torch.arange(length)
    causal = (positions[:, None] >= positions[None, :]).expand_as(full)  # ones(L, L).tril()
    if mask.dtype == torch.bool:
        return CAUSAL if torch.equal(full, causal) else None
    blocked = (full == -math.inf) | (full == torch.finfo(mask.dtype).min)
    return CAUSAL if torch.equal(full == 0, causal) and torch.equal(blocked, ~causal) else None
