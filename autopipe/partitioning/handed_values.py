"""Values the generated code hands from unit to unit and no unit keeps: its locals.

A stage's (or a block's) generated ``forward`` names every value it computes and keeps it until
it returns. What autograd saves for the backward, the cost model counts as activations; what
leaves the stage, as its outputs; a unit's own intermediates, as the unit's temporaries (the
profile's). A value one unit makes and later units of the same forward read, which none of
them saves and the model does not return, is none of those: it is a local of the forward that
names it, alive until that forward returns. This module finds them, by storage: a view of a
value (a reshape before a product, a no-op ``to``) shares its storage, and the storage stays
alive while any of its names is saved, returned or sent on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["HandedValue", "handed_values"]


@dataclass(frozen=True)
class HandedValue:
    """One storage handed between units and kept by none of them: the unit that makes it, the
    units that read it (under any of its names), its bytes, and the block (by position among
    the blocks) whose own local it is where one block makes and reads it all (else -1)."""

    producer: int
    readers: tuple[int, ...]
    nbytes: float
    block: int = -1


def handed_values(
    exchanges: Sequence[tuple[str, int, Sequence[int], float]],
    savers: Sequence[Sequence[int]],
    storage_of: Mapping[str, str],
    blocks: Sequence[Sequence[int]],
    num_units: int,
) -> list[HandedValue]:
    """The storages among ``exchanges`` (``(name, producer, readers, bytes)``: producer -1 for a
    model input, a reader ``num_units`` for the model's output) that no unit saves (``savers``:
    the units saving each exchange) under any name sharing the storage (``storage_of``: each
    name's storage's owner), that the model does not return and that a unit makes (not a model
    input), each once: made by the first unit making any of its names, read by every unit
    reading one, as large as its largest name."""
    groups: dict[str, list[int]] = {}
    for e, exchange in enumerate(exchanges):
        groups.setdefault(storage_of.get(exchange[0], exchange[0]), []).append(e)
    block_of = {unit: b for b, units in enumerate(blocks) for unit in units}
    handed = []
    for members in groups.values():
        producer = min(exchanges[e][1] for e in members)
        readers = sorted({reader for e in members for reader in exchanges[e][2]})
        kept = any(savers[e] for e in members)
        if kept or producer < 0 or not readers or readers[-1] >= num_units:
            continue
        home = block_of.get(producer, -1)
        inside = home >= 0 and all(block_of.get(unit, -1) == home for unit in readers)
        handed.append(
            HandedValue(
                producer,
                tuple(readers),
                float(max(exchanges[e][3] for e in members)),
                home if inside else -1,
            )
        )
    return handed
