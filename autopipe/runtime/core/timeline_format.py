"""The files of a measured timeline (``train.py --trace DIR``): their format, read and written.

Copied into every generated pipeline as ``runtime/core/timeline_format.py``; it needs only the
standard library. ``runtime/timeline.py`` records a run into these objects; ``autopipe report
--run`` and ``autopipe replan`` read them back. Each rank's ``rankR.json`` is a
:class:`RankTimeline` (compact JSON, checked field by field when read); :func:`chrome_trace`
makes the Chrome / Perfetto ``trace.json`` of them all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .fields import FieldReader, is_object

__all__ = [
    "FORMAT",
    "VERSION",
    "KINDS",
    "INSTANTS",
    "RECEIVES",
    "TRANSFERS",
    "COMPUTE",
    "UNITS",
    "TENSOR_PARALLEL",
    "TRACKS",
    "Record",
    "RunLayout",
    "RankTimeline",
    "TimelineFormatError",
    "chrome_trace",
]

FORMAT, VERSION = "autopipe.timeline", 3

#: what a record measures, and its letter in the trace's event names
KINDS = {
    "forward": "F",
    "backward": "B",  # a full backward (input and weight gradients)
    "backward_input": "I",
    "backward_weight": "W",
    "send_activation": "F",  # transfers name what is sent or received, and the peer
    "send_gradient": "B",
    "recv_activation": "F",
    "recv_gradient": "B",
    "dp_reduce": "dp-reduce",  # what a stage's backward left of its data-parallel reduction
    "reduce": "reduce",  # gradients scaled, tied copies summed, the norm taken and clipped
    "optimizer": "optimizer",
    "step": "step",
    "unshard": "unshard",  # an FSDP2 unit's parameters all-gathered and copied out
    "reshard": "reshard",  # an FSDP2 unit's gathered parameters freed
    "fsdp_reduce": "fsdp-reduce",  # an FSDP2 unit's gradients reduced (reduce-scatter, all-reduce)
    "tp_gather": "tp-gather",  # tensor parallelism: DTensor's all-gather over the tp ranks
    "tp_reduce_scatter": "tp-reduce-scatter",  # ... its reduce-scatter
    "tp_all_reduce": "tp-all-reduce",  # ... its all-reduce
}
#: the transfers between stages (their records name the peer)
TRANSFERS = frozenset({"send_activation", "send_gradient", "recv_activation", "recv_gradient"})
#: the kinds recorded as instants: a send's creation (torch's schedules wait for sends later,
#: out of the stage's sight)
INSTANTS = frozenset({"send_activation", "send_gradient"})
#: the receives, recorded from their creation to the start of the action that consumes them
#: (which waits for them first): what the rank waited for its input, on a track of their own
#: (a schedule may post a receive early and compute meanwhile)
RECEIVES = frozenset({"recv_activation", "recv_gradient"})
#: the compute actions of a schedule
COMPUTE = frozenset({"forward", "backward", "backward_input", "backward_weight"})
#: FSDP2's actions on one unit (a block, or the stage's own parameters outside its blocks: the
#: unit ``""``), each within the action or reduction it happened in
UNITS = frozenset({"unshard", "reshard", "fsdp_reduce"})
#: the collectives of tensor parallelism (torch's styles, run by DTensor), each within the
#: action it happened in
TENSOR_PARALLEL = frozenset({"tp_gather", "tp_reduce_scatter", "tp_all_reduce"})
#: the tracks of a rank in the Chrome trace, by the kinds on them (the rest: "actions", 0)
TRACKS = {
    "receives": (1, RECEIVES),
    "unshard": (2, frozenset({"unshard"})),
    "reshard": (3, frozenset({"reshard"})),
    "FSDP reduce": (4, frozenset({"fsdp_reduce"})),
    "tensor parallel": (5, TENSOR_PARALLEL),
}


#: each kind's track (see TRACKS)
_TRACK_OF = {kind: tid for tid, kinds in TRACKS.values() for kind in kinds}


class TimelineFormatError(ValueError):
    """A timeline file that breaks its format; the message names the first bad field."""


#: checks of JSON values, refusing with the field's path
_read = FieldReader(TimelineFormatError, "a timeline")


@dataclass(frozen=True)
class Record:
    """One measured action: nanoseconds from the run's common origin (global rank 0's clock
    at :meth:`Timeline.align`). ``stage``, ``microbatch`` and ``peer`` are None where they do
    not apply; ``round`` is the accumulation round (``--accumulate``) of a microbatch's action;
    ``unit`` the FSDP2 unit of an FSDP2 action (:data:`UNITS`), else None."""

    step: int
    kind: str
    stage: int | None
    microbatch: int | None
    start_ns: int
    end_ns: int
    round: int = 0
    peer: int | None = None
    unit: str | None = None

    KEYS = ("step", "kind", "stage", "microbatch", "round", "peer", "unit", "start_ns", "end_ns")

    @property
    def name(self) -> str:
        """``F3 s1``: the forward of microbatch 3 at stage 1 (``F3.1 s1`` in accumulation round
        1); ``optimizer s1``, ``reduce``; ``send F3 s1 to rank 2``, ``recv B3 s1 from rank 2``;
        FSDP2's: ``unshard blocks.0 mb3 s1`` (the unit ``""`` named ``stage``); tensor
        parallelism's: ``tp-gather mb3 s1``."""
        letter = KINDS[self.kind]
        where = f" s{self.stage}" if self.stage is not None else ""
        if self.kind in UNITS:
            unit = self.unit or "stage"
            during = f" mb{self.microbatch}" if self.microbatch is not None else ""
            during += f".{self.round}" if self.round and self.microbatch is not None else ""
            return f"{letter} {unit}{during}{where}"
        if self.kind in TENSOR_PARALLEL:  # ``tp-gather mb3 s1``
            during = f" mb{self.microbatch}" if self.microbatch is not None else ""
            return f"{letter}{during}{where}"
        what = letter + (str(self.microbatch) if self.microbatch is not None else "")
        if self.round:
            what += f".{self.round}"
        if self.kind not in TRANSFERS:
            return what + where
        verb = self.kind.split("_")[0]
        peer = f" {'to' if verb == 'send' else 'from'} rank {self.peer}"
        return f"{verb} {what}{where}{peer if self.peer is not None else ''}"

    def to_json(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.KEYS}

    @classmethod
    def from_json(cls, data: object, where: str = "record") -> Record:
        fields = _read.fields(data, where, cls.KEYS)
        kind = _read.check(
            fields["kind"], f"{where}.kind", KINDS.__contains__, f"one of {list(KINDS)}"
        )
        step, start, end, round_ = (
            _read.integer(fields[k], f"{where}.{k}", minimum=0)
            for k in ("step", "start_ns", "end_ns", "round")
        )
        if end < start:
            raise TimelineFormatError(f"{where}.end_ns {end} is before start_ns {start}")
        unit = fields["unit"]
        if (unit is not None) != (kind in UNITS) or not isinstance(unit, (str, type(None))):
            raise _read.fail(f"{where}.unit", unit, "a unit's name for an FSDP2 action, else null")
        return cls(
            step=step,
            kind=kind,
            stage=_read.optional_integer(fields["stage"], f"{where}.stage"),
            microbatch=_read.optional_integer(fields["microbatch"], f"{where}.microbatch"),
            start_ns=start,
            end_ns=end,
            round=round_,
            peer=_read.optional_integer(fields["peer"], f"{where}.peer"),
            unit=unit,
        )


