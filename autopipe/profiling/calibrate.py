"""``autopipe calibrate``: measure the local device and write a device spec for ``--device-spec``.

Measured, not looked up: matrix-multiply FLOP/s per dtype, streaming memory bandwidth, the cost of
launching a tiny operator (and on CPU of a view, which the dispatcher spends in line), the
device's memory size, and the bandwidth between two pipeline stages (two local processes over
gloo on CPU, with the rates of gloo's collectives between them; a device-to-device copy on CUDA,
or a host-device copy when there is a single GPU).
The fractions of peak are 1: these are achieved rates already. The spec's tables hold the rates
by size (products by their FLOPs, attention by its FLOPs with and without a causal mask, copies
by their bytes), which the analytic profile interpolates. An optimizer step (AdamW and SGD, as
train.py builds them) is timed over tensors of several sizes: the parameter bytes it updates per
second by tensor size, which the cost model charges each rank's step tensor by tensor.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..artifacts import atomic_write_text
from ..errors import AutopipeError
from torch.nn import functional as F

from .devices import (
    COLLECTIVES,
    KNOWN_DEVICES,
    LOCAL_DEVICES,
    OPTIMIZERS,
    DeviceSpec,
    RateTable,
    device_spec,
)
from .flops import flop_counter
from .operator_rates import operator_tables
from .rank_conditions import as_a_rank_runs

__all__ = [
    "LOCAL_DEVICES",
    "calibrate",
    "known_gpu",
    "local_spec",
    "resolve_device_spec",
    "spec_cache",
]

#: what a calibration measures, in the cache's key: a spec cached by an older one is measured
#: again (v2: the tables by size and the view overhead; v3: a CPU's operators in real layers;
#: v4: the link's latency; v5: SDPA's math path, the receive wait, freed memory kept; v6: the
#: optimizer step; v7: the optimizer step by tensor size; v8: the device type, which picks the
#: attention kernels the analytic profile runs; v9: the collectives)
CALIBRATION = "calibration-v9"
#: the sizes (elements) of the parameter tensors an optimizer step is timed over: from a
#: launch-bound one to one a CPU's caches do not hold (a GPU's table adds 64 Mi)
OPTIMIZER_TENSOR_SIZES = (256, 4096, 65536, 1 << 20, 8 << 20)
#: the bytes of parameters each of those steps updates (16 times more on a GPU), in at most
#: :data:`OPTIMIZER_TENSORS` tensors
OPTIMIZER_STEP_BYTES = 64 << 20
OPTIMIZER_TENSORS = 512
#: receives timed under load (:func:`_receive_waits`): the mean of a wait that is bimodal (a
#: busy sender's transfer thread gets a core at once, or after the scheduler's slice)
RECEIVE_ROUNDS = 96
#: the bytes of the tensors each collective is timed on (:func:`_collective_rates`), and the
#: calls timed at each size
COLLECTIVE_SIZES = (1 << 10, 16 << 10, 256 << 10, 2 << 20, 16 << 20)
COLLECTIVE_ROUNDS = 24
#: the specs this process calibrated, by cache file
_CALIBRATED: dict[Path, DeviceSpec] = {}


#: calls timed back to back between two synchronisations on a GPU, so that a small kernel's
#: time is its own and not a synchronisation's
GPU_CALLS = 10


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after a warm-up (on a GPU, of :data:`GPU_CALLS` calls
    between two synchronisations, divided by them)."""
    fn()
    calls = GPU_CALLS if device.type == "cuda" else 1
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) / calls)
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


def view_overhead(device: torch.device, repeats: int = 200) -> float:
    """Seconds a view costs the caller (the dispatcher's time; no kernel)."""
    x = torch.ones(4, 4, device=device)
    return _timed(lambda: [x.view(16) for _ in range(repeats)], device, 5) / repeats


