"""Run by tests/test_blocks.py on 2 gloo ranks: ``fully_shard`` one block of a generated stage and
train it on each rank's own data; it must train exactly like the unsharded stage on both ranks'
data (gradients averaged), step by step.

    torchrun --nproc-per-node=2 tests/fsdp_block.py PACKAGE BLOCK_FQN
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from autopipe.verify import load_pipeline

STEPS, LR = 3, 0.05


def stage_inputs(pipeline: dict, stage: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for name in pipeline["stages"][stage]["inputs"]:
        value = pipeline["values"][name]
        shape, dtype = value["shape"], getattr(torch, value["dtype"])
        if dtype.is_floating_point:
            inputs.append(torch.randn(shape, generator=generator, dtype=dtype))
        else:
            high = pipeline["input_ranges"].get(name, 2)
            inputs.append(torch.randint(0, high, shape, generator=generator, dtype=dtype))
    return inputs


def loss_of(outputs) -> torch.Tensor:
    return sum(o.float().pow(2).mean() for o in outputs if o.is_floating_point())


def main(package_dir: str, fqn: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    package = load_pipeline(package_dir)
    pipeline = package.PIPELINE
    reference, sharded = package.build_stage(0), package.build_stage(0)
    block = sharded.get_submodule(fqn)
    full_shapes = {name: p.shape for name, p in block.named_parameters()}
    fully_shard(block)
    assert all(isinstance(p, DTensor) for p in block.parameters()), "block not sharded"
    assert not any(isinstance(p, DTensor) for n, p in sharded.named_parameters() if fqn not in n)

    gathered = []

    def check_gathered(module, args):  # runs after FSDP's own pre-hook gathered the block
        shapes = {name: p.shape for name, p in module.named_parameters()}
        gathered.append(shapes == full_shapes)

    block.register_forward_pre_hook(check_gathered)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    for step in range(STEPS):
        # reference: every rank's microbatch on the whole stage, losses averaged
        ref_opt.zero_grad()
        losses = []
        for r in range(world):
            torch.manual_seed(1000 * step + r)
            losses.append(loss_of(reference(*stage_inputs(pipeline, 0, 1000 * step + r))))
        torch.stack(losses).mean().backward()
        ref_opt.step()
        # sharded: this rank's microbatch; FSDP averages the block's gradients, DP the rest
        opt.zero_grad()
        torch.manual_seed(1000 * step + rank)
        loss = loss_of(sharded(*stage_inputs(pipeline, 0, 1000 * step + rank)))
        loss.backward()
        for name, p in sharded.named_parameters():
            if fqn not in name and p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        opt.step()
        torch.testing.assert_close(loss.detach(), losses[rank].detach())
    assert gathered == [True] * STEPS, f"the block ran without its gathered parameters: {gathered}"
    expected = reference.state_dict()
    for name, value in sharded.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        torch.testing.assert_close(value, expected[name], msg=f"{name} after {STEPS} steps")
    if rank == 0:
        print(f"fully_shard({fqn}): {STEPS} steps exact on {world} ranks", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # gloo's worker threads may abort the interpreter's teardown ("terminate called without an
    # active exception") after a clean run: leave without it
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