@dataclass(frozen=True)
class RunLayout:
    """How the traced run ran the pipeline, which a prediction of it needs: the package
    (:meth:`Pipeline.digest` of its ``pipeline.json``), the schedule, the microbatches per
    pipeline run and the runs per step (``--accumulate``), the pipeline's stage count, the
    ranks along the pipeline and across data parallelism (replicas x shards), what
    ``--recompute`` recomputed: stages whole, and blocks (by original name) one by one, and
    whether it ran ``--bf16`` (left out when not; traces from before it read as not)."""

    pipeline: str
    schedule: str
    microbatches: int
    accumulate: int
    num_stages: int
    pp_size: int
    dp_size: int
    recompute: tuple[int, ...] = ()
    recompute_blocks: tuple[str, ...] = ()
    bf16: bool = False

    KEYS = (
        "pipeline",
        "schedule",
        "microbatches",
        "accumulate",
        "num_stages",
        "pp_size",
        "dp_size",
        "recompute",
        "recompute_blocks",
    )
    COUNTS = ("microbatches", "accumulate", "num_stages", "pp_size", "dp_size")

    def to_json(self) -> dict[str, Any]:
        return (
            {key: getattr(self, key) for key in self.KEYS}
            | {
                "recompute": list(self.recompute),
                "recompute_blocks": list(self.recompute_blocks),
            }
            | ({"bf16": True} if self.bf16 else {})
        )

    @classmethod
    def from_json(cls, data: object, where: str = "timeline.run") -> RunLayout:
        fields = _read.fields(data, where, cls.KEYS, ("bf16",))
        pipeline, schedule = (
            _read.check(fields[key], f"{where}.{key}", lambda v: isinstance(v, str) and v, what)
            for key, what in (("pipeline", "a digest"), ("schedule", "a name"))
        )
        counts = {
            key: _read.integer(fields[key], f"{where}.{key}", minimum=1) for key in cls.COUNTS
        }
        recompute = _read.ints(fields["recompute"], f"{where}.recompute")
        if any(s < 0 or s >= counts["num_stages"] for s in recompute):
            raise _read.fail(f"{where}.recompute", list(recompute), "stages of the pipeline")
        blocks = _read.names(fields["recompute_blocks"], f"{where}.recompute_blocks")
        bf16 = _read.boolean(fields.get("bf16", False), f"{where}.bf16")
        return cls(
            pipeline, schedule, **counts, recompute=recompute, recompute_blocks=blocks, bf16=bf16
        )


