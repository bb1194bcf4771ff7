"""Model specs: ``FILE.py:FUNCTION`` or ``package.module:FUNCTION``.

The function takes no arguments and returns ``(model, args)``, ``(model, args, kwargs)`` or, for a
loss given with ``--loss``, ``(model, args, kwargs, target)``: the model and one example
*microbatch*. Data functions (``--data``) are loaded the same way.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch
from torch import nn

from .errors import SpecError

SPEC_FORMS = "FILE.py:FUNCTION or package.module:FUNCTION"


@dataclass
class Example:
    """A model and one example microbatch for it."""

    model: nn.Module
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: Any = None


def load_function(spec: str, what: str = "model spec") -> Callable:
    """Import the function a spec names."""
    if not isinstance(spec, str) or ":" not in spec:
        raise SpecError(f"{what} {spec!r} must have the form {SPEC_FORMS}")
    location, _, func_name = spec.rpartition(":")
    if not location or not func_name.isidentifier():
        raise SpecError(f"{what} {spec!r} must have the form {SPEC_FORMS}")
    if location.endswith(".py") or "/" in location or "\\" in location:
        module = _import_file(Path(location), what)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as exc:
            raise SpecError(
                f"{what} {spec!r}: cannot import module {location!r} ({exc}); give a file path "
                f"ending in .py or a module on PYTHONPATH"
            ) from None
    func = getattr(module, func_name, None)
    if func is None:
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise SpecError(
            f"{what} {spec!r}: {location} has no function {func_name!r} "
            f"(callables there: {', '.join(names) or 'none'})"
        )
    if not callable(func):
        raise SpecError(
            f"{what} {spec!r}: {func_name!r} is a {type(func).__name__}, not a function"
        )
    return func


def _import_file(path: Path, what: str):
    if not path.is_file():
        raise SpecError(f"{what}: file {str(path)!r} does not exist")
    resolved = path.resolve()
    name = f"_autopipe_user_{resolved.stem}_{zlib.crc32(str(resolved).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:  # no loader for its suffix
        raise SpecError(f"{what}: file {str(path)!r} is not a Python file (FILE.py)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(resolved.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise SpecError(f"{what}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def load_example(spec: str) -> Example:
    """Call a model spec's function and check what it returns."""
    func = load_function(spec)
    try:
        result = func()
    except Exception as exc:
        raise SpecError(
            f"model spec {spec!r}: calling it raised {type(exc).__name__}: {exc}"
        ) from exc
    return as_example(result, f"model spec {spec!r}")


def as_example(result: Any, where: str = "the model function") -> Example:
    """Turn ``(model, args[, kwargs[, target]])`` into an :class:`Example`, or explain what is wrong."""
    expected = "(model, args), (model, args, kwargs) or (model, args, kwargs, target)"
    if isinstance(result, Example):
        return result
    if not isinstance(result, (tuple, list)) or not 2 <= len(result) <= 4:
        raise SpecError(f"{where} returned {_describe(result)}; it must return {expected}")
    model, args, *rest = result
    kwargs = rest[0] if rest else {}
    target = rest[1] if len(rest) > 1 else None
    if not isinstance(model, nn.Module):
        raise SpecError(
            f"{where}: the first item must be a torch.nn.Module, got {_describe(model)}"
        )
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise SpecError(f"{where}: args must be a tuple of example inputs, got {_describe(args)}")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise SpecError(f"{where}: kwargs must be a dict with string keys, got {_describe(kwargs)}")
    return Example(model, tuple(args), dict(kwargs), target)


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"
