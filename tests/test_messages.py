"""Messages carry the numbers, and what they print can be pasted (issue 26): a memory refusal
states what each rank needs against the device's capacity in readable units and the smallest
changes that fit, each of which does fit when run; the printed train command is shell-quoted; a
compile into an output directory that another autopipe process is writing is refused and
changes nothing, and a lock left by a process that is gone is taken over."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shlex
import socket
import subprocess

import pytest

from autopipe.partitioning.byte_units import format_bytes, format_bytes_each
from autopipe.cli import main as autopipe
from autopipe.codegen import write_package
from autopipe.codegen.output_lock import lock_path, pid_alive
from autopipe.compiler import CompileOptions, profile_step, trace_step
from autopipe.errors import DeviceMemoryError, OutputLockedError
from autopipe.partitioning import CostModel, partition
from autopipe.partitioning.cost import STATE_FACTOR
from autopipe.partitioning.dp import solve_contiguous
from autopipe.profiling import device_spec
from autopipe.spec import load_example

from conftest import compile_model, spec
from graphs import chain_graph, device, profile

GiB = 2**30
MiB = 2**20
#: a GPT-2 whose parameters outweigh its activations: 193 MiB of AdamW state in all
WIDE = "gpt2_wide_meta"
#: a device on which two stages of it do not fit, even recomputing (each holds ~97 MiB of state)
SMALL = 80 * MiB


@pytest.fixture(scope="module")
def wide_graph():
    """The wide GPT-2 traced, and profiled on a device like an H100 but of ``SMALL`` memory."""
    example = load_example(spec(WIDE))
    options = CompileOptions(stages=2)
    graph = trace_step(example, options)
    roomy = profile_step(graph, options, example)
    small = dataclasses.replace(roomy.device, name="small", memory=SMALL)
    return graph, dataclasses.replace(roomy, device=small)


@pytest.fixture
def small_spec(tmp_path):
    """``--device-spec`` of that device."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps(device_spec("h100").to_json() | {"name": "small", "memory": SMALL}))
    return path


def peak(part) -> float:
    return max(part.predicted.device_memory)


def test_bytes_are_written_in_readable_units():
    """MiB below a GiB, GiB above, three significant digits."""
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(80 * MiB) == "80.0 MiB"
    assert format_bytes(1023 * MiB) == "1023 MiB"
    assert format_bytes(1.25 * GiB) == "1.25 GiB"
    assert format_bytes_each([2 * GiB, 3 * GiB], "stage") == (
        "2.00 GiB on stage 0 and 3.00 GiB on stage 1"
    )
    assert format_bytes_each([MiB] * 3, "rank") == "1.00 MiB, 1.00 MiB and 1.00 MiB on ranks 0 to 2"


def test_contiguous_refusal_names_the_least_a_split_needs():
    """Four units of 1 GiB of activations on 2 stages under 1F1B (stage 0 holds 2 microbatches
    in flight, stage 1 one): the split needing the least memory is 1 | 3 units, 2 and 3 GiB. The
    refusal on 1.5 GiB (without recomputing) says exactly that, and it is the threshold: 3 GiB
    fits, a byte less not."""
    graph = chain_graph(4)

    def model(memory: float) -> CostModel:
        spec = device(memory)
        plain = CostModel(graph, profile(graph, [1] * 4, activations=[GiB] * 4, spec=spec))
        return plain.without_balancing_recomputation()

    with pytest.raises(DeviceMemoryError) as failure:
        solve_contiguous(model(1.5 * GiB), 2)
    message = str(failure.value)
    assert message.startswith(
        "no split into 2 stages fits the memory of A100 (1.50 GiB per device)"
    )
    assert "needs at least 2.00 GiB on stage 0 and 3.00 GiB on stage 1" in message
    assert "stage 1: 0 B of parameters, gradients and optimizer state and 3.00 GiB of " in message
    assert "activations for 1 microbatch in flight" in message
    assert failure.value.peak == 3 * GiB
    assert solve_contiguous(model(3 * GiB), 2) == [0, 1, 1, 1]
    with pytest.raises(DeviceMemoryError):
        solve_contiguous(model(3 * GiB - 1), 2)


