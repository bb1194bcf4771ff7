"""Device specs: what the analytic profiler and the partitioner know about the target hardware.

A spec gives peak dense FLOP/s per dtype, memory bandwidth and size, the bandwidth of the link
between pipeline stages, and the fractions of those peaks real kernels reach. The table holds
common GPUs (datasheet figures, dense, per GPU); ``--device-spec FILE.json`` gives any other
device in the same fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..checks import is_number, is_text
from ..errors import AutopipeError

GB = 1e9
TFLOPS = 1e12
GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU) as the cost model sees it."""

    name: str
    #: peak dense FLOP/s by dtype name ("float32", "bfloat16", ...); "default" for the rest
    flops: dict[str, float]
    memory_bandwidth: float  # bytes/s
    memory: float  # bytes
    link_bandwidth: float  # bytes/s between two pipeline stages (one direction)
    link: str = ""  # what the link is, for reports
    compute_efficiency: float = 0.6  # fraction of peak FLOP/s large kernels reach
    memory_efficiency: float = 0.8  # fraction of peak bandwidth streaming kernels reach
    kernel_overhead: float = 4e-6  # seconds per launched operator

    def peak_flops(self, dtype: torch.dtype | None) -> float:
        name = str(dtype).removeprefix("torch.") if dtype is not None else "default"
        peak = self.flops.get(name, self.flops.get("default", self.flops.get("float32")))
        assert peak is not None  # every spec has a "default" or "float32" entry (from_json checks)
        return peak

    def to_json(self) -> dict:
        return asdict(self)

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
        flops = data["flops"]
        bad = next((k for k, v in flops.items() if not is_number(v, 0, strict=True)), None)
        if bad is not None:
            raise AutopipeError(
                f"{where}: flops[{bad!r}] must be a finite number of FLOP/s > 0, got {flops[bad]!r}"
            )
        if not {"default", "float32"} & set(flops):
            raise AutopipeError(f'{where}: flops needs a "default" or "float32" entry')
        return cls(**data)


def _positive(value: Any) -> bool:
    return is_number(value, 0, strict=True)


def _fraction(value: Any) -> bool:
    return _positive(value) and value <= 1


#: field -> (check, what it must be); flops values are checked on their own
_FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (lambda v: is_text(v) and bool(v), "a non-empty one-line name"),
    "flops": (
        lambda v: isinstance(v, dict) and bool(v) and all(map(is_text, v)),
        'an object of FLOP/s by dtype name ({"float32": ..., "default": ...})',
    ),
    "memory_bandwidth": (_positive, "a finite number of bytes/s > 0"),
    "memory": (_positive, "a finite number of bytes > 0"),
    "link_bandwidth": (_positive, "a finite number of bytes/s > 0"),
    "link": (is_text, "a one-line description"),
    "compute_efficiency": (_fraction, "a fraction in (0, 1]"),
    "memory_efficiency": (_fraction, "a fraction in (0, 1]"),
    "kernel_overhead": (lambda v: is_number(v, 0), "a finite number of seconds >= 0"),
}


def _gpu(
    name, fp32, tf32, half, bandwidth, memory, link_bandwidth, link, fp8=None, fp64=None
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
    return DeviceSpec(name, flops, bandwidth * GB, memory * GiB, link_bandwidth * GB, link)


#: Known devices, by lower-case name. Datasheet dense peaks; link: one direction between two GPUs.
KNOWN_DEVICES: dict[str, DeviceSpec] = {
    spec.name.lower(): spec
    for spec in [
        _gpu("H100", 67, 495, 989, 3350, 80, 450, "NVLink 4", fp8=1979, fp64=67),
        _gpu("H100-PCIe", 51, 378, 756, 2000, 80, 64, "PCIe 5 x16", fp8=1513, fp64=51),
        _gpu("H200", 67, 495, 989, 4800, 141, 450, "NVLink 4", fp8=1979, fp64=67),
        _gpu("B200", 80, 1100, 2250, 8000, 180, 900, "NVLink 5", fp8=4500, fp64=40),
        _gpu("A100", 19.5, 156, 312, 2039, 80, 300, "NVLink 3", fp64=19.5),
        _gpu("A100-40GB", 19.5, 156, 312, 1555, 40, 300, "NVLink 3", fp64=19.5),
        _gpu("L40S", 91.6, 183, 362, 864, 48, 32, "PCIe 4 x16", fp8=733),
        _gpu("L4", 30.3, 60, 121, 300, 24, 32, "PCIe 4 x16", fp8=242),
        _gpu("A10G", 31.2, 62.5, 125, 600, 24, 32, "PCIe 4 x16"),
        _gpu("RTX4090", 82.6, 82.6, 165, 1008, 24, 32, "PCIe 4 x16", fp8=330),
        _gpu("V100", 15.7, 15.7, 125, 900, 32, 150, "NVLink 2", fp64=7.8),
        _gpu("T4", 8.1, 8.1, 65, 320, 16, 16, "PCIe 3 x16"),
    ]
}

#: Cross-node links, for --link.
KNOWN_LINKS = {
    "nvlink4": 450 * GB,
    "nvlink3": 300 * GB,
    "pcie5": 64 * GB,
    "pcie4": 32 * GB,
    "ib-ndr": 50 * GB,
    "ib-hdr": 25 * GB,
    "ethernet-100g": 12.5 * GB,
}

DEFAULT_DEVICE = "h100"


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
    known = ", ".join(spec.name for spec in KNOWN_DEVICES.values())
    raise AutopipeError(f"unknown device {key!r}; known devices: {known}; or give a JSON spec file")


def link_bandwidth(link: str | float) -> tuple[float, str]:
    """Bytes/s and a label for ``--link``: a known link name or a bandwidth in GB/s."""
    if isinstance(link, str) and link.strip().lower() in KNOWN_LINKS:
        return KNOWN_LINKS[link.strip().lower()], link.strip().lower()
    try:
        gbps = float(link) if isinstance(link, (str, int, float)) else math.nan
    except ValueError:
        gbps = math.nan
    if isinstance(link, bool) or not is_number(gbps, 0, strict=True):
        raise AutopipeError(
            f"--link {link!r} is neither a known link ({', '.join(KNOWN_LINKS)}) nor a bandwidth "
            "in GB/s greater than 0"
        )
    return gbps * GB, f"{link} GB/s"


def with_link(spec: DeviceSpec, link: str | float | None) -> DeviceSpec:
    """The spec with its stage-to-stage link replaced (``--link ib-ndr`` or a GB/s number)."""
    if link is None or link == "":
        return spec
    bandwidth, label = link_bandwidth(link)
    return DeviceSpec.from_json(spec.to_json() | {"link_bandwidth": bandwidth, "link": label})
