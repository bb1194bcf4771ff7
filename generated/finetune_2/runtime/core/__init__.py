"""The runtime's core, shared by the compiler and train.py: the pipeline contract (``pipeline``),
the schedule catalogue and action orders (``schedules``), size formulas (``shapes``), the sizes
of a batch's dynamic dimensions (``dimensions``), the global ranks' places on the device mesh
(``mesh``), live-tensor memory counting (``memory``) and the run's error and message helpers
(``errors``).

Copied with the rest of ``autopipe.runtime`` into every generated pipeline, as
``runtime/core/``; it needs only torch and the standard library. The compiler imports nothing of
the runtime but this package.
"""

from __future__ import annotations

__all__: list[str] = []
