"""The pipeline description, typed: what train.py's ranks, ``autopipe verify`` and the report
know about a generated pipeline.

Copied into every generated pipeline as ``runtime/core/pipeline.py``; it needs only torch. A
package's ``PIPELINE`` stays the plain JSON dict that ``pipeline.json`` holds;
``Pipeline.from_json`` checks it (raising :class:`PipelineFormatError` naming the first bad
field) and builds these frozen objects once, and ``to_json`` gives back exactly that dict. Facts derived from the description
(ranks, default microbatches, the stages of a rank, ...) are defined here and nowhere else.

Words: a *rank* is one process of a pipeline replica. The JSON names a stage's rank ``device``
(a key of the package contract, kept as it is); :attr:`Stage.rank` is that number.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .fields import FieldReader, is_int, is_number, is_object, json_kind
from .fixed_inputs import FixedInput, fixed_inputs_from_json
from .schedules import PipelineCosts
from .shapes import FormulaError, names_in, shape

FORMAT, VERSION = "autopipe.pipeline", 1


class PipelineFormatError(ValueError):
    """A pipeline description that breaks the contract; the message names the field."""


#: checks of JSON values, refusing with the field's path
_read = FieldReader(PipelineFormatError, "the pipeline contract")


#: the dimensions of the world's device mesh: replicas, shards of each stage, pipeline ranks
MESH_DIMENSIONS = ("dp_replicate", "dp_shard", "pp")
#: the mesh order (outermost first) that puts a pipeline's ranks next to each other, within a
#: node when they fit: global rank = data-parallel rank x pp + pipeline rank (the default)
PIPELINE_INNERMOST = ("dp_replicate", "dp_shard", "pp")
#: the mesh order that puts the shards of a stage next to each other (within a node when they
#: fit) and the pipeline across them: global rank = pipeline rank x data-parallel ranks + dp rank
SHARDS_INNERMOST = ("pp", "dp_replicate", "dp_shard")


def _is_mesh_order(value: Any) -> bool:
    """Whether ``value`` is a JSON list of the mesh dimensions, each once, in some order."""
    return (
        isinstance(value, list)
        and all(isinstance(name, str) for name in value)
        and sorted(value) == sorted(MESH_DIMENSIONS)
    )


def default_microbatches(num_stages: int) -> int:
    """Microbatches per pipeline run when none are given: two per stage, for the partitioner's
    cost model as for train.py."""
    return 2 * num_stages


# -- the description --------------------------------------------------------------------------
@dataclass(frozen=True)
class Dimension:
    """A dynamic dimension: sizes of the inputs ``sources`` (input, dimension) that change from
    batch to batch within ``min`` .. ``max`` (None: no upper bound); values' shapes are
    formulas of its name, and their ``shape`` is for its ``planned`` size."""

    name: str
    min: int
    max: int | None
    planned: int
    sources: tuple[tuple[str, int], ...]

    @classmethod
    def from_json(cls, data: Any, name: str, where: str) -> Dimension:
        _read.check(name, where, str.isidentifier, "named by an identifier")
        _read.fields(data, where, ("min", "max", "planned", "sources"))
        low = _read.check(data["min"], f"{where}.min", lambda v: is_int(v) and v >= 2, "2 or more")
        planned = _read.check(
            data["planned"], f"{where}.planned", lambda v: is_int(v) and v >= low, ">= min"
        )
        high = _read.check(
            data["max"],
            f"{where}.max",
            lambda v: v is None or (is_int(v) and v >= planned),
            "null or >= planned",
        )
        sources = _read.items(
            data["sources"],
            f"{where}.sources",
            lambda v: isinstance(v, list)
            and len(v) == 2
            and isinstance(v[0], str)
            and is_int(v[1])
            and v[1] >= 0,
            "[input, dimension] pair",
        )
        return cls(name, low, high, planned, tuple((i, d) for i, d in sources))

    def to_json(self) -> dict[str, Any]:
        return {
            "min": self.min,
            "max": self.max,
            "planned": self.planned,
            "sources": [list(s) for s in self.sources],
        }

    def holds(self, size: int) -> bool:
        """Whether ``size`` is within the bounds."""
        return self.min <= size and (self.max is None or size <= self.max)

    @property
    def bounds(self) -> str:
        """``[16:256]``, ``[2:]`` without an upper bound."""
        return f"[{self.min}:{'' if self.max is None else self.max}]"


@dataclass(frozen=True)
class Value:
    """A tensor passed into, between or out of stages. ``shape`` is its shape in the example
    microbatch (at the planned sizes of dynamic dimensions); ``sizes``, for a value with dynamic
    dimensions, one formula of their names (or a fixed size) per dimension."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # a torch dtype's name: "float32"
    requires_grad: bool
    sizes: tuple[str | int, ...] | None = None
    #: sequence parallelism: the dimension each tensor-parallel rank holds ``1/tp`` of (its
    #: slice of the sequence) where the value crosses a stage boundary; None: whole
    tp_dim: int | None = None

    @classmethod
    def from_json(cls, data: Any, name: str, where: str) -> Value:
        _read.fields(data, where, ("shape", "dtype", "requires_grad"), ("sizes", "tp_dim"))
        shape = _read.items(data["shape"], f"{where}.shape", lambda v: is_int(v) and v >= 0, "size")
        sizes = None
        if "sizes" in data:
            sizes = _read.items(
                data["sizes"],
                f"{where}.sizes",
                lambda v: (is_int(v) and v >= 0) or isinstance(v, str),
                "size or formula",
            )
            if len(sizes) != len(shape):
                raise _read.fail(f"{where}.sizes", data["sizes"], f"a list of {len(shape)} sizes")
        dtype = _read.check(
            data["dtype"],
            f"{where}.dtype",
            lambda v: isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype),
            "the name of a torch dtype",
        )
        requires_grad = _read.check(
            data["requires_grad"], f"{where}.requires_grad", lambda v: isinstance(v, bool), "a bool"
        )
        tp_dim = None
        if "tp_dim" in data:
            tp_dim = _read.check(
                data["tp_dim"],
                f"{where}.tp_dim",
                lambda v: is_int(v) and 0 <= v < len(shape),
                f"a dimension of its shape (0 to {len(shape) - 1})",
            )
        return cls(name, shape, dtype, requires_grad, sizes, tp_dim)

    def to_json(self) -> dict[str, Any]:
        data = {"shape": list(self.shape), "dtype": self.dtype, "requires_grad": self.requires_grad}
        data |= {"sizes": list(self.sizes)} if self.sizes is not None else {}
        return data | ({"tp_dim": self.tp_dim} if self.tp_dim is not None else {})

    @property
    def torch_dtype(self) -> torch.dtype:
        return cast(torch.dtype, getattr(torch, self.dtype))  # checked by from_json

    def shape_for(self, dimensions: dict[str, int] | None = None) -> tuple[int, ...]:
        """This value's shape for the dynamic dimensions' sizes ``dimensions`` (a static value:
        its shape)."""
        if self.sizes is None or dimensions is None:
            return self.shape
        return shape(self.sizes, dimensions)

    def local_shape(self, dimensions: dict[str, int] | None = None, tp: int = 1) -> tuple[int, ...]:
        """:meth:`shape_for`, as each of ``tp`` tensor-parallel ranks holds it (its slice along
        ``tp_dim``). Raises ValueError where the slices would not be equal."""
        shape = self.shape_for(dimensions)
        if self.tp_dim is None or tp == 1:
            return shape
        size = shape[self.tp_dim]
        if size % tp:
            raise ValueError(
                f"{self.name} is sliced along dimension {self.tp_dim} over the {tp} "
                f"tensor-parallel ranks (sequence parallelism), but has {size} there, which "
                f"{tp} does not divide; use sizes that are multiples of {tp}, or compile with "
                "--sequence-parallel off"
            )
        return shape[: self.tp_dim] + (size // tp,) + shape[self.tp_dim + 1 :]

    def meta_tensor(self, dimensions: dict[str, int] | None = None, tp: int = 1) -> torch.Tensor:
        """An empty tensor of this value's shape (for the dynamic dimensions' sizes
        ``dimensions``, on each of ``tp`` tensor-parallel ranks), dtype and autograd flag on
        the meta device."""
        shape = self.local_shape(dimensions, tp)
        tensor = torch.empty(shape, dtype=self.torch_dtype, device="meta")
        return tensor.requires_grad_(self.requires_grad)


@dataclass(frozen=True)
class Stage:
    """One stage: the values it takes and returns (by name, in call order), and its rank.
    Of its inputs, a later stage reads ``data_inputs`` (model inputs: ``labels`` in the last
    stage, a padding mask in every stage) from the step's batch on its own rank, not from the
    stage before; it receives the others. The first stage takes every input from the batch."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    rank: int  # the JSON's "device": the rank of a replica that runs this stage
    module: str  # the package's module defining it: "stage0"
    recompute: bool  # activations recomputed in backward by default (the partitioner's choice)
    blocks: tuple[str, ...] = ()  # original names of the blocks it holds as submodules, in order
    recompute_blocks: tuple[str, ...] = ()  # of those, the partitioner's choice to recompute
    #: the inputs it reads from the batch (empty for the first stage, which reads them all, and
    #: in pipelines compiled before: they relayed every model input through the stages between)
    data_inputs: tuple[str, ...] = ()
    #: values of earlier stages it computes again from sizes and constants instead of
    #: receiving them (a Llama's rotary tables), as the generated code names them
    recomputes: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Any, index: int, where: str) -> Stage:
        keys = ("inputs", "outputs", "device", "module", "recompute", "blocks", "recompute_blocks")
        _read.fields(data, where, keys, ("data_inputs", "recomputes"))
        data_inputs = _read.check(
            _read.names(data.get("data_inputs", []), f"{where}.data_inputs"),
            f"{where}.data_inputs",
            lambda names: set(names) <= set(data["inputs"]) and not (index == 0 and names),
            "names among the stage's inputs (none for the first stage)",
        )
        return cls(
            data_inputs=data_inputs,
            recomputes=_read.names(data.get("recomputes", []), f"{where}.recomputes"),
            index=index,
            inputs=_read.names(data["inputs"], f"{where}.inputs"),
            outputs=_read.names(data["outputs"], f"{where}.outputs"),
            rank=_read.check(
                data["device"], f"{where}.device", lambda v: is_int(v) and v >= 0, "a rank >= 0"
            ),
            module=_read.text(data["module"], f"{where}.module"),
            recompute=_read.check(
                data["recompute"], f"{where}.recompute", lambda v: isinstance(v, bool), "a bool"
            ),
            blocks=_read.names(data["blocks"], f"{where}.blocks"),
            recompute_blocks=_read.check(
                _read.names(data["recompute_blocks"], f"{where}.recompute_blocks"),
                f"{where}.recompute_blocks",
                lambda names: set(names) <= set(data["blocks"]),
                "names among the stage's blocks",
            ),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "device": self.rank,
            "module": self.module,
            "recompute": self.recompute,
            "blocks": list(self.blocks),
            "recompute_blocks": list(self.recompute_blocks),
        } | (
            ({"data_inputs": list(self.data_inputs)} if self.data_inputs else {})
            | ({"recomputes": list(self.recomputes)} if self.recomputes else {})
        )


@dataclass(frozen=True)
class Loss:
    """How train.py gets the loss: a model output (Hugging Face style), or the generated
    module ``module`` applied to the model's outputs and a ``target`` batch."""

    output: str | None = None
    module: str | None = None
    target: Value | None = None

    @classmethod
    def from_json(cls, data: Any, where: str) -> Loss:
        if isinstance(data, dict) and "module" in data:
            _read.fields(data, where, ("module", "target"))
            target = Value.from_json(data["target"], "target", f"{where}.target")
            return cls(module=_read.text(data["module"], f"{where}.module"), target=target)
        _read.fields(data, where, ("output",))
        output = _read.check(
            data["output"], f"{where}.output", lambda v: v is None or isinstance(v, str), "a name"
        )
        return cls(output=output)

    def to_json(self) -> dict[str, Any]:
        if self.module is not None:
            assert self.target is not None  # a loss module always has its target
            return {"module": self.module, "target": self.target.to_json()}
        return {"output": self.output}

    @property
    def needs_target(self) -> bool:
        """Whether the loss takes a target batch beside the model's outputs."""
        return self.module is not None


#: StageCosts tables with a number per stage, and with one per boundary between stages
_PER_STAGE = ("forward", "backward", "activations", "static_memory")
_PER_BOUNDARY = ("send_forward", "send_backward")
#: ... and the memory model's finer tables, absent from pipelines compiled before them
MEMORY_DETAIL = (
    "gradients",
    "buffers",
    "input_gradients",
    "transient_forward",
    "transient_backward",
    "transient_optimizer",
)
#: ... and each stage's wait on its receives from another rank, of plans whose device spec has
#: one (a calibrated CPU's ``receive_overhead``): absent otherwise
RECEIVE_WAITS = ("receive_forward", "receive_backward")
#: the optional per-stage tables, in the order they are written
DETAIL_TABLES = (*MEMORY_DETAIL, *RECEIVE_WAITS)


@dataclass(frozen=True)
class StageCosts:
    """What the cost model predicts per stage for one microbatch (seconds and bytes); the
    ``auto`` schedule orders each rank's actions by these."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    activations: tuple[float, ...]  # bytes kept from a microbatch's forward to its backward
    static_memory: tuple[float, ...]  # parameters, gradients, optimizer state
    send_forward: tuple[float, ...]  # one fewer: the boundary after each stage but the last
    send_backward: tuple[float, ...]
    memory_capacity: float | None = None  # bytes per rank, when the device spec says
    #: DETAIL_TABLES name -> bytes or seconds per stage (see schedules.PipelineCosts)
    detail: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, num_stages: int, where: str) -> StageCosts:
        _read.fields(
            data, where, (*_PER_STAGE, *_PER_BOUNDARY), ("memory_capacity", *DETAIL_TABLES)
        )
        tables = {k: _read.numbers(data[k], f"{where}.{k}", num_stages) for k in _PER_STAGE}
        detail = {
            k: _read.numbers(data[k], f"{where}.{k}", num_stages)
            for k in DETAIL_TABLES
            if k in data
        }
        for key in _PER_BOUNDARY:
            tables[key] = _read.numbers(data[key], f"{where}.{key}", max(num_stages - 1, 0))
        capacity = data.get("memory_capacity")
        if capacity is not None:
            _read.check(
                capacity, f"{where}.memory_capacity", lambda v: is_number(v) and v > 0, "> 0"
            )
        return cls(**tables, memory_capacity=capacity, detail=detail)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {k: list(getattr(self, k)) for k in (*_PER_STAGE, *_PER_BOUNDARY)}
        data |= {k: list(v) for k, v in self.detail.items()}
        if self.memory_capacity is not None:
            data["memory_capacity"] = self.memory_capacity
        return data


@dataclass(frozen=True)
class TrainingPlan:
    """The plan the partition was made for (train.py's defaults) and what it predicts."""

    microbatches: int  # per pipeline run
    accumulate: int  # pipeline runs per optimizer step
    step_time: float  # predicted seconds per optimizer step (0 when not predicted)
    flops_per_microbatch: float  # the model's forward + backward FLOPs on one microbatch
    peak_flops: float  # one device's peak FLOP/s, for the dtype it computes in (bf16 under
    #: bf16, else the model's; 0 when unknown)
    device: str  # the device spec the prediction is for
    #: dynamic dimensions: the sizes the step time and FLOPs are for
    sizes: dict[str, int] = field(default_factory=dict)
    #: planned for bf16 autocast: train.py runs ``--bf16`` by default (left out of the JSON
    #: when false; plans from before it are in the model's dtype)
    bf16: bool = False

    @classmethod
    def from_json(cls, data: Any, where: str) -> TrainingPlan:
        _read.fields(data, where, tuple(cls.__dataclass_fields__)[:-2], ("sizes", "bf16"))
        sizes = _read.check(
            data.get("sizes", {}),
            f"{where}.sizes",
            lambda v: isinstance(v, dict) and all(is_int(s) and s >= 2 for s in v.values()),
            "sizes of dynamic dimensions by name",
        )
        counts = {
            k: _read.check(data[k], f"{where}.{k}", lambda v: is_int(v) and v >= 1, "1 or more")
            for k in ("microbatches", "accumulate")
        }
        figures = {
            k: _read.check(data[k], f"{where}.{k}", lambda v: is_number(v) and v >= 0, ">= 0")
            for k in ("step_time", "flops_per_microbatch", "peak_flops")
        }
        bf16 = _read.boolean(data.get("bf16", False), f"{where}.bf16")
        return cls(
            **counts,
            **figures,
            device=_read.text(data["device"], f"{where}.device"),
            sizes=sizes,
            bf16=bf16,
        )

    def to_json(self) -> dict[str, Any]:
        data = {
            k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("sizes", "bf16")
        }
        return (
            ({"sizes": dict(self.sizes)} if self.sizes else {})
            | data
            | ({"bf16": True} if self.bf16 else {})
        )

    def utilisation(self, seconds: float, microbatches: int, devices: int) -> float | None:
        """The model FLOPs utilisation of training ``microbatches`` microbatches in
        ``seconds`` on ``devices`` devices (see :func:`flops_utilisation`)."""
        return flops_utilisation(
            self.flops_per_microbatch, self.peak_flops, seconds, microbatches, devices
        )


def flops_utilisation(
    flops_per_microbatch: float, peak_flops: float, seconds: float, microbatches: int, devices: int
) -> float | None:
    """The fraction of ``devices`` devices' peak FLOP/s that the model's FLOPs of
    ``microbatches`` microbatches in ``seconds`` are (MFU); None when a figure is unknown."""
    if not (peak_flops and flops_per_microbatch and seconds > 0):
        return None
    return flops_per_microbatch * microbatches / (seconds * devices * peak_flops)


@dataclass(frozen=True)
class Schedule:
    """The schedule the partition was made for (train.py's default) and its stage costs."""

    name: str
    costs: StageCosts

    @classmethod
    def from_json(cls, data: Any, num_stages: int, where: str) -> Schedule:
        _read.fields(data, where, ("name", "costs"))
        return cls(
            _read.text(data["name"], f"{where}.name"),
            StageCosts.from_json(data["costs"], num_stages, f"{where}.costs"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "costs": self.costs.to_json()}


@dataclass(frozen=True)
class TiedParameter:
    """A parameter held by several stages (tied embeddings): its original names, and the name
    each holding stage keeps its copy under. Its gradients are summed over the copies."""

    names: tuple[str, ...]
    holders: dict[int, str]  # stage index -> local name, by ascending stage

    @classmethod
    def from_json(cls, data: Any, num_stages: int, where: str) -> TiedParameter:
        _read.fields(data, where, ("names", "holders"))
        names = _read.names(data["names"], f"{where}.names")
        holders = _read.check(
            data["holders"], f"{where}.holders", lambda v: isinstance(v, dict), "an object"
        )
        typed = {}
        for key, name in holders.items():
            stage = isinstance(key, str) and key.isdigit() and str(int(key)) == key
            if not (stage and int(key) < num_stages):
                raise _read.fail(
                    f"{where}.holders", key, f"keyed by stage numbers 0 .. {num_stages - 1}"
                )
            typed[int(key)] = _read.text(name, f"{where}.holders.{key}")
        if list(typed) != sorted(typed):
            raise _read.fail(f"{where}.holders", list(holders), "keyed by ascending stage numbers")
        return cls(names, typed)

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "holders": {str(s): n for s, n in self.holders.items()}}

    @property
    def later_holders(self) -> dict[int, str]:
        """The holders past the first: their gradients are the same sum, counted once in norms."""
        return dict(list(self.holders.items())[1:])


@dataclass(frozen=True)
class ModelIdentity:
    """Which model a pipeline trains, whatever its partition: every tensor of the original
    model's ``state_dict`` (under its first name; tied names are in ``Pipeline.aliases``) with
    its shape and dtype, and ``digest``, a digest of the traced model (its class, its module
    tree with each module's class, and those tensors). Training checkpoints record it, and a run
    resumes only from checkpoints of the same identity."""

    digest: str
    tensors: dict[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype name)

    @classmethod
    def from_json(cls, data: Any, where: str) -> ModelIdentity:
        _read.fields(data, where, ("digest", "tensors"))
        digest = _read.text(data["digest"], f"{where}.digest")
        entries = _read.check(
            data["tensors"], f"{where}.tensors", lambda v: isinstance(v, dict), "an object"
        )
        tensors = {}
        for name, entry in entries.items():
            at = f"{where}.tensors.{name}"
            _read.fields(entry, at, ("shape", "dtype"))
            size = _read.items(
                entry["shape"], f"{at}.shape", lambda v: is_int(v) and v >= 0, "size"
            )
            dtype = _read.check(
                entry["dtype"],
                f"{at}.dtype",
                lambda v: isinstance(v, str) and isinstance(getattr(torch, v, None), torch.dtype),
                "the name of a torch dtype",
            )
            tensors[name] = (size, dtype)
        return cls(digest, tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "tensors": {n: {"shape": list(s), "dtype": d} for n, (s, d) in self.tensors.items()},
        }


@dataclass(frozen=True)
class PeftAdapter:
    """A PEFT model's adapter, as ``PeftModel.save_pretrained`` writes it: the content of
    ``adapter_config.json``, and the name in ``adapter_model.safetensors`` of each adapter
    tensor of the model's ``state_dict`` (the adapter's name left out of it)."""

    config: dict[str, Any]
    weights: dict[str, str]  # state_dict name -> adapter file name

    @classmethod
    def from_json(cls, data: Any, where: str) -> PeftAdapter:
        _read.fields(data, where, ("config", "weights"))
        config = _read.check(data["config"], f"{where}.config", is_object, "an object")
        weights = _read.check(
            data["weights"],
            f"{where}.weights",
            lambda v: isinstance(v, dict) and all(isinstance(n, str) for n in v.values()),
            "an object of names by state_dict name",
        )
        return cls(config, weights)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "weights": self.weights}


@dataclass(frozen=True)
class HuggingFaceModel:
    """What a ``transformers`` model's ``from_pretrained`` directory holds besides its weights:
    ``config.json`` (``architectures`` naming the class) and, for a model that generates,
    ``generation_config.json``, as ``save_pretrained`` writes them (differences from the
    defaults); for a PEFT model, those of its base model and its ``adapter``. Recorded at
    compile time; ``autopipe merge --hf`` and ``--save-format hf`` write them beside the trained
    weights."""

    config: dict[str, Any]
    generation_config: dict[str, Any] | None = None
    adapter: PeftAdapter | None = None  # a PEFT model's (``config`` is its base model's)

    @classmethod
    def from_json(cls, data: Any, where: str) -> HuggingFaceModel:
        _read.fields(data, where, ("config",), ("generation_config", "adapter"))
        config = _read.check(data["config"], f"{where}.config", is_object, "an object")
        generation = data.get("generation_config")
        if generation is not None:
            _read.check(generation, f"{where}.generation_config", is_object, "an object")
        adapter = data.get("adapter")
        return cls(
            config,
            generation,
            PeftAdapter.from_json(adapter, f"{where}.adapter") if adapter is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        return (
            {"config": self.config}
            | ({"generation_config": self.generation_config} if self.generation_config else {})
            | ({"adapter": self.adapter.to_json()} if self.adapter else {})
        )


@dataclass(frozen=True)
class Pipeline:
    """A generated pipeline: the model's inputs and outputs, its stages and the values they
    pass, how the loss is taken, the default schedule, and parameters held under several names."""

    model: str  # the original model's class, fully qualified
    signature: tuple[str, ...]  # the model's forward parameters, in order
    inputs: tuple[str, ...]  # the tensors of the example, by parameter name
    outputs: tuple[str, ...]  # one name per tensor leaf of the model's output
    stages: tuple[Stage, ...]
    values: dict[str, Value]  # every input, output and value between stages, by name
    loss: Loss
    schedule: Schedule
    tied: tuple[TiedParameter, ...]
    aliases: tuple[tuple[str, ...], ...]  # groups of names of one tensor in the original model
    #: integer inputs (and "target") -> the largest value synthetic batches draw
    input_ranges: dict[str, int]
    dp_shard: int  # the data-parallel ranks per stage the partition planned memory for
    plan: TrainingPlan | None = None  # absent from pipelines compiled before plans
    #: dynamic dimensions by name (compiled with --dynamic); values' sizes are formulas of them
    dimensions: dict[str, Dimension] = field(default_factory=dict)
    identity: ModelIdentity | None = None  # absent from pipelines compiled before identities
    #: the parameters (first names) that take no gradient (a frozen base under LoRA adapters):
    #: no gradients, optimizer state or reduction; empty in pipelines compiled before it
    frozen: tuple[str, ...] = ()
    huggingface: HuggingFaceModel | None = None  # a transformers model's configurations
    #: the example's arguments that hold no tensor, by name: fixed in the graph to these values
    #: (:mod:`.fixed_inputs`); empty in pipelines compiled before them
    fixed_inputs: dict[str, FixedInput] = field(default_factory=dict)
    #: the dimension that holds the batch of each input whose batch is not along dimension 0
    #: (a time-first sequence, an RNN's initial state), by name; every other input, and a
    #: loss's target, holds it along dimension 0. Empty in pipelines compiled before it
    batch_dims: dict[str, int] = field(default_factory=dict)
    #: the order of the run's device mesh, outermost dimension first: which ranks torchrun
    #: starts next to each other (see ``mesh.RankMesh``); the default in pipelines compiled
    #: before it, and left out of the JSON when it is the default
    mesh: tuple[str, ...] = PIPELINE_INNERMOST
    #: the tensor-parallel degree the package was compiled for (``autopipe compile --tp``):
    #: ranks each stage's sharded projections are split over, innermost in the mesh; 1 (left
    #: out of the JSON) without tensor parallelism
    tp: int = 1
    #: with ``tp``: the values between regions sliced along the sequence over the
    #: tensor-parallel ranks (those crossing a stage boundary say so by their ``tp_dim``)
    sequence_parallel: bool = False
    #: with ``tp``: the head's logits stay split over the vocabulary to the loss, which train.py
    #: computes vocabulary-parallel (torch's ``loss_parallel``, around its steps)
    loss_parallel: bool = False

    @classmethod
    def from_json(cls, data: Any) -> Pipeline:
        """The description in ``data`` (a package's ``PIPELINE``), checked field by field."""
        where = "pipeline"
        keys: tuple[str, ...]
        keys = ("format", "version", "model", "signature", "inputs", "outputs", "stages")
        keys += ("values", "loss", "schedule", "tied", "aliases", "input_ranges", "dp_shard")
        optional: tuple[str, ...]
        optional = ("plan", "dimensions", "identity", "huggingface", "frozen", "fixed_inputs")
        optional += ("batch_dims", "mesh", "tp", "sequence_parallel", "loss_parallel")
        _read.fields(data, where, keys, optional)
        if data["format"] != FORMAT:
            raise _read.fail(f"{where}.format", data["format"], repr(FORMAT))
        if data["version"] != VERSION:
            raise _read.fail(f"{where}.version", data["version"], f"{VERSION} (this runtime's)")
        _read.check(
            data["stages"],
            f"{where}.stages",
            lambda v: isinstance(v, list) and v,
            "a list of stages",
        )
        stages = tuple(
            Stage.from_json(s, i, f"{where}.stages[{i}]") for i, s in enumerate(data["stages"])
        )
        num_stages = len(stages)
        values = _read.check(
            data["values"], f"{where}.values", lambda v: isinstance(v, dict), "an object"
        )
        pipeline = cls(
            model=_read.text(data["model"], f"{where}.model"),
            signature=_read.names(data["signature"], f"{where}.signature"),
            inputs=_read.names(data["inputs"], f"{where}.inputs"),
            outputs=_read.names(data["outputs"], f"{where}.outputs"),
            stages=stages,
            values={n: Value.from_json(v, n, f"{where}.values.{n}") for n, v in values.items()},
            loss=Loss.from_json(data["loss"], f"{where}.loss"),
            schedule=Schedule.from_json(data["schedule"], num_stages, f"{where}.schedule"),
            tied=tuple(
                TiedParameter.from_json(t, num_stages, f"{where}.tied[{i}]")
                for i, t in enumerate(
                    _read.items(data["tied"], f"{where}.tied", lambda v: True, "tie")
                )
            ),
            aliases=tuple(
                _read.names(group, f"{where}.aliases[{i}]")
                for i, group in enumerate(
                    _read.items(data["aliases"], f"{where}.aliases", lambda v: True, "name group")
                )
            ),
            input_ranges=_read.check(
                data["input_ranges"],
                f"{where}.input_ranges",
                lambda v: isinstance(v, dict) and all(is_int(x) for x in v.values()),
                "an object of integers",
            ),
            dp_shard=_read.check(
                data["dp_shard"], f"{where}.dp_shard", lambda v: is_int(v) and v >= 1, "1 or more"
            ),
            plan=TrainingPlan.from_json(data["plan"], f"{where}.plan") if "plan" in data else None,
            dimensions={
                name: Dimension.from_json(d, name, f"{where}.dimensions.{name}")
                for name, d in _read.check(
                    data.get("dimensions", {}),
                    f"{where}.dimensions",
                    lambda v: isinstance(v, dict),
                    "an object",
                ).items()
            },
            identity=(
                ModelIdentity.from_json(data["identity"], f"{where}.identity")
                if "identity" in data
                else None
            ),
            huggingface=(
                HuggingFaceModel.from_json(data["huggingface"], f"{where}.huggingface")
                if "huggingface" in data
                else None
            ),
            frozen=_read.names(data.get("frozen", []), f"{where}.frozen"),
            fixed_inputs=fixed_inputs_from_json(
                data.get("fixed_inputs", {}), f"{where}.fixed_inputs", _read
            ),
            batch_dims=_read.check(
                data.get("batch_dims", {}),
                f"{where}.batch_dims",
                lambda v: isinstance(v, dict) and all(is_int(d) and d >= 1 for d in v.values()),
                "an object of dimensions (1 or more) by input name",
            ),
            mesh=tuple(
                _read.check(
                    data.get("mesh", list(PIPELINE_INNERMOST)),
                    f"{where}.mesh",
                    _is_mesh_order,
                    f"an order of the mesh dimensions {', '.join(MESH_DIMENSIONS)}",
                )
            ),
            tp=_read.check(
                data.get("tp", 1), f"{where}.tp", lambda v: is_int(v) and v >= 1, "1 or more"
            ),
            sequence_parallel=_read.boolean(
                data.get("sequence_parallel", False), f"{where}.sequence_parallel"
            ),
            loss_parallel=_read.boolean(data.get("loss_parallel", False), f"{where}.loss_parallel"),
        )
        pipeline._check_references()
        pipeline._check_batch_dims()
        pipeline._check_formulas()
        return pipeline

    def _check_references(self) -> None:
        """Names refer to values and outputs that exist; ranks are numbered 0 .. ranks - 1."""
        _read.known(self.inputs, "pipeline.inputs", self.values, "in pipeline.values")
        _read.known(self.outputs, "pipeline.outputs", self.values, "in pipeline.values")
        for stage in self.stages:
            where = f"pipeline.stages[{stage.index}]"
            _read.known(stage.inputs, f"{where}.inputs", self.values, "in pipeline.values")
            _read.known(stage.outputs, f"{where}.outputs", self.values, "in pipeline.values")
            _read.known(stage.data_inputs, f"{where}.data_inputs", self.inputs, "a model input")
            if not self.received(stage):
                raise _read.error(
                    f"{where}: receives nothing (every input it takes is read from the batch); "
                    "a pipeline stage receives at least one value from the stage before"
                )
        if self.loss.output is not None and self.loss.output not in self.outputs:
            raise _read.fail("pipeline.loss.output", self.loss.output, "one of pipeline.outputs")
        if self.identity is not None:
            _read.known(
                self.frozen, "pipeline.frozen", self.identity.tensors, "a tensor of the model"
            )
        ranks = sorted(set(self.rank_of_stage))
        if ranks != list(range(len(ranks))):
            raise _read.fail(
                "pipeline.stages[*].device", ranks, "ranks numbered from 0 without gaps"
            )

    def _check_batch_dims(self) -> None:
        """Each recorded batch dimension is an input's, within its rank."""
        where = "pipeline.batch_dims"
        for name, dim in self.batch_dims.items():
            if name not in self.inputs:
                raise _read.error(f"{where}: {name!r} is not a pipeline input")
            shape = list(self.values[name].shape)
            if dim >= len(shape):
                raise _read.fail(
                    f"{where}.{name}", dim, f"a dimension of the input's shape {shape} (1 or more)"
                )

    def _check_formulas(self) -> None:
        """Every value's formulas read known dimensions and give its shape at their planned
        sizes; each dimension's sources are inputs of the pipeline."""
        upper = {name: d.planned for name, d in self.dimensions.items()}
        for value in self.values.values():
            if value.sizes is None:
                continue
            where = f"pipeline.values.{value.name}.sizes"
            try:
                unknown = set().union(*map(names_in, value.sizes)) - set(upper)
                planned = shape(value.sizes, upper) if not unknown else None
            except (FormulaError, ArithmeticError) as exc:
                raise PipelineFormatError(f"{where}: {exc}") from None
            if unknown:
                raise _read.fail(
                    where, list(value.sizes), f"formulas of {sorted(upper) or 'no'} dimensions"
                )
            if planned != value.shape:
                raise _read.fail(
                    where, list(value.sizes), f"formulas giving the shape {list(value.shape)}"
                )
        if self.plan is not None:
            _read.known(tuple(self.plan.sizes), "pipeline.plan.sizes", upper, "a dynamic dimension")
        for dimension in self.dimensions.values():
            where = f"pipeline.dimensions.{dimension.name}.sources"
            _read.known(
                tuple(i for i, _ in dimension.sources), where, self.inputs, "a pipeline input"
            )

    def to_json(self) -> dict[str, Any]:
        """The JSON dict this was read from (``pipeline.json``), key for key (but ``mesh``,
        left out when it is the default order)."""
        return (
            {
                "format": FORMAT,
                "version": VERSION,
                "model": self.model,
                "signature": list(self.signature),
                "inputs": list(self.inputs),
                "outputs": list(self.outputs),
                "stages": [stage.to_json() for stage in self.stages],
                "values": {name: value.to_json() for name, value in self.values.items()},
                "loss": self.loss.to_json(),
                "schedule": self.schedule.to_json(),
                "tied": [tie.to_json() for tie in self.tied],
                "aliases": [list(group) for group in self.aliases],
                "input_ranges": dict(self.input_ranges),
                "dp_shard": self.dp_shard,
            }
            | ({"mesh": list(self.mesh)} if self.mesh != PIPELINE_INNERMOST else {})
            | ({"tp": self.tp} if self.tp > 1 else {})
            | ({"sequence_parallel": True} if self.sequence_parallel else {})
            | ({"loss_parallel": True} if self.loss_parallel else {})
            | ({"plan": self.plan.to_json()} if self.plan else {})
            | (
                {"dimensions": {n: d.to_json() for n, d in self.dimensions.items()}}
                if self.dimensions
                else {}
            )
            | ({"identity": self.identity.to_json()} if self.identity else {})
            | ({"huggingface": self.huggingface.to_json()} if self.huggingface else {})
            | ({"frozen": list(self.frozen)} if self.frozen else {})
            | (
                {"fixed_inputs": {n: f.to_json() for n, f in self.fixed_inputs.items()}}
                if self.fixed_inputs
                else {}
            )
            | ({"batch_dims": dict(self.batch_dims)} if self.batch_dims else {})
        )

    # -- derived facts ------------------------------------------------------------------------
    def digest(self) -> str:
        """A digest of this description (its JSON, keys sorted): which package, split included,
        a run ran, as its trace records it."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def rank_of_stage(self) -> list[int]:
        return [stage.rank for stage in self.stages]

    @property
    def num_ranks(self) -> int:
        """Ranks (processes) one replica of the pipeline runs on."""
        return len(set(self.rank_of_stage))

    @property
    def default_microbatches(self) -> int:
        """train.py's default --microbatches: the plan's."""
        return self.plan.microbatches if self.plan else default_microbatches(self.num_stages)

    @property
    def default_accumulate(self) -> int:
        """train.py's default --accumulate: the plan's."""
        return self.plan.accumulate if self.plan else 1

    @property
    def default_bf16(self) -> bool:
        """train.py's default for --bf16: the plan's precision."""
        return self.plan.bf16 if self.plan else False

    @property
    def model_class(self) -> str:
        """The model's class name without its module: ``GPT2LMHeadModel``."""
        return self.model.rsplit(".", 1)[-1]

    def stages_on(self, rank: int) -> list[Stage]:
        """The stages rank ``rank`` of a replica runs, in stage order."""
        return [stage for stage in self.stages if stage.rank == rank]

    @property
    def last_rank(self) -> int:
        """The rank running the last stage, which computes the loss."""
        return self.stages[-1].rank

    @property
    def recomputed(self) -> frozenset[int]:
        """The stages the partitioner chose to recompute (train.py's --recompute auto)."""
        return frozenset(stage.index for stage in self.stages if stage.recompute)

    @property
    def recomputed_blocks(self) -> frozenset[str]:
        """The blocks the partitioner chose to recompute one by one (--recompute auto)."""
        return frozenset(b for stage in self.stages for b in stage.recompute_blocks)

    def taken(self, stage: Stage) -> list[Value]:
        """Every value ``stage``'s forward takes, in its call order: those it receives and
        those it reads from the batch."""
        return [self.values[name] for name in stage.inputs]

    def received(self, stage: Stage) -> list[Value]:
        """The values ``stage`` receives (from the stage before; the first stage, from the
        schedule), in its call order: its inputs less those it reads from the batch."""
        return [self.values[name] for name in stage.inputs if name not in stage.data_inputs]

    def returned(self, stage: Stage) -> list[Value]:
        """The values ``stage`` returns, in order."""
        return [self.values[name] for name in stage.outputs]

    @property
    def data_inputs(self) -> list[Value]:
        """What a batch must hold: the inputs the first stage takes, in its order, then those
        later stages read from the batch, in stage order (model inputs nothing reads are left
        out)."""
        names = list(self.stages[0].inputs)
        for stage in self.stages[1:]:
            names += [name for name in stage.data_inputs if name not in names]
        return [self.values[name] for name in names]

    @property
    def first_inputs(self) -> list[Value]:
        """The inputs the first stage takes from the batch (the schedule splits them into its
        microbatches), in its order: the first of :attr:`data_inputs`."""
        return self.received(self.stages[0])

    def batch_dim(self, name: str) -> int:
        """The dimension of input ``name`` that holds the batch (a loss's ``target``: 0): the
        one a step's batch is split along into pipeline runs and microbatches."""
        return self.batch_dims.get(name, 0)

    @property
    def samples_per_microbatch(self) -> int:
        """Samples in the example microbatch: the batch dimension of the first model input."""
        return self.samples_in_microbatch()

    def samples_in_microbatch(self, dimensions: dict[str, int] | None = None) -> int:
        """Samples in a microbatch (for the dynamic dimensions' sizes ``dimensions``)."""
        if not self.inputs:
            return 1
        shape = self.values[self.inputs[0]].shape_for(dimensions)
        return shape[self.batch_dim(self.inputs[0])] if shape else 1

    @property
    def loss_over_tokens(self) -> bool:
        """Whether the loss is a mean over tokens, whose exponential is a perplexity: its labels
        (the loss module's target, else the model's input ``labels``) are integers of shape
        (batch, sequence). A classifier's labels (one per sample) and a regression's targets
        (floating point) are not."""
        if self.loss.target is not None:
            labels: Value | None = self.loss.target
        else:
            labels = self.values.get("labels") if "labels" in self.inputs else None
        return labels is not None and len(labels.shape) == 2 and labels.dtype in ("int64", "int32")

    @property
    def tokens_per_sample(self) -> int | None:
        """Tokens in one sample, for language models: the length of an integer input of shape
        (batch, sequence) such as ``input_ids``; None when the model has none."""
        return self.tokens_in_sample()

    def tokens_in_sample(self, dimensions: dict[str, int] | None = None) -> int | None:
        """Tokens in one sample (for the dynamic dimensions' sizes ``dimensions``)."""
        for name in self.inputs:
            value = self.values[name]
            if len(value.shape) == 2 and value.dtype in ("int64", "int32"):
                return value.shape_for(dimensions)[1 - self.batch_dim(name)]
        return None

    def flops_scale(self, dimensions: dict[str, int] | None) -> float:
        """A microbatch's FLOPs at the dynamic dimensions' sizes ``dimensions`` relative to the
        plan's, estimated as the ratio of the first input's elements (the tokens, for a language
        model): linear in them, where attention's part grows with the square of the length."""
        if not (dimensions and self.plan and self.plan.sizes and self.inputs):
            return 1.0
        value = self.values[self.inputs[0]]
        planned = math.prod(value.shape_for(self.plan.sizes))
        return math.prod(value.shape_for(dimensions)) / planned if planned else 1.0

    def tie_ranks(self, tie: TiedParameter) -> list[int]:
        """The ranks of a replica holding a copy of ``tie``, ascending."""
        return sorted({self.stages[s].rank for s in tie.holders})

    def pipeline_costs(self) -> PipelineCosts:
        """The stage costs under this placement, as the schedule simulator takes them."""
        return PipelineCosts(**self.schedule.costs.to_json(), device_of_stage=self.rank_of_stage)


def as_pipeline(pipeline: Pipeline | dict[str, Any]) -> Pipeline:
    """``pipeline`` typed: a package's ``PIPELINE`` dict is read with ``Pipeline.from_json``."""
    return pipeline if isinstance(pipeline, Pipeline) else Pipeline.from_json(pipeline)
