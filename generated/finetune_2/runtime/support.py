"""State of generated stages: parameters and buffers under the original model's names.

Copied into every generated pipeline as ``runtime/support.py``; it needs only torch.
"""

from __future__ import annotations

import importlib
import zlib
from collections.abc import Mapping, Sequence
from typing import ClassVar, TypeVar, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .core.kept_modules import run_over_packed, tensors_of
from .core.region_rng import on_rank_stream
from .core.sharded_layers import (
    ReplicatedHeadsParallel,
    SectionedColwiseParallel,
    TransposedLinear,
    TransposedRowwiseParallel,
)

#: name -> (shape, dtype, requires_grad, initialisation rule): a stage's or block's PARAMETERS.
ParameterTable = dict[str, tuple[tuple[int, ...], torch.dtype, bool, str]]
#: name -> (shape, dtype, persistent, initialisation rule or fixed value): BUFFERS.
BufferTable = dict[str, tuple[tuple[int, ...], torch.dtype, bool, "str | torch.Tensor"]]


_T = TypeVar("_T")


class MissingOperatorError(ImportError):
    """A stage calls an operator from outside torch whose module cannot be imported."""


def require_operators(operators: dict[str, str]) -> None:
    """Import the modules that register the operators from outside torch a stage calls
    (``"namespace::name"`` -> module), or say which package is missing."""
    for name, module in operators.items():
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingOperatorError(
                f"this pipeline calls the operator {name}, which the module {module} registers, "
                f"and that module cannot be imported ({exc}); install the package that provides "
                f"it (e.g. pip install {module.split('.')[0]})"
            ) from None


class IndexedModule(nn.Module):
    """A module whose children named ``"0"``, ``"1"`` ... are reached as ``module[0]``."""

    def __getitem__(self, key: int | str) -> nn.Module:
        # torch types _modules' values as Optional; the numbered children are real modules
        return cast(nn.Module, self._modules[str(key)])


class ModuleScope(IndexedModule):
    """Stands for a module of the original model that the stage does not call, so that the
    stage's parameters keep their original fully-qualified names."""


class Block(IndexedModule):
    """Base class of the generated block classes (blocks.py): a block of the original model,
    called by the stage, holding its parameters and buffers (``PARAMETERS`` / ``BUFFERS``,
    named within the block)."""

    PARAMETERS: ClassVar[ParameterTable] = {}
    BUFFERS: ClassVar[BufferTable] = {}

    def __init__(self, device: torch.device | str = "cpu", meta_state: bool = False):
        super().__init__()
        build_state(self, self.PARAMETERS, self.BUFFERS, device, meta_state)


