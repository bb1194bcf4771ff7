"""The profile artefact: forward / backward time and memory of every unit of a graph."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import torch

from ..artifacts import read_artifact, write_artifact
from ..checks import is_number, is_text, require
from ..errors import ArtifactError, AutopipeError
from ..ir import Graph
from ..ir.types import dtype_from_name, dtype_name
from .devices import DeviceSpec

PROFILE_KIND = "profile"
#: what ``--profile`` makes: costs from the device spec, or timed on this machine
PROFILE_MODES = ("analytic", "measured")
#: what a profile artefact may hold: those, or times measured in a traced training run
#: (``autopipe replan --from-trace``)
TRACED = "traced"
ARTIFACT_MODES = (*PROFILE_MODES, TRACED)


@dataclass
class UnitCost:
    """Costs of one unit for one microbatch."""

    forward: float  # seconds
    backward: float  # seconds
    flops_forward: float = 0.0
    flops_backward: float = 0.0
    bytes_forward: int = 0  # bytes operators read and write (analytic profile)
    bytes_backward: int = 0
    activations: int = 0  # bytes autograd saves for backward (storage de-duplicated)
    temporaries: int = 0  # other bytes its forward creates (held until the forward returns)
    backward_memory: int = 0  # the most bytes its backward holds at once
    #: which of its inputs and outputs it saves (positions in the unit's inputs + outputs)
    saved_values: list[int] = field(default_factory=list)
    outputs: int = 0  # bytes of the values the unit hands to other units
    #: bytes of the parameters it reads (the cost model takes from the graph which of them
    #: train: gradients and optimizer state scale with those alone)
    parameters: int = 0
    #: of ``activations``, the bf16 copies of its parameters autocast made and autograd saves
    #: (profiles for ``--bf16``; FSDP2 gathers the parameters in bf16 instead, and frees them)
    cast_parameters: int = 0
    #: of ``forward``, the seconds autocast spends casting parameters to bf16 (those copies,
    #: and the biases it does not save); FSDP2 gathers bf16 parameters instead, cast shard by
    #: shard as it copies them in (on its own stream on a GPU)
    cast_time: float = 0.0

    @property
    def time(self) -> float:
        return self.forward + self.backward


_UNIT_FIELDS = set(UnitCost.__dataclass_fields__)


def _unit_json(unit: UnitCost) -> dict:
    """A unit's costs as the artefact holds them (``cast_parameters`` and ``cast_time`` only
    where there are)."""
    data = asdict(unit)
    for name in ("cast_parameters", "cast_time"):
        if not data[name]:
            del data[name]
    return data


def _is_positions(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value)


def profile_source(mode: str, device: str, measured_on: str = "", bf16: bool = False) -> str:
    """What a profile's times describe: ``analytic profile for H100``, ``measured on cpu
    (x86_64, 1 thread), memory and link of H100``, or ``measured in the run traced in DIR (...),
    memory and link of H100``; ``, bf16 autocast`` after it for a profile for ``--bf16``."""
    precision = ", bf16 autocast" if bf16 else ""
    if mode == TRACED:
        where = measured_on or "a traced run"
        return f"measured in {where}, memory and link of {device}{precision}"
    if measured_on:
        return f"measured on {measured_on}, memory and link of {device}{precision}"
    return f"{mode} profile for {device}{precision}"


@dataclass
class Profile:
    mode: str  # "analytic" | "measured" | "traced"
    device: DeviceSpec
    units: list[UnitCost]
    graph_digest: str
    #: the local device a measured profile ran on; the run a traced profile was measured in
    measured_on: str = ""
    #: the dynamic dimensions' sizes its times are for (--expected); memory is at their upper
    #: bounds, as are times of dimensions not named here
    timed_at: dict[str, int] = field(default_factory=dict)
    #: tensor parallelism: each parameter (first name) and value (node name) of the graph that
    #: every rank holds ``1/N`` of, -> N (the cost model divides their bytes); empty without
    divided: dict[str, int] = field(default_factory=dict)
    #: profiled for train.py's ``--bf16``: every unit's forward under bf16 autocast
    #: (:mod:`.precision`)
    bf16: bool = False
    #: with ``bf16``, the values (node names) autocast makes in another dtype than the traced
    #: one (a product's output: bf16), -> that dtype: a stage holds them so, and casts those it
    #: sends back to the traced dtype
    autocast_dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    @property
    def source(self) -> str:
        """What the times describe (see :func:`profile_source`)."""
        return profile_source(self.mode, self.device.name, self.measured_on, self.bf16)

    def check_graph(self, graph: Graph) -> None:
        if self.graph_digest != graph_digest(graph) or len(self.units) != len(graph.units):
            raise ArtifactError(
                "the profile was made for a different graph (other model, depth or basic blocks); "
                "run `autopipe profile` on this graph again"
            )

    def to_json(self) -> dict:
        return (
            {
                "mode": self.mode,
                "measured_on": self.measured_on,
                "graph_digest": self.graph_digest,
                "device": self.device.to_json(),
                "units": [_unit_json(u) for u in self.units],
            }
            | ({"timed_at": dict(self.timed_at)} if self.timed_at else {})
            | ({"divided": dict(self.divided)} if self.divided else {})
            | ({"bf16": True} if self.bf16 else {})
            | (
                {"autocast_dtypes": {k: dtype_name(v) for k, v in self.autocast_dtypes.items()}}
                if self.autocast_dtypes
                else {}
            )
        )

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        """The profile a ``autopipe.profile`` payload describes, every field checked."""
        try:
            require(
                data["mode"] in ARTIFACT_MODES, "mode", data["mode"], f"one of {ARTIFACT_MODES}"
            )
            require(is_text(data["graph_digest"]), "graph_digest", data["graph_digest"], "a digest")
            measured_on = data.get("measured_on", "")
            require(is_text(measured_on), "measured_on", measured_on, "a device name")
            units = data["units"]
            require(isinstance(units, list), "units", units, "a list of unit costs")
            for index, unit in enumerate(units):
                require(
                    isinstance(unit, dict)
                    and set(unit) <= _UNIT_FIELDS
                    and {"forward", "backward"} <= set(unit)
                    and all(is_number(v, 0) for k, v in unit.items() if k != "saved_values")
                    and _is_positions(unit.get("saved_values", [])),
                    f"units[{index}]",
                    unit,
                    f"costs >= 0 with fields {sorted(_UNIT_FIELDS)}",
                )
            device = DeviceSpec.from_json(data["device"], "device")
            timed_at = data.get("timed_at", {})
            require(
                isinstance(timed_at, dict)
                and all(
                    is_text(k) and is_number(v, 2) and int(v) == v for k, v in timed_at.items()
                ),
                "timed_at",
                timed_at,
                "sizes of dynamic dimensions by name",
            )
            bf16 = data.get("bf16", False)
            require(isinstance(bf16, bool), "bf16", bf16, "true or false")
            dtypes = data.get("autocast_dtypes", {})
            require(
                isinstance(dtypes, dict)
                and all(is_text(k) and is_text(v) for k, v in dtypes.items()),
                "autocast_dtypes",
                dtypes,
                "dtype names by value name",
            )
            autocast_dtypes = {k: dtype_from_name(v) for k, v in dtypes.items()}
            divided = data.get("divided", {})
            require(
                isinstance(divided, dict)
                and all(is_text(k) and isinstance(v, int) and v >= 1 for k, v in divided.items()),
                "divided",
                divided,
                "tensor-parallel degrees (1 or more) by parameter or value name",
            )
        except KeyError as exc:
            raise ArtifactError(
                f"the profile artefact has no {exc}; run `autopipe profile` again"
            ) from None
        except AutopipeError as exc:
            raise ArtifactError(
                f"the profile artefact is invalid: {exc}; run `autopipe profile` again"
            ) from None
        return cls(
            mode=data["mode"],
            device=device,
            units=[UnitCost(**u) for u in units],
            graph_digest=data["graph_digest"],
            measured_on=measured_on,
            timed_at={k: int(v) for k, v in timed_at.items()},
            divided=dict(divided),
            bf16=bf16,
            autocast_dtypes=autocast_dtypes,
        )

    def save(self, path) -> None:
        write_artifact(path, PROFILE_KIND, self.to_json())

    @classmethod
    def load(cls, path) -> Profile:
        data = read_artifact(path, PROFILE_KIND)
        try:
            return cls.from_json(data)
        except ArtifactError as exc:
            raise ArtifactError(f"{path}: {exc}") from None


def graph_digest(graph: Graph) -> str:
    """A fingerprint of the graph, so a profile or partition is never applied to another graph."""
    return hashlib.sha256(graph.json_text().encode()).hexdigest()[:16]