@dataclass(frozen=True)
class RankTimeline:
    """What one rank recorded: where it sits, the stages it holds, how the run ran the pipeline,
    how far its clock is from global rank 0's (0 on rank 0's host), and its records in the order
    they started."""

    rank: int
    pp_rank: int
    dp_rank: int
    stages: tuple[int, ...]
    device: str  # "cpu" or "cuda"
    run: RunLayout
    clock_offset_ns: int
    steps: tuple[int, int]  # the traced steps, [A, B)
    records: tuple[Record, ...]

    KEYS = (
        "format",
        "version",
        "rank",
        "pp_rank",
        "dp_rank",
        "stages",
        "device",
        "run",
        "clock_offset_ns",
        "steps",
        "records",
    )

    def to_json(self) -> str:
        """Compact and byte-stable: one line, fields in a fixed order."""
        data = {
            "format": FORMAT,
            "version": VERSION,
            "rank": self.rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "stages": list(self.stages),
            "device": self.device,
            "run": self.run.to_json(),
            "clock_offset_ns": self.clock_offset_ns,
            "steps": list(self.steps),
            "records": [r.to_json() for r in self.records],
        }
        return json.dumps(data, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RankTimeline:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TimelineFormatError(f"not JSON: {exc}") from None
        where = "timeline"
        fields = _read.fields(data, where, cls.KEYS)
        _read.check(fields["format"], f"{where}.format", FORMAT.__eq__, repr(FORMAT))
        _read.check(fields["version"], f"{where}.version", VERSION.__eq__, f"{VERSION}")
        ints = {
            k: _read.integer(
                fields[k], f"{where}.{k}", minimum=None if k == "clock_offset_ns" else 0
            )
            for k in ("rank", "pp_rank", "dp_rank", "clock_offset_ns")
        }
        steps = _read.ints(fields["steps"], f"{where}.steps")
        if len(steps) != 2 or not 0 <= steps[0] <= steps[1]:
            raise _read.fail(f"{where}.steps", list(steps), "[A, B] with 0 <= A <= B")
        records = _read.items(fields["records"], f"{where}.records", is_object, "record")
        return cls(
            rank=ints["rank"],
            pp_rank=ints["pp_rank"],
            dp_rank=ints["dp_rank"],
            stages=_read.ints(fields["stages"], f"{where}.stages"),
            device=_read.check(
                fields["device"], f"{where}.device", ("cpu", "cuda").__contains__, "cpu or cuda"
            ),
            run=RunLayout.from_json(fields["run"], f"{where}.run"),
            clock_offset_ns=ints["clock_offset_ns"],
            steps=(steps[0], steps[1]),
            records=tuple(
                Record.from_json(r, f"{where}.records[{i}]") for i, r in enumerate(records)
            ),
        )


def chrome_trace(timelines: Sequence[RankTimeline]) -> str:
    """A Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev) of every rank's
    timeline: one process per rank named by its stages, a track of complete events (``X``,
    microseconds from the common origin; the step encloses its actions) with the creation of
    sends as instants, a track of the receives (from their creation to the start of the
    action that consumed them), and one per FSDP2 action (:data:`TRACKS`). Byte-stable for the
    same timelines."""
    events: list[dict[str, Any]] = []
    for timeline in sorted(timelines, key=lambda t: t.rank):
        pid = timeline.rank
        stages = ", ".join(str(s) for s in timeline.stages)
        label = f"rank {pid} (stage{'s' if len(timeline.stages) != 1 else ''} {stages})"
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}}
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "actions"}}
        )
        for name, (tid, kinds) in TRACKS.items():
            if any(record.kind in kinds for record in timeline.records):
                events.append(
                    {
                        "ph": "M",
                        "name": "thread_name",
                        "pid": pid,
                        "tid": tid,
                        "args": {"name": name},
                    }
                )
        for record in timeline.records:
            args: dict[str, Any] = {
                "step": record.step,
                "stage": record.stage,
                "microbatch": record.microbatch,
                "round": record.round,
            }
            if record.peer is not None:
                args["peer"] = record.peer
            if record.unit is not None:
                args["unit"] = record.unit
            event: dict[str, Any] = {
                "name": record.name,
                "cat": record.kind,
                "pid": pid,
                "tid": _TRACK_OF.get(record.kind, 0),
                "ts": record.start_ns / 1000,
                "args": args,
            }
            if record.kind in INSTANTS:
                event.update(ph="i", s="t")
            else:
                event.update(ph="X", dur=(record.end_ns - record.start_ns) / 1000)
            events.append(event)
    return (
        json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")) + "\n"
    )