def _parent(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    module = root
    *path, leaf = fqn.split(".")
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = ModuleScope()
            module.add_module(part, child)
        module = child
    return module, leaf


def build_state(
    root: nn.Module,
    parameters: ParameterTable,
    buffers: BufferTable,
    device: torch.device | str,
    meta_state: bool = False,
) -> None:
    """Create the parameters and buffers of a stage, uninitialised, on ``device``.

    ``parameters``: name -> (shape, dtype, requires_grad, init rule);
    ``buffers``: name -> (shape, dtype, persistent, init rule or fixed value). With ``meta_state``
    the parameters and persistent buffers stay on the meta device for a checkpoint to fill
    (``load_state_dict(..., assign=True)``); buffers with fixed values are always real.
    """
    state_device = "meta" if meta_state else device
    for name, (shape, dtype, requires_grad, _rule) in parameters.items():
        parent, leaf = _parent(root, name)
        tensor = torch.empty(shape, dtype=dtype, device=state_device)
        parent.register_parameter(leaf, nn.Parameter(tensor, requires_grad=requires_grad))
    for name, (shape, dtype, persistent, rule) in buffers.items():
        parent, leaf = _parent(root, name)
        if isinstance(rule, torch.Tensor):
            tensor = rule.to(device, copy=True)  # never shared between stages or blocks
        else:
            tensor = torch.empty(shape, dtype=dtype, device=state_device)
        parent.register_buffer(leaf, tensor, persistent=persistent)


@torch.no_grad()
def init_state(
    root: nn.Module, parameters: ParameterTable, buffers: BufferTable, seed: int = 0
) -> None:
    """Initialise a stage and its blocks deterministically: every tensor is drawn from a
    generator seeded by ``seed`` and its full name, so a parameter gets the same values whatever
    the partition.

    This is autopipe's generic initialisation (normal(0, 0.02) weights, zero biases, unit norm
    scales), not the model's own: load a checkpoint of the original model to start from that.
    """
    tables = [("", root, parameters, buffers)] + [
        (f"{fqn}.", block, block.PARAMETERS, block.BUFFERS)
        for fqn, block in root.named_modules()
        if isinstance(block, Block)
    ]
    for prefix, module, parameters, buffers in tables:
        for name, (_shape, _dtype, _requires_grad, rule) in parameters.items():
            _fill(module.get_parameter(name), rule, seed, prefix + name)
        for name, (_shape, _dtype, _persistent, init) in buffers.items():
            if isinstance(init, str):
                _fill(module.get_buffer(name), init, seed, prefix + name)


def _fill(tensor: torch.Tensor, rule: str, seed: int, name: str) -> None:
    if tensor.is_meta:
        return
    kind, _, arg = rule.partition(":")
    arg, _, seed_name = arg.partition(":")
    if kind == "zeros":
        tensor.zero_()
    elif kind == "ones":
        tensor.fill_(1)
    elif kind == "normal":
        key = (seed_name or name).encode()  # tied copies share the canonical name
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key))
        values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * float(arg)
        copy_whole(tensor, values)
    else:
        raise ValueError(f"unknown initialisation rule {rule!r} for {name}")


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def copy_whole(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Copy the whole tensor's ``values`` into ``tensor``, or into this rank's shard of it when
    it is a DTensor (FSDP2): every rank holds the same ``values``, so nothing is sent."""
    if isinstance(tensor, DTensor):
        # on the shards' device first: distribute_tensor would move them to the mesh's device
        # type without an index (the current device)
        values = distribute_tensor(
            values.to(tensor.device, tensor.dtype),
            tensor.device_mesh,
            tensor.placements,
            src_data_rank=None,
        ).to_local()
    local_shard(tensor).copy_(values)


def stage_state(
    stage: nn.Module, state: Mapping[str, _T], aliases: Sequence[Sequence[str]]
) -> dict[str, _T]:
    """The entries of an original-model ``state_dict`` a stage holds, tied aliases resolved.
    Raises ``KeyError`` naming the first missing entry."""
    alias_of = {name: group for group in aliases for name in group}
    own = {}
    for key in stage.state_dict():
        found = next((k for k in alias_of.get(key, [key]) if k in state), None)
        if found is None:
            raise KeyError(key)
        own[key] = state[found]
    return own


def add_submodule(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Place ``module`` at the fully-qualified name ``fqn`` under ``root`` (a block of the
    original model at its original name: ``transformer.h.3``)."""
    parent, leaf = _parent(root, fqn)
    parent.add_module(leaf, module)


def keep_whole(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Place ``module``, a torch module the stage calls whole (built on the meta device), at
    the fully-qualified name ``fqn`` under ``root``, holding the parameters ``build_state``
    created under that name: the stage's ``state_dict()`` keeps the original keys, and
    initialisation, checkpoints and FSDP reach them as any other parameter."""
    parent, leaf = _parent(root, fqn)
    scope = parent._modules.get(leaf)
    held = dict(scope.named_parameters()) if scope is not None else {}
    wanted = [name for name, _ in module.named_parameters()]
    if sorted(held) != sorted(wanted):
        raise ValueError(
            f"{fqn} ({type(module).__name__}) has the parameters {sorted(wanted)}, but the stage "
            f"created {sorted(held)} under its name: regenerate the pipeline"
        )
    for name in wanted:
        owner, attribute = _parent(module, name)
        setattr(owner, attribute, held[name])  # an RNN re-reads its weight list on assignment
    parent.add_module(leaf, module)


__all__ = [
    "Block",
    "BufferTable",
    "IndexedModule",
    "MissingOperatorError",
    "ModuleScope",
    "ParameterTable",
    "ReplicatedHeadsParallel",
    "SectionedColwiseParallel",
    "TransposedLinear",
    "TransposedRowwiseParallel",
    "add_submodule",
    "build_state",
    "copy_whole",
    "init_state",
    "keep_whole",
    "local_shard",
    "on_rank_stream",
    "require_operators",
    "run_over_packed",
    "stage_state",
    "tensors_of",
]
