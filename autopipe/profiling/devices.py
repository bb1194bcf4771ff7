"""Device specs: what the analytic profiler and the partitioner know about the target hardware.

A spec gives peak dense FLOP/s per dtype, memory bandwidth and size, the bandwidth of the link
between pipeline stages, and the fractions of those peaks real kernels reach. The table holds
common GPUs (datasheet figures, dense, per GPU); ``--device-spec FILE.json`` gives any other
device in the same fields.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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
        return self.flops.get(name, self.flops.get("default", self.flops.get("float32")))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DeviceSpec:
        required = {"name", "flops", "memory_bandwidth", "memory", "link_bandwidth"}
        missing = sorted(required - set(data))
        if missing:
            raise AutopipeError(
                f"device spec is missing {', '.join(missing)} (needs {', '.join(sorted(required))})"
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutopipeError(
                f"device spec has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)


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
    key = (name_or_path or DEFAULT_DEVICE).strip()
    if key.lower() in KNOWN_DEVICES:
        return KNOWN_DEVICES[key.lower()]
    path = Path(key)
    if path.suffix == ".json" or path.is_file():
        try:
            return DeviceSpec.from_json(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            raise AutopipeError(f"device spec file {key} does not exist") from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise AutopipeError(f"device spec file {key} is not a valid spec: {exc}") from None
    known = ", ".join(spec.name for spec in KNOWN_DEVICES.values())
    raise AutopipeError(f"unknown device {key!r}; known devices: {known}; or give a JSON spec file")


def with_link(spec: DeviceSpec, link: str | None) -> DeviceSpec:
    """The spec with its stage-to-stage link replaced (``--link ib-ndr`` or a GB/s number)."""
    if not link:
        return spec
    if link.lower() in KNOWN_LINKS:
        bandwidth, label = KNOWN_LINKS[link.lower()], link.lower()
    else:
        try:
            bandwidth, label = float(link) * GB, f"{link} GB/s"
        except ValueError:
            raise AutopipeError(
                f"unknown link {link!r}; give one of {', '.join(KNOWN_LINKS)} or a bandwidth in GB/s"
            ) from None
    data = spec.to_json() | {"link_bandwidth": bandwidth, "link": label}
    return DeviceSpec.from_json(data)
