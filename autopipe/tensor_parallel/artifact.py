"""The tensor-parallel regions of a graph as an artefact: typed, versioned, strictly read.

``tp_regions.json`` holds what :func:`autopipe.tensor_parallel.regions.find_regions` found: per
region its kind (attention, mlp, embedding, head), the module it is in, its column projections
(the weight, the weight's dimension of output features, and for a fused projection its
sections), its row projection, the heads and key/value heads it splits, the sizes a degree must
divide, the degrees that do, and why it is left replicated when none does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pathlib import Path

from ..artifacts import artifact_text, read_artifact, write_artifact
from ..checks import is_int, is_text, require
from ..errors import ArtifactError

__all__ = ["REGION_KINDS", "TP_REGIONS_KIND", "ColumnShard", "Region", "TensorParallelRegions"]

#: the artefact's kind (``"format": "autopipe.tp_regions"``, the artefacts' version)
TP_REGIONS_KIND = "tp_regions"
REGION_KINDS = ("attention", "mlp", "embedding", "head")


def _ints(value: Any, where: str, what: str) -> tuple[int, ...]:
    require(isinstance(value, list) and all(is_int(v, 1) for v in value), where, value, what)
    return tuple(value)


@dataclass(frozen=True)
class ColumnShard:
    """A projection split along its output features: its weight (first name), the weight's
    dimension of output features, the sections of a fused projection (empty: one), and whether
    it is the key or value projection of grouped-query attention (``key_value``: at a degree
    above the region's key/value heads it is replicated, each rank computing the head its query
    heads read)."""

    weight: str
    dim: int
    sections: tuple[int, ...]
    key_value: bool = False

    @classmethod
    def from_json(cls, data: Any, where: str) -> ColumnShard:
        require(isinstance(data, dict), where, data, "an object")
        _known(data, cls, where)
        require(is_text(data.get("weight")), f"{where}.weight", data.get("weight"), "a name")
        require(data.get("dim") in (0, 1), f"{where}.dim", data.get("dim"), "0 or 1")
        sections = _ints(data.get("sections", []), f"{where}.sections", "a list of sizes")
        key_value = data.get("key_value", False)
        require(isinstance(key_value, bool), f"{where}.key_value", key_value, "true or false")
        return cls(data["weight"], data["dim"], sections, key_value)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "weight": self.weight,
            "dim": self.dim,
            "sections": list(self.sections),
        }
        if self.key_value:
            data["key_value"] = True
        return data


@dataclass(frozen=True)
class Region:
    """One region (see the module's text); ``order``: where it starts in program order."""

    kind: str
    scope: str
    order: int
    columns: tuple[ColumnShard, ...]
    row: str  # the row projection's weight ("" for the embedding and the head)
    row_node: str
    heads: int  # 0: not attention
    kv_heads: int
    sizes: tuple[int, ...]
    degrees: tuple[int, ...]
    reason: str  # why it is left replicated ("" when a degree splits it)
    #: the views, reshapes, expansions and splits of sharded values: (node, the dimension of
    #: its result that is sharded), whose size there a rank computes locally (-1 in generated
    #: code; a split of a fused projection's output: its sections, a chunk into as many)
    reshapes: tuple[tuple[str, int], ...] = ()

    @property
    def splits(self) -> bool:
        return bool(self.degrees)

    def allows(self, degree: int) -> bool:
        return degree == 1 or degree in self.degrees

    def replicates_heads(self, degree: int) -> bool:
        """Whether ``degree`` splits the region with its key and value projections replicated
        (grouped-query attention's key/value heads fewer than the degree)."""
        return self.kv_heads > 0 and degree > self.kv_heads and degree in self.degrees

    def why_not(self, degree: int) -> str:
        """Why ``degree`` leaves the region replicated ("" if it splits it)."""
        if self.allows(degree):
            return ""
        if self.reason:
            return self.reason
        undivided = [size for size in self.sizes if size % degree]
        named = []
        for size in undivided:
            if size == self.heads:
                named.append(f"{size} heads")
            elif size == self.kv_heads:
                named.append(f"{size} key/value heads")
            else:
                named.append(f"{size}")
        return f"{degree} does not divide {', '.join(named)}"

    @classmethod
    def from_json(cls, data: Any, where: str) -> Region:
        require(isinstance(data, dict), where, data, "an object")
        _known(data, cls, where)
        require(
            data.get("kind") in REGION_KINDS, f"{where}.kind", data.get("kind"), str(REGION_KINDS)
        )
        for key in ("scope", "row", "row_node", "reason"):
            require(is_text(data.get(key, "")), f"{where}.{key}", data.get(key), "a text")
        for key in ("order", "heads", "kv_heads"):
            require(is_int(data.get(key), 0), f"{where}.{key}", data.get(key), "a count")
        columns = data.get("columns")
        require(isinstance(columns, list) and bool(columns), f"{where}.columns", columns, "a list")
        return cls(
            kind=data["kind"],
            scope=data.get("scope", ""),
            order=data["order"],
            columns=tuple(
                ColumnShard.from_json(c, f"{where}.columns[{i}]") for i, c in enumerate(columns)
            ),
            row=data.get("row", ""),
            row_node=data.get("row_node", ""),
            heads=data["heads"],
            kv_heads=data["kv_heads"],
            sizes=_ints(data.get("sizes", []), f"{where}.sizes", "a list of sizes"),
            degrees=_ints(data.get("degrees", []), f"{where}.degrees", "a list of degrees"),
            reason=data.get("reason", ""),
            reshapes=_reshapes(data.get("reshapes", []), f"{where}.reshapes"),
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["columns"] = [c.to_json() for c in self.columns]
        for key in ("sizes", "degrees"):
            data[key] = list(data[key])
        data["reshapes"] = [[node, dim] for node, dim in self.reshapes]
        return data


@dataclass(frozen=True)
class TensorParallelRegions:
    """Every region of a model's graph, in program order."""

    model: str
    regions: tuple[Region, ...]

    def degrees(self) -> tuple[int, ...]:
        """The degrees every region that splits at all allows."""
        splitting = [r for r in self.regions if r.splits]
        if not splitting:
            return ()
        common = set(splitting[0].degrees)
        for region in splitting[1:]:
            common &= set(region.degrees)
        return tuple(sorted(common))

    def replicated(self, degree: int) -> list[Region]:
        """The regions ``degree`` leaves replicated."""
        return [r for r in self.regions if not r.allows(degree)]

    def summary(self, degree: int | None = None) -> str:
        """One line: how many regions of each kind, the degrees, what stays replicated."""
        counts: dict[str, int] = {}
        for region in self.regions:
            if region.splits:
                counts[region.kind] = counts.get(region.kind, 0) + 1
        found = ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "none"
        degrees = self.degrees()
        line = f"tensor-parallel regions: {found}; degrees {', '.join(map(str, degrees)) or '-'}"
        left = [r for r in self.regions if not r.splits]
        if degree is not None:
            left = self.replicated(degree)
        if left:
            shown = "; ".join(
                f"{r.scope or r.kind}: {r.why_not(degree) if degree else r.reason}"
                for r in left[:3]
            )
            more = f" (and {len(left) - 3} more)" if len(left) > 3 else ""
            line += f"; replicated: {shown}{more}"
        return line

    def to_json(self) -> dict[str, Any]:
        """The artefact's payload (``artifact_text`` adds its format and version)."""
        return {"model": self.model, "regions": [r.to_json() for r in self.regions]}

    def text(self) -> str:
        return artifact_text(TP_REGIONS_KIND, self.to_json())

    def save(self, path: str | Path) -> None:
        write_artifact(path, TP_REGIONS_KIND, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> TensorParallelRegions:
        data = read_artifact(path, TP_REGIONS_KIND)
        try:
            return cls.from_json(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None

    @classmethod
    def from_json(cls, data: Any, where: str = "tp_regions") -> TensorParallelRegions:
        """The regions a payload describes (its format and version, if there, already
        checked by :func:`read_artifact`), every field checked."""
        require(isinstance(data, dict), where, data, "an object")
        _known(data, None, where, {"format", "version", "model", "regions"})
        require(is_text(data.get("model", "")), f"{where}.model", data.get("model"), "a name")
        regions = data.get("regions")
        require(isinstance(regions, list), f"{where}.regions", regions, "a list of regions")
        return cls(
            data.get("model", ""),
            tuple(Region.from_json(r, f"{where}.regions[{i}]") for i, r in enumerate(regions)),
        )


def _reshapes(value: Any, where: str) -> tuple[tuple[str, int], ...]:
    require(
        isinstance(value, list)
        and all(
            isinstance(p, list) and len(p) == 2 and is_text(p[0]) and is_int(p[1], 0) for p in value
        ),
        where,
        value,
        "a list of [node, dimension] pairs",
    )
    return tuple((node, dim) for node, dim in value)


def _known(data: dict[str, Any], cls: Any, where: str, keys: set[str] | None = None) -> None:
    allowed = keys if keys is not None else set(cls.__dataclass_fields__)
    for key in data:
        if key not in allowed:
            raise ArtifactError(f"{where}.{key} is not a field of the tensor-parallel regions")
