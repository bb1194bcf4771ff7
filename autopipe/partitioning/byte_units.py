"""Byte counts in readable binary units, as messages to the user quote them."""

from __future__ import annotations

__all__ = ["format_bytes", "format_bytes_each"]

#: binary units, largest first
UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches, three significant digits:
    ``1.25 GiB``, ``842 MiB``, ``12.5 MiB``, ``3.00 KiB``, ``512 B``."""
    for unit, size in UNITS:
        if abs(nbytes) >= size:
            value = nbytes / size
            digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
            return f"{value:.{digits}f} {unit}"
    return f"{nbytes:.0f} B"


def format_bytes_each(values: list[float], noun: str) -> str:
    """Bytes of each of ``noun`` 0, 1, ...: ``3.00 MiB on stage 0 and 2.50 MiB on stage 1``,
    ``1.00 GiB, 900 MiB and 800 MiB on ranks 0 to 2``."""
    sizes = [format_bytes(v) for v in values]
    if len(sizes) == 1:
        return f"{sizes[0]} on {noun} 0"
    if len(sizes) == 2:
        return f"{sizes[0]} on {noun} 0 and {sizes[1]} on {noun} 1"
    return f"{', '.join(sizes[:-1])} and {sizes[-1]} on {noun}s 0 to {len(sizes) - 1}"
