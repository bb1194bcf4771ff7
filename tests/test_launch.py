"""Launching on more than one node (issue 27, item 6): ``autopipe compile`` writes
``launch/slurm.sbatch`` into the package, its nodes, GPUs per node and torchrun line derived from
the plan (pipeline ranks x planned --dp-shard) and ``--gpus-per-node``; a plan costed on a CPU
asks for CPU nodes (no GPUs, gloo, the node's CPUs shared by its processes); the script runs as
SLURM would run it (``scontrol`` and ``srun`` stood in for by shims) and trains; and train.py
names the numbers to change when torchrun starts another layout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autopipe.partitioning.network import node_layout
from autopipe.runtime.parallel import world_size_problem

from conftest import ROOT, compile_model, cpu_spec_file, torchrun_env


def test_node_layout_takes_the_fewest_equal_nodes():
    assert node_layout(2, 8) == (1, 2)
    assert node_layout(8, 8) == (1, 8)
    assert node_layout(8, 4) == (2, 4)
    assert node_layout(12, 8) == (2, 6)  # torchrun starts as many processes on every node
    assert node_layout(7, 4) == (7, 1)


def _directives(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", script, re.M))


def _torchrun_flags(script: str) -> str:
    return script[script.index("srun ") :]


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("launch")
    compile_model("mlp_with_target", root / "one_node", 2, loss="tests/models.py:mse")
    compile_model("gpt2", root / "two_nodes", 2, dp_shard=2, gpus_per_node=2)
    compile_model(
        "mlp_with_target", root / "cpu_node", 2, loss="tests/models.py:mse",
        device_spec=str(cpu_spec_file(root)), gpus_per_node=2,
    )  # fmt: skip
    return {name: root / name for name in ("one_node", "two_nodes", "cpu_node")}


def test_the_script_asks_for_the_plans_processes(packages):
    """Two layouts: 2 stages on one node of 8 GPUs (2 used); 2 stages x --dp-shard 2 = 4
    processes on nodes of 2 GPUs (2 nodes)."""
    one = (packages["one_node"] / "launch" / "slurm.sbatch").read_text()
    assert _directives(one) == {
        "job-name": "autopipe-SkipMLP",
        "nodes": "1",
        "ntasks-per-node": "1",
        "gpus-per-node": "2",
        "output": "%x-%j.out",
    }
    assert '--nproc-per-node="${SLURM_GPUS_ON_NODE:-2}"' in _torchrun_flags(one)
    assert '"${package}/train.py" "$@"' in one  # no --dp-shard: the plan has none

    two = (packages["two_nodes"] / "launch" / "slurm.sbatch").read_text()
    assert _directives(two)["nodes"] == "2" and _directives(two)["gpus-per-node"] == "2"
    assert '--nnodes="${SLURM_NNODES}"' in _torchrun_flags(two)
    assert '"${package}/train.py" --dp-shard 2 "$@"' in two
    assert "2 nodes x 2 GPUs = 4 processes, the plan's 2 pipeline ranks x --dp-shard 2" in two
    for script in (one, two):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
        assert "--device cpu" not in script and "NCCL_DEBUG" in script


def test_a_cpu_plans_script_asks_for_cpu_nodes(packages):
    """Planned on a CPU, the script asks for nodes, not GPUs: torchrun starts the plan's
    processes on each (SLURM sets no GPU count), train.py runs gloo (--device cpu), and each
    process gets its share of the node's CPUs as threads (at least one)."""
    script = (packages["cpu_node"] / "launch" / "slurm.sbatch").read_text()
    assert _directives(script) == {
        "job-name": "autopipe-SkipMLP",
        "nodes": "1",
        "ntasks-per-node": "1",
        "output": "%x-%j.out",
    }
    assert "GPU" not in script and "NCCL" not in script
    assert "on a SLURM cluster of CPU nodes" in script and "1 node x 2 processes" in script
    assert "--nproc-per-node=2 \\\n" in _torchrun_flags(script)
    assert '"${package}/train.py" --device cpu "$@"' in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    threads = script[script.index("threads=") : script.index("\n\n", script.index("threads="))]
    for cpus, expected in (("16", "8"), ("3", "1"), ("1", "1")):
        shown = subprocess.run(
            ["bash", "-c", f"{threads}\necho $OMP_NUM_THREADS"],
            env={"PATH": os.environ["PATH"], "SLURM_CPUS_ON_NODE": cpus},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert shown.stdout.strip() == expected, (cpus, shown.stdout)


def test_the_script_outside_slurm_says_how_to_run_it(packages, tmp_path):
    """Run by hand (no SLURM_JOB_ID), the script stops with how to run it instead of bash's
    "unbound variable"; its example keeps --resume, which torchrun's restarts need."""
    script = packages["two_nodes"] / "launch" / "slurm.sbatch"
    text = script.read_text()
    assert re.search(
        r"^#     sbatch launch/slurm.sbatch .*--checkpoint-dir \S+ --resume$", text, re.M
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", str(script), "--steps", "2"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "unbound variable" not in result.stderr
    assert result.stderr.startswith(
        "slurm.sbatch: not inside a SLURM job (SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_NNODES not "
        "set): submit it with sbatch launch/slurm.sbatch TRAIN_ARGS...; on one machine, run "
        "torchrun --nproc-per-node=4 train.py --dp-shard 2 TRAIN_ARGS... instead"
    ), result.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "package, extra",
    [
        ("cpu_node", {}),  # a CPU plan's script: no --device given, no GPU count from SLURM
        ("one_node", {"SLURM_GPUS_ON_NODE": "2"}),  # a GPU plan's, told --device cpu here
    ],
)
def test_the_script_trains_as_slurm_runs_it(packages, tmp_path, package, extra):
    """The one-node script run the way sbatch runs it: from a copy in a spool directory, with
    ``scontrol`` naming the submitted script and the node, ``srun`` running its command once;
    torchrun's c10d rendezvous then trains the package on gloo (a CPU plan's script says
    --device cpu itself; a GPU plan's starts as many processes as SLURM gives GPUs)."""
    shims = tmp_path / "bin"
    shims.mkdir()
    submitted = packages[package] / "launch" / "slurm.sbatch"
    (shims / "scontrol").write_text(
        "#!/bin/bash\n"
        'if [ "$2" = job ]; then echo "   Command=' + str(submitted) + ' --steps 2"; '
        "else echo 127.0.0.1; fi\n"
    )
    (shims / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    spool = tmp_path / "spool" / "slurm_script"  # where slurmd keeps its own copy
    spool.parent.mkdir()
    spool.write_text(submitted.read_text())
    env = torchrun_env() | {
        "PATH": os.pathsep.join([str(shims), str(Path(sys.executable).parent), os.environ["PATH"]]),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NNODES": "1",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "RDZV_PORT": str(_free_port()),
        **extra,
    }
    args = ["--steps", "2", "--microbatches", "4"]
    args += [] if package == "cpu_node" else ["--device", "cpu"]
    args += ["--data", "tests/models.py:mlp_batch"]
    result = subprocess.run(
        ["bash", str(spool), *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"step \d+ loss", result.stdout)) == 2, result.stdout[-2000:]


def test_a_world_of_another_size_names_the_numbers_to_change(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    message = world_size_problem(8, 4, 1, 4)
    assert "torchrun started 2 nodes x 4 processes = 8" in message
    assert "torchrun --nnodes=4 --nproc-per-node=4" in message
    assert "--dp x --dp-shard = 2" in message
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert "torchrun --nproc-per-node=2" in world_size_problem(3, 2, 1, 1)
