"""Process groups of a generated pipeline and the gradient traffic between them.

Copied into every generated pipeline as ``runtime/parallel.py``; it needs only torch. The world is a
3-D mesh of ``pp`` pipeline ranks (the ``Stage.rank`` of the pipeline), ``dp_replicate`` replicas
and ``dp_shard`` shards: each stage runs on ``dp_replicate x dp_shard`` data-parallel ranks. The
package says the mesh's order (``Pipeline.mesh``, outermost first), which places the global ranks
(``core/mesh.py``'s ``RankMesh``, the one place a global rank is computed): by default the pipeline
innermost, each pipeline on ``pp`` consecutive ranks (global rank = data-parallel rank x pp +
pipeline rank); shards innermost, the data-parallel ranks of each stage consecutive (global rank =
pipeline rank x data-parallel ranks + data-parallel rank). With more than one data-parallel rank
every stage is FSDP2-managed (``fully_shard``, each block then the rest): sharded over ``dp_shard``,
replicated over ``dp_replicate`` (HSDP when both exceed 1), gradients averaged over all of them (see
:class:`DataParallelStage` for when). Parameters tied across stages are summed shard by shard over
the copies. Parameters that take no gradient (a frozen base under LoRA adapters) are gathered for
compute like the others but never get a gradient buffer, a reduction (FSDP2 reduce-scatters only the
gradients there are), a tie sum or a place in the gradient norm, and their stages' optimizers do not
hold them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from .activity import ACTIVITY, doing, recorded, transfer
from .core.errors import PipelineRunError
from .core.mesh import RankMesh
from .core.mixed_precision import AUTOCAST_DTYPE
from .core.pipeline import MESH_DIMENSIONS, PIPELINE_INNERMOST, Pipeline
from .core.sharded_layers import fsdp_placement, is_split
from .support import local_shard
from .timeline import Timeline


@dataclass
class Layout:
    """Where this process sits in the run's (dp_replicate, dp_shard, pp) mesh, and its groups."""

    device: torch.device
    pp_size: int
    dp_size: int  # data-parallel ranks per stage: replicas x shards
    pp_rank: int  # the rank within its pipeline: the stages with this ``Stage.rank`` run here
    dp_rank: int  # which data-parallel rank (replica x dp_shard + shard)
    pp_group: Any
    dp_group: Any  # every data-parallel rank of this pipeline rank
    dp_shard: int = 1
    #: the mesh FSDP2 works over: (dp_replicate, dp_shard) with replicas (HSDP), else dp_shard alone
    #: (a replica dimension of 1 would make FSDP2 all-reduce each unit's gradients over one rank
    #: and hold a second gradient-sized buffer per unit until its next backward)
    dp_mesh: DeviceMesh | None = None
    shard_group: Any = None  # the ranks this rank's shards are a part of
    #: the mesh's dimensions, outermost first: the package's order (``Pipeline.mesh``)
    order: tuple[str, ...] = PIPELINE_INNERMOST
    tp_size: int = 1  # tensor-parallel ranks each place's projections are sharded over
    tp_rank: int = 0
    tp_mesh: DeviceMesh | None = None  # the 1-D "tp" mesh parallelize_module shards over

    @property
    def rank_mesh(self) -> RankMesh:
        """The run's mesh, which places every global rank."""
        return RankMesh(
            self.pp_size, self.dp_size // self.dp_shard, self.dp_shard, self.order, self.tp_size
        )

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.global_rank(self.pp_rank, self.dp_rank)

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        """The global rank of pipeline rank ``pp_rank`` in data-parallel rank ``dp_rank`` at
        this rank's tensor-parallel rank (its peer there)."""
        return self.rank_mesh.global_rank(pp_rank, dp_rank, self.tp_rank)

    @property
    def tensor_parallel(self) -> bool:
        """Whether the stages' projections are sharded over tensor-parallel ranks."""
        return self.tp_size > 1

    @property
    def reports(self) -> bool:
        """Whether this rank is the one of its place that speaks for it (tensor-parallel rank
        0: the others compute the same losses)."""
        return self.tp_rank == 0

    @property
    def place(self) -> int:
        """This rank's place in the mesh as a number that no mesh order changes (see
        ``RankMesh.place``): what seeds its random streams."""
        return self.rank_mesh.place(self.pp_rank, self.dp_rank)

    @property
    def sharded(self) -> bool:
        """Whether the stages are FSDP2-managed (any data parallelism)."""
        return self.dp_size > 1


