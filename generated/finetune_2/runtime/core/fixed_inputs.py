"""Inputs of the example that are not tensors: fixed in the pipeline, checked in every batch.

Copied into every generated pipeline as ``runtime/core/fixed_inputs.py``; it needs only torch.
torch.export specialises a forward argument that holds no tensor (a Python list of lengths, a
scale, a flag, a None) to its value in the example: the graph computes with that value, and the
generated stages do not take the argument at all; so is an argument the example leaves at its
default. A batch passing another value would be trained on silently as if it passed the
example's. The pipeline contract therefore records each such value (``pipeline.json``'s
``fixed_inputs``), and train.py (every step's batch) and ``autopipe verify`` (the example)
refuse a batch whose value differs, naming the input, both values and the fix. A batch may
leave such an argument out where the recorded value is what the forward's default gives it (the
stages compute with the recorded value, the model with its default: the same); where the
example passed another value than the default, or the forward has no default for it, the
record also holds the default (``"default"``: its ``repr``, or null where there is none), and a
batch that leaves the argument out is refused: the model would compute with its default, the
pipeline with the example's value. Records without ``"default"`` (pipelines compiled before
defaults were recorded) let a batch leave the argument out, as they did.

A value is recorded as JSON where it has a JSON form (None, booleans, numbers, strings, and
lists, tuples and string-keyed dicts of them: tuples read back as lists), else as its ``repr``
where that says what it is (a dtype, a device, an enum), compared as such; other objects are
not recorded.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import PipelineRunError
from .fields import FieldReader, is_object

__all__ = ["FixedInput", "check_fixed_inputs", "fixed_inputs_from_json"]


#: the kinds of values without a JSON form recorded (and compared) by their ``repr``
_BY_REPR = (float, complex, torch.dtype, torch.device, torch.memory_format, enum.Enum)


def _said_by_repr(value: Any) -> bool:
    """Whether ``repr(value)`` says all of it: plain values and the kinds of
    :data:`_BY_REPR`, and lists, tuples and dicts of them."""
    if value is None or isinstance(value, (bool, int, str, *_BY_REPR)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_said_by_repr, value))
    if isinstance(value, dict):
        return all(_said_by_repr(k) and _said_by_repr(v) for k, v in value.items())
    return False


class _NoJsonForm(Exception):
    """A value without a JSON form (recorded by its ``repr``)."""


def _json_form(value: Any) -> Any:
    """``value`` as JSON would hold it (tuples as lists); raises :class:`_NoJsonForm`."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _NoJsonForm  # JSON has no NaN or infinity
        return value
    if isinstance(value, (list, tuple)):
        return [_json_form(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_form(v) for k, v in value.items()}
    raise _NoJsonForm


def _described(value: Any) -> str:
    """A batch's value in a message: a tensor by its shape, anything else by its (short) repr."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


@dataclass(frozen=True)
class FixedInput:
    """A forward argument the example passed without tensors: its JSON ``value``, or where it
    has no JSON form its ``text`` (``repr``) and ``value`` None. ``required``: a batch must pass
    it, as the forward's default (``default``, its ``repr``; None where the forward has none)
    is not the recorded value."""

    name: str
    value: Any = None
    text: str | None = None
    required: bool = False
    default: str | None = None

    @classmethod
    def of(cls, name: str, value: Any) -> FixedInput | None:
        """The record of ``value``, passed as the argument ``name``: its JSON form, or the
        ``repr`` of a value whose ``repr`` says what it is (a dtype, a device, an enum, a
        float that JSON cannot hold, and lists, tuples and dicts of such values and plain
        ones); None for other objects (not checked)."""
        try:
            return cls(name, _json_form(value))
        except _NoJsonForm:
            if _said_by_repr(value):
                return cls(name, None, repr(value))
            return None

    def beside_default(self, default: Any, has_default: bool = True) -> FixedInput:
        """This record, told the forward's ``default`` for the argument (``has_default``
        False: the forward has none): a default that computes as the recorded value changes
        nothing, another makes the argument ``required``."""
        if has_default and self.matches(default):
            return self
        shown = _described(default) if has_default else None
        return FixedInput(self.name, self.value, self.text, True, shown)

    def matches(self, value: Any) -> bool:
        """Whether a batch passing ``value`` computes what the pipeline computes."""
        if self.text is not None:
            return not isinstance(value, torch.Tensor) and repr(value) == self.text
        try:
            form = _json_form(value)
        except _NoJsonForm:
            return False
        return bool(form == self.value) and _kinds(form) == _kinds(self.value)

    @property
    def shown(self) -> str:
        """The recorded value, as the example's code would write it."""
        return self.text if self.text is not None else repr(self.value)

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = (
            {"repr": self.text} if self.text is not None else {"value": self.value}
        )
        if self.required:
            record["default"] = self.default
        return record