def test_memory_refusal_states_each_ranks_need_and_changes_that_fit(wide_graph):
    """Two stages on 80 MiB: each stage's need in MiB against the capacity (they add up to the
    model's state: parameter bytes x 4 under AdamW), then the fewest stages and the least
    --dp-shard that fit, with their fullest rank's need. Partitioned again with each suggestion,
    the model fits with exactly that need, and with one less it does not."""
    graph, small = wide_graph
    with pytest.raises(DeviceMemoryError) as failure:
        partition(graph, small, 2)
    message = str(failure.value)
    assert "GiB" not in message
    assert message.startswith(
        "no split into 2 stages fits the memory of small (80.0 MiB per device) even with every "
        "stage's activations recomputed: the split needing the least memory needs at least "
    )
    needs = re.search(r"at least ([\d.]+) MiB on stage 0 and ([\d.]+) MiB on stage 1", message)
    assert needs, message
    stage_needs = [float(n) * MiB for n in needs.groups()]
    assert max(stage_needs) > SMALL
    state = sum(CostModel(graph, small).param_bytes) * STATE_FACTOR["adamw"]
    assert sum(stage_needs) == pytest.approx(state, rel=0.01)

    stages = re.search(r"--stages (\d+) \((\d+) devices, at most ([\d.]+ MiB) each\)", message)
    assert stages, message
    count = int(stages.group(1))
    assert int(stages.group(2)) == count > 2
    more = partition(graph, small, count)
    assert peak(more) <= SMALL and format_bytes(peak(more)) == stages.group(3)
    with pytest.raises(DeviceMemoryError):
        partition(graph, small, count - 1, advise=False)

    shards = re.search(
        r"--dp-shard (\d+) \((\d+) devices in all, at most ([\d.]+ MiB) each\)", message
    )
    assert shards, message
    shard = int(shards.group(1))
    assert int(shards.group(2)) == 2 * shard
    sharded = partition(graph, small, 2, dp_shard=shard)
    assert peak(sharded) <= SMALL and format_bytes(peak(sharded)) == shards.group(3)
    if shard > 2:
        with pytest.raises(DeviceMemoryError):
            partition(graph, small, 2, dp_shard=shard - 1, advise=False)
    assert message.endswith("or a device with more memory (--device-spec)")


def test_refusal_after_recomputation_states_every_ranks_peak(wide_graph):
    """Three stages on 80 MiB split, but a rank is short even recomputing: the refusal lists
    every rank's need (one over the capacity) and what the fullest holds at its peak, adding
    up to its need; the suggested stage count fits."""
    graph, small = wide_graph
    with pytest.raises(DeviceMemoryError) as failure:
        partition(graph, small, 3)
    message = str(failure.value)
    assert message.startswith(
        "no partition into 3 stages on 3 devices fits the memory of small (80.0 MiB per device) "
        "even recomputing the activations of every rank short of memory: they need "
    )
    ranks = re.search(
        r"they need ([\d.]+) MiB, ([\d.]+) MiB and ([\d.]+) MiB on ranks 0 to 2", message
    )
    assert ranks, message
    needs = [float(n) * MiB for n in ranks.groups()]
    assert max(needs) > SMALL and failure.value.peak == pytest.approx(max(needs), rel=0.01)
    fullest = needs.index(max(needs))
    held = re.search(rf"\(rank {fullest} at its peak, [^:]+: ([^)]+)\)", message)
    assert held, message
    units = {"B": 1, "KiB": 2**10, "MiB": MiB}
    parts = [
        float(size) * units[unit]
        for size, unit in re.findall(r"([\d.]+) (B|KiB|MiB) of", held.group(1))
    ]
    assert sum(parts) == pytest.approx(max(needs), rel=0.01)
    stages = int(re.search(r"--stages (\d+) ", message).group(1))
    assert peak(partition(graph, small, stages)) <= SMALL


