"""The pass that gives grouped-query attention eager's call back (issue 43, item 2).

A GQA model with fewer key/value heads than query heads repeats its keys and values for every
query head before attention (Hugging Face's ``repeat_kv``: ``x[:, :, None].expand(b, kv, n,
s, d).reshape(b, kv * n, s, d)``), which materialises copies ``n`` times the size of the keys
and values; under tracing it always does, because the model sees an explicit mask there, where
eager, calling attention without a mask, passes the keys and values as they are with
``enable_gqa=True`` (``transformers``' ``use_gqa_in_sdpa``). Once the causal-mask pass
(autopipe/tracing/causal_mask.py) has dropped the mask, this pass does what eager does: an
attention call without a mask whose key and value are both repeated so (the same factor, query
head ``h`` reading key/value head ``h // n``, which is what ``enable_gqa`` computes) takes the
unrepeated key and value and ``enable_gqa=True``; the copies nobody else reads are removed.

``x.repeat_interleave(n, dim=1)`` repeats the heads the same way and is rewritten alike. A call
with an explicit mask keeps its repeated keys and values, as eager does: a GPU's
memory-efficient kernel, the one that takes a mask, has no grouped-query form. So does one
whose repeat is not exactly that (another dimension, heads tiled rather than repeated in a row,
``repeat`` instead of ``expand``, sizes that differ).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..ir import Node, Ref
from ..ir.types import argument_value
from .passes import drop_dead

__all__ = ["GQA_ATTENTION", "grouped_query", "use_enable_gqa"]

#: the attention operator that takes ``enable_gqa`` (torch's composite, which picks a kernel)
GQA_ATTENTION = "aten.scaled_dot_product_attention.default"
#: the schema positions of its mask and ``is_causal`` (``enable_gqa`` is keyword-only)
_MASK, _CAUSAL = 3, 5
#: operators merging the repeated dimension into the heads
_MERGES = {"aten.reshape.default", "aten.view.default", "aten._unsafe_view.default"}
#: ``x.repeat_interleave(n, dim=1)``: each key/value head n times in a row, as enable_gqa reads
_INTERLEAVE = "aten.repeat_interleave.self_int"


def use_enable_gqa(nodes: list[Node], outputs: Sequence[str]) -> list[str]:
    """Rewrite the attention calls of ``nodes`` (in program order) without a mask whose keys
    and values are repeated for grouped-query attention into ``enable_gqa=True`` on the
    unrepeated ones, and remove the repeats nobody else reads (``nodes`` is changed in place;
    ``outputs`` are the graph's output names). Returns the names of the calls rewritten."""
    by_name = {n.name: n for n in nodes}
    rewritten = []
    for node in nodes:
        if node.kind != "call" or node.target != GQA_ATTENTION:
            continue
        if node.kwargs.get("enable_gqa") is True or argument_value(node, "attn_mask") is not None:
            continue
        if len(node.args) < 3 or not all(isinstance(r, Ref) for r in node.args[:3]):
            continue
        query = by_name[node.args[0].name]
        key = _unrepeated(by_name[node.args[1].name], by_name)
        value = _unrepeated(by_name[node.args[2].name], by_name)
        if key is None or value is None or key[1] != value[1]:
            continue
        heads, groups = _heads(query), _heads(key[0])
        if heads is None or groups is None or heads != groups * key[1]:
            continue  # not every query head reads the key/value head enable_gqa gives it
        node.args = (node.args[0], Ref(key[0].name), Ref(value[0].name), *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        rewritten.append(node.name)
    if rewritten:
        nodes[:] = drop_dead(nodes, set(outputs))
    return rewritten


def grouped_query(node: Node) -> bool:
    """Whether ``node`` is an attention call with ``enable_gqa=True``."""
    return node.kind == "call" and node.kwargs.get("enable_gqa") is True


def _unrepeated(merged: Node, by_name: Mapping[str, Node]) -> tuple[Node, int] | None:
    """The tensor ``merged`` repeats for grouped-query attention and the factor (``x[:, :,
    None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)`` gives ``(x, n)``); None if it is
    not that."""
    if merged.kind == "call" and merged.target == _INTERLEAVE:
        return _interleaved(merged, by_name)
    if merged.kind != "call" or merged.target not in _MERGES or not merged.args:
        return None
    expanded = _source(merged, by_name)
    if expanded is None or expanded.target != "aten.expand.default":
        return None
    unsqueezed = _source(expanded, by_name)
    if (
        unsqueezed is None
        or unsqueezed.target != "aten.unsqueeze.default"
        or argument_value(unsqueezed, "dim") not in (2, -3)
    ):
        return None
    original = _source(unsqueezed, by_name)
    if original is None:
        return None
    x, u, e, m = (n.tensor_meta for n in (original, unsqueezed, expanded, merged))
    if x is None or u is None or e is None or m is None:
        return None
    if len(x.shape) != 4 or len(e.shape) != 5 or len(m.shape) != 4:
        return None
    factor = e.shape[2]
    if u.shape[2] != 1 or factor < 1 or str(e.formulas[2]) != str(factor):
        return None  # a repeat by a dynamic size is not the model's head structure
    same = (0, 1, 3, 4)
    if [e.formulas[i] for i in same] != [u.formulas[i] for i in same]:
        return None  # expand changed another dimension: not a repeat
    if (
        m.formulas[0] != x.formulas[0]
        or m.formulas[2:] != x.formulas[2:]
        or m.shape[1] != x.shape[1] * factor
    ):
        return None  # the merge is not of the key/value heads with their repeats
    return original, factor


def _interleaved(repeated: Node, by_name: Mapping[str, Node]) -> tuple[Node, int] | None:
    """``x.repeat_interleave(n, dim=1)`` of a 4-D ``x``: ``(x, n)`` (the same heads as
    enable_gqa's); None for another dimension, a tensor of repeats or a dynamic size."""
    original = _source(repeated, by_name)
    factor = argument_value(repeated, "repeats")
    dim = argument_value(repeated, "dim")
    if original is None or not isinstance(factor, int) or isinstance(factor, bool):
        return None
    x, r = original.tensor_meta, repeated.tensor_meta
    if x is None or r is None or len(x.shape) != 4 or dim not in (1, -3) or factor < 1:
        return None
    if r.formulas[:1] != x.formulas[:1] or r.formulas[2:] != x.formulas[2:]:
        return None
    return (original, factor) if r.shape[1] == x.shape[1] * factor else None


def _source(node: Node, by_name: Mapping[str, Node]) -> Node | None:
    first = node.args[0] if node.args else None
    return by_name[first.name] if isinstance(first, Ref) else None


def _heads(node: Node) -> int | None:
    meta = node.tensor_meta
    return meta.shape[1] if meta is not None and len(meta.shape) == 4 else None
