"""Device specs: what the analytic profiler and the partitioner know about the target hardware.

A spec gives peak dense FLOP/s per dtype, memory bandwidth and size, the fractions of those peaks
real kernels reach, and the two links of a cluster built of such devices: the link between the
GPUs of one node (NVLink, PCIe: ``link_bandwidth``, ``link_latency``) and each GPU's link to other
nodes (its NIC: ``network_bandwidth``, ``network_latency``; :mod:`autopipe.partitioning.network`
costs transfers and collectives over them). The table holds common GPUs (datasheet figures, dense,
per GPU; one direction; latencies per message are orders of magnitude, as NCCL's own tuning model
assumes them); ``--device-spec FILE.json`` gives any other device in the same fields. A spec
without a network (a JSON file from before it, a calibrated CPU) has nodes joined by its link.
"""

from __future__ import annotations

import bisect
import difflib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..checks import is_number, is_text
from ..errors import AutopipeError

GB = 1e9
#: the size (FLOPs, else elements written) from which an operator's rate no longer grows with
#: it on these devices: a table that reaches it extrapolates to larger calls, one that stops
#: short of it does not (:meth:`DeviceSpec.operator_time`)
SATURATED_SIZE = 65536.0
TFLOPS = 1e12
GiB = 1024**3


@dataclass(frozen=True)
class RateTable:
    """A rate measured by operation size (``autopipe calibrate``): ``points`` of (size, rate),
    sizes ascending (FLOPs of one call, or bytes it moves), rates in FLOP/s or bytes/s. Between
    two points the rate is interpolated linearly in the logarithms of both (so it lies between
    theirs), beyond the ends it is the end's."""

    points: tuple[tuple[float, float], ...]

    @cached_property
    def _sizes(self) -> list[float]:
        return [p[0] for p in self.points]

    def at(self, size: float) -> float:
        """The rate of an operation of ``size``."""
        points = self.points
        if size <= points[0][0]:
            return points[0][1]
        if size >= points[-1][0]:
            return points[-1][1]
        index = bisect.bisect_right(self._sizes, size)
        (x0, y0), (x1, y1) = points[index - 1], points[index]
        t = (math.log(size) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))

    def to_json(self) -> list[list[float]]:
        return [list(point) for point in self.points]

    @classmethod
    def from_json(cls, data: Any, where: str) -> RateTable:
        """The table ``data`` lists, checked: points of two numbers > 0, sizes ascending."""
        ok = (
            isinstance(data, list)
            and data
            and all(
                isinstance(p, list) and len(p) == 2 and all(_positive(v) for v in p) for p in data
            )
        )
        if not ok:
            raise AutopipeError(
                f"{where} must be a non-empty list of [size, rate] pairs of numbers > 0, got "
                f"{data!r}"
            )
        sizes = [p[0] for p in data]
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise AutopipeError(f"{where}: the sizes must ascend, got {sizes}")
        return cls(tuple((float(a), float(b)) for a, b in data))


#: the optimizers train.py steps with (``--optimizer``), as a spec's ``optimizer_steps`` names them
OPTIMIZERS = ("adamw", "sgd")
#: the collectives a plan costs (FSDP2's gather of parameters and reduction of gradients, the
#: all-reduce of tied gradients and of the norm), as a spec's ``collectives`` names them
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