def test_cli_memory_refusals_print_the_numbers(tmp_path, small_spec, capsys):
    """``autopipe compile`` and ``autopipe plan`` for a device too small: exit 1, no traceback,
    the needs in MiB; the plan table says what each plan needs, and the error how many devices
    the model's state alone needs (its bytes / the usable 90% of the device). Nothing is left
    on disk, not even the folders --out would have been created in."""
    out = tmp_path / "new" / "pipe"
    args = ["--device-spec", str(small_spec)]
    compile_args = ["compile", spec(WIDE), "--stages", "2", "--out", str(out), "--quiet"]
    assert autopipe([*compile_args, *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopipe compile: error: no split into 2 stages fits the memory of ")
    assert "small (80.0 MiB per device)" in err and "Traceback" not in err
    assert re.search(r"--stages \d+ \(\d+ devices, at most [\d.]+ MiB each\)", err)
    assert list(tmp_path.iterdir()) == [small_spec]

    assert autopipe(["plan", spec(WIDE), "--devices", "2", *args]) == 1
    captured = capsys.readouterr()
    # the state alone does not fit: every plan is refused before it is partitioned
    assert "a device needs at least " in captured.out and "MiB whatever the split" in captured.out
    floor = re.search(
        r"alone take ([\d.]+) MiB: at least (\d+) devices of 72.0 MiB whatever the plan",
        captured.err,
    )
    assert floor and "Traceback" not in captured.err
    state = float(floor.group(1)) * MiB
    assert int(floor.group(2)) == math.ceil(state / (0.9 * SMALL))


def test_train_hint_is_shell_quoted(tmp_path, capsys):
    """An --out with a space: the printed torchrun command splits, as a shell would, into the
    train.py that was written."""
    out = tmp_path / "my pipe"
    args = ["compile", spec("mlp"), "--stages", "2", "--out", str(out), "--quiet", "--no-report"]
    assert autopipe(args) == 0
    line = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("train it: ")
    )
    words = shlex.split(line.removeprefix("train it: "))
    assert words == ["torchrun", "--nproc-per-node=2", str(out / "train.py"), "--steps", "100"]
    assert (out / "train.py").is_file()


def checksums(directory) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def hold_lock(out, pid: int) -> None:
    """Write ``out``'s lock as process ``pid`` of this host would."""
    holder = {"pid": pid, "host": socket.gethostname(), "since": "2026-11-25T10:00:00+00:00"}
    lock_path(out).write_text(json.dumps(holder))


def test_compile_into_a_directory_being_written_is_refused(tmp_path, capsys):
    """A live process (``sleep``) holds the lock of --out: compiling there with --force is
    refused naming it, in-process and on the command line (exit 1, no traceback), as is writing
    a package there directly; the directory, its lock and its parent are unchanged."""
    out = tmp_path / "pipe"
    compile_model("mlp", out, 2)
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        hold_lock(out, sleeper.pid)
        lock = lock_path(out).read_bytes()
        before, listing = checksums(out), sorted(p.name for p in tmp_path.iterdir())
        busy = (
            rf"{re.escape(str(out))} is being written by another autopipe compile \(pid "
            rf"{sleeper.pid} on {re.escape(socket.gethostname())}, since 2026-11-25T10:00:00"
            r"\+00:00\); wait for it to finish or choose another --out"
        )
        with pytest.raises(OutputLockedError, match=busy):
            compile_model("mlp", out, 3, force=True)
        with pytest.raises(OutputLockedError, match=busy):
            write_package(out, {"stage0.py": "# mine\n"}, force=True)
        assert (
            autopipe(["compile", spec("mlp"), "--stages", "3", "--out", str(out), "--force"]) == 1
        )
        err = capsys.readouterr().err
        assert re.match(f"autopipe compile: error: {busy}", err) and "Traceback" not in err
        assert checksums(out) == before
        assert lock_path(out).read_bytes() == lock
        assert sorted(p.name for p in tmp_path.iterdir()) == listing
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_lock_is_taken_over(tmp_path, capsys, monkeypatch):
    """A lock left by a process that is gone: the compile takes it over, says so, writes the
    pipeline and removes the lock when done."""
    monkeypatch.setenv("COLUMNS", "1000")  # the note on one line
    out = tmp_path / "pipe"
    compile_model("mlp", out, 2)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not pid_alive(gone.pid)
    hold_lock(out, gone.pid)
    args = ["compile", spec("mlp"), "--stages", "3", "--out", str(out), "--force", "--no-report"]
    assert autopipe(args) == 0
    captured = capsys.readouterr()
    assert f"took over the lock of {out} from pid {gone.pid} on " in " ".join(captured.err.split())
    assert "wrote 3-stage pipeline" in captured.out
    assert (out / "stage2.py").is_file()
    assert not lock_path(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
