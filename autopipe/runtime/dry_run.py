"""``train.py --dry-run``: one process plays ranks of the whole job on fake tensors.

Copied into every generated pipeline as ``runtime/dry_run.py``; it needs only torch. Each rank in
turn (or ``--rank R`` alone) joins torch's fake process group as rank R of ``--world-size``
(collectives return at once, without communicating) and runs the driver's own training phases
(``driver.rehearse``: ``TrainingRun``'s setup, steps and checkpoint) under ``FakeTensorMode``:
tensors on the target device have shapes, dtypes and devices but no data, and an operator that
mixes devices raises. A launch's device placement, its ``torch.cuda`` calls, NCCL's options,
bf16 autocast, the schedule, FSDP2's sharding and the optimizer are exercised as the job would
run them, for any world size, in one process without the device.

:class:`Rehearsal`, a dispatch mode under the fake tensor mode, counts the rank's live tensor
bytes on the device (``core.memory``: the fake-measured peak, against the plan's prediction for
the rank, :func:`predicted_peak`) and the collectives it issues, each under the action it runs
in (``activity.py``). Fake tensors hold no values, yet the run reads a few (a loss, a gradient
norm, the dynamic sizes the ranks agree on, torch's own vote on the schedule's mode): the mode
follows the values of small tensors the run builds from known numbers (a collective leaves each
as this rank gave it, as if every rank held the same), and reads any other as 1 (0 if boolean).

What torch cannot pretend without the device is faked alone, for the dry run's duration, and
listed in its output (:class:`Fakes`): ``torch.cuda``'s device, stream, event, random state and
memory functions, NCCL's process group (the fake one instead, without ``device_id``), autocast's
check that CUDA is there; and with a torch built without CUDA, the CUDA device guard autograd
needs (installed into c10's registry of device guards, as torch's own fake tensor mode does on a
CUDA build without a GPU) and the device autograd's engine sees while it runs a backward
(``meta``: it would look for a CUDA stream).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import linecache
import os
import re
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .activity import ACTIVITY
from .activity import Action as RankAction
from .core.errors import PipelineRunError, first_line
from .core.fused_attention import fused_kernels
from .core.memory import LiveTensorBytes
from .core.mesh import RankMesh
from .core.pipeline import Pipeline
from .core.schedules import (
    SINGLE_STAGE,
    Action,
    device_memory,
    greedy_orders,
    single_stage_order,
)
from .options import TrainConfig
from .parallel import Layout, init_distributed

__all__ = [
    "STEPS",
    "DataDependentSize",
    "DeviceMismatch",
    "Fakes",
    "RankResult",
    "Rehearsal",
    "generated_line",
    "play_ranks",
    "predicted_peak",
    "rehearsal_config",
    "run_dry",
]

#: optimizer steps a rank plays (fewer when --steps says so)
STEPS = 2
#: tensors of at most this many elements have their values followed (see Rehearsal)
SMALL = 64
#: GPUs per node the played ranks are spread over (LOCAL_RANK = rank % this)
GPUS_PER_NODE = 8
#: a compute action in the text of one of torch's schedule actions ("0F3", "(0F3;3B1)...")
_COMPUTE = re.compile(r"\d+[FBIW]\d+")
_META = torch.device("meta")
#: the Python function autograd's engine runs a backward from, and torch's wrappers between a
#: frame that calls into C++ and a dispatch mode
_ENGINE = torch.autograd.graph._engine_run_backward.__code__
_TORCH = os.path.dirname(torch.__file__)
_WRAPPERS = frozenset(
    {os.path.join(_TORCH, "_compile.py"), os.path.join(_TORCH, "_dynamo", "eval_frame.py")}
)
_DEVICE_OP = torch.ops.prim.device.default
_ITEM_OP = torch.ops.aten._local_scalar_dense.default
_WAIT_OP = torch.ops._c10d_functional.wait_tensor.default
_HALF = (torch.bfloat16, torch.float16)


class _NoSuchError(Exception):
    """Never raised: stands for an error class this torch does not have."""


#: what fake tensors raise for operands on two devices (torch 2.13; an older torch, as the lent
#: GPU machine's image has, raises a bare RuntimeError, which the dry run passes on as it is)
_DEVICE_MISMATCH: type[Exception] = getattr(
    fake_tensor, "FakeTensorDeviceMismatchError", _NoSuchError
)
#: c10d's point-to-point operators, by what they do
_TRANSFERS = {"send": "sends", "recv": "receives", "recv_any_source": "receives"}

#: what plays one rank: the driver's phases on this rank's layout, under the rehearsal config;
#: returns the schedule the rank's steps ran (its action order is the prediction's)
Play = Callable[[TrainConfig, Layout], Any]


# -- what the rank did ------------------------------------------------------------------------
@dataclass
class RankResult:
    """What one played rank did: its place, its fake-measured and predicted peaks, the
    collectives it issued (by operator, then by the action they ran in) and its error."""

    rank: int
    world: int
    device: str
    pp_rank: int = -1
    dp_rank: int = -1
    stages: tuple[int, ...] = ()
    seconds: float = 0.0
    steps: int = 0
    peak: int = 0  # the most bytes of live fake tensors on the device at once, in the steps
    peak_at: str | None = None  # the action running then
    setup_peak: int = 0  # ... before them (building, initialising and sharding the stages)
    operators: int = 0  # operators run
    half_precision: int = 0  # ... of them returning bf16 or fp16 tensors (autocast)
    predicted: float | None = None  # the plan's peak for this rank
    prediction_note: str = ""  # how the plan differs from what ran, if it does
    collectives: dict[str, Counter[str]] = field(default_factory=dict)
    transfers: Counter[str] = field(default_factory=Counter)  # sends and receives
    error: str | None = None
    action: str | None = None  # the action the error happened in
    line: str | None = None  # the generated line it happened at

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> list[str]:
        """The rank's report, a line each: where it sits, its memory, its collectives, and its
        error with the action and generated line it happened at."""
        stages = f"stage{'s' if len(self.stages) != 1 else ''} {', '.join(map(str, self.stages))}"
        head = (
            f"rank {self.rank} of {self.world} (pipeline rank {self.pp_rank}, data-parallel rank "
            f"{self.dp_rank}, {stages}) on fake {self.device}: "
        )
        if self.pp_rank < 0:
            head = f"rank {self.rank} of {self.world} on fake {self.device}: "
        if self.ok:
            head += f"setup and {self.steps} step{'s' if self.steps != 1 else ''} ok"
        else:
            head += "FAILED"
        lines = [head + f" ({self.seconds:.2f} s)"]
        measured = f"peak memory {self.peak / 2**20:.2f} MiB of live fake tensors"
        if self.peak_at:
            measured += f" (in {self.peak_at})"
        if self.predicted is not None:
            off = (self.peak - self.predicted) / self.predicted * 100 if self.predicted else 0.0
            measured += f", {self.predicted / 2**20:.2f} MiB predicted by the plan ({off:+.1f}%)"
        else:
            measured += ", no prediction (the pipeline has no memory plan)"
        if self.setup_peak > self.peak:
            measured += (
                f"; setup peaks higher, at {self.setup_peak / 2**20:.2f} MiB (building, "
                "initialising or loading the stages: a sharded tensor is made whole first)"
            )
        lines.append(f"  {measured}{self.prediction_note}")
        if self.half_precision:
            lines.append(
                f"  {self.half_precision} of {self.operators} operators computed in bf16 or fp16"
            )
        if self.collectives:
            parts = []
            for name, where in sorted(self.collectives.items()):
                actions = ", ".join(f"{kind} {count}" for kind, count in where.most_common())
                parts.append(f"{name} {sum(where.values())} ({actions})")
            lines.append(f"  collectives: {'; '.join(parts)}")
        if self.transfers:
            sent = ", ".join(f"{count} {name}" for name, count in sorted(self.transfers.items()))
            lines.append(f"  point to point: {sent}")
        if self.error is not None:
            lines.append(f"  error in {self.action or 'setup'}: {self.error}")
            if self.line:
                lines.append(f"  at {self.line}")
        return lines


def generated_line(exc: BaseException, package_dir: Path) -> str | None:
    """``stage1.py:57: <the line>``: the innermost frame of an exception's traceback (and its
    causes') in the package's generated code (stage modules, ``blocks.py``, ``loss.py``), or
    None when it did not pass through it."""
    found = None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame in traceback.extract_tb(exc.__traceback__):
            path = Path(frame.filename)
            if path.parent == package_dir and path.suffix == ".py" and path.name != "train.py":
                found = f"{path.name}:{frame.lineno}: {(frame.line or '').strip()}"
        if found:
            return found
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]  # ends at None
    return None


def _root_cause(exc: BaseException) -> BaseException:
    """What an exception was raised from: a :class:`DeviceMismatch` along its causes, else
    the innermost cause."""
    seen = {id(exc)}
    while not isinstance(exc, (DeviceMismatch, DataDependentSize)) and exc.__cause__ is not None:
        if id(exc.__cause__) in seen:
            break
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


# -- the prediction ---------------------------------------------------------------------------
def predicted_peak(
    pipeline: Pipeline, config: TrainConfig, pp_rank: int, schedule: Any
) -> tuple[float | None, str]:
    """The plan's peak bytes for pipeline rank ``pp_rank`` under the run's schedule and
    microbatches (``core.schedules.device_memory`` of the rank's action order, as the compiler
    predicts it), and a note on how the plan's costs differ from the run (another
    ``--dp-shard``, recomputation, replicas, bf16), or "". None without stage costs."""
    costs = pipeline.pipeline_costs().for_schedule(config.schedule)
    if not any(costs.static_memory) and not any(costs.activations):
        return None, ""
    microbatches = config.microbatches
    if config.schedule in SINGLE_STAGE:
        stage = pipeline.stages_on(pp_rank)[0].index
        order = single_stage_order(config.schedule, stage, pipeline.num_stages, microbatches)
    elif config.schedule == "auto":
        order = greedy_orders(costs, microbatches)[pp_rank]
    else:  # torch's multi-stage schedules: the order the built schedule runs
        actions = schedule.pipeline_order[pp_rank]
        order = [
            Action.parse(part)
            for text in (str(a) for a in actions if a is not None)
            for part in _COMPUTE.findall(text)
        ]
    events = [(pp_rank, action, float(i), float(i + 1)) for i, action in enumerate(order)]
    peak = device_memory(events, costs)[pp_rank].total
    notes = []
    if config.dp_shard != pipeline.dp_shard:
        notes.append(f"planned for --dp-shard {pipeline.dp_shard}")
    if config.dp > 1:
        notes.append("planned without --dp replicas")
    if (config.recompute, config.recompute_blocks) != (
        pipeline.recomputed,
        pipeline.recomputed_blocks,
    ):
        notes.append("planned with the partitioner's recomputation")
    if config.bf16 != pipeline.default_bf16:
        notes.append(
            "planned in the model's dtype, without --bf16" if config.bf16 else "planned for --bf16"
        )
    if pipeline.dimensions:
        notes.append("planned at the dynamic dimensions' upper bounds")
    return peak, f" ({'; '.join(notes)})" if notes else ""


# -- the dispatch mode ------------------------------------------------------------------------
_V = TypeVar("_V")


class ByTensor(Generic[_V]):
    """Values by tensor identity, forgotten with the tensor (torch's ``WeakIdKeyDictionary``,
    typed)."""

    def __init__(self) -> None:
        self.map: Any = WeakIdKeyDictionary()

    def get(self, tensor: torch.Tensor) -> _V | None:
        return cast("_V | None", self.map.get(tensor))

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return tensor in self.map

    def __getitem__(self, tensor: torch.Tensor) -> _V:
        return cast(_V, self.map[tensor])

    def __setitem__(self, tensor: torch.Tensor, value: _V) -> None:
        self.map[tensor] = value

    def forget(self, tensor: torch.Tensor) -> None:
        self.map.pop(tensor, None)


class DeviceMismatch(RuntimeError):
    """An operator or collective given a tensor on another device than the run's, with where
    the generated code made it."""


class DataDependentSize(RuntimeError):
    """An operator whose output's size depends on values (``nonzero``), which fake tensors
    have not: the dry run stops there."""


class Rehearsal(LiveTensorBytes):
    """Under the fake tensor mode, for one played rank: the most bytes of live fake tensors on
    ``device_type`` (:class:`LiveTensorBytes`), the collectives issued, by operator and action
    (:data:`ACTIVITY`'s current one), and values for ``.item()``: each small tensor computed
    from known values (literals, results of other such tensors) keeps its value alongside; a
    collective leaves it as this rank gave it (an all-gather gives each rank's slot this rank's
    value), as if every rank held the same; any other reads as 1 (0 if boolean).

    A tensor the package's generated code (files in ``package_dir``) creates on another device
    has its line kept: an operator that mixes it with the run's device raises
    :class:`DeviceMismatch`, naming where it was made. With NCCL (``device_type`` cuda), a
    collective given a tensor off the device raises too (NCCL takes CUDA tensors only).

    ``backward_meta``: when autograd's engine asks a fake tensor for its device (running a
    backward), the tensor says ``meta``: a torch built without CUDA has no CUDA stream for the
    engine to look up (a tensor the engine then makes on ``meta`` is made on ``device``).
    Everything else (Python code, hooks and recomputation the backward runs, operators'
    device checks, autocast, autograd recording the forward) sees the device."""

    def __init__(self, device: torch.device, backward_meta: bool, package_dir: Path) -> None:
        device_type = device.type
        super().__init__(device_type=device_type)
        self.device = device
        self.backward_meta = backward_meta
        self.package_dir = str(package_dir) + os.sep
        #: tensors the generated code made off the device -> where ("stage0.py:57: <line>")
        self.made_off: ByTensor[str] = ByTensor()
        #: storages on the device counted as live -> their bytes now (FSDP2 resizes some)
        self.sizes: dict[StorageWeakRef, int] = {}
        self.young: list[StorageWeakRef] = []  # those the last operator returned
        self.peak_at: RankAction | None = None  # the action running at the peak
        #: before the first action (building, initialising, loading and sharding the stages):
        #: its peak, apart from the steps' (``peak``, which the plan predicts)
        self.setup = True
        self.setup_peak = 0
        self.operators = 0  # operators run
        self.half_precision = 0  # ... that returned bf16 or fp16 tensors (autocast)
        self.values: ByTensor[torch.Tensor] = ByTensor()  # fake tensor -> its real value
        self.collectives: dict[str, Counter[str]] = {}
        self.transfers: Counter[str] = Counter()

    def __torch_dispatch__(
        self,
        func: Any,
        types: tuple[type, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _DEVICE_OP and isinstance(args[0], DTensor):  # see _dtensor_with_device
            return _META if self.backward_meta and _engine_asks() else args[0]._local_tensor.device
        if self.backward_meta:
            if func is _DEVICE_OP and _engine_asks():
                return _META
            if kwargs.get("device") == _META and _engine_asks():  # made from what it was told
                kwargs = {**kwargs, "device": self.device}
        if func is _ITEM_OP:
            return self.read(args[0])
        if func.namespace == "c10d" and self.device_type == "cuda":
            self.on_device(func, args)
        try:
            out = func(*args, **kwargs)
        except _DEVICE_MISMATCH as exc:
            raise self.mismatch(func, args, kwargs, exc) from exc
        except DynamicOutputShapeException as exc:
            raise DataDependentSize(
                f"{func} makes a tensor whose size depends on tensor values, which fake tensors "
                "do not hold: a dry run cannot play past it (a real run specialises the size "
                "to the compile-time example and checks it)"
            ) from exc
        self.count(out)
        self.made((args, kwargs), out)
        if func.namespace == "c10d":
            self.collective(func, args)
        else:
            if func.namespace == "_c10d_functional" and func is not _WAIT_OP:  # DTensor's
                self.count_collective(func._schema.name.split("::")[-1])
            self.follow(func, args, kwargs, out)
        return out

    # -- devices -------------------------------------------------------------------------------
    def made(self, inputs: Any, out: Any) -> None:
        """Keeps where the generated code made each output off the device: the line that
        made the first such tensor it derives from, else the line running."""
        line: str | None = None
        for tensor in _fakes(out):
            if tensor.device.type in (self.device_type, "meta"):
                continue
            if line is None:
                origins = (self.made_off.get(t) for t in _fakes(inputs))
                line = next((o for o in origins if o is not None), None) or self.generated_frame()
            if line is None:
                return  # not made by generated code
            self.made_off[tensor] = line

    def generated_frame(self) -> str | None:
        """``stage0.py:57: <line>``: the innermost frame running the package's generated code
        (not its runtime/), or None."""
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(self.package_dir) and os.sep not in path[len(self.package_dir) :]:
                line = linecache.getline(path, frame.f_lineno).strip()
                return f"{os.path.basename(path)}:{frame.f_lineno}: {line}"
            frame = frame.f_back  # type: ignore[assignment]  # ends at None
        return None

    def mismatch(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception
    ) -> DeviceMismatch:
        off = [t for t in _fakes((args, kwargs)) if t.device.type != self.device_type]
        where = next((self.made_off[t] for t in off if t in self.made_off), None)
        devices = sorted({str(t.device) for t in _fakes((args, kwargs))})
        made = f"; the {off[0].device} tensor was made at {where}" if off and where else ""
        return DeviceMismatch(f"{func} mixes {' and '.join(devices)}{made} ({first_line(exc)})")

    def on_device(self, func: Any, args: tuple[Any, ...]) -> None:
        off = sorted({str(t.device) for t in _fakes(args) if t.device.type != "cuda"})
        if off:
            where = self.made_off.get(next(t for t in _fakes(args) if t.device.type != "cuda"))
            raise DeviceMismatch(
                f"{func} is given a tensor on {', '.join(off)}: NCCL takes CUDA tensors only"
                + (f" (made at {where})" if where else "")
            )

    # -- live bytes --------------------------------------------------------------------------
    def __enter__(self) -> Rehearsal:
        resize = torch.UntypedStorage.resize_
        self.restore_resize = resize

        def resized(storage: torch.UntypedStorage, size: int) -> Any:
            done = resize(storage, size)
            self.resized(storage)
            return done

        torch.UntypedStorage.resize_ = resized  # type: ignore[method-assign,assignment]
        self.restore_tolist = FakeTensor.tolist
        FakeTensor.tolist = lambda tensor: self.tolist(tensor)  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self.restore_resize  # type: ignore[method-assign]
        FakeTensor.tolist = self.restore_tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def count(self, out: object) -> None:
        """Counts the storages of an operator's outputs ``out`` (on the device) until freed:
        :class:`LiveTensorBytes` looks at every live storage after every operator; here the
        last operator's outputs are looked at, and every storage only when the count (which
        may still hold storages freed since) passes the peak: the peak is exact, and an
        operator costs what it returns, not what is alive (thousands of tensors at 512
        ranks)."""
        for ref in self.young:
            if ref in self.sizes and ref.expired():  # type: ignore[no-untyped-call]  # torch
                self.bytes -= self.sizes.pop(ref)
        self.young = []
        half = False
        for tensor in _fakes(out):
            half = half or tensor.dtype in _HALF
            if self.counts(tensor.device):
                storage = tensor.untyped_storage()
                ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]  # torch
                if ref not in self.sizes:
                    self.sizes[ref] = storage.nbytes()
                    self.bytes += self.sizes[ref]
                    self.young.append(ref)
        self.operators += 1
        self.half_precision += half
        self.steps_begun()
        if self.bytes > (self.setup_peak if self.setup else self.peak):
            self.settle()
            self.new_peak()

    def steps_begun(self) -> None:
        """At the first operator of the first action, the steps begin: their peak starts from
        what setup left alive."""
        if self.setup and ACTIVITY.now is not None:
            self.setup = False
            self.settle()
            self.peak = self.bytes
            self.peak_at = ACTIVITY.now[0]

    def new_peak(self) -> None:
        if self.setup:
            self.setup_peak = max(self.setup_peak, self.bytes)
        elif self.bytes > self.peak:
            self.peak = self.bytes
            self.peak_at = ACTIVITY.now[0] if ACTIVITY.now is not None else None

    def settle(self) -> None:
        """Uncounts every storage freed since it was counted."""
        for ref in [r for r in self.sizes if r.expired()]:  # type: ignore[no-untyped-call]
            self.bytes -= self.sizes.pop(ref)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A counted storage resized in place (FSDP2 frees and refills its gathered
        parameters so)."""
        ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]  # torch
        if ref in self.sizes:
            size = storage.nbytes()
            self.bytes += size - self.sizes[ref]
            self.sizes[ref] = size
            self.steps_begun()
            if self.bytes > (self.setup_peak if self.setup else self.peak):
                self.settle()
                self.new_peak()

    # -- values --------------------------------------------------------------------------------
    def read(self, tensor: torch.Tensor) -> bool | int | float:
        if not isinstance(tensor, FakeTensor):  # a real one (a device mesh's rank numbers)
            with unset_fake_temporarily():
                return tensor.item()
        value = self.values.get(tensor)
        if value is not None:
            with unset_fake_temporarily():  # a real tensor, read as such
                return value.item()
        return _unknown(tensor.dtype)

    def tolist(self, tensor: torch.Tensor) -> Any:
        """``FakeTensor.tolist`` in one go (torch's reads each element, an operator each: the
        metrics' per-rank tables at 512 ranks): the known value's, else 1 (0 if boolean)."""
        value = self.values.get(tensor)
        if value is not None:
            with unset_fake_temporarily():
                return value.tolist()
        unknown = _unknown(tensor.dtype)

        def nested(shape: tuple[int, ...]) -> Any:
            return [nested(shape[1:]) for _ in range(shape[0])] if shape else unknown

        return nested(tuple(tensor.shape))

    def count_collective(self, name: str) -> None:
        """One collective ``name`` more, in the action running."""
        now = ACTIVITY.now
        kind = now[0].kind if now is not None else "setup"
        self.collectives.setdefault(name, Counter())[kind] += 1

    def collective(self, func: Any, args: tuple[Any, ...]) -> None:
        name = func._schema.name.split("::")[-1].strip("_")
        if name in _TRANSFERS:  # batched by torch's schedule: counted, not placed in actions
            self.transfers[_TRANSFERS[name]] += 1
        else:
            self.count_collective(name)
        if name in ("allreduce", "broadcast"):
            return  # this rank's values stand for every rank's
        if name == "allgather":
            for slots, given in zip(args[0], args[1]):
                value = self.values.get(given)
                for slot in slots:
                    if value is None:
                        self.values.forget(slot)
                        continue
                    with unset_fake_temporarily():
                        self.values[slot] = value.clone()
            return
        for tensor in tree_flatten(args)[0]:
            if isinstance(tensor, FakeTensor):
                self.values.forget(tensor)  # received or reduced: unknown

    def follow(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Keeps the values of an operator's small outputs (and of the inputs it modifies)
        computed from known values only; forgets those of the inputs it modifies otherwise."""
        inputs = list(_fakes((args, kwargs)))
        if any(a not in self.values for a in inputs):  # most operators: a parameter's, ...
            if func._schema.is_mutable:
                for tensor in inputs:
                    self.values.forget(tensor)
            return
        outputs = list(_fakes(out))
        if not (inputs or outputs) or any(o.numel() > SMALL for o in outputs):
            return
        if torch.Tag.nondeterministic_seeded in func.tags:
            return
        computed = self.compute(func, args, kwargs)
        if computed is None:
            for tensor in outputs + (inputs if func._schema.is_mutable else []):
                self.values.forget(tensor)
            return
        for tensor, value in zip(tree_flatten(out)[0], tree_flatten(computed)[0]):
            if isinstance(tensor, FakeTensor) and isinstance(value, torch.Tensor):
                self.values[tensor] = value

    def compute(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` on the known values (on the CPU), modifying them as it modifies its
        inputs; None when the CPU refuses it."""

        def real(value: Any) -> Any:
            if isinstance(value, FakeTensor):
                return self.values[value]
            if isinstance(value, torch.device) and value.type != "cpu":
                return torch.device("cpu")
            return value

        with unset_fake_temporarily():
            try:
                computed = func(*tree_map(real, args), **tree_map(real, kwargs))
            except Exception:  # noqa: BLE001 - an operator the CPU refuses: values unknown
                return None
        return () if computed is None else computed


def _unknown(dtype: torch.dtype) -> bool | int | float:
    """What a value the dry run cannot know reads as: 1 (0 if boolean)."""
    if dtype == torch.bool:
        return False
    return 1.0 if dtype.is_floating_point or dtype.is_complex else 1


def _fakes(value: Any) -> Iterator[FakeTensor]:
    """The fake tensors in an operator's arguments or results (nested tuples, lists, dicts):
    what ``tree_flatten`` finds, faster, for every operator."""
    if isinstance(value, FakeTensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _fakes(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _fakes(item)


def _engine_asks() -> bool:
    """Whether the operator being dispatched was called by autograd's engine (C++ running a
    backward) rather than by Python code."""
    frame = sys._getframe(2)  # the dispatch mode's caller
    while frame is not None and frame.f_code.co_filename in _WRAPPERS:
        frame = frame.f_back  # type: ignore[assignment]  # ends at None
    return frame is not None and frame.f_code is _ENGINE


# -- what is faked ----------------------------------------------------------------------------
class _FakeEvent:
    """``torch.cuda.Event`` without a device: recorded, waited for and timed at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> _FakeEvent:
        return self

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Any) -> float:
        return 0.0


class _FakeStream:
    """``torch.cuda.Stream`` without a device: every wait and record returns at once."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else _FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _HeldWork:
    """A fake process group's work on sends, holding the tensors sent as long as it lives: a
    real one (gloo's, NCCL's) keeps them until it is dropped, which torch's schedules do after
    waiting on it, as late as the end of the step."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def held(works: list[Any], ops: list[dist.P2POp]) -> list[Any]:
    """``works`` (of torch's schedules' batched transfers ``ops``), holding what they send."""
    sent = [op.tensor for op in ops if op.op is dist.isend]
    return [_HeldWork(work, sent) for work in works] if sent else works


class _CudaGuard(torch._C._acc.DeviceGuard):
    """A device guard that says it is CUDA's (see :meth:`Fakes.cuda_guard`)."""

    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.CUDA


class Fakes:
    """What torch cannot pretend on a machine without the device, replaced for the dry run's
    duration (``with Fakes(...)``, restored on exit) and listed in :attr:`faked`. The process
    group is the fake one whatever the device (:meth:`init_process_group`)."""

    def __init__(self, device_type: str, rank: int, world: int) -> None:
        self.device_type = device_type
        self.rank, self.world = rank, world  # the rank played now (set per rank)
        self.local_device = 0  # what torch.cuda.set_device set
        self.mode: Rehearsal | None = None  # the played rank's
        self.peak: Callable[[], int] = lambda: 0  # the rank's fake-measured peak
        self.start_group = dist.init_process_group  # the real one
        self.faked: list[str] = []
        self._undo: list[Callable[[], None]] = []
        #: autograd cannot run on CUDA tensors in a torch built without CUDA: see cuda_guard
        built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]  # torch
        self.cpu_only_torch = device_type == "cuda" and not built

    def patch(self, owner: Any, name: str, value: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def __enter__(self) -> Fakes:
        try:
            self.patch(dist, "init_process_group", self.init_process_group)
            self.faked.append(
                f"the process group: torch's fake one (collectives return at once) instead of "
                f"{'NCCL' if self.device_type == 'cuda' else 'gloo'}"
            )
            self.patch(dist, "all_gather_object", self.all_gather_object)
            self.patch(dist, "broadcast_object_list", self.broadcast_object_list)
            self.patch(DeviceMesh, "mesh", property(_real_mesh))
            self.patch(DeviceMesh, "__init__", _real_mesh_init)
            self.faked.append(
                "collectives of Python objects (fake tensors cannot carry their bytes): each "
                "rank's object is this rank's"
            )
            original = torch_schedules._batch_p2p
            self.patch(
                torch_schedules,
                "_batch_p2p",
                lambda ops, *args, **kwargs: held(original(ops, *args, **kwargs), ops),
            )
            self.faked.append(
                "the fake process group's sends hold the tensors they send until the schedule "
                "drops their work, as a real one's do (the fake one's return at once, holding "
                "nothing)"
            )
            if self.device_type == "cuda":
                self.fake_cuda()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def init_process_group(self, backend: str | None = None, **kwargs: Any) -> None:
        """``dist.init_process_group`` as ``parallel.init_distributed`` calls it, checked to be
        the device's backend, started as the played rank of the fake process group."""
        expected = "nccl" if self.device_type == "cuda" else "gloo"
        if backend != expected:
            raise PipelineRunError(f"the run started process group {backend!r}, not {expected}")
        device = kwargs.pop("device_id", None)
        if self.device_type == "cuda" and (
            device is None or device != torch.device("cuda", self.local_device)
        ):
            raise PipelineRunError(
                f"the NCCL process group was bound to {device}, not the rank's cuda:"
                f"{self.local_device}"
            )
        self.start_group("fake", store=FakeStore(), rank=self.rank, world_size=self.world, **kwargs)

    def all_gather_object(self, object_list: list[Any], obj: Any, group: Any = None) -> None:
        self.counted("all_gather_object")
        object_list[:] = [obj] * len(object_list)

    def broadcast_object_list(self, object_list: list[Any], *args: Any, **kwargs: Any) -> None:
        self.counted("broadcast_object_list")  # this rank's objects stand for the source's

    def counted(self, name: str) -> None:
        if self.mode is not None:
            now = ACTIVITY.now
            kind = now[0].kind if now is not None else "setup"
            self.mode.collectives.setdefault(name, Counter())[kind] += 1

    def fake_cuda(self) -> None:
        cuda = torch.cuda

        def set_device(device: Any) -> None:
            self.local_device = device if isinstance(device, int) else torch.device(device).index

        stream = _FakeStream()
        replacements: dict[str, Any] = {
            "set_device": set_device,
            "current_device": lambda: self.local_device,
            "device_count": lambda: min(self.world, GPUS_PER_NODE),
            "get_device_name": lambda device=None: "fake CUDA device (--dry-run)",
            "Stream": _FakeStream,
            "Event": _FakeEvent,
            "current_stream": lambda device=None: stream,
            "default_stream": lambda device=None: stream,
            "stream": lambda s=None: contextlib.nullcontext(),
            "synchronize": lambda device=None: None,
            "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
            "set_rng_state": lambda state, device="cuda": None,
            "max_memory_allocated": lambda device=None: self.peak(),
            "memory_allocated": lambda device=None: 0,
            "reset_peak_memory_stats": lambda device=None: None,
        }
        for name, value in replacements.items():
            self.patch(cuda, name, value)
        self.patch(torch.accelerator, "current_stream", lambda device=None: stream)
        self.faked.append(
            "torch.cuda's device, streams, events, random state and memory statistics "
            "(max_memory_allocated answers the live fake-tensor peak)"
        )
        self.faked.append(
            "NCCL's device_id (torch refuses it without CUDA): checked to be the rank's "
            "cuda:LOCAL_RANK, not passed on"
        )
        kernels = contextlib.ExitStack()
        kernels.enter_context(fused_kernels())
        self._undo.append(kernels.close)
        self.faked.append(
            "attention's choice of kernel, which needs a GPU: a GPU's fused kernel (flash, "
            "memory-efficient) instead of the math path, which keeps the probabilities"
        )
        self.patch(cuda.amp.common, "amp_definitely_not_available", lambda: False)
        self.patch(cuda, "is_bf16_supported", lambda *args, **kwargs: True)
        self.faked.append("autocast's check that CUDA is available (and supports bf16)")
        if self.cpu_only_torch:
            self.cuda_guard()

    def cuda_guard(self) -> None:
        """A torch built without CUDA has no CUDA device guard, which autograd looks up for
        every CUDA tensor it records (and aborts the process without): a guard that says it
        is CUDA's (a Python device guard, made by torch's own API for PrivateUse1 devices) is
        put in CUDA's slot of c10's registry for the dry run's duration, as torch's fake
        tensor mode puts a no-op guard there on a CUDA build without a GPU."""
        library = Path(torch.__file__).parent / "lib" / "libc10.so"
        try:
            c10 = ctypes.CDLL(str(library))
            first = ctypes.c_void_p.in_dll(c10, "_ZN3c104impl26device_guard_impl_registryE")
        except (OSError, ValueError) as exc:
            raise PipelineRunError(
                f"--dry-run --device cuda: this torch is built without CUDA, and its CUDA "
                f"device guard cannot be faked here ({exc}); run the dry run with a torch "
                "built with CUDA (a GPU is not needed)"
            ) from None
        base = ctypes.addressof(first)
        width = ctypes.sizeof(ctypes.c_void_p)

        def slot(device_type: Any) -> ctypes.c_void_p:
            return ctypes.c_void_p.from_address(base + width * int(device_type))

        kinds = torch._C._autograd.DeviceType
        cuda_slot, spare = slot(kinds.CUDA), slot(kinds.PrivateUse1)
        if cuda_slot.value is not None:
            return  # torch has one
        before = spare.value
        torch._C._acc.register_python_privateuseone_device_guard(_GUARD)
        cuda_slot.value, spare.value = spare.value, before
        self.patch(DTensor, "__new__", _dtensor_with_device)

        def restore() -> None:
            cuda_slot.value = None

        self._undo.append(restore)
        threads = torch.autograd.set_multithreading_enabled(False)
        threads.__enter__()
        self._undo.append(lambda: threads.__exit__(None, None, None))
        self.faked.append(
            "autograd on CUDA, which a torch built without CUDA cannot run: a device guard "
            "that says it is CUDA's in c10's registry, autograd's engine on the calling "
            "thread, and fake tensors telling the engine, when it asks as it runs a backward, "
            "that they are on meta (it would look for a CUDA stream); DTensors (tensor "
            "parallelism) made to answer the same way"
        )


#: the device guard Fakes.cuda_guard registers (c10 keeps a pointer to it: it must live on)
_GUARD = _CudaGuard()


_MESH, _MESH_INIT = DeviceMesh.mesh, DeviceMesh.__init__


def _real_mesh(mesh: DeviceMesh) -> torch.Tensor:
    """``DeviceMesh.mesh`` computed from the mesh's real rank numbers outside the fake tensor
    mode (a mesh FSDP2 makes for tensor-parallel parameters in a played rank's setup would
    otherwise look up its ranks in fake tensors, whose values are unknown)."""
    with unset_fake_temporarily():
        return cast(torch.Tensor, _MESH.fget(mesh))  # type: ignore[attr-defined]


def _real_mesh_init(mesh: DeviceMesh, *args: Any, **kwargs: Any) -> None:
    """``DeviceMesh.__init__`` outside the fake tensor mode, for :func:`_real_mesh`'s reason
    (it finds this rank's coordinates in the mesh's rank numbers)."""
    with unset_fake_temporarily():
        _MESH_INIT(mesh, *args, **kwargs)


def _forget_dtensor_shardings() -> None:
    """Empty DTensor's caches of sharding propagation (its C++ one and its Python one). The
    ranks a dry run plays one after another in one process each make their process groups
    and device mesh anew, and torch compares two meshes of the same shape and names as equal
    whatever their groups: a cached result would hand a rank's new DTensors the mesh of a rank
    played before, whose groups are gone."""
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    propagator: Any = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()


def _dtensor_with_device(
    cls: type, local_tensor: torch.Tensor, spec: Any, *, requires_grad: bool
) -> DTensor:
    """``DTensor.__new__`` during a fake-CUDA dry run on a torch built without CUDA: the same
    wrapper around ``local_tensor``, but one that asks the dispatch modes for its device (as
    fake tensors do), so that :class:`Rehearsal` can tell autograd's engine it is on ``meta``
    (the engine would look for the stream of the CUDA device a DTensor otherwise stores)."""
    meta = spec.tensor_meta
    made: Any = torch.Tensor._make_wrapper_subclass(
        cls,
        meta.shape,
        strides=meta.stride,
        dtype=local_tensor.dtype,
        device=local_tensor.device,
        layout=local_tensor.layout,
        requires_grad=requires_grad,
        dispatch_device=True,
    )
    made._spec = spec
    made._local_tensor = local_tensor
    return cast(DTensor, made)


# -- playing ranks ----------------------------------------------------------------------------
def rehearsal_config(config: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """The options a played rank runs with, and what of the given ones it leaves out: at most
    :data:`STEPS` steps; nothing written (logs, sinks, traces, checkpoints, --save), nothing
    resumed, evaluated or compiled."""
    left_out = []
    for name, what in (
        ("log_json", "--log-json"),
        ("tensorboard", "--tensorboard"),
        ("wandb", "--wandb"),
        ("trace", "--trace"),
        ("save", "--save"),
        ("checkpoint_dir", "--checkpoint-dir"),
    ):
        if getattr(config, name):
            left_out.append(f"{what} (nothing is written)")
    if config.resume:
        left_out.append("--resume (the checkpoint is not read)")
    if config.eval_data:
        left_out.append("--eval-data (no evaluation)")
    if config.compile:
        left_out.append("--compile (fake tensors compile nothing real)")
    played = dataclasses.replace(
        config,
        steps=max(1, min(config.steps, STEPS)),
        eval_only=False,
        eval_data=None,
        eval_every=0,
        log_json=None,
        tensorboard=None,
        wandb=None,
        trace=None,
        trace_steps=None,
        save=None,
        save_format=None,
        checkpoint_dir=None,
        resume=False,
        resume_from=None,
        compile=False,
        log_every=1,
    )
    return played, left_out


@contextlib.contextmanager
def _environment(rank: int, world: int) -> Iterator[None]:
    """torchrun's variables for ``rank`` of ``world`` (``GPUS_PER_NODE`` a node), restored
    after."""
    local = min(world, GPUS_PER_NODE)
    values = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank % local),
        "LOCAL_WORLD_SIZE": str(local),
    }
    saved = {name: os.environ.get(name) for name in (*values, "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(values)
    for name in ("MASTER_ADDR", "MASTER_PORT"):  # no torchrun store: nothing reaches for one
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def play_rank(
    rank: int,
    pipeline: Pipeline,
    config: TrainConfig,
    fakes: Fakes,
    play: Play,
    package_dir: Path,
) -> RankResult:
    """Rank ``rank`` of the job, played: its process group and layout (``init_distributed``,
    as train.py starts them), then ``play`` under fake tensors; what it did."""
    world = config.world_size or 1
    result = RankResult(rank, world, config.device)
    fakes.rank, fakes.world = rank, world
    began = time.perf_counter()
    mode = Rehearsal(torch.device(config.device), fakes.cpu_only_torch, package_dir)
    fakes.mode = mode
    fakes.peak = lambda: mode.peak
    schedule = None
    ACTIVITY.reset()
    _forget_dtensor_shardings()  # made with the ranks played before
    try:
        with _environment(rank, world):
            fakes.local_device = 0  # a fresh process's current device
            available = torch.cuda.is_available
            if config.device == "cuda":  # init_distributed's check that there is a GPU
                torch.cuda.is_available = lambda: True
            try:
                layout = init_distributed(
                    pipeline, config.device, config.dp, config.dp_shard, config.timeout
                )
            finally:
                torch.cuda.is_available = available
            result.pp_rank, result.dp_rank = layout.pp_rank, layout.dp_rank
            result.stages = tuple(s.index for s in pipeline.stages_on(layout.pp_rank))
            result.device, mode.device = str(layout.device), layout.device
            with FakeTensorMode(allow_non_fake_inputs=True), mode:
                schedule = play(config, layout)
            result.steps = config.steps
    except Exception as exc:  # noqa: BLE001 - the rank's error is its result
        failed = ACTIVITY.failed or (ACTIVITY.now[0] if ACTIVITY.now is not None else None)
        result.action = failed.what() if failed is not None else None
        cause = _root_cause(exc)  # torch's schedule wraps what a stage raised
        result.error = f"{type(cause).__name__}: {first_line(cause)}"
        result.line = generated_line(exc, package_dir)
    finally:
        fakes.mode = None
        if dist.is_initialized():
            dist.destroy_process_group()
    result.seconds = time.perf_counter() - began
    result.peak, result.setup_peak = mode.peak, mode.setup_peak
    result.operators, result.half_precision = mode.operators, mode.half_precision
    result.peak_at = mode.peak_at.what() if mode.peak_at is not None else None
    result.collectives, result.transfers = mode.collectives, mode.transfers
    if schedule is not None or config.schedule in SINGLE_STAGE or config.schedule == "auto":
        ranks = RankMesh.of(pipeline, config.dp, config.dp_shard)
        pp_rank = result.pp_rank if result.pp_rank >= 0 else ranks.pp_rank_of(rank)
        try:
            result.predicted, result.prediction_note = predicted_peak(
                pipeline, config, pp_rank, schedule
            )
        except Exception as exc:  # noqa: BLE001 - the prediction is a figure, not the check
            result.prediction_note = f" (no prediction: {first_line(exc)})"
    return result


def play_ranks(
    package: ModuleType,
    pipeline: Pipeline,
    config: TrainConfig,
    play: Play,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> list[RankResult]:
    """``--dry-run``: each rank of ``--world-size`` in turn (or ``--rank``) played by ``play``
    (the driver's phases), each report said as it ends (``say``: a line at a time); what each
    played rank did."""
    if dist.is_initialized():
        raise PipelineRunError("--dry-run plays its ranks in a process without a process group")
    world = config.world_size or 1
    played, left_out = rehearsal_config(config)
    ranks = [config.rank] if config.rank is not None else list(range(world))
    package_dir = Path(package.__file__ or ".").resolve().parent
    layout = (
        f"{pipeline.num_ranks} pipeline ranks x --dp {config.dp} x --dp-shard {config.dp_shard}"
        + (f" x tp {pipeline.tp}" if pipeline.tp > 1 else "")
    )
    if config.dp * config.dp_shard * pipeline.tp > 1:  # where the data-parallel ranks sit
        layout += f"; {RankMesh.of(pipeline, config.dp, config.dp_shard).describe()}"
    which = f"rank {ranks[0]}" if len(ranks) == 1 else f"each of its {world} ranks in turn"
    say(
        f"dry run of {pipeline.model_class} in {pipeline.num_stages} stages: a job of {world} "
        f"processes ({layout}) on --device {config.device}, {which}; schedule "
        f"{config.schedule}, {config.microbatches} microbatches x {config.accumulate} "
        f"accumulation, {played.steps} step{'s' if played.steps > 1 else ''}"
    )
    results = []
    with Fakes(config.device, ranks[0], world) as fakes:
        for line in fakes.faked:
            say(f"faked: {line}")
        for line in left_out:
            say(f"left out: {line}")
        for rank in ranks:
            result = play_rank(rank, pipeline, played, fakes, play, package_dir)
            results.append(result)
            for line in result.describe():
                say(line)
    failed = [r for r in results if not r.ok]
    fullest = max(results, key=lambda r: r.peak)
    seconds = sum(r.seconds for r in results)
    say(
        f"dry run: {len(results) - len(failed)} of {len(results)} rank"
        f"{'s' if len(results) > 1 else ''} ok in {seconds:.1f} s "
        f"({seconds / len(results):.2f} s a rank); the fullest, rank {fullest.rank}, peaks at "
        f"{fullest.peak / 2**20:.2f} MiB"
        + (
            f"; FAILED: rank{'s' if len(failed) > 1 else ''} "
            f"{', '.join(str(r.rank) for r in failed)}"
            if failed
            else ""
        )
    )
    return results


def run_dry(package: ModuleType, pipeline: Pipeline, config: TrainConfig, play: Play) -> int:
    """``--dry-run``'s exit status: 0 when every played rank's setup and steps succeeded
    (see :func:`play_ranks`), 1 otherwise."""
    return 0 if all(r.ok for r in play_ranks(package, pipeline, config, play)) else 1