def world_size_problem(world: int, pp: int, dp: int, dp_shard: int, tp: int = 1) -> str:
    """Why ``world`` processes do not run ``pp`` pipeline ranks x ``dp`` x ``dp_shard`` x the
    package's tensor-parallel degree ``tp``, and which numbers to change: torchrun's (nodes x
    processes per node) or train.py's."""
    wanted = pp * dp * dp_shard * tp
    flags = f"--dp {dp}" + (f" --dp-shard {dp_shard}" if dp_shard > 1 else "")
    if tp > 1:
        flags += f" x tp {tp}"
    pp_tp = pp * tp
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or world
    nodes = world // per_node if per_node and world % per_node == 0 else 1
    started = (
        f"{nodes} nodes x {per_node} processes = {world}" if nodes > 1 else f"{world} processes"
    )
    if wanted % per_node == 0 and nodes > 1:
        launch = f"torchrun --nnodes={wanted // per_node} --nproc-per-node={per_node}"
    elif nodes > 1:
        launch = f"torchrun with --nnodes x --nproc-per-node = {wanted}"
    else:
        launch = f"torchrun --nproc-per-node={wanted}"
    tensor = f" (the package's tensor-parallel degree, autopipe compile --tp)" if tp > 1 else ""
    if world % pp_tp:
        return (
            f"this pipeline runs on {pp} ranks per pipeline x {flags} = {wanted} processes"
            f"{tensor}, but torchrun started {started}, not a multiple of {pp_tp}; use {launch}"
        )
    return (
        f"this pipeline runs on {pp} ranks per pipeline x {flags} = {wanted} processes{tensor}, "
        f"but torchrun started {started}; use {launch}, or choose --dp x --dp-shard = "
        f"{world // pp_tp}"
    )


