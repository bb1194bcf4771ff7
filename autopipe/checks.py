"""Checks of values that enter autopipe from outside: names that reach generated code (and the
one allocator of fresh names), operator names, and the numbers of options and device specs
(the compile options' rules, in :mod:`autopipe.options`, are built on these).

Predicates (``is_*``) answer yes or no; :func:`require` raises an :class:`ArtifactError`, with a
message that names the value, what is wrong and what is allowed.
"""

from __future__ import annotations

import keyword
import math
from collections.abc import Iterable
from typing import Any

import torch

from .errors import ArtifactError

#: Names the generated code uses itself; graph values are named away from them.
RESERVED = frozenset(keyword.kwlist) | {
    "torch",
    "aten",
    "nn",
    "self",
    "device",
    "float",
    "math",
    "Scope",
}


class Namespace:
    """Hands out names not taken yet: ``view``, then ``view_1``, ``view_2`` ..."""

    def __init__(self, taken: Iterable[str] = ()):
        self.used = set(taken)

    def claim(self, preferred: str) -> str:
        candidate, counter = preferred, 0
        while candidate in self.used:
            counter += 1
            candidate = f"{preferred}_{counter}"
        self.used.add(candidate)
        return candidate


def is_value_name(name: Any) -> bool:
    """A name generated code may bind a value to: an identifier, not a keyword or reserved."""
    return isinstance(name, str) and name.isidentifier() and name not in RESERVED


def is_identifier(name: Any) -> bool:
    """A Python identifier that is not a keyword."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def is_fqn(name: Any) -> bool:
    """A module, parameter or buffer name: dot-separated identifiers (not keywords) or numbers."""
    return isinstance(name, str) and all(
        (part.isascii() and part.isdigit()) or is_identifier(part) for part in name.split(".")
    )


def is_class_name(name: Any) -> bool:
    """A qualified class name such as ``torch.nn.modules.linear.Linear`` or ``build.<locals>.M``."""
    if not isinstance(name, str):
        return False
    parts = name.split(".")
    return parts[-1].isidentifier() and all(p.isidentifier() or p == "<locals>" for p in parts)


def is_text(value: Any) -> bool:
    """A one-line printable string (labels and names shown in comments, tables and reports)."""
    return isinstance(value, str) and value.isprintable()


def is_int(value: Any, minimum: int | None = None) -> bool:
    """An ``int`` (not a ``bool``), at least ``minimum`` when given."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (minimum is None or value >= minimum)
    )


def is_number(value: Any, minimum: float | None = None, *, strict: bool = False) -> bool:
    """A finite ``int`` or ``float`` (not a ``bool``), ``>= minimum`` (``> minimum`` if strict)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return minimum is None or (value > minimum if strict else value >= minimum)


def op_overload(target: Any) -> torch._ops.OpOverload | None:
    """The torch operator ``"namespace.name.overload"`` names (``aten.addmm.default``), if any."""
    if not isinstance(target, str):
        return None
    parts = target.split(".")
    if len(parts) != 3 or not all(map(str.isidentifier, parts)):
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) and str(op) == target else None


def require(ok: bool, field: str, value: Any, rule: str) -> None:
    """Raise an :class:`ArtifactError` saying that ``field`` of an artefact, ``value``, is not
    ``rule``, unless ``ok``."""
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ArtifactError(f"{field} is {shown}, which is not {rule}")
