"""Process groups of a generated pipeline and the gradient traffic between them.

Copied into every generated pipeline as ``runtime/parallel.py``; it needs only torch. The world
is a 2-D mesh ``(dp, pp)``: ``dp`` replicas of the pipeline, each on ``pp`` consecutive ranks
(global rank = replica x pp + rank within the replica, the ``Stage.rank`` of the pipeline).
Gradients are averaged over the replicas of each stage and summed over the copies of each
parameter tied across stages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .data import PipelineRunError
from .pipeline import Pipeline

#: elements per data-parallel all-reduce (the flat copy costs this much extra memory)
BUCKET_ELEMENTS = 1 << 25


@dataclass
class Layout:
    """Where this process sits in the (dp, pp) mesh."""

    device: torch.device
    pp_size: int
    dp_size: int
    pp_rank: int  # the rank within its replica: the stages with this ``Stage.rank`` run here
    dp_rank: int  # which replica
    pp_group: Any
    dp_group: Any

    @property
    def rank(self) -> int:
        return self.dp_rank * self.pp_size + self.pp_rank


def init_distributed(pipeline: Pipeline, device_kind: str, dp: int, timeout: float) -> Layout:
    """Start the process group torchrun prepared and build the (dp, pp) mesh."""
    world = int(os.environ.get("WORLD_SIZE", "0"))
    pp = pipeline.num_ranks
    if world == 0:
        raise PipelineRunError(
            f"start train.py with torchrun: torchrun --nproc-per-node={pp * dp} train.py ..."
        )
    if world != pp * dp:
        raise PipelineRunError(
            (
                f"this pipeline runs on {pp} ranks per replica x --dp {dp} = {pp * dp} processes, but "
                f"torchrun started {world}; use torchrun --nproc-per-node={pp * dp} (or --dp {world // pp})"
                if world % pp == 0
                else f"this pipeline runs on {pp} ranks per replica (x --dp {dp}), but torchrun started "
                f"{world}, not a multiple of {pp}; use torchrun --nproc-per-node={pp * dp}"
            ),
            every_rank=True,
        )
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
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return Layout(
        device=device,
        pp_size=pp,
        dp_size=dp,
        pp_rank=mesh.get_local_rank("pp"),
        dp_rank=mesh.get_local_rank("dp"),
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
    )


@dataclass
class Tie:
    """One parameter tied across ranks of a replica: its group and this rank's copies."""

    group: Any
    copies: list[nn.Parameter]


class GradientSync:
    """Reduces the gradients of this rank's stages after the pipeline's backward passes."""

    def __init__(self, pipeline: Pipeline, layout: Layout, stages: dict[int, nn.Module]):
        self.layout = layout
        self.params = [p for m in stages.values() for p in m.parameters() if p.requires_grad]
        self.ties = self._ties(pipeline, layout, stages)
        # copies of a tied parameter past its first holder do not count towards the norm
        duplicate = {
            id(stages[stage].get_parameter(name))
            for tie in pipeline.tied
            for stage, name in tie.later_holders.items()
            if stage in stages
        }
        self.norm_params = [p for p in self.params if id(p) not in duplicate]

    @staticmethod
    def _ties(pipeline: Pipeline, layout: Layout, stages: dict[int, nn.Module]) -> list[Tie]:
        ties = []
        for tie in pipeline.tied:
            holding = pipeline.tie_ranks(tie)
            mine = None
            for replica in range(layout.dp_size):  # every rank takes part in every new_group
                ranks = [replica * layout.pp_size + r for r in holding]
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if replica == layout.dp_rank:
                    mine = group
            copies = [
                stages[stage].get_parameter(name)
                for stage, name in tie.holders.items()
                if stage in stages
            ]
            if copies:
                ties.append(Tie(mine, copies))
        return ties

    def scale(self, factor: float) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def _buckets(self, size: int = BUCKET_ELEMENTS) -> list[list[torch.Tensor]]:
        """Gradients in groups of one dtype and at most ``size`` elements (or one tensor)."""
        buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        for p in self.params:
            groups = buckets.setdefault(p.grad.dtype, [[]])
            if groups[-1] and sum(g.numel() for g in groups[-1]) + p.numel() > size:
                groups.append([])
            groups[-1].append(p.grad)
        return [group for groups in buckets.values() for group in groups]

    def reduce(self) -> None:
        """Average over replicas (one flat all-reduce per dtype), then sum tied copies."""
        if self.layout.dp_size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            for grads in self._buckets():
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=self.layout.dp_group)
                flat /= self.layout.dp_size
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        for tie in self.ties:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tie.copies]
            total = torch.stack(grads).sum(0) if len(grads) > 1 else grads[0].clone()
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for p in tie.copies:
                p.grad = total.clone()

    def clip(self, max_norm: float | None) -> float:
        """The global gradient norm over every stage of the replica (each tied parameter once);
        gradients scaled down to ``max_norm`` when given, as ``clip_grad_norm_`` would."""
        grads = [p.grad for p in self.norm_params if p.grad is not None]
        local = (
            torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
            if grads
            else torch.zeros((), device=self.layout.device)
        )
        local = local.to(self.layout.device)
        dist.all_reduce(local, group=self.layout.pp_group)
        norm = local.sqrt()
        if max_norm is not None:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient.to(p.grad.dtype))
        return float(norm)
