"""Profiling: forward / backward time and memory of every unit, measured or analytic."""

from __future__ import annotations

from ..errors import AutopipeError
from ..ir import Graph
from ..runtime.core.pipeline import Dimension
from ..spec import Example
from .analytic import profile_analytic
from .devices import KNOWN_DEVICES, DeviceSpec, device_spec, with_link
from .measured import profile_measured
from .profile import PROFILE_MODES, Profile, UnitCost

#: UnitCost fields that describe time (the rest describe memory, at the planned sizes)
TIME_FIELDS = (
    "forward",
    "backward",
    "flops_forward",
    "flops_backward",
    "bytes_forward",
    "bytes_backward",
    "cast_time",
)


def profile(
    graph: Graph,
    mode: str = "analytic",
    spec: DeviceSpec | None = None,
    example: Example | None = None,
    expected: dict[str, int] | None = None,
    bf16: bool = False,
) -> Profile:
    """Profile every unit of ``graph``: ``analytic`` (deterministic, any model size) or
    ``measured`` (runs each unit on the local device). A graph with dynamic dimensions is
    profiled at their planned sizes (upper bounds), its times at the ``expected`` sizes when
    given. ``bf16``: as train.py's ``--bf16`` runs it, its forwards under bf16 autocast
    (:mod:`.precision`)."""
    spec = spec or device_spec()
    if mode not in PROFILE_MODES:
        raise AutopipeError(f"unknown profile mode {mode!r}; use one of {', '.join(PROFILE_MODES)}")

    def run(at: Graph) -> Profile:
        if mode == "analytic":
            return profile_analytic(at, spec, bf16)
        return profile_measured(at, spec, example, bf16=bf16)

    result = run(graph)
    if not expected:
        return result
    check_expected(graph, expected)
    timed = run(graph.rebound(expected))
    for unit, at_expected in zip(result.units, timed.units):
        for name in TIME_FIELDS:
            setattr(unit, name, getattr(at_expected, name))
    result.timed_at = dict(expected)
    return result


def check_expected(graph: Graph, expected: dict[str, int]) -> None:
    """``expected`` names dynamic dimensions of ``graph``, at sizes within their bounds."""
    symbols = graph.model.symbols
    for name, size in expected.items():
        if name not in symbols:
            known = ", ".join(symbols) or "none (compile with --dynamic)"
            raise AutopipeError(
                f"--expected {name}={size}: {name} is not a dynamic dimension of the model; "
                f"its dynamic dimensions are {known}"
            )
        dimension = Dimension.from_json(symbols[name].to_json(), name, f"symbols.{name}")
        if not dimension.holds(size):
            raise AutopipeError(
                f"--expected {name}={size} is outside the bounds {dimension.bounds} of {name}"
            )


__all__ = [
    "profile",
    "Profile",
    "UnitCost",
    "DeviceSpec",
    "device_spec",
    "with_link",
    "KNOWN_DEVICES",
    "PROFILE_MODES",
]
