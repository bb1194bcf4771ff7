"""``autopipe calibrate``: measure the local device and write a device spec for ``--device-spec``.

Measured, not looked up: matrix-multiply FLOP/s per dtype, streaming memory bandwidth, the cost of
launching a tiny operator, the device's memory size, and the bandwidth between two pipeline stages
(two local processes over gloo on CPU; a device-to-device copy on CUDA, or a host-device copy when
there is a single GPU). The fractions of peak are 1: these are achieved rates already.

``--device-spec cpu`` (or ``cuda``) names this machine's own device: :func:`local_spec`
calibrates it on first use and keeps the spec in autopipe's cache (``$AUTOPIPE_CACHE_DIR``, else
``$XDG_CACHE_HOME/autopipe`` or ``~/.cache/autopipe``), keyed by the processor or GPU, its
threads and torch's version, so that a plan is made for the machine that runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..artifacts import atomic_write_text
from ..errors import AutopipeError
from .devices import DeviceSpec, device_spec

__all__ = ["LOCAL_DEVICES", "calibrate", "local_spec", "resolve_device_spec", "spec_cache"]

#: ``--device-spec`` names of this machine's devices, calibrated on first use
LOCAL_DEVICES = ("cpu", "cuda")
#: the specs this process calibrated, by cache file
_CALIBRATED: dict[Path, DeviceSpec] = {}


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after a warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / _timed(lambda: a @ b, device, repeats)


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    source = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    return 2 * nbytes / _timed(lambda: target.copy_(source), device, repeats)


def kernel_overhead(device: torch.device, repeats: int = 200) -> float:
    x = torch.ones(1, device=device)
    return _timed(lambda: [x.add(1) for _ in range(repeats)], device, 5) / repeats


def _gloo_bandwidth_worker(rank: int, init_file: str, nbytes: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    tensor = torch.ones(nbytes // 4)
    samples = []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        samples.append(time.perf_counter() - start)
    if rank == 0:
        result.put(2 * nbytes / statistics.median(samples[1:]))
    dist.destroy_process_group()


def link_bandwidth(device: torch.device, nbytes: int) -> tuple[float, str]:
    """Bytes/s between two pipeline stages on this machine, and what was measured."""
    if device.type == "cuda":
        if torch.cuda.device_count() > 1:
            source = torch.empty(nbytes // 4, device="cuda:0")
            target = torch.empty(nbytes // 4, device="cuda:1")
            seconds = _timed(lambda: target.copy_(source), device, 5)
            return nbytes / seconds, "cuda:0 -> cuda:1 copy"
        host = torch.empty(nbytes // 4).pin_memory()
        on_device = torch.empty(nbytes // 4, device=device)
        return (
            nbytes / _timed(lambda: on_device.copy_(host), device, 5),
            "pinned host -> device copy",
        )
    context = mp.get_context("spawn")
    result = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _gloo_bandwidth_worker,
            args=(os.path.join(tmp, "init"), nbytes, result),
            nprocs=2,
            start_method="spawn",
        )
    return result.get(), "gloo between two local processes"


def total_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(
    device: torch.device | None = None, name: str | None = None, log=lambda message: None
) -> DeviceSpec:
    """Measure ``device`` (default: CUDA when present, else CPU) into a :class:`DeviceSpec`."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    size = 4096 if on_gpu else 1024
    flops = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # a CPU without half-precision units emulates them, 50x slower: smaller products
        # measure the same rate in a fraction of the time
        side = size if on_gpu or dtype == torch.float32 else size // 4
        try:
            flops[str(dtype).removeprefix("torch.")] = matmul_flops(device, dtype, side)
        except RuntimeError:  # a dtype this device cannot multiply
            continue
        log(f"matmul {dtype}: {flops[str(dtype).removeprefix('torch.')] / 1e12:.3f} TFLOP/s")
    flops["default"] = flops["float32"]
    bandwidth = memory_bandwidth(device, (1 << 30) if on_gpu else (128 << 20))
    log(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s")
    overhead = kernel_overhead(device)
    log(f"operator overhead: {overhead * 1e6:.1f} us")
    link, how = link_bandwidth(device, (256 << 20) if on_gpu else (64 << 20))
    log(f"link ({how}): {link / 1e9:.2f} GB/s")
    label = name or (
        torch.cuda.get_device_name(device) if on_gpu else f"cpu-{os.cpu_count()}-cores"
    )
    return DeviceSpec(
        name=label,
        flops=flops,
        memory_bandwidth=bandwidth,
        memory=total_memory(device),
        link_bandwidth=link,
        link=f"measured: {how}",
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_overhead=overhead,
    )


def spec_cache() -> Path:
    """The folder cached device specs are kept in."""
    root = os.environ.get("AUTOPIPE_CACHE_DIR")
    if root:
        return Path(root) / "devices"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autopipe" / "devices"


def _processor() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _cache_key(kind: str) -> str:
    """What the cached spec of ``kind`` holds for: the CPU model and the threads a rank runs
    with (one: what torchrun gives each), or the GPU's name; and torch's version."""
    if kind == "cuda":
        what = f"{torch.cuda.get_device_name(0)}"
    else:
        what = f"{_processor()} {platform.machine()} 1-thread"
    key = f"{kind} {what} torch-{torch.__version__}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", key).strip("_")


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def local_spec(kind: str, log: Callable[[str], None] = lambda message: None) -> DeviceSpec:
    """This machine's ``kind`` device (``cpu`` or ``cuda``) as a spec: read from the cache, or
    calibrated now (on CPU with one thread, as torchrun runs each rank) and cached."""
    if kind not in LOCAL_DEVICES:
        raise AutopipeError(f"unknown local device {kind!r}; use one of {', '.join(LOCAL_DEVICES)}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise AutopipeError(
            "--device-spec cuda calibrates this machine's GPU, but torch sees no CUDA device "
            "here; run `autopipe calibrate -o gpu.json` on the GPU machine and pass "
            "--device-spec gpu.json, or name a GPU of the table (h100, ...)"
        )
    path = spec_cache() / f"{_cache_key(kind)}.json"
    if path in _CALIBRATED:  # measured in this process already (its cache may be read-only)
        return _CALIBRATED[path]
    if path.is_file():
        try:
            return DeviceSpec.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
        except (OSError, ValueError, AutopipeError) as exc:
            log(f"the cached device spec {path} cannot be read ({exc}); calibrating again")
    log(f"calibrating this machine's {kind} (first use; the spec is kept in {path})")
    device = torch.device(kind)
    with _threads(1) if kind == "cpu" else contextlib.nullcontext():
        name = f"cpu ({_processor()}, 1 thread)" if kind == "cpu" else None
        spec = calibrate(device, name, log=log)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(spec.to_json(), indent=1) + "\n")
    except OSError as exc:  # a read-only home: the spec serves this compile only
        log(f"the device spec cannot be cached in {path} ({exc}); it is used for this run only")
    _CALIBRATED[path] = spec
    return spec


def resolve_device_spec(
    name_or_path: str | None, log: Callable[[str], None] = lambda message: None
) -> DeviceSpec:
    """``--device-spec``: this machine's ``cpu`` or ``cuda`` (calibrated on first use, see
    :func:`local_spec`), a device of the table, or a JSON spec file."""
    if name_or_path is not None and name_or_path.strip().lower() in LOCAL_DEVICES:
        return local_spec(name_or_path.strip().lower(), log)
    return device_spec(name_or_path)