#: the kinds of calibrated tables: matrix products, attention's forward and backward kernels
#: (causal or not) by dtype (FLOPs of a call -> FLOP/s), and streaming kernels (bytes read and
#: written -> bytes/s)
TABLE_KINDS = (
    "matmul",
    "attention",
    "causal_attention",
    "attention_backward",
    "causal_attention_backward",
    "memory",  # last: the one kind without a dtype
)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU) as the cost model sees it. A calibrated spec (``autopipe
    calibrate``) also has ``tables``: the rates its kernels reached by size, which the analytic
    profile reads instead of the peaks times the efficiencies; without them (the table of GPUs
    below, datasheet figures) the spec is uncalibrated."""

    name: str
    #: peak dense FLOP/s by dtype name ("float32", "bfloat16", ...); "default" for the rest
    flops: dict[str, float]
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes
    link_bandwidth: float  # bytes/s between two GPUs of one node (one direction)
    link: str = ""  # what the link is, for reports
    compute_efficiency: float = 0.6  # fraction of peak FLOP/s large kernels reach
    memory_efficiency: float = 0.8  # fraction of peak bandwidth streaming kernels reach
    kernel_overhead: float = 4e-6  # seconds per launched operator
    link_latency: float = 0.0  # seconds per message (per step of a collective) on the link
    #: bytes/s from one GPU to other nodes (one direction, its own NIC); None: as the link
    network_bandwidth: float | None = None
    network_latency: float | None = None  # seconds per message between nodes; None: the link's
    network: str = ""  # what the network is, for reports
    #: NICs a node has to other nodes (None: one per GPU, as DGX/HGX nodes have, rail to rail)
    nics_per_node: int | None = None
    #: seconds an operator that launches no kernel (a view, a size) costs the step: the
    #: dispatcher's time, which a CPU spends in line and a GPU hides behind its kernels
    view_overhead: float = 0.0
    #: seconds a rank waits on each action's receives from another rank, however early they
    #: were sent: torch's schedules post an action's receives when it needs them, and the
    #: transfers' handshake then waits for the sender (on a CPU whose ranks fill its cores, for
    #: the busy sender's transfer thread to get a core; ``autopipe calibrate`` measures it)
    receive_overhead: float = 0.0
    #: what an optimizer step costs, by optimizer ("adamw", "sgd"), as train.py runs torch's (a
    #: few operators over many tensors on a GPU, each tensor's operators in turn on a CPU):
    #: parameter bytes updated per second by the size of the tensors (bytes), measured by
    #: ``autopipe calibrate``. Small tensors cost their operators' launches; a CPU's tensors that
    #: fit its caches update faster than those streamed from memory. Without it, the cost model
    #: streams the optimizer's traffic at the memory rate.
    optimizer_steps: dict[str, RateTable] = field(default_factory=dict)
    #: what a collective over ranks of one node costs, by kind (:data:`COLLECTIVES`), as
    #: ``autopipe calibrate`` measures it between two ranks (gloo between two processes on a
    #: CPU, where a collective reaches a fraction of its send and receive's rate): the bytes
    #: each rank sends per second (the bus bandwidth: a ring all-reduce of ``n`` bytes over
    #: ``k`` ranks sends ``2 (k - 1) / k x n``, an all-gather of ``n`` gathered bytes
    #: ``(k - 1) / k x n``) by those bytes, the two ranks' latencies included. Without it, the
    #: ring over ``link_bandwidth`` and ``link_latency`` (:mod:`autopipe.partitioning.network`).
    collectives: dict[str, RateTable] = field(default_factory=dict)
    #: the kind of device its kernels are: "cuda" (a GPU, whose attention runs a fused kernel
    #: that keeps no probabilities for the backward) or "cpu" (torch's CPU kernels)
    device_type: str = "cuda"
    #: measured rates by kind and dtype ("matmul.float32", "attention.bfloat16", "memory"), and
    #: by operator ("op.gelu.float32", a CPU's: :mod:`.operator_rates`)
    tables: dict[str, RateTable] = field(default_factory=dict)
    #: the datasheet's peak dense FLOP/s by dtype, what MFU is measured against where ``flops``
    #: holds the rates a calibration measured (a GPU of the table calibrated); empty: ``flops``
    datasheet_flops: dict[str, float] = field(default_factory=dict)

    @property
    def calibrated(self) -> bool:
        """Whether the spec holds measured rates (else datasheet peaks and efficiencies)."""
        return bool(self.tables)

    def shared_by(self, processes: int) -> DeviceSpec:
        """The device as each of ``processes`` ranks on one node has it: a CPU's memory is the
        node's, which its processes share; a GPU's memory is its own (the spec unchanged)."""
        if self.device_type != "cpu" or processes <= 1:
            return self
        return replace(self, memory=self.memory / processes)

    def compute_rate(self, kind: str | None, dtype: torch.dtype | None, flops: float) -> float:
        """FLOP/s an operator of ``kind`` (matmul, attention, None for the rest) reaches on
        ``flops`` in ``dtype``: the calibrated table's, else the peak times the efficiency."""
        name = str(dtype).removeprefix("torch.") if dtype is not None else "default"
        table = self.tables.get(f"{kind}.{name}") if kind is not None else None
        if table is not None:
            return table.at(flops)
        return self.peak_flops(dtype) * self.compute_efficiency

    def operator_time(
        self, name: str, dtype: torch.dtype | None, size: float, kind: str | None
    ) -> float | None:
        """Seconds of operator ``name`` of ``size`` (its FLOPs, else the elements it writes:
        :func:`~autopipe.profiling.operator_rates.operator_size`) by its own table, measured
        on the layers of models (``op.NAME.DTYPE``), where the table reaches that size, or
        has it alone (no table of its ``kind`` does) and either covers the size or reaches
        :data:`SATURATED_SIZE` (a rate measured on tiny calls alone says nothing of large
        ones); None otherwise."""
        table = self.tables.get(f"op.{name}.{str(dtype).removeprefix('torch.')}")
        if table is None:
            return None
        smallest, largest = table.points[0][0], table.points[-1][0]
        covered = smallest / 2 <= size <= largest * 2
        name_of = str(dtype).removeprefix("torch.")
        if not covered and kind is not None and f"{kind}.{name_of}" in self.tables:
            return None  # the kind's table reaches further
        if size > largest * 2 and largest < SATURATED_SIZE:
            # measured only where the call's fixed cost is its time (a loss's gradient seed of
            # one element): its rate says nothing of a large call, which the roofline times
            return None
        return size / table.at(size)

    def operator_seconds(
        self,
        name: str | None,
        dtype: torch.dtype | None,
        size: float,
        moved: float,
        flops: float = 0.0,
        kind: str | None = None,
    ) -> float:
        """Seconds of one launch of operator ``name`` (of ``size``: its FLOPs, else the
        elements it writes; ``moved`` bytes read and written; ``kind`` its table's, None for an
        operator of no table kind): by its own table (:meth:`operator_time`, with the caller's
        dispatch; no name: none), else the roofline, the slower of its FLOPs at the compute rate
        and its bytes at the memory rate, with a launch. The analytic profile times every
        operator so."""
        measured = None if name is None else self.operator_time(name, dtype, size, kind)
        if measured is not None:
            return measured + self.view_overhead
        compute = flops / self.compute_rate(kind, dtype, flops)
        memory = moved / self.memory_rate(moved) if moved else 0.0
        return max(compute, memory) + self.kernel_overhead

    def memory_rate(self, nbytes: float) -> float:
        """Bytes/s a streaming operator moving ``nbytes`` reaches."""
        table = self.tables.get("memory")
        if table is not None:
            return table.at(nbytes)
        return self.memory_bandwidth * self.memory_efficiency

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        return _by_dtype(self.flops, dtype)

    def utilisation_peak(self, dtype: torch.dtype | None) -> float:
        """The peak FLOP/s a model FLOPs utilisation is reckoned against: the datasheet's where
        the spec keeps it apart from measured rates, else :meth:`peak_flops`."""
        return _by_dtype(self.datasheet_flops or self.flops, dtype)

    def to_json(self) -> dict:
        data = asdict(self)
        data["tables"] = {kind: table.to_json() for kind, table in self.tables.items()}
        data["optimizer_steps"] = {k: t.to_json() for k, t in self.optimizer_steps.items()}
        data["collectives"] = {k: t.to_json() for k, t in self.collectives.items()}
        # a spec without measurements has none
        for optional in ("tables", "optimizer_steps", "collectives", "datasheet_flops"):
            if not data[optional]:
                del data[optional]
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "device spec") -> DeviceSpec:
        """The spec ``data`` describes, every field checked (``where`` names it in errors)."""
        if not isinstance(data, dict):
            raise AutopipeError(f"{where} must be a JSON object, got {type(data).__name__}")
        required = {"name", "flops", "memory_bandwidth", "memory", "link_bandwidth"}
        missing = sorted(required - set(data))
        if missing:
            raise AutopipeError(
                f"{where} is missing {', '.join(missing)} (needs {', '.join(sorted(required))})"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutopipeError(
                f"{where} has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        for name, (ok, rule) in _FIELD_RULES.items():
            if name in data and not ok(data[name]):
                raise AutopipeError(f"{where}: {name} must be {rule}, got {data[name]!r}")
        for peaks in ("flops", "datasheet_flops"):
            flops = data.get(peaks, {})
            bad = next((k for k, v in flops.items() if not is_number(v, 0, strict=True)), None)
            if bad is not None:
                raise AutopipeError(
                    f"{where}: {peaks}[{bad!r}] must be a finite number of FLOP/s > 0, got "
                    f"{flops[bad]!r}"
                )
            if flops and not {"default", "float32"} & set(flops):
                raise AutopipeError(f'{where}: {peaks} needs a "default" or "float32" entry')
        flops = data["flops"]
        tables = data.get("tables", {})
        if not isinstance(tables, dict):
            raise AutopipeError(f"{where}: tables must be an object of rate tables by kind")
        for kind in tables:
            if not _table_key(kind):
                raise AutopipeError(
                    f"{where}: tables[{kind!r}] is not a kind of table: memory, or "
                    f"{', '.join(TABLE_KINDS[:-1])} with a dtype (matmul.bfloat16)"
                )
        steps = data.get("optimizer_steps", {})
        if not isinstance(steps, dict) or not set(steps) <= set(OPTIMIZERS):
            raise AutopipeError(
                f"{where}: optimizer_steps must be an object of steps by optimizer "
                f"({', '.join(OPTIMIZERS)}), got {steps!r}"
            )
        collectives = data.get("collectives", {})
        if not isinstance(collectives, dict) or not set(collectives) <= set(COLLECTIVES):
            raise AutopipeError(
                f"{where}: collectives must be an object of rates by collective "
                f"({', '.join(COLLECTIVES)}), got {collectives!r}"
            )
        return cls(
            **(
                data
                | {"flops": dict(flops), "datasheet_flops": dict(data.get("datasheet_flops", {}))}
            )
            | {
                "tables": {
                    kind: RateTable.from_json(table, f"{where}: tables[{kind!r}]")
                    for kind, table in tables.items()
                },
                "optimizer_steps": {
                    name: RateTable.from_json(table, f"{where}: optimizer_steps[{name!r}]")
                    for name, table in steps.items()
                },
                "collectives": {
                    kind: RateTable.from_json(table, f"{where}: collectives[{kind!r}]")
                    for kind, table in collectives.items()
                },
            }
        )


def _table_key(key: Any) -> bool:
    """``memory``, a compute kind and a torch dtype (``matmul.bfloat16``), or an operator and
    a dtype (``op.gelu.float32``)."""
    if key == "memory":
        return True
    kind, _, rest = str(key).partition(".")
    if kind == "op":
        name, _, dtype = rest.rpartition(".")
        return bool(name) and isinstance(getattr(torch, dtype, None), torch.dtype)
    return kind in TABLE_KINDS[:-1] and isinstance(getattr(torch, rest, None), torch.dtype)


def _positive(value: Any) -> bool:
    return is_number(value, 0, strict=True)


def _fraction(value: Any) -> bool:
    return _positive(value) and value <= 1


def _by_dtype(flops: dict[str, float], dtype: torch.dtype | None) -> float:
    """The FLOP/s of ``dtype`` in a table of FLOP/s by dtype name, else its default."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else "default"
    peak = flops.get(name, flops.get("default", flops.get("float32")))
    assert peak is not None  # every table has a "default" or "float32" entry (from_json checks)
    return peak


#: field -> (check, what it must be); flops values are checked on their own
_FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (lambda v: is_text(v) and bool(v), "a non-empty one-line name"),
    "flops": (
        lambda v: isinstance(v, dict) and bool(v) and all(map(is_text, v)),
        'an object of FLOP/s by dtype name ({"float32": ..., "default": ...})',
    ),
    "datasheet_flops": (
        lambda v: isinstance(v, dict) and all(map(is_text, v)),
        'an object of FLOP/s by dtype name ({"float32": ..., "default": ...}), or {}',
    ),
    "memory_bandwidth": (_positive, "a finite number of bytes/s > 0"),
    "memory": (_positive, "a finite number of bytes > 0"),
    "link_bandwidth": (_positive, "a finite number of bytes/s > 0"),
    "link": (is_text, "a one-line description"),
    "compute_efficiency": (_fraction, "a fraction in (0, 1]"),
    "memory_efficiency": (_fraction, "a fraction in (0, 1]"),
    "kernel_overhead": (lambda v: is_number(v, 0), "a finite number of seconds >= 0"),
    "link_latency": (lambda v: is_number(v, 0), "a finite number of seconds >= 0"),
    "network_bandwidth": (
        lambda v: v is None or _positive(v),
        "a finite number of bytes/s > 0 (or null: nodes joined by the link)",
    ),
    "network_latency": (
        lambda v: v is None or is_number(v, 0),
        "a finite number of seconds >= 0 (or null: the link's)",
    ),
    "network": (is_text, "a one-line description"),
    "device_type": (lambda v: v in ("cuda", "cpu"), '"cuda" (a GPU) or "cpu"'),
    "view_overhead": (lambda v: is_number(v, 0), "a finite number of seconds >= 0"),
    "receive_overhead": (lambda v: is_number(v, 0), "a finite number of seconds >= 0"),
    "nics_per_node": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        "a number of NICs (1 or more), or null: one per GPU",
    ),
}


@dataclass(frozen=True)
class KnownLink:
    """A link of the table: bytes/s one direction per GPU, and seconds per message."""

    bandwidth: float
    latency: float
    label: str
    per_gpu: bool = True  # a NIC per GPU (InfiniBand, RoCE rails), else one per node


#: Links by ``--link`` / ``--network`` name: NVLink and PCIe between the GPUs of a node; the
#: NIC each GPU has to other nodes (InfiniBand, RoCE, Ethernet), per GPU
KNOWN_LINKS: dict[str, KnownLink] = {
    "nvlink5": KnownLink(900 * GB, 2e-6, "NVLink 5"),
    "nvlink4": KnownLink(450 * GB, 2e-6, "NVLink 4"),
    "nvlink3": KnownLink(300 * GB, 2e-6, "NVLink 3"),
    "nvlink2": KnownLink(150 * GB, 3e-6, "NVLink 2"),
    "pcie5": KnownLink(64 * GB, 3e-6, "PCIe 5 x16"),
    "pcie4": KnownLink(32 * GB, 3e-6, "PCIe 4 x16"),
    "pcie3": KnownLink(16 * GB, 3e-6, "PCIe 3 x16"),
    "ib-xdr": KnownLink(100 * GB, 5e-6, "InfiniBand XDR 800 Gb/s per GPU"),
    "ib-ndr": KnownLink(50 * GB, 5e-6, "InfiniBand NDR 400 Gb/s per GPU"),
    "ib-hdr": KnownLink(25 * GB, 5e-6, "InfiniBand HDR 200 Gb/s per GPU"),
    "ib-edr": KnownLink(12.5 * GB, 5e-6, "InfiniBand EDR 100 Gb/s per GPU"),
    "roce-400g": KnownLink(50 * GB, 8e-6, "RoCE 400 Gb/s per GPU"),
    "ethernet-100g": KnownLink(12.5 * GB, 15e-6, "Ethernet 100 Gb/s per node", per_gpu=False),
    "ethernet-25g": KnownLink(3.125 * GB, 20e-6, "Ethernet 25 Gb/s per node", per_gpu=False),
}


def _gpu(
    name, fp32, tf32, half, bandwidth, memory, link, network, fp8=None, fp64=None
) -> DeviceSpec:
    flops = {
        "float32": fp32 * TFLOPS,
        "tfloat32": tf32 * TFLOPS,
        "bfloat16": half * TFLOPS,
        "float16": half * TFLOPS,
    }
    if fp8:
        flops["float8_e4m3fn"] = flops["float8_e5m2"] = fp8 * TFLOPS
    if fp64:
        flops["float64"] = fp64 * TFLOPS
    flops["default"] = fp32 * TFLOPS
    node, between = KNOWN_LINKS[link], KNOWN_LINKS[network]
    return DeviceSpec(
        name,
        flops,
        bandwidth * GB,
        memory * GiB,
        node.bandwidth,
        node.label,
        link_latency=node.latency,
        network_bandwidth=between.bandwidth,
        network_latency=between.latency,
        network=between.label,
        nics_per_node=None if between.per_gpu else 1,
    )


#: Devices of the table by datasheet, by lower-case name: dense peaks; the link between the GPUs of
#: a node and each GPU's NIC of the systems they are usually built into (DGX/HGX: one 400 Gb/s NIC
#: per H100, H200 or B200, 200 Gb/s per A100)
DATASHEET_DEVICES: dict[str, DeviceSpec] = {
    spec.name.lower(): spec
    for spec in [
        _gpu("H100", 67, 495, 989, 3350, 80, "nvlink4", "ib-ndr", fp8=1979, fp64=67),
        _gpu("H100-PCIe", 51, 378, 756, 2000, 80, "pcie5", "ib-ndr", fp8=1513, fp64=51),
        _gpu("H200", 67, 495, 989, 4800, 141, "nvlink4", "ib-ndr", fp8=1979, fp64=67),
        _gpu("B200", 80, 1100, 2250, 8000, 180, "nvlink5", "ib-ndr", fp8=4500, fp64=40),
        _gpu("A100", 19.5, 156, 312, 2039, 80, "nvlink3", "ib-hdr", fp64=19.5),
        _gpu("A100-40GB", 19.5, 156, 312, 1555, 40, "nvlink3", "ib-hdr", fp64=19.5),
        _gpu("L40S", 91.6, 183, 362, 864, 48, "pcie4", "ethernet-100g", fp8=733),
        _gpu("L4", 30.3, 60, 121, 300, 24, "pcie4", "ethernet-100g", fp8=242),
        _gpu("A10G", 31.2, 62.5, 125, 600, 24, "pcie4", "ethernet-100g"),
        _gpu("RTX4090", 82.6, 82.6, 165, 1008, 24, "pcie4", "ethernet-100g", fp8=330),
        _gpu("V100", 15.7, 15.7, 125, 900, 32, "nvlink2", "ib-edr", fp64=7.8),
        _gpu("T4", 8.1, 8.1, 65, 320, 16, "pcie3", "ethernet-25g"),
    ]
}

#: calibrated specs committed with autopipe (``autopipe calibrate`` on one of the table's GPUs,
#: ``benchmarks/gpu.py``'s ``calibrated.json``), one per device: ``<name>.json``, the table's
#: lower-case name
CALIBRATED_SPECS = Path(__file__).resolve().parent / "specs"


def known_devices(folder: Path = CALIBRATED_SPECS) -> dict[str, DeviceSpec]:
    """The table's devices: each one's calibrated spec where ``folder`` holds one (as
    ``autopipe calibrate`` wrote it on one such GPU: its measured rates and memory, the links of
    the nodes the table's device is built into; under the table's name), else its datasheet
    figures."""
    devices = dict(DATASHEET_DEVICES)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        key = path.stem.lower()
        where = f"calibrated device spec {path}"
        if key not in DATASHEET_DEVICES:
            known = ", ".join(sorted(DATASHEET_DEVICES))
            raise AutopipeError(f"{where}: {path.stem!r} is not a device of the table ({known})")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise AutopipeError(f"{where} cannot be read: {exc}") from None
        spec = DeviceSpec.from_json(data, where)
        if not spec.calibrated:
            raise AutopipeError(f"{where} holds no measured tables: it is not calibrated")
        datasheet = DATASHEET_DEVICES[key]
        devices[key] = replace(
            spec, name=datasheet.name, datasheet_flops=spec.datasheet_flops or datasheet.flops
        )
    return devices


#: Known devices, by lower-case name: the table's, calibrated where autopipe ships a spec
KNOWN_DEVICES: dict[str, DeviceSpec] = known_devices()

DEFAULT_DEVICE = "h100"
#: ``--device-spec`` names of this machine's own devices, calibrated on first use
#: (:func:`autopipe.profiling.calibrate.resolve_device_spec`)
LOCAL_DEVICES = ("cpu", "cuda")


def device_spec(name_or_path: str | None = None) -> DeviceSpec:
    """A spec by table name (case-insensitive) or from a JSON file."""
    if name_or_path is not None and not isinstance(name_or_path, str):
        raise AutopipeError(f"a device spec is a name or a JSON file, got {name_or_path!r}")
    key = (name_or_path or DEFAULT_DEVICE).strip()
    if key.lower() in KNOWN_DEVICES:
        return KNOWN_DEVICES[key.lower()]
    path = Path(key)
    if path.suffix == ".json" or path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise AutopipeError(f"device spec file {key} does not exist") from None
        except (OSError, ValueError) as exc:
            raise AutopipeError(f"device spec file {key} is not a valid spec: {exc}") from None
        return DeviceSpec.from_json(data, f"device spec file {key}")
    shown = {name: spec.name for name, spec in KNOWN_DEVICES.items()}
    shown |= {name: name for name in LOCAL_DEVICES}
    close = difflib.get_close_matches(key.lower(), shown, n=1)
    guess = f" (did you mean {shown[close[0]]}?)" if close else ""
    known = ", ".join(spec.name for spec in KNOWN_DEVICES.values())
    raise AutopipeError(
        f"unknown device {key!r}{guess}; known devices: {known}; "
        f"{' or '.join(LOCAL_DEVICES)} for this machine's own (calibrated on first use); or give "
        "a JSON spec file"
    )


def known_link(link: str | float, flag: str = "--link") -> tuple[float, float | None, str]:
    """Bytes/s, seconds per message (None: not known, for a bare bandwidth) and a label for
    ``--link`` / ``--network``: a known link name or a bandwidth in GB/s."""
    if isinstance(link, str) and link.strip().lower() in KNOWN_LINKS:
        known = KNOWN_LINKS[link.strip().lower()]
        return known.bandwidth, known.latency, link.strip().lower()
    try:
        gbps = float(link) if isinstance(link, (str, int, float)) else math.nan
    except ValueError:
        gbps = math.nan
    if isinstance(link, bool) or not is_number(gbps, 0, strict=True):
        raise AutopipeError(
            f"{flag} {link!r} is neither a known link ({', '.join(KNOWN_LINKS)}) nor a "
            "bandwidth in GB/s greater than 0"
        )
    return gbps * GB, None, f"{link} GB/s"


def link_bandwidth(link: str | float) -> tuple[float, str]:
    """Bytes/s and a label for ``--link``: a known link name or a bandwidth in GB/s."""
    bandwidth, _, label = known_link(link)
    return bandwidth, label


def with_link(
    spec: DeviceSpec, link: str | float | None, network: str | float | None = None
) -> DeviceSpec:
    """The spec with the link between the GPUs of a node replaced (``--link nvlink4`` or a GB/s
    number) and the link from each GPU to other nodes (``--network ib-ndr`` or GB/s); a bare
    bandwidth keeps the latency the spec had. A new link drops the collectives measured over
    the old one (a calibrated CPU's): its collectives are then the ring over the new link."""
    changed: dict[str, Any] = {}
    if link is not None and link != "":
        bandwidth, latency, label = known_link(link)
        changed |= {"link_bandwidth": bandwidth, "link": label, "collectives": {}}
        if latency is not None:
            changed["link_latency"] = latency
    if network is not None and network != "":
        bandwidth, latency, label = known_link(network, "--network")
        changed |= {"network_bandwidth": bandwidth, "network": label}
        if isinstance(network, str) and network.strip().lower() in KNOWN_LINKS:
            per_gpu = KNOWN_LINKS[network.strip().lower()].per_gpu
            changed["nics_per_node"] = None if per_gpu else 1
        if latency is not None:
            changed["network_latency"] = latency
    if not changed:
        return spec
    return DeviceSpec.from_json(spec.to_json() | changed)
