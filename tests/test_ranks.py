"""The tests' launcher (tests/ranks.py) against torchrun: a generated train.py trained on ranks
forked from a server that has imported torch trains exactly as under the real torchrun, whose
ranks are fresh interpreters; a rank that fails ends the others and names its status."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from autopipe.runtime import train_state

from conftest import ROOT, compile_model, run_ranks, torchrun_command, torchrun_env


def _losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_forked_ranks_train_as_torchruns_fresh_ones(tmp_path):
    """2 stages x --dp-shard 2 (FSDP2 over gloo) for 2 steps with a checkpoint after each (DCP),
    then resumed for a third: on ranks forked from the server and on torchrun's fresh
    interpreters (each with its own hash seed and start-up), the same losses and the same
    checkpoints."""
    out = tmp_path / "pipe"
    compile_model("bert", out, 2)
    args = ["--microbatches", "2", "--dp-shard", "2", "--checkpoint-every", "1"]
    losses, states = {}, {}
    for launcher in ("torchrun", "forked"):
        ckpt, log = tmp_path / f"{launcher}-ckpt", tmp_path / f"{launcher}.jsonl"
        run = [*args, "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
        for steps, more in (("2", []), ("3", ["--resume"])):
            if launcher == "torchrun":
                real = subprocess.run(
                    torchrun_command(out / "train.py", 4, *run, "--steps", steps, *more),
                    capture_output=True, text=True, timeout=600, env=torchrun_env(), cwd=ROOT,
                )  # fmt: skip
                assert real.returncode == 0, real.stderr[-4000:]
            else:
                result = run_ranks(out / "train.py", 4, *run, "--steps", steps, *more)
                assert ("resumed from" in result.stdout) == bool(more)  # rank 0's console
        losses[launcher] = _losses(log)
        states[launcher] = train_state.merge_checkpoint(ckpt)[0]
    assert len(losses["torchrun"]) == 3 and losses["forked"] == losses["torchrun"]
    assert states["forked"].keys() == states["torchrun"].keys()
    for name, tensor in states["torchrun"].items():
        assert torch.equal(states["forked"][name], tensor), name


def test_a_value_read_at_start_up_is_refused(tmp_path):
    """PYTHONPATH (and its sitecustomize) is read when Python starts: a forked rank would not
    have it, so the launcher refuses the run instead of running it without."""
    with pytest.raises(ValueError, match="PYTHONPATH: read when Python or torch starts"):
        run_ranks(tmp_path / "train.py", 2, env={"PYTHONPATH": str(tmp_path)})


def test_a_failing_rank_ends_the_run_with_its_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('rank 1 gives up', file=sys.stderr)\n"
        "    sys.exit(3)\n"
        "time.sleep(600)  # rank 0 waits for a peer that is gone\n"
    )
    with pytest.raises(AssertionError, match=r"(?s)train\.py failed \(3\).*rank 1 gives up"):
        run_ranks(script, 2, timeout=120)  # within seconds: rank 0 is ended, not waited for