def init_distributed(
    pipeline: Pipeline, device_kind: str, dp: int, dp_shard: int, timeout: float
) -> Layout:
    """Start the process group torchrun prepared and build the (dp_replicate, dp_shard, pp) mesh
    in the package's order (:func:`_world_mesh`), checked to place this rank where
    ``RankMesh`` says."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    pp, tp = pipeline.num_ranks, pipeline.tp
    wanted = pp * dp * dp_shard * tp
    if world == 0:
        raise PipelineRunError(
            f"start train.py with torchrun: torchrun --nproc-per-node={wanted} train.py ..."
        )
    if world != wanted:
        raise PipelineRunError(world_size_problem(world, pp, dp, dp_shard, tp), every_rank=True)
    wait = timedelta(seconds=timeout)
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise PipelineRunError("--device cuda: no CUDA device is available; use --device cpu")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device, timeout=wait)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=wait)
    if dp * dp_shard == 1 and tp == 1:  # one pipeline: no other groups to make
        mesh = init_device_mesh(device.type, (pp,), mesh_dim_names=("pp",))
        return Layout(
            device=device,
            pp_size=pp,
            dp_size=1,
            pp_rank=mesh.get_local_rank("pp"),
            dp_rank=0,
            pp_group=mesh.get_group("pp"),
            dp_group=None,
            order=pipeline.mesh,
        )
    mesh = _world_mesh(device.type, RankMesh.of(pipeline, dp, dp_shard))
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    layout = Layout(
        device=device,
        pp_size=pp,
        dp_size=dp * dp_shard,
        pp_rank=mesh.get_local_rank("pp"),
        dp_rank=mesh.get_local_rank("dp_replicate") * dp_shard + mesh.get_local_rank("dp_shard"),
        pp_group=mesh.get_group("pp"),
        dp_group=dp_mesh._flatten("dp").get_group(),
        dp_shard=dp_shard,
        dp_mesh=dp_mesh if dp > 1 else mesh["dp_shard"],
        shard_group=mesh.get_group("dp_shard"),
        order=pipeline.mesh,
        tp_size=tp,
        tp_rank=mesh.get_local_rank("tp") if tp > 1 else 0,
        tp_mesh=mesh["tp"] if tp > 1 else None,
    )
    problem = _placement_problem(layout)
    if problem:
        raise PipelineRunError(problem)
    return layout


def _world_mesh(device_type: str, ranks: RankMesh) -> DeviceMesh:
    """The world's DeviceMesh, its dimensions in ``MESH_DIMENSIONS``' order (replicas, shards,
    pipeline ranks) then ``tp``, each global rank where ``ranks``' order puts it:
    ``init_device_mesh``'s numbering of a mesh of the dimensions in that order (row-major, tp
    innermost), transposed. Named in one order whatever the package's, the mesh gives FSDP2
    its (dp_replicate, dp_shard) mesh by slicing, which torch allows only along the order the
    mesh has, and the tensor-parallel styles their "tp" mesh."""
    order = [ranks.order.index(d) for d in MESH_DIMENSIONS]
    if ranks.tp == 1:  # no tensor parallelism: no "tp" dimension (and no groups for it)
        numbered = torch.arange(ranks.world).view(ranks.sizes).permute(order)
        return DeviceMesh(device_type, numbered, mesh_dim_names=MESH_DIMENSIONS)
    numbered = torch.arange(ranks.world).view(*ranks.sizes, ranks.tp).permute([*order, 3])
    return DeviceMesh(device_type, numbered, mesh_dim_names=(*MESH_DIMENSIONS, "tp"))


def _placement_problem(layout: Layout) -> str | None:
    """What differs between where the device mesh put this rank, with its pipeline and its
    data-parallel ranks, and where the mesh order puts them (``RankMesh``), or None: the
    schedule sends to the pipeline group's ranks by their place in the group, the ties and the
    reports compute global ranks from the order."""
    ranks = layout.rank_mesh
    rank = dist.get_rank()
    found = {
        "global rank": rank,
        "pipeline rank in its group": dist.get_rank(layout.pp_group),
        "pipeline": group_ranks(layout.pp_group),
        "data-parallel ranks": group_ranks(layout.dp_group),
    }
    wanted = {
        "global rank": layout.rank,
        "pipeline rank in its group": layout.pp_rank,
        "pipeline": tuple(sorted(ranks.pipeline_ranks(layout.dp_rank, layout.tp_rank))),
        "data-parallel ranks": tuple(sorted(ranks.dp_ranks(layout.pp_rank, layout.tp_rank))),
    }
    if layout.tp_mesh is not None:
        found["tensor-parallel ranks"] = group_ranks(layout.tp_mesh.get_group())
        wanted["tensor-parallel ranks"] = ranks.tp_ranks(layout.pp_rank, layout.dp_rank)
    for what, value in found.items():
        if value != wanted[what]:
            return (
                f"rank {rank}: the device mesh placed it at pipeline rank {layout.pp_rank}, "
                f"data-parallel rank {layout.dp_rank}, with the {what} {value}; the "
                f"{ranks.describe()} gives {wanted[what]}"
            )
    return None


def shard_stage(
    runner: nn.Module, blocks: Sequence[nn.Module], layout: Layout, per_block: bool, bf16: bool
) -> None:
    """FSDP2 over the data-parallel mesh: each block one unit (gathered for its forward, its
    gradients reduced as its backward ends), then the rest of the stage under ``runner``.
    ``per_block``: free each unit's gathered parameters after its forward and backward
    (gathered again for every microbatch), else keep them gathered until the step's last
    backward. ``bf16``: bf16 compute, fp32 gradient reduction and fp32 stored (master)
    parameters."""
    policy = (
        MixedPrecisionPolicy(param_dtype=AUTOCAST_DTYPE, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for module in [*blocks, runner]:
        fully_shard(
            module,
            mesh=layout.dp_mesh,
            reshard_after_forward=per_block,
            mp_policy=policy,
            shard_placement_fn=fsdp_placement,
        )
    _prefetch_backward_in_order(runner, blocks)


def _prefetch_backward_in_order(runner: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Each unit's backward gathers the unit the stage's backward runs next: the stage's last
    block from the rest (the root, whose backward starts first), then each block the one before
    it. FSDP2 otherwise guesses the next unit from the order forwards ended in, which a schedule
    interleaving microbatches (1F1B) breaks: a block's backward would gather a block of another
    microbatch's forward, whose parameters then stay gathered until that block next runs, up to
    every block of the stage at once. The first block names the root, gathered already, so
    that it guesses nothing either."""
    if not blocks:
        return
    units = [runner, *reversed(blocks), runner]  # the backward's order, then its first again
    for unit, following in zip(units, units[1:]):
        cast(FSDPModule, unit).set_modules_to_backward_prefetch([cast(FSDPModule, following)])