#: the keys a record may hold: the value's (one of them), and the forward's default where it
#: differs from the value
_RECORD_KEYS = (["value"], ["repr"], ["default", "value"], ["default", "repr"])


def fixed_inputs_from_json(data: Any, where: str, read: FieldReader) -> dict[str, FixedInput]:
    """A ``fixed_inputs`` record (``{name: {"value": JSON} | {"repr": text}}``, each with
    ``"default"``, the forward's default as its ``repr`` or null, where a batch must pass the
    argument), checked by ``read`` (the reader of the format holding it)."""
    read.check(data, where, is_object, "an object")
    fixed = {}
    for name, record in data.items():
        at = f"{where}.{name}"
        read.check(name, at, str.isidentifier, "named by an argument of forward")
        read.check(
            record,
            at,
            lambda v: is_object(v) and sorted(v) in _RECORD_KEYS,
            '{"value": the example\'s value} or {"repr": its repr}, with "default" or without',
        )
        required = "default" in record
        default = record.get("default")
        if default is not None:
            read.text(default, f"{at}.default")
        if "repr" in record:
            text = read.text(record["repr"], f"{at}.repr")
            fixed[name] = FixedInput(name, None, text, required, default)
        else:
            fixed[name] = FixedInput(name, record["value"], None, required, default)
    return fixed


def _kinds(form: Any) -> Any:
    """``form``'s structure with its leaves' kinds: None, a boolean and a number differ (True
    == 1 in Python, but a flag and a count are different arguments); integers and floats
    do not (the graph computes with either)."""
    if isinstance(form, list):
        return [_kinds(v) for v in form]
    if isinstance(form, dict):
        return {k: _kinds(v) for k, v in form.items()}
    if isinstance(form, bool):
        return "bool"
    return "number" if isinstance(form, (int, float)) else type(form).__name__


def check_fixed_inputs(
    fixed: Mapping[str, FixedInput], given: Mapping[str, Any], where: str
) -> None:
    """Refuse inputs ``given`` (by name) whose value differs from the one the pipeline was
    compiled with (``fixed``), and the absence of one that must be passed (the forward's default
    differs from that value); another input not given is not checked (the stages compute with
    the recorded value, which is the forward's default)."""
    for name, record in fixed.items():
        if name not in given and record.required:
            compiled = f"{name}={record.shown}"
            if record.default is not None:
                why = (
                    f"the forward's default is {name}={record.default}: the model would compute "
                    f"with {name}={record.default}, the pipeline computes with {compiled}. Pass "
                    f"{compiled} in every batch, or compile again with an example that leaves "
                    f"{name} at its default"
                )
            else:
                why = (
                    "the forward has no default for it (the model cannot be called without "
                    f"it). Pass {compiled} in every batch"
                )
            raise PipelineRunError(
                f"{where}: input {name!r} is left out, but the pipeline was compiled with "
                f"{compiled} (the example's value) and {why}"
            )
        if name in given and not record.matches(given[name]):
            raise PipelineRunError(
                f"{where}: input {name!r} is {_described(given[name])}, but the pipeline was "
                f"compiled with {name}={record.shown}: torch.export fixes an argument that "
                "holds no tensor to the example's value, and the stages compute with it. Pass "
                f"{name}={record.shown}; to vary it, pass it as a tensor (e.g. "
                f"torch.tensor(...)) in the example and the batches, and compile again"
            )
