"""Dynamic dimensions: input sizes that change from batch to batch (the sequence length of
padded-per-batch text, a smaller last batch).

The user declares each one by a name and the input dimensions it sizes
(``seq[8:2048]=input_ids:1,labels:1``); tracing gives ``torch.export`` one ``Dim`` per name, and
every size the model computes from them becomes a formula of the names (``2 * seq``,
``seq - 1``), which the generated code evaluates and ``pipeline.json`` records.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import builtins

import sympy
import torch
from torch.utils._sympy.functions import CeilDiv, FloorDiv, Mod, PowByNatural, PythonMod

from ..checks import RESERVED
from ..errors import AutopipeError

#: The smallest lower bound: ``torch.export`` specialises sizes 0 and 1 (a model that broadcasts
#: over a size-1 dimension traces another graph), so a dimension is dynamic from 2 on.
MIN_SIZE = 2
_DECLARATION = re.compile(
    r"^(?P<name>[A-Za-z_]\w*)(\[(?P<low>\d*):(?P<high>\d*)\])?=(?P<sources>.+)$"
)


@dataclass(frozen=True)
class DynamicDim:
    """One dynamic dimension: its name, the (input, dimension) pairs it sizes, its bounds."""

    name: str
    sources: tuple[tuple[str, int], ...]
    min: int | None = None  # None: MIN_SIZE
    max: int | None = None  # None: no upper bound
    #: the size the graph's metadata, profile and plan are for: the upper bound, or the
    #: example's size when there is none (set by :func:`resolve`)
    planned: int | None = None

    def declaration(self) -> str:
        """The ``--dynamic`` text of this dimension."""
        low, high = ("" if b is None else b for b in (self.min, self.max))
        bounds = f"[{low}:{high}]" if (self.min, self.max) != (None, None) else ""
        return f"{self.name}{bounds}=" + ",".join(f"{i}:{d}" for i, d in self.sources)


def parse_dynamic(text: str) -> DynamicDim:
    """``NAME[MIN:MAX]=INPUT:DIM[,INPUT:DIM...]`` (bounds optional) as a :class:`DynamicDim`."""
    match = _DECLARATION.match(text.replace(" ", ""))
    if match is None:
        raise AutopipeError(
            f"--dynamic {text!r} must have the form NAME=INPUT:DIM[,INPUT:DIM...], optionally "
            "with bounds NAME[MIN:MAX]=...: for example seq[8:2048]=input_ids:1,labels:1"
        )
    sources = []
    for source in match["sources"].split(","):
        name, _, dim = source.rpartition(":")
        if not name.isidentifier() or not dim.isdigit():
            raise AutopipeError(
                f"--dynamic {text!r}: {source!r} must be INPUT:DIM, an input of the model's "
                "forward and a dimension number (input_ids:1)"
            )
        sources.append((name, int(dim)))
    low, high = match["low"], match["high"]
    return _checked(
        DynamicDim(
            match["name"], tuple(sources), int(low) if low else None, int(high) if high else None
        )
    )


def dynamic_dims(value: Any) -> tuple[DynamicDim, ...]:
    """The dynamic dimensions the API's ``dynamic=`` gives: ``{"seq": [("input_ids", 1)]}``
    (a key may carry bounds, ``"seq[8:2048]"``), ``--dynamic`` texts, or :class:`DynamicDim`s."""
    if not value:
        return ()
    if isinstance(value, Mapping):
        dims = []
        for key, sources in value.items():
            one = isinstance(sources, tuple) and len(sources) == 2 and isinstance(sources[0], str)
            pairs = [sources] if one else sources
            try:
                text = f"{key}=" + ",".join(f"{name}:{dim}" for name, dim in pairs)
            except (TypeError, ValueError):
                raise AutopipeError(
                    f"dynamic={{{key!r}: {sources!r}}}: give a list of (input name, dimension) "
                    'pairs, as in dynamic={"seq": [("input_ids", 1), ("labels", 1)]}'
                ) from None
            dims.append(parse_dynamic(text))
    elif isinstance(value, str):
        dims = [parse_dynamic(value)]
    else:
        dims = [d if isinstance(d, DynamicDim) else parse_dynamic(d) for d in value]
    names = [d.name for d in dims]
    sources = [s for d in dims for s in d.sources]
    for things, what in ((names, "name"), (sources, "input dimension")):
        repeated = sorted({str(t) for t in things if things.count(t) > 1})
        if repeated:
            raise AutopipeError(
                f"--dynamic declares the {what} {repeated[0]} twice; each dynamic dimension has "
                "one name and each input dimension belongs to one of them"
            )
    return tuple(dims)


def _checked(dim: DynamicDim) -> DynamicDim:
    if dim.name in RESERVED or dim.name in dir(builtins) or dim.name.startswith("_"):
        raise AutopipeError(
            f"--dynamic: {dim.name!r} cannot name a dimension (the generated code uses it); "
            "choose another name, such as seq or batch"
        )
    low = MIN_SIZE if dim.min is None else dim.min
    if low < MIN_SIZE:
        raise AutopipeError(
            f"--dynamic {dim.declaration()}: the lower bound must be at least {MIN_SIZE}; "
            "torch.export compiles sizes 0 and 1 as special cases, so a graph traced for larger "
            f"sizes is not valid for them. Pad such batches to {MIN_SIZE}"
        )
    if dim.max is not None and dim.max < low:
        raise AutopipeError(f"--dynamic {dim.declaration()}: the upper bound is below the lower")
    return dim


def resolve(
    dims: Iterable[DynamicDim], inputs: Mapping[str, Any], parameters: Iterable[str] = ()
) -> tuple[DynamicDim, ...]:
    """``dims`` with their lower bound and planned size set (the upper bound, else the
    example's size), checked against the example ``inputs`` (the model's forward
    ``parameters``, bound)."""
    resolved = []
    for dim in dims:
        if dim.name in set(parameters) | set(inputs):
            raise AutopipeError(
                f"--dynamic {dim.declaration()}: {dim.name!r} is a parameter of the model's "
                "forward; name the dimension otherwise (the generated code uses both names)"
            )
        sizes = []
        for name, index in dim.sources:
            value = inputs.get(name)
            if not isinstance(value, torch.Tensor):
                known = ", ".join(n for n, v in inputs.items() if isinstance(v, torch.Tensor))
                raise AutopipeError(
                    f"--dynamic {dim.declaration()}: the example has no tensor input {name!r}; "
                    f"its tensor inputs are {known or 'none'}"
                )
            if index >= value.dim():
                raise AutopipeError(
                    f"--dynamic {dim.declaration()}: input {name!r} has {value.dim()} "
                    f"dimension(s) (shape {list(value.shape)}), so it has no dimension {index}"
                )
            sizes.append(int(value.shape[index]))
        if len(set(sizes)) > 1:
            shown = ", ".join(f"{n}:{i} is {s}" for (n, i), s in zip(dim.sources, sizes))
            raise AutopipeError(
                f"--dynamic {dim.declaration()}: the example's sizes differ ({shown}); the "
                "dimensions of one name must have one size"
            )
        low = MIN_SIZE if dim.min is None else dim.min
        if not (low <= sizes[0] and (dim.max is None or sizes[0] <= dim.max)):
            raise AutopipeError(
                f"--dynamic {dim.declaration()}: the example's size {sizes[0]} is outside the "
                f"bounds [{low}:{'' if dim.max is None else dim.max}]; trace with an example "
                "inside them"
            )
        planned = sizes[0] if dim.max is None else dim.max
        resolved.append(replace(dim, min=low, planned=planned))
    return tuple(resolved)


def export_shapes(
    dims: Iterable[DynamicDim], inputs: Mapping[str, Any]
) -> dict[str, dict[int, Any] | None]:
    """``torch.export``'s ``dynamic_shapes`` for the forward parameters ``inputs``: one
    ``Dim`` per name, on every input dimension it sizes."""
    shapes: dict[str, dict[int, Any] | None] = {name: None for name in inputs}
    for dim in dims:
        export_dim = torch.export.Dim(dim.name, min=dim.min, max=dim.max)
        for name, index in dim.sources:
            shapes[name] = (shapes[name] or {}) | {index: export_dim}
    return shapes


# -- formulas ---------------------------------------------------------------------------------
class UnwritableSize(ValueError):
    """A size expression :func:`formula` cannot write as Python."""


def formula(expr: Any, names: Mapping[Any, str]) -> str:
    """A sympy size expression of torch's symbols as Python over the dimensions' ``names``
    (symbol -> name): ``2*s0`` -> ``"2 * seq"``, ``Max(32, 32*s0)`` -> ``"max(32, 32 * seq)"``."""
    return _write(sympy.sympify(expr), names)[0]


#: precedence of the Python operators written: higher binds tighter
_ATOM, _POWER, _PRODUCT, _SUM = 4, 3, 2, 1


def _write(expr: Any, names: Mapping[Any, str]) -> tuple[str, int]:
    """Python source for ``expr`` and its precedence."""
    if expr.is_Symbol:
        if expr not in names:
            raise UnwritableSize(f"the size depends on {expr}, which is not a dynamic dimension")
        return names[expr], _ATOM
    if expr.is_Integer:
        value = int(expr)
        return str(value), (_ATOM if value >= 0 else _SUM)
    if expr.is_Add:
        terms = sorted(
            expr.args,
            key=lambda t: (
                bool(t.is_number),
                bool(t.as_coeff_Mul()[0] < 0),
                _write(_abs_term(t), names)[0],
            ),
        )
        text = _operand(terms[0], names, _SUM)
        for term in terms[1:]:
            if term.as_coeff_Mul()[0].is_negative:
                text += f" - {_operand(-term, names, _PRODUCT)}"
            else:
                text += f" + {_operand(term, names, _SUM)}"
        return text, _SUM
    if expr.is_Mul:
        coefficient, rest = expr.as_coeff_Mul()
        if not coefficient.is_Integer:
            raise UnwritableSize(f"the size {expr} has the fractional factor {coefficient}")
        parts = sorted(  # a // or % among the factors is bracketed: Python groups left to right
            (_operand(f, names, _PRODUCT + 1) for f in sympy.Mul.make_args(rest)),
            key=lambda part: (part.startswith("("), part),  # names before sums
        )
        if abs(coefficient) != 1:
            parts.insert(0, str(abs(int(coefficient))))
        text = " * ".join(parts)
        return (f"-{text}", _SUM) if coefficient < 0 else (text, _PRODUCT)
    if expr.is_Pow and expr.exp.is_Integer and expr.exp > 0:
        return f"{_operand(expr.base, names, _POWER + 1)} ** {int(expr.exp)}", _POWER
    function = type(expr).__name__
    if function in ("Max", "Min"):
        args = sorted(expr.args, key=lambda a: (not a.is_number, sympy.default_sort_key(a)))
        return f"{function.lower()}({', '.join(_write(a, names)[0] for a in args)})", _ATOM
    if len(expr.args) == 2 and isinstance(expr, (FloorDiv, Mod, PythonMod, CeilDiv)):
        left = _operand(expr.args[0], names, _PRODUCT)
        right = _operand(expr.args[1], names, _PRODUCT + 1)
        if isinstance(expr, CeilDiv):  # ceil(a / b) in integers
            return f"-(-{_operand(expr.args[0], names, _POWER)} // {right})", _SUM
        return f"{left} {'//' if isinstance(expr, FloorDiv) else '%'} {right}", _PRODUCT
    if isinstance(expr, PowByNatural):
        return (
            f"{_operand(expr.args[0], names, _POWER + 1)} ** {_write(expr.args[1], names)[0]}",
            _POWER,
        )
    raise UnwritableSize(f"the size {expr} uses {function}, which autopipe cannot write")


def _abs_term(term: Any) -> Any:
    """A term of a sum without its sign: ``-2*s`` -> ``2*s``."""
    return -term if bool(term.as_coeff_Mul()[0] < 0) else term


def _operand(expr: Any, names: Mapping[Any, str], needed: int) -> str:
    text, precedence = _write(expr, names)
    return text if precedence >= needed else f"({text})"