def parallelize_stage(stage: nn.Module, layout: Layout) -> list[str]:
    """Shard ``stage``'s projections over the "tp" mesh by its generated plan
    (``tensor_parallel_plan``: original name -> style), with torch's ``parallelize_module``;
    returns the style of each module sharded, by its class name."""
    plan = getattr(stage, "tensor_parallel_plan", None) or {}
    if plan:
        parallelize_module(stage, layout.tp_mesh, dict(plan))
    return [type(style).__name__ for style in plan.values()]


class DataParallelStage(PipelineStage):
    """A pipeline stage that decides when its FSDP2 units reduce their gradients: with
    ``reduce_every_microbatch`` after each backward (sharded gradients accumulate, 1/N of the
    memory; with replicas, HSDP, the shards accumulate before the one all-reduce over the
    replicas in the step's last backward), otherwise once per optimizer step: during the step's last backward when
    ``overlap`` (each unit's reduction starts as soon as its backward ends and runs while the
    rest of the backward does), else after it. Earlier accumulation rounds (``final_round``
    False) only accumulate. Each forward, backward and transfer is this rank's current action
    (``activity.py``) while it runs; with a ``timeline`` attached (``--trace``), each forward
    and backward is also recorded as an interval and each send and receive created as an
    instant. A forward output unlike the ``planned_outputs`` stops the run before it is sent
    into the next stage's buffer of the planned shape (which would hang or abort that rank)."""

    final_round = True
    reduce_every_microbatch = False
    overlap = True
    #: the recorder of a traced step (``--trace``); None: nothing is recorded
    timeline: Timeline | None = None
    #: the name, shape and dtype of each output the next stages receive into buffers of that
    #: shape (None: not checked, as on the last stage)
    planned_outputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] | None = None
    #: the ranks this stage's gradients are reduced over (data parallelism)
    dp_ranks: tuple[int, ...] = ()
    #: none of the values this stage receives needs a gradient (it hands none back): under a
    #: split backward its input pass runs its whole backward and its weight pass nothing. torch
    #: finds the weights' gradients in the weight pass from what the input pass kept, which
    #: misses them when no input needs a gradient (it runs the whole backward in the weight pass
    #: for stage 0 alone, whose inputs are data)
    whole_backward_in_input: bool = False
    #: called with each microbatch's number before its forward: hands the stage the inputs it
    #: reads from the batch for that microbatch (None: it reads none)
    feed: Callable[[int], None] | None = None

    # -- the actions: each one this rank's current action, recorded when traced ----------------
    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        # a microbatch split along a batch dimension other than 0 is a strided view: given
        # contiguous, as the model's own batch is (cuDNN's RNNs refuse a strided state)
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        if self.feed is not None:
            self.feed(fwd_chunk_id)
        with recorded(self.timeline, "forward", self.stage_index, fwd_chunk_id):
            output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self.planned_outputs is not None:
            self._check_outputs(fwd_chunk_id, output)
        return output

    def _check_outputs(self, microbatch: int, output: Any) -> None:
        """Refuses a forward output whose shape or dtype is not the planned one: the next
        stage's buffer has the planned shape, and a transfer of another size hangs (NCCL) or
        aborts the receiving process (gloo)."""
        assert self.planned_outputs is not None  # checked by the caller
        outputs = output if isinstance(output, tuple) else (output,)
        for index, (value, (name, shape, dtype)) in enumerate(zip(outputs, self.planned_outputs)):
            if not isinstance(value, torch.Tensor):
                continue
            if tuple(value.shape) != shape or value.dtype != dtype:
                sent = f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
                planned = f"{list(shape)} {str(dtype).removeprefix('torch.')}"
                raise PipelineRunError(
                    f"step {ACTIVITY.step}: a data-dependent shape mismatch: stage "
                    f"{self.stage_index}'s forward of microbatch {microbatch} returned output "
                    f"{index} ({name!r}) as {sent}, but the next stage receives it into a buffer "
                    f"of {planned}, the shape the pipeline was compiled for; sending it would "
                    "hang the receiving rank (NCCL) or abort it (gloo). Compile with --dynamic "
                    "for the dimension that varies with the data, or make the batches one shape"
                )

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: Any = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        kind = "backward" if full_backward else "backward_input"
        whole = not full_backward and self.whole_backward_in_input and not self.is_first
        with recorded(self.timeline, kind, self.stage_index, bwd_chunk_id):
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward or whole, last_backward)
        if whole:
            self._done_in_input().add(bwd_chunk_id)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with recorded(self.timeline, "backward_weight", self.stage_index, bwd_chunk_id):
            done = self._done_in_input()
            if bwd_chunk_id in done:  # its input pass ran the whole backward
                done.discard(bwd_chunk_id)
                return
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def _done_in_input(self) -> set[int]:
        """The microbatches whose whole backward ran in their input pass, their weight pass
        not yet run (see :attr:`whole_backward_in_input`)."""
        done: set[int] = self.__dict__.setdefault("_whole_backward_done", set())
        return done

    def _transfer(self, kind: str, chunk: int, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        return transfer(self.timeline, kind, self.stage_index, chunk, ops)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._transfer(
            "send_activation", fwd_chunk_id, super().get_fwd_send_ops(fwd_chunk_id)
        )

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._transfer("send_gradient", bwd_chunk_id, super().get_bwd_send_ops(bwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._transfer(
            "recv_activation", fwd_chunk_id, super().get_fwd_recv_ops(fwd_chunk_id)
        )

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._transfer("recv_gradient", bwd_chunk_id, super().get_bwd_recv_ops(bwd_chunk_id))

    # -- gradient reduction --------------------------------------------------------------------

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], Any]:
        last = last_backward and self.final_round
        reduce_now = self.reduce_every_microbatch or (last and self.overlap)
        if not (isinstance(self.submod, FSDPModule) and reduce_now and backward_type == "full"):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(last)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        self.submod.set_requires_all_reduce(last)  # over the replicas (HSDP): once a step
        grads = stage_backward(
            bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"]
        )
        return grads, None

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if not (self.final_round or self.reduce_every_microbatch):
            return
        # what backward left
        with recorded(self.timeline, "dp_reduce", self.stage_index, ranks=self.dp_ranks):
            super().perform_reduce_grad(grad_scale_factor)


@dataclass
class Tie:
    """One parameter tied across ranks of a pipeline: its group (and its ranks) and this
    rank's copies."""

    group: Any
    copies: list[nn.Parameter]
    ranks: tuple[int, ...] = ()


def sharded_over_tp(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter or its gradient) is split over the tensor-parallel
    ranks: a DTensor sharded along the mesh's "tp" dimension (replicated parameters, FSDP2's
    included, hold the same values on every tensor-parallel rank)."""
    if not isinstance(tensor, DTensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return "tp" in names and is_split(tensor.placements[names.index("tp")])


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group (None: every rank), ascending."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(sorted(dist.get_process_group_ranks(group)))


class GradientSync:
    """Tied gradients, the gradients tensor parallelism leaves partial (sequence parallelism's,
    replicated key/value heads') and the global norm of this rank's stages, after the backward
    passes: of the parameters that train only (frozen ones have no gradient to sum or count)."""

    def __init__(self, pipeline: Pipeline, layout: Layout, stages: dict[int, nn.Module]):
        self.layout = layout
        self.params = [p for m in stages.values() for p in m.parameters() if p.requires_grad]
        self.ties = self._ties(pipeline, layout, stages)
        #: the parameters each tensor-parallel rank took a part of the gradient of: over its
        #: slice of the sequence (the stages' ``sequence_parallel_parameters``), or of its query
        #: heads (``replicated_heads_parameters``: grouped key/value projections held whole)
        self.partial = [
            parameter
            for module in stages.values()
            for listed in ("sequence_parallel_parameters", "replicated_heads_parameters")
            for name in getattr(module, listed, ())
            if (parameter := module.get_parameter(name)).requires_grad
        ]
        # copies of a tied parameter past its first holder do not count towards the norm
        duplicate = {
            id(stages[stage].get_parameter(name))
            for tie in pipeline.tied
            for stage, name in tie.later_holders.items()
            if stage in stages
        }
        self.norm_params = [p for p in self.params if id(p) not in duplicate]
        #: the ranks of each all-reduce the gradient norm is summed by: over the pipeline, then
        #: over the shards; each one this rank's current action as it runs
        self.norm_groups = [(layout.pp_group, group_ranks(layout.pp_group))]
        if layout.dp_shard > 1:
            self.norm_groups.append((layout.shard_group, group_ranks(layout.shard_group)))

    @staticmethod
    def _ties(pipeline: Pipeline, layout: Layout, stages: dict[int, nn.Module]) -> list[Tie]:
        ties = []
        for tie in pipeline.tied:
            holding = pipeline.tie_ranks(tie)
            mine = None
            my_ranks: tuple[int, ...] = ()
            mesh = layout.rank_mesh
            for dp_rank in range(layout.dp_size):  # every rank takes part in every new_group
                for tp_rank in range(layout.tp_size):
                    ranks = [mesh.global_rank(r, dp_rank, tp_rank) for r in holding]
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if (dp_rank, tp_rank) == (layout.dp_rank, layout.tp_rank):
                        mine, my_ranks = group, tuple(ranks)
            copies = [
                stages[stage].get_parameter(name)
                for stage, name in tie.holders.items()
                if stage in stages
            ]
            # a frozen tied parameter (frozen in every copy) has no gradients to sum
            if copies and copies[0].requires_grad:
                ties.append(Tie(mine, copies, my_ranks))
        return ties

    def scale(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def reduce(self) -> None:
        """Sum the copies of each tied parameter (shard by shard when sharded; FSDP2 already
        averaged every gradient over the data-parallel ranks), then the partial gradients of
        tensor parallelism over the tensor-parallel ranks (in one all-reduce)."""
        for tie in self.ties:
            present = [local_shard(p.grad) for p in tie.copies if p.grad is not None]
            if len(present) == 1 and present[0].is_contiguous():
                total = present[0]  # this rank's one gradient, summed where it lies
            elif present:
                total = torch.stack(present).sum(0)
            else:
                total = torch.zeros_like(local_shard(tie.copies[0].data))
            if tie.group is not None:
                with doing("tied_sum", ranks=tie.ranks):
                    dist.all_reduce(total, group=tie.group)
            for p in tie.copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = local_shard(p.grad)
                if grad.data_ptr() != total.data_ptr():
                    grad.copy_(total)
        present = [local_shard(p.grad) for p in self.partial if p.grad is not None]
        if present and self.layout.tp_mesh is not None:
            tp_group = self.layout.tp_mesh.get_group()
            flat = torch.cat([g.reshape(-1) for g in present])
            with doing("partial_sum", ranks=group_ranks(tp_group)):
                dist.all_reduce(flat, group=tp_group)
            for grad, summed in zip(present, torch.split(flat, [g.numel() for g in present])):
                grad.copy_(summed.view_as(grad))

    def _squares(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the squares of this rank's parts of ``grads``, on its device."""
        if not grads:
            return torch.zeros((), device=self.layout.device)
        parts = [local_shard(g).detach().float().pow(2).sum() for g in grads]
        return torch.stack(parts).sum().to(self.layout.device)

    def clip(self, max_norm: float | None) -> float:
        """The global gradient norm over every stage and shard (each tied parameter once);
        gradients scaled down to ``max_norm`` when given, as ``clip_grad_norm_`` would."""
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        split = [g for g in grads if sharded_over_tp(g)]
        whole = [g for g in grads if not sharded_over_tp(g)]
        local = self._squares(whole)
        if self.layout.tensor_parallel:  # each rank holds a part of each split gradient
            parts = self._squares(split)
            assert self.layout.tp_mesh is not None  # tensor parallel: init_distributed made it
            tp_group = self.layout.tp_mesh.get_group()
            with doing("norm", ranks=group_ranks(tp_group)):
                dist.all_reduce(parts, group=tp_group)
            local = local + parts
        for group, ranks in self.norm_groups:
            with doing("norm", ranks=ranks):
                dist.all_reduce(local, group=group)
        norm = local.sqrt()
        if max_norm is not None:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient.to(p.grad.dtype))
        return float(norm)