def optimizer_steps(device: torch.device) -> dict[str, RateTable]:
    """Parameter bytes a step of each optimizer train.py runs updates per second on ``device``,
    by the size of the parameter tensors: steps over :data:`OPTIMIZER_STEP_BYTES` of tensors of
    each size of :data:`OPTIMIZER_TENSOR_SIZES` (at most :data:`OPTIMIZER_TENSORS` of them)."""
    on_gpu = device.type == "cuda"
    total = OPTIMIZER_STEP_BYTES * (16 if on_gpu else 1) // 4
    steps = {}
    for name in OPTIMIZERS:
        points = []
        for elements in OPTIMIZER_TENSOR_SIZES + ((64 << 20,) if on_gpu else ()):
            count = min(OPTIMIZER_TENSORS, max(1, total // elements))
            seconds = _optimizer_step(device, name, [elements] * count)
            points.append((elements * 4.0, count * elements * 4 / seconds))
        steps[name] = RateTable(tuple(points))
    return steps


def _optimizer_step(device: torch.device, name: str, sizes: list[int]) -> float:
    """Seconds of one step of optimizer ``name`` over float32 parameters of ``sizes``, built as
    train.py builds it (``runtime/driver.py``: torch's default implementation, no weight decay
    or momentum unless asked)."""
    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
        if name == "adamw"
        else torch.optim.SGD(params, lr=1e-3)
    )
    optimizer.step()  # AdamW's moments are made at its first step
    return _timed(optimizer.step, device, 5)


def _rate(work: float, seconds: float, overhead: float) -> float:
    """The rate of ``work`` done in ``seconds`` less the launch ``overhead`` the analytic
    profile charges on its own (at most nine tenths of them)."""
    return work / max(seconds - overhead, seconds / 10)


def matmul_table(
    device: torch.device, dtype: torch.dtype, sides: tuple[int, ...], overhead: float
) -> RateTable:
    """FLOP/s of square products of each side, by the FLOPs of one (launch ``overhead``
    apart)."""
    points = []
    for n in sides:
        flops = 2.0 * n**3
        points.append((flops, _rate(flops, flops / matmul_flops(device, dtype, n), overhead)))
    return RateTable(tuple(points))


def attention_tables(
    device: torch.device,
    dtype: torch.dtype,
    lengths: tuple[int, ...],
    causal: bool,
    overhead: float,
) -> tuple[RateTable, RateTable]:
    """FLOP/s of ``scaled_dot_product_attention``'s forward and of its backward kernel (8 heads
    of 64, one sequence of each length), each by the FLOPs torch counts for that kernel."""
    forwards: dict[float, float] = {}
    backwards: dict[float, float] = {}
    for length in lengths:
        q, k, v = (
            torch.randn(1, 8, length, 64, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(1, 8, length, 64, device=device, dtype=dtype)

        def forward() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def step() -> None:
            torch.autograd.grad(forward(), (q, k, v), grad)

        with flop_counter() as counter:
            with torch.no_grad():
                forward()
        forward_flops = counter.get_total_flops()
        with flop_counter() as counter:
            step()
        backward_flops = counter.get_total_flops() - forward_flops
        with torch.no_grad():
            forward_seconds = _timed(forward, device, 5)
        backward_seconds = max(_timed(step, device, 5) - forward_seconds, forward_seconds / 10)
        forwards[forward_flops] = _rate(forward_flops, forward_seconds, overhead)
        backwards[backward_flops] = _rate(backward_flops, backward_seconds, overhead)
    return RateTable(tuple(sorted(forwards.items()))), RateTable(tuple(sorted(backwards.items())))


def memory_table(device: torch.device, sizes: tuple[int, ...], overhead: float) -> RateTable:
    """Bytes/s of a copy moving each number of bytes (read and written), launch ``overhead``
    apart."""
    points = []
    for n in sizes:
        moved = 2.0 * n
        points.append((moved, _rate(moved, moved / memory_bandwidth(device, n), overhead)))
    return RateTable(tuple(points))


def _round_trips(rank: int, tensor: torch.Tensor, count: int, barrier: bool) -> list[float]:
    """Seconds of ``count`` round trips of ``tensor`` between ranks 0 and 1 (from rank 0 and
    back), each after a barrier when ``barrier``."""
    samples = []
    for _ in range(count):
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        else:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        samples.append(time.perf_counter() - start)
    return samples


def _gloo_bandwidth_worker(rank: int, init_file: str, nbytes: int, result, threads: int) -> None:
    """One of two processes computing with ``threads`` threads, as the ranks do: the bandwidth
    of ``nbytes`` messages, the latency of a tiny one, the wait of a receive under load
    (:func:`_receive_waits`) and the collectives' rates (:func:`_collective_rates`), over
    gloo, put on ``result`` by rank 0."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    large = _round_trips(rank, torch.ones(nbytes // 4), 6, barrier=True)[1:]
    small = _round_trips(rank, torch.ones(1), 50, barrier=False)
    waited = torch.tensor([statistics.mean(_receive_waits(rank, RECEIVE_ROUNDS))])
    dist.broadcast(waited, src=1)
    collectives = _collective_rates()
    if rank == 0:
        result.put(
            (
                2 * nbytes / statistics.median(large),
                statistics.median(small) / 2,
                float(waited),
                collectives,
            )
        )
    dist.destroy_process_group()


#: the collectives into one tensor and out of one, by torch 2.13's names (an older torch, as the
#: lent GPU machine's image has, holds only the names 2.13 deprecates: same arguments)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective_rates() -> dict[str, RateTable]:
    """The bus bandwidth of each collective (:data:`COLLECTIVE_SIZES`, the mean of
    :data:`COLLECTIVE_ROUNDS`) between the two ranks of the default group: the bytes a rank
    sends per second (an all-reduce's whole tensor, half a gathered or reduced one; see
    :attr:`DeviceSpec.collectives`), by the slower rank's mean time. The mean, as of a
    receive's wait (:func:`_receive_waits`): on a CPU whose cores the ranks fill a collective
    takes 0.15 ms or 4 at random (gloo's thread woken at once or after the scheduler's slice),
    and a median of a few flips between the two."""
    rates: dict[str, RateTable] = {}
    for kind in COLLECTIVES:
        points = []
        slowest = 0.0  # a larger message takes at least a smaller one's time (the noise's)
        for nbytes in COLLECTIVE_SIZES:
            whole, half = torch.ones(nbytes // 4), torch.ones(nbytes // 8)
            samples = []
            for _ in range(COLLECTIVE_ROUNDS + 1):  # the first warms the buffers up
                dist.barrier()
                start = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(whole)
                elif kind == "all_gather":
                    _ALL_GATHER_SINGLE(whole, half)
                else:
                    _REDUCE_SCATTER_SINGLE(half, whole)
                samples.append(time.perf_counter() - start)
            seconds = torch.tensor([statistics.mean(samples[1:])])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            slowest = max(slowest, float(seconds))
            sent = nbytes if kind == "all_reduce" else nbytes / 2
            points.append((float(sent), sent / slowest))
        rates[kind] = RateTable(tuple(points))
    return rates


def _receive_waits(rank: int, rounds: int) -> list[float]:
    """Seconds rank 1 waits on each of ``rounds`` receives of an activation-sized message
    (64 KiB) that rank 0 sent 5 ms before and computes on after, as a pipeline's ranks do
    (torch's schedules post each receive when the action needs it): the handshake of the
    transfer, which waits for the busy sender's transfer thread (rank 0 returns ``[0.0]``)."""
    message = torch.ones(16384)
    left, right = torch.randn(256, 256), torch.randn(256, 256)

    def compute(seconds: float) -> None:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            torch.mm(left, right)

    waits = []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            sent = dist.isend(message, 1)
            assert sent is not None  # None only off the group
            compute(0.010)
            sent.wait()
        else:
            compute(0.005)
            began = time.perf_counter()
            received = dist.irecv(torch.empty_like(message), 0)
            assert received is not None
            received.wait()
            waits.append(time.perf_counter() - began)
    return waits or [0.0]


@dataclass(frozen=True)
class Link:
    """What :func:`link_bandwidth` measured between two ranks."""

    bandwidth: float  # bytes/s of a large message
    latency: float  # seconds of a tiny one
    waited: float  # seconds a receive waits for a busy sender (0: not measured)
    collectives: dict[str, RateTable]  # bus bandwidth by collective (empty: not measured)
    how: str  # what was measured


def link_bandwidth(device: torch.device, nbytes: int) -> Link:
    """Bytes/s between two pipeline stages on this machine, the seconds of a message, the
    seconds a receive under load waits (:func:`_receive_waits`; 0 where not measured), the
    collectives' rates (on a CPU) and what was measured."""
    if device.type == "cuda":
        if torch.cuda.device_count() > 1:
            source = torch.empty(nbytes // 4, device="cuda:0")
            target = torch.empty(nbytes // 4, device="cuda:1")
            seconds = _timed(lambda: target.copy_(source), device, 5)
            return Link(nbytes / seconds, 0.0, 0.0, {}, "cuda:0 -> cuda:1 copy")
        host = torch.empty(nbytes // 4).pin_memory()
        on_device = torch.empty(nbytes // 4, device=device)
        return Link(
            nbytes / _timed(lambda: on_device.copy_(host), device, 5),
            0.0,
            0.0,
            {},
            "pinned host -> device copy",
        )
    context = mp.get_context("spawn")
    result = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _gloo_bandwidth_worker,
            args=(os.path.join(tmp, "init"), nbytes, result, torch.get_num_threads()),
            nprocs=2,
            start_method="spawn",
        )
    bandwidth, latency, waited, collectives = result.get()
    return Link(bandwidth, latency, waited, collectives, "gloo between two local processes")


def total_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(
    device: torch.device | None = None,
    name: str | None = None,
    log=lambda message: None,
    threads: int = 1,
) -> DeviceSpec:
    """Measure ``device`` (default: CUDA when present, else CPU) into a :class:`DeviceSpec`.

    A CPU is measured with ``threads`` compute threads: the threads each rank computes with
    (one where torchrun starts several ranks on a node: it sets ``OMP_NUM_THREADS=1``). A spec
    measured with every core predicts a rank that has one of them at the rate of all."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return _calibrate(device, name, log)
    if threads < 1:
        raise AutopipeError(f"a CPU is calibrated with 1 thread or more, not {threads}")
    with as_a_rank_runs(device, threads):
        plural = "thread" if threads == 1 else "threads"
        return _calibrate(device, name or f"cpu ({_processor()}, {threads} {plural})", log)


def _calibrate(device: torch.device, name: str | None, log: Callable[[str], None]) -> DeviceSpec:
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
    # by size: a GPU's dtypes; a CPU's float32 and bfloat16 (float16, emulated, is left at
    # its one rate: no CPU trains in it)
    sized = [name for name in flops if on_gpu or name in ("float32", "bfloat16")]
    tables = _tables(device, sized, overhead, log)
    if not on_gpu:  # a CPU's operators are synchronous: timed one by one in real layers
        tables |= operator_tables((torch.float32,), log)
    views = 0.0 if on_gpu else view_overhead(device)  # a GPU's views hide behind its kernels
    log(f"view overhead: {views * 1e6:.2f} us")
    steps = optimizer_steps(device)
    for optimizer, table in steps.items():
        log(f"{optimizer} step, GB/s of parameters by tensor size: {_by_size(table)}")
    link = link_bandwidth(device, (256 << 20) if on_gpu else (64 << 20))
    log(
        f"link ({link.how}): {link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us per "
        f"message, {link.waited * 1e6:.0f} us a receive waits while its sender computes"
    )
    for kind, table in link.collectives.items():
        log(f"{kind} over two ranks, GB/s a rank sends by the bytes it sends: {_by_size(table)}")
    label = name or torch.cuda.get_device_name(device)
    links: dict[str, Any] = {
        "link_bandwidth": link.bandwidth,
        "link": f"measured: {link.how}",
        "link_latency": link.latency,
        "receive_overhead": link.waited,
        "collectives": link.collectives,
    }
    known = known_gpu(torch.cuda.get_device_name(device)) if on_gpu else None
    if known is not None and torch.cuda.device_count() < 2:
        # one GPU cannot measure the links of the nodes it is built into: its table's
        links = {
            key: getattr(known, key)
            for key in ("link_bandwidth", "link", "link_latency")
            + ("network_bandwidth", "network_latency", "network", "nics_per_node")
        }
        log(f"links of a {known.name} node (one GPU here cannot measure them): {known.link}")
    return DeviceSpec(
        name=label,
        flops=flops,
        memory_bandwidth=bandwidth,
        memory=total_memory(device),
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        kernel_overhead=overhead,
        view_overhead=views,
        device_type=device.type,
        optimizer_steps=steps,
        tables=tables,
        # a GPU of the table: MFU stays reckoned against its datasheet's peak
        datasheet_flops=dict(known.flops) if known is not None else {},
        **links,
    )


def _by_size(table: RateTable) -> str:
    """A table of bytes/s by bytes, for the log: ``16 KiB 0.12, 256 KiB 0.56, ...`` (GB/s)."""
    return ", ".join(f"{size / 1024:.0f} KiB {rate / 1e9:.2f}" for size, rate in table.points)


def known_gpu(name: str) -> DeviceSpec | None:
    """The device of the table a GPU's name is (``NVIDIA H200`` -> H200), the longest name
    matching; None for another."""

    def compact(text: str) -> str:
        return re.sub(r"[^A-Z0-9]", "", text.upper())

    for key in sorted(KNOWN_DEVICES, key=len, reverse=True):
        if compact(KNOWN_DEVICES[key].name) in compact(name):
            return KNOWN_DEVICES[key]
    return None


#: sides of the square products, lengths of the attention and bytes of the copies calibrated
_SIDES = {"cpu": (32, 64, 128, 256, 512, 1024), "cuda": (256, 512, 1024, 2048, 4096, 8192)}
_HALF_SIDES_CPU = (32, 64, 128, 256)  # a CPU without half-precision units emulates them
_LENGTHS = {"cpu": (64, 128, 256, 512, 1024), "cuda": (256, 512, 1024, 2048, 4096, 8192)}
_COPIES = {
    "cpu": tuple(1 << p for p in range(12, 27, 2)),  # 4 KiB .. 64 MiB
    "cuda": tuple(1 << p for p in range(16, 31, 2)),  # 64 KiB .. 1 GiB
}


def _tables(
    device: torch.device, dtypes: list[str], overhead: float, log: Callable[[str], None]
) -> dict[str, RateTable]:
    """The rates of ``device``'s kernels by size: products and attention (causal or not) in
    each of ``dtypes`` it multiplies, copies."""
    kind = device.type
    tables: dict[str, RateTable] = {}
    for name in dtypes:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            continue
        sides = _SIDES[kind] if kind == "cuda" or dtype == torch.float32 else _HALF_SIDES_CPU
        lengths = _LENGTHS[kind] if kind == "cuda" or dtype == torch.float32 else (64, 128, 256)
        try:
            measured = {f"matmul.{name}": matmul_table(device, dtype, sides, overhead)}
            for causal in (False, True):
                forward, backward = attention_tables(device, dtype, lengths, causal, overhead)
                prefix = "causal_" if causal else ""
                measured[f"{prefix}attention.{name}"] = forward
                measured[f"{prefix}attention_backward.{name}"] = backward
        except RuntimeError as exc:  # a dtype this device cannot run: its ops keep the peak
            log(f"{name}: not calibrated ({str(exc).splitlines()[0][:80]})")
            continue
        tables |= measured
        rates = ", ".join(f"{rate / 1e12:.3g}" for _, rate in tables[f"matmul.{name}"].points)
        log(f"matmul {name} by size: {rates} TFLOP/s")
    tables["memory"] = memory_table(device, _COPIES[kind], overhead)
    rates = ", ".join(f"{rate / 1e9:.3g}" for _, rate in tables["memory"].points)
    log(f"copies by size: {rates} GB/s")
    return tables


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
    key = f"{kind} {what} torch-{torch.__version__} {CALIBRATION}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", key).strip("_")


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
    spec = calibrate(torch.device(kind), log=log)  # a CPU with one thread, as torchrun runs ranks
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
