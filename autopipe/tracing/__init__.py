"""Tracing: capture a model with ``torch.export`` into the graph IR and group it into units."""

from .export import trace
from .units import group_units

__all__ = ["trace", "group_units"]
