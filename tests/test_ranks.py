"""The tests' launcher (tests/ranks.py) against torchrun: a generated train.py trained on ranks
forked from a server that has imported torch trains exactly as under the real torchrun, whose
ranks are fresh interpreters; a rank that fails ends the others and names its status."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, compile_model, run_ranks, torchrun_command, torchrun_env


def _losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def test_forked_ranks_train_as_torchruns_fresh_ones(tmp_path):
    out = tmp_path / "pipe"
    compile_model("bert", out, 2)
    args = ["--steps", "3", "--microbatches", "2", "--schedule", "1f1b"]
    fresh, forked = tmp_path / "torchrun.jsonl", tmp_path / "forked.jsonl"
    real = subprocess.run(
        torchrun_command(out / "train.py", 2, *args, "--log-json", str(fresh)),
        capture_output=True, text=True, timeout=600, env=torchrun_env(), cwd=ROOT,
    )  # fmt: skip
    assert real.returncode == 0, real.stderr[-4000:]
    result = run_ranks(out / "train.py", 2, *args, "--log-json", str(forked))
    assert _losses(forked) == _losses(fresh) and len(_losses(fresh)) == 3
    assert "step 2 loss" in result.stdout  # rank 0's console, as torchrun passes it on


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
