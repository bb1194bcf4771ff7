"""Profiling: forward / backward time and memory of every unit, measured or analytic."""

from __future__ import annotations

from ..errors import AutopipeError
from ..graph import Graph
from ..spec import Example
from .analytic import profile_analytic
from .devices import KNOWN_DEVICES, DeviceSpec, device_spec, with_link
from .measured import profile_measured
from .profile import PROFILE_MODES, Profile, UnitCost


def profile(
    graph: Graph,
    mode: str = "analytic",
    spec: DeviceSpec | None = None,
    example: Example | None = None,
) -> Profile:
    """Profile every unit of ``graph``: ``analytic`` (deterministic, any model size) or
    ``measured`` (runs each unit on the local device)."""
    spec = spec or device_spec()
    if mode == "analytic":
        return profile_analytic(graph, spec)
    if mode == "measured":
        return profile_measured(graph, spec, example)
    raise AutopipeError(f"unknown profile mode {mode!r}; use one of {', '.join(PROFILE_MODES)}")


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
