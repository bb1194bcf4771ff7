"""What ``autopipe merge`` refuses before it reads a tensor: an output that would overwrite the
checkpoint or what it was not asked to replace, and a ``--hf`` directory the checkpoint cannot be
written as (its Hugging Face model, when it can)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import AutopipeError
from ..runtime.core.errors import PipelineRunError
from ..runtime.core.pipeline import HuggingFaceModel, PipelineFormatError

__all__ = ["checked_output", "merged_model"]


def checked_output(args: argparse.Namespace, source: Path) -> Path:
    """Where ``merge`` writes the checkpoint at ``source``, or the reason it may not write there."""
    # imported here, not above: train_state brings torch.distributed.pipelining, torch._dynamo and
    # torch.distributed.checkpoint, which would slow every other command's start-up
    from ..runtime.huggingface import directory_problem
    from ..runtime.train_state import STEP_NAME, latest_checkpoint

    root = source.parent if STEP_NAME.fullmatch(source.name) else source
    if args.merge_adapters and not args.hf:
        raise AutopipeError("--merge-adapters says how --hf DIR is written; give --hf DIR")
    if args.hf and args.output:
        raise AutopipeError("give -o FILE (a state_dict) or --hf DIR (a model directory), not both")
    if args.hf or args.output:
        out: Path = args.hf or Path(args.output)
    else:  # named after the step it merges, so that two steps merged keep two files
        try:
            step = source if STEP_NAME.fullmatch(source.name) else latest_checkpoint(source)
        except PipelineRunError:  # a damaged pointer: checked_checkpoint says what is wrong
            step = None
        out = root / (f"merged-{step.name}.pt" if step is not None else "merged.pt")
    target, home = out.resolve(), root.resolve()
    parts = target.relative_to(home).parts if target.is_relative_to(home) else ()
    option = "--hf" if args.hf else "-o"
    if (
        (out.is_dir() and not args.hf)
        or (parts and (STEP_NAME.fullmatch(parts[0]) or parts[0] in ("latest", ".lock")))
        or target == home
    ):
        raise AutopipeError(
            f"{option} {out} would overwrite part of the checkpoint directory {root}; write the "
            f"merged {'model' if args.hf else 'state_dict'} outside its step-N directories"
        )
    if home.is_relative_to(target):
        raise AutopipeError(
            f"{option} {out} holds the checkpoint directory {root}; a model directory is written "
            f"only where nothing else lies: write it beside the checkpoints instead, e.g. --hf "
            f"{home.parent / (home.name + '-hf')}"
        )
    if args.hf:  # a model directory: only one autopipe wrote is replaced, and only its files
        problem = directory_problem(target, "--hf", replace=args.force, file_option="-o FILE")
        if problem:
            raise AutopipeError(problem)
    elif out.exists() and not args.force:
        raise AutopipeError(f"{option} {out} already exists; pass --force to replace it")
    return out


def merged_model(
    manifest: dict[str, Any], source: Path, partial: str | None, merge_adapters: bool
) -> HuggingFaceModel:
    """What ``merge --hf`` writes the checkpoint as (its recorded Hugging Face description), or
    the reason it cannot: no description recorded, only the trainable tensors of a model that
    is not an adapter (or of one whose adapter is to be merged), ``--merge-adapters`` for a
    model without an adapter. ``partial``: the note of a trainable-only checkpoint."""
    if "huggingface" not in manifest:
        raise AutopipeError(
            f"--hf writes a Hugging Face model directory, and {source} holds no Hugging Face "
            f"configuration: {manifest['model']} is not a transformers PreTrainedModel, or its "
            "package was compiled before autopipe recorded configurations (recompile it, then "
            "merge a checkpoint it writes); use -o FILE for a state_dict"
        )
    try:
        hf = HuggingFaceModel.from_json(manifest["huggingface"], "checkpoint.json: huggingface")
    except PipelineFormatError as exc:
        raise AutopipeError(f"{source} is damaged ({exc})") from None
    if partial and (hf.adapter is None or merge_adapters):
        raise AutopipeError(
            f"{source} holds only the trainable tensors (--save-trainable-only), and "
            + (
                "--merge-adapters needs the base weights too; merge without "
                "--merge-adapters to write the adapter, for PeftModel.from_pretrained over "
                "the base model"
                if hf.adapter is not None
                else "a from_pretrained directory needs every weight; -o FILE writes the "
                "trainable ones"
            )
        )
    if merge_adapters and hf.adapter is None:
        raise AutopipeError(
            f"--merge-adapters merges a PEFT model's adapter into its base weights, and "
            f"{manifest['model']} is not a PEFT model; leave --merge-adapters out"
        )
    return hf
