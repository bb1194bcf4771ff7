"""Checks of the JSON values the runtime's strict codecs read back.

Copied into every generated pipeline as ``runtime/core/fields.py``; it needs only the standard
library. A :class:`FieldReader` is bound to a format's error class (``pipeline.json``'s
``PipelineFormatError``, a timeline's ``TimelineFormatError``) and the name of what it reads, so
that every format refuses a bad value with the same words: the path of the field, what it must
be, and what it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

__all__ = ["FieldReader", "is_int", "is_number", "is_object", "json_kind"]


def json_kind(value: Any) -> str:
    """``null`` for None, else the Python type's name."""
    return "null" if value is None else type(value).__name__


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_object(value: Any) -> bool:
    return isinstance(value, dict)


class FieldReader:
    """Checks of JSON values raising ``error`` with the field's path (``where``); ``contract``
    names the format in the message of a field that is not one of it."""

    def __init__(self, error: Callable[[str], Exception], contract: str) -> None:
        self.error = error
        self.contract = contract

    def fail(self, where: str, value: Any, expected: str) -> Exception:
        """The error of a value that is not what ``expected`` says (shown when short)."""
        shown = repr(value) if len(repr(value)) <= 60 else f"a {json_kind(value)}"
        return self.error(f"{where} must be {expected}, got {shown}")

    def fields(
        self, data: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """``data``, checked to be a JSON object with the ``required`` keys and no unknown one."""
        if not isinstance(data, dict):
            raise self.fail(where, data, "an object")
        for key in required:
            if key not in data:
                raise self.error(f"{where}.{key} is missing")
        for key in data:
            if key not in required and key not in optional:
                raise self.error(f"{where}.{key} is not a field of {self.contract}")
        return data

    def check(self, value: Any, where: str, ok: Callable[[Any], object], expected: str) -> Any:
        if not ok(value):
            raise self.fail(where, value, expected)
        return value

    def text(self, value: Any, where: str) -> str:
        return cast(str, self.check(value, where, lambda v: isinstance(v, str), "a string"))

    def boolean(self, value: Any, where: str) -> bool:
        return cast(bool, self.check(value, where, lambda v: isinstance(v, bool), "true or false"))

    def integer(self, value: Any, where: str, minimum: int | None = None) -> int:
        """An integer, at least ``minimum`` when given."""
        return cast(int, self._at_least(value, where, is_int, "an integer", minimum))

    def number(self, value: Any, where: str, minimum: float | None = None) -> float:
        """A number (an integer or a float, not a boolean) as a float, at least ``minimum``
        when given."""
        return float(self._at_least(value, where, is_number, "a number", minimum))

    def _at_least(
        self,
        value: Any,
        where: str,
        ok: Callable[[Any], bool],
        expected: str,
        minimum: float | None,
    ) -> Any:
        """``value``, checked to be ``ok`` (``expected`` says what that is) and at least
        ``minimum`` when given."""
        if minimum is None:
            return self.check(value, where, ok, expected)
        return self.check(
            value, where, lambda v: ok(v) and v >= minimum, f"{expected} >= {minimum}"
        )

    def optional_integer(self, value: Any, where: str) -> int | None:
        return None if value is None else self.integer(value, where)

    def items(
        self, value: Any, where: str, ok: Callable[[Any], object], item: str
    ) -> tuple[Any, ...]:
        """``value``, checked to be a list of ``item``s (each one ``ok``), as a tuple."""
        self.check(value, where, lambda v: isinstance(v, list), f"a list of {item}s")
        for i, element in enumerate(value):
            self.check(element, f"{where}[{i}]", ok, f"a {item}")
        return tuple(value)

    def names(self, value: Any, where: str) -> tuple[str, ...]:
        return self.items(value, where, lambda v: isinstance(v, str), "string")

    def ints(self, value: Any, where: str) -> tuple[int, ...]:
        return self.items(value, where, is_int, "integer")

    def numbers(self, value: Any, where: str, length: int) -> tuple[float, ...]:
        numbers = self.items(value, where, is_number, "number")
        if len(numbers) != length:
            raise self.fail(where, value, f"a list of {length} numbers")
        return numbers

    def known(self, names: tuple[str, ...], where: str, known: Any, what: str) -> None:
        """Each of ``names`` is in ``known`` (``what`` says what it must be)."""
        for i, name in enumerate(names):
            if name not in known:
                raise self.error(f"{where}[{i}] = {name!r} is not {what}")
