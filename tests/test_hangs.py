"""Hangs explained and stragglers named (issue 28, items 2 and 3). A hang planted three ways on
2 gloo ranks, each through ``tests/planted_train.py`` (a rank stopped with SIGSTOP, a rank that
sends a batch of another shape, a rank that skips a collective), is diagnosed with the right rank
and cause within the timeout, and the run then stops as it always did; SIGUSR1 to a rank blocked
in a transfer prints the diagnosis and the run goes on; a rank slowed on purpose is named as a
straggler, and the JSON log holds every rank's times. The diagnosis itself, the reports' codec
and the straggler rule are checked in process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopipe.runtime.activity import ACTIVITY, Action, Activity, BusyTimes, doing, rank_list
from autopipe.runtime.core.errors import PipelineRunError
from autopipe.runtime.core.mesh import RankMesh
from autopipe.runtime.core.pipeline import SHARDS_INNERMOST
from autopipe.runtime.driver import prepare_together
from autopipe.runtime.guards import RankFailedError
from autopipe.runtime.hangs import (
    ANSWER_WAIT,
    POLL_SECONDS,
    Frame,
    HangReportError,
    HangWatch,
    RankReport,
    diagnosis,
)
from autopipe.runtime.stragglers import (
    cores_shared,
    RankTimes,
    RankTimesError,
    StageTimes,
    Stragglers,
    slowest,
)

from conftest import ROOT, compile_model, cpu_spec_file, torchrun_command, torchrun_env

PLANTED = ROOT / "tests" / "planted_train.py"
TIMEOUT = 6  # --timeout of the hang runs: small, so that the suite stays fast


# -- the diagnosis, in process ------------------------------------------------------------------
def report(rank: int, action: Action | None, seconds: float = 7.0, **fields) -> RankReport:
    frames = fields.pop("stack", (Frame("/x/stage1.py", 40, "forward", "h = f(x)", "user"),))
    return RankReport(
        rank=rank,
        host="node",
        pid=100 + rank,
        stages=(rank,),
        action=action,
        after=fields.pop("after", None),
        seconds=seconds,
        stack=frames,
    )


def test_rank_report_round_trips_and_refuses_bad_fields():
    action = Action("recv_activation", 3, 1, 2, 5, (1,), (), ((2, 16, 32),), 2)
    mine = report(2, action, after=Action("forward", 3, 1, 2, 4))
    assert RankReport.from_json(mine.to_json()) == mine
    assert RankReport.from_json(report(0, None).to_json()).action is None
    data = json.loads(mine.to_json())
    for edit, message in (
        (lambda d: d.update(extra=1), "report.extra is not a field of a hang report"),
        (lambda d: d["action"].update(kind="jump"), "report.action.kind must be an action"),
        (lambda d: d["action"].pop("peers"), "report.action.peers is missing"),
        (lambda d: d["stack"][0].update(origin="x"), r"report.stack\[0\].origin must be one of"),
        (lambda d: d.update(seconds=-1), "report.seconds must be a number >= 0"),
    ):
        bad = json.loads(json.dumps(data))
        edit(bad)
        with pytest.raises(HangReportError, match=message):
            RankReport.from_json(json.dumps(bad))
    with pytest.raises(HangReportError, match="not JSON"):
        RankReport.from_json("{")


def test_actions_in_words():
    recv = Action("recv_activation", 5, 0, 3, 3, (4,))
    assert recv.describe() == "waits for rank 4's forward of microbatch 3 (stage 3's input, step 5)"
    assert Action("forward", 5, 1, 2, 3).describe() == (
        "is inside stage 2's forward of microbatch 3 (step 5, accumulation round 1)"
    )
    assert Action("norm", 1, ranks=(0, 1, 2, 3, 6)).describe() == (
        "waits in the gradient norm's all-reduce with ranks 0-3, 6 (step 1)"
    )
    assert rank_list([3]) == "rank 3" and rank_list([0, 1]) == "ranks 0, 1"
    between = report(1, Action("pipeline", 5, order=2), after=Action("forward", 5, 0, 1, 2))
    assert between.doing() == (
        "is in the pipeline schedule (step 5) for 7.0 s, after stage 1's forward of microbatch 2 "
        "(step 5)"
    )


def test_a_stopped_rank_is_the_cause_when_others_wait_for_it():
    waiting = report(5, Action("recv_activation", 9, 0, 3, 3, (4,)), seconds=212)
    who = report(4, None)  # what rank 4 said when it started
    text = diagnosis("rank 5 waited", {5: waiting}, {4: who}, stops=True)
    lines = text.splitlines()
    assert lines[0] == "train.py: hang diagnosis: rank 5 waited"
    assert "    rank 5 waits for rank 4's forward of microbatch 3 (stage 3's input, step 9)" in text
    assert "    -> rank 4 did not answer" in lines
    assert f"did not answer within {ANSWER_WAIT:g} s: rank 4 (stage 4, pid 104 on node)" in text
    assert "likely cause: a dead or stopped rank: rank 4 did not answer" in text
    assert "py-spy dump --pid 104 on node" in text
    assert lines[-1].endswith("unless the run moves on by then")


def test_the_chain_ends_where_a_rank_computes():
    """The issue's example: rank 5 waits for rank 4's forward, rank 4 is inside stage 2's
    forward at FILE:LINE."""
    reports = {
        5: report(5, Action("recv_activation", 9, 0, 3, 3, (4,)), seconds=212),
        4: report(4, Action("forward", 9, 0, 2, 3), seconds=212),
    }
    text = diagnosis("SIGUSR1 to rank 5", reports, {}, stops=False)
    assert (
        "    -> rank 4 is inside stage 2's forward of microbatch 3 (step 9) for 212 s at " in text
    )
    assert "/x/stage1.py:40" in text
    assert "likely cause: slow or stuck work, not communication: the wait ends at rank 4" in text
    assert text.splitlines()[-1].endswith("the run goes on")


def test_a_collective_skipped_by_one_rank_names_that_rank():
    reports = {
        0: report(0, Action("tied_sum", 1, ranks=(0, 1), order=4)),
        1: report(1, Action("norm", 1, ranks=(0, 1), order=5)),
    }
    text = diagnosis("rank 0 waited", reports, {}, stops=True)
    assert (
        "likely cause: a collective issued by some ranks only: rank 0 waits in the sum of tied "
        "gradients with ranks 0, 1 (step 1), which rank 1 went past without taking part"
    ) in text
    assert "    -> rank 1 waits in the gradient norm's all-reduce" in text
    assert "    -> rank 0 (see above)" in text


def test_a_collective_waiting_for_a_missing_rank_leads_to_it():
    """Ranks 1 and 3 wait in one collective (their ranks in either order) for ranks 0 and 2:
    each chain goes on to rank 0, which did not answer, before rank 2, which computes."""
    reports = {
        1: report(1, Action("norm", 2, ranks=(0, 1, 2, 3), order=5)),
        2: report(2, Action("forward", 2, 0, 2, 1, order=2)),
        3: report(3, Action("norm", 2, ranks=(3, 2, 1, 0), order=5)),
    }
    text = diagnosis("rank 1 waited", reports, {0: None}, stops=True)
    lines = text.splitlines()
    assert (
        "    rank 3 waits in the gradient norm's all-reduce with ranks 0-3 (step 2) for 7.0 s; "
        "ranks 0, 2 are not in it"
    ) in lines
    assert lines.count("    -> rank 0 did not answer") == 2, text
    assert "-> rank 2" not in text
    assert "likely cause: a dead or stopped rank: rank 0 did not answer" in text


def test_a_rank_reading_data_is_named_as_slow_data_loading():
    """Issue 41: the rank reading a step's batch is doing so, not in the collective the others
    wait in: the chain ends there and the cause names data loading and --timeout, whether the
    others wait in the sizes' all-reduce of a dynamic pipeline, for its activation, or not yet
    (a rank alone noticed its own timeout)."""
    reading = report(0, Action("read_batch", 0, order=1), seconds=12)
    waiting = {
        "collective": Action("data", 0, ranks=(0, 1), order=1),
        "transfer": Action("recv_activation", 0, 0, 1, 0, (0,), order=2),
    }
    for how, action in waiting.items():
        text = diagnosis("rank 1 waited", {0: reading, 1: report(1, action)}, {}, stops=True)
        assert "    -> rank 0 is reading the batch (step 0) for 12.0 s at /x/stage1.py:40" in text
        assert (
            "likely cause: slow data loading: the wait ends at rank 0, which is reading the "
            "batch (step 0)"
        ) in text, how
        assert "what to do: a step's batch must be read within --timeout SECONDS" in text, how
    assert "rank 1 is at the step's batch, agreeing on its sizes with ranks 0, 1 (step 0)" in (
        diagnosis("rank 1 waited", {0: reading, 1: report(1, waiting["collective"])}, {},
                  stops=True)
    )  # fmt: skip
    alone = diagnosis("rank 0 waited", {0: reading}, {}, stops=True)
    assert "likely cause: slow data loading: rank 0 is reading the batch (step 0)" in alone
    preparing = report(0, Action("prepare_data", -1), seconds=40)
    waits = report(1, Action("wait_data", -1, ranks=(0, 1)))
    text = diagnosis("SIGUSR1 to rank 1", {0: preparing, 1: waits}, {}, stops=False)
    assert (
        "    rank 1 waits for the dataset files' preparation, with ranks 0, 1 (before the first "
        "step) for 7.0 s; rank 0 is not in it"
    ) in text
    assert (
        "likely cause: slow data loading: the wait ends at rank 0, which is preparing the "
        "dataset files' rows (reading, tokenizing and packing them, before the first step)"
    ) in text


def test_ranks_wait_for_the_data_preparation_without_a_timeout():
    """The ranks that read a dataset file prepare it before the first step while the others
    wait through the store, polled, without a collective's timeout; a rank whose preparation
    fails raises its error, the others stop naming it, and ranks failing alike say it once."""
    for fails in (False, True):
        store, finished, errors = dist.HashStore(), {}, {}

        def prepare() -> None:
            time.sleep(0.5)
            if fails:
                raise PipelineRunError("--data corpus.jsonl: no column 'text'")

        def rank(number: int) -> None:
            try:
                prepare_together(prepare if number == 0 else None, number, 2, store)
            except PipelineRunError as exc:
                errors[number] = exc
            finished[number] = time.monotonic()

        threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert finished[1] - began >= 0.5  # it waited for rank 0's preparation
        if not fails:
            assert errors == {}
            continue
        assert str(errors[0]) == "--data corpus.jsonl: no column 'text'"
        assert isinstance(errors[1], RankFailedError) and errors[1].failed == 0
        assert str(errors[1]) == (
            "it could not prepare its data: --data corpus.jsonl: no column 'text'"
        )
    # both ranks read the same file and fail alike: the lowest says it, the other names it (rank
    # 1, quicker, waits for rank 0's answer); failing unlike, each says its own
    for second in ("no column 'text'", "no such file"):
        store, errors = dist.HashStore(), {}

        def failing(number: int, message: str) -> None:
            def prepare() -> None:
                time.sleep(0.5 if number == 0 else 0.0)
                raise PipelineRunError(f"--data corpus.jsonl: {message}")

            try:
                prepare_together(prepare, number, 2, store)
            except PipelineRunError as exc:
                errors[number] = exc

        threads = [
            threading.Thread(target=failing, args=(1, second)),
            threading.Thread(target=failing, args=(0, "no column 'text'")),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert str(errors[0]) == "--data corpus.jsonl: no column 'text'"
        if second == "no column 'text'":
            assert isinstance(errors[1], RankFailedError) and errors[1].failed == 0
            assert (
                str(errors[1])
                == "it could not prepare its data: --data corpus.jsonl: no column 'text'"
            )
        else:
            assert str(errors[1]) == "--data corpus.jsonl: no such file"
    ACTIVITY.reset()


def test_a_send_of_another_shape_is_a_shape_mismatch():
    """What NCCL does with a transfer of another size: both sides wait; their shapes tell."""
    reports = {
        1: report(1, Action("recv_activation", 2, 0, 1, 0, (0,), (), ((2, 16, 32),), 2)),
        0: report(0, Action("send_activation", 2, 0, 0, 0, (1,), (), ((3, 16, 32),), 2)),
    }
    text = diagnosis("rank 1 waited", reports, {}, stops=True)
    assert (
        "likely cause: a data-dependent shape mismatch: rank 0 sends stage 0's output of "
        "microbatch 0 to rank 1 (step 2) shaped [3, 16, 32], and rank 1 receives it into a "
        "buffer of [2, 16, 32]"
    ) in text


def test_ranks_waiting_for_each_other_in_transfers_are_a_cycle():
    reports = {
        0: report(0, Action("recv_gradient", 1, 0, 0, 2, (1,), order=2)),
        1: report(1, Action("recv_activation", 1, 0, 1, 3, (0,), order=2)),
    }
    text = diagnosis("rank 0 waited", reports, {}, stops=True)
    assert "likely cause: ranks that wait for each other: rank 0 -> rank 1 -> rank 0" in text


def test_stacks_show_user_code_first_and_name_repeats():
    frames = (
        Frame("/lib/torch/c10d.py", 10, "wait", "work.wait()", "library"),
        Frame("/pkg/runtime/driver.py", 5, "run_schedule", "call()", "runtime"),
        Frame("/mine/data.py", 7, "batch", "load()", "user"),
    )
    reports = {r: report(r, Action("metrics", 0, ranks=(0, 1, 2)), stack=frames) for r in (1, 2)}
    text = diagnosis("SIGUSR1 to rank 1", reports, {0: None}, stops=False)
    stack = text[text.index("    rank 1 (stage 1") :].splitlines()
    assert [line.split(" in ")[0].strip() for line in stack[1:4]] == [
        "/mine/data.py:7",
        "/pkg/runtime/driver.py:5",
        "/lib/torch/c10d.py:10",
    ]
    assert "      the same stack as rank 1" in text
    assert "did not answer within 4 s: rank 0" in text


def test_activity_follows_the_hooks_and_times_a_steps_compute():
    activity = Activity()
    activity.reset(BusyTimes())
    activity.begin_step(3)
    activity.enter("step")
    activity.enter("pipeline")
    activity.instant("recv_activation", 1, 0, (0,), ((2, 4),))
    assert activity.now is not None and activity.now[0].kind == "recv_activation"
    activity.enter("forward", 1, 0)
    time.sleep(0.01)
    activity.leave()
    action, _since, after = activity.now
    assert (action.kind, action.step, after.kind) == ("pipeline", 3, "forward")
    activity.leave()
    activity.leave()
    assert activity.now is None
    forward, backward = activity.busy.take()
    assert forward[1] >= 0.01 and backward == {}
    assert activity.busy.take() == ({}, {})  # taken: a fresh start


def test_a_timeout_in_one_process_is_diagnosed_once(capfd):
    """Without torchrun's store the rank diagnoses itself: after --timeout of one action, once;
    the preparation of a dataset file before the first step has no timeout."""
    ACTIVITY.reset()
    watch = HangWatch(rank=0, world_size=1, stages=(0,), timeout=0.5)
    watch.start()
    try:
        with doing("prepare_data"):
            time.sleep(0.5 + 1.5 * POLL_SECONDS)
        with doing("checkpoint"):
            time.sleep(0.5 + 2.5 * POLL_SECONDS)
    finally:
        watch.stop()
        ACTIVITY.reset()
    err = capfd.readouterr().err
    assert err.count("train.py: hang diagnosis:") == 1, err
    assert "hang diagnosis: rank 0 is writing a checkpoint (before the first step) for " in err
    assert "longer than --timeout 0.5 s" in err
    assert "in test_a_timeout_in_one_process_is_diagnosed_once" in err  # the main thread's stack


# -- stragglers, in process ---------------------------------------------------------------------
def times(rank: int, busy: float, planned: float = 0.1) -> RankTimes:
    return RankTimes(rank, 1.0, (StageTimes(rank, busy / 2, busy / 2, planned),))


def test_rank_times_codec_is_strict():
    mine = times(2, 0.3)
    assert RankTimes.from_json(json.loads(json.dumps(mine.to_json()))) == mine
    assert mine.vs_plan == pytest.approx(3.0)
    bad = mine.to_json() | {"busy": 1.0}
    with pytest.raises(RankTimesError, match=r"rank_times.busy must be 0.3 \(from its stages\)"):
        RankTimes.from_json(bad)
    negative = mine.to_json() | {"stages": [mine.stages[0].to_json() | {"forward": -1}]}
    with pytest.raises(RankTimesError, match=r"rank_times.stages\[0\].forward must be a number"):
        RankTimes.from_json(negative)


def test_a_straggler_is_named_once_after_consecutive_lines():
    stragglers = Stragglers(RankMesh(pp=4), lines=3)
    slow = [times(0, 0.1), times(1, 0.1), times(2, 0.5), times(3, 0.12)]
    assert slowest(slow)[0].rank == 2 and slowest(slow)[1] == "5x its plan"
    # a rank without a prediction: all are compared, and described, by their compute
    unplanned = [*slow[:3], RankTimes(3, 1.0, (StageTimes(3, 0.06, 0.06, 0.0),))]
    assert slowest(unplanned)[1] == "0.5 s of compute per step"
    assert stragglers.observe(slow) is None and stragglers.observe(slow) is None
    note = stragglers.observe(slow)
    assert note == (
        "rank 2 (stage 2) is a straggler: 5x its plan against 1x for the other ranks (median) "
        "over the last 3 log steps, 5 times slower"
    )
    assert stragglers.observe(slow) is None  # named once
    other = Stragglers(RankMesh(pp=4), lines=3)
    even = [times(0, 0.1), times(1, 0.1), times(2, 0.15), times(3, 0.12)]
    assert all(other.observe(line) is None for line in (slow, slow, even, slow, slow))


def test_ranks_sharing_cpu_cores_are_planned_on_their_share(monkeypatch):
    """The quick start's 4 ranks on 2 cores (issue 42): each rank computes on half a core, where
    a plan for this CPU gives it one; the comparison with the plan says so and scales."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cores_shared(torch.device("cpu")) == (4, 2)
    assert cores_shared(torch.device("cuda")) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_shared(torch.device("cpu")) is None


def test_replicas_are_the_peers_with_data_parallelism():
    stragglers = Stragglers(RankMesh(pp=2, dp_replicate=2), lines=1)
    assert stragglers.peers(1) == [3] and stragglers.peers(2) == [0]
    # shards innermost: a stage's data-parallel ranks are consecutive
    shards = Stragglers(RankMesh(pp=2, dp_shard=2, order=SHARDS_INNERMOST), lines=1)
    assert shards.peers(1) == [0] and shards.peers(2) == [3]
    # rank 1 is slower than rank 0 (another stage) but not than its replica, rank 3
    line = [times(0, 0.1), times(1, 0.3), times(2, 0.1), times(3, 0.3)]
    assert stragglers.observe(line) is None
    note = stragglers.observe([times(0, 0.1), times(1, 0.3), times(2, 0.1), times(3, 0.1)])
    assert note is not None and note.startswith("rank 1 (stage 1) is a straggler")
    assert "its data-parallel replicas (rank 3)" in note


# -- planted on 2 gloo ranks ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """The 3-layer test GPT-2 in 2 stages; its embedding and LM head are tied across them.
    Planned for a CPU (a spec of CPU-like figures, named as `--device-spec cpu` names one), so
    that its runs compare their stages with the plan."""
    root = tmp_path_factory.mktemp("hangs")
    compile_model("gpt2", root / "pipe", 2, device_spec=str(cpu_spec_file(root)))
    return root / "pipe"


class Planted:
    """train.py on 2 gloo ranks with ``plant`` on ``rank`` (see tests/planted_train.py)."""

    def __init__(self, package: Path, directory: Path, plant: str, rank: int, *args: str, **env):
        self.directory = directory
        directory.mkdir()
        self.out, self.err = directory / "stdout", directory / "stderr"
        variables = {
            "PLANTED_PACKAGE": str(package),
            "PLANTED": plant,
            "PLANTED_RANK": str(rank),
            "PLANTED_DIR": str(directory),
            **env,
        }
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                torchrun_command(PLANTED, 2, "--microbatches", "4", *args),
                cwd=ROOT,
                env={**torchrun_env(), **variables},
                stdout=out,
                stderr=err,
            )

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_for(self, text: str, timeout: float, path: Path | None = None) -> float:
        """Waits for ``text`` in stderr (or in ``path``); the time it appeared."""
        path = path or self.err
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and text in path.read_text():
                return time.time()
            if self.process.poll() is not None and path == self.err:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} in {path.name} after {timeout} s:\n{self.stderr()}")

    def pid(self, rank: int) -> int:
        return int((self.directory / f"rank{rank}.pid").read_text())

    def struck(self) -> float:
        return float((self.directory / "struck").read_text())

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def the_diagnosis(stderr: str) -> str:
    """The one diagnosis block in ``stderr``: its first line and the indented ones after it."""
    assert stderr.count("train.py: hang diagnosis:") == 1, stderr[-6000:]
    lines = stderr[stderr.index("train.py: hang diagnosis:") :].splitlines()
    block = [lines[0]]
    for line in lines[1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return "\n".join(block)


def first_seen(runs: dict[str, Planted], text: str, timeout: float) -> dict[str, float]:
    """Waits for ``text`` in the stderr of every run at once; the time it appeared in each."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(runs) and time.monotonic() < deadline:
        for name, run in runs.items():
            if name not in seen and text in run.stderr():
                seen[name] = time.time()
            elif name not in seen and run.process.poll() is not None:
                raise AssertionError(f"{name}: no {text!r} in stderr:\n{run.stderr()}")
        time.sleep(0.2)
    missing = [name for name in runs if name not in seen]
    assert not missing, f"no {text!r} after {timeout} s in {missing}"
    return seen


@pytest.fixture(scope="module")
def hung(package, tmp_path_factory) -> dict[str, tuple[Planted, float]]:
    """Two hung runs, started together since each mostly waits for its --timeout: rank 0 stops
    itself with SIGSTOP ("stop"), rank 1 skips a collective ("skip"); each with the time its
    diagnosis appeared. The stopped rank is continued once its partner lost contact, so that
    torchrun can stop it."""
    root = tmp_path_factory.mktemp("hung")
    runs = {
        plant: Planted(
            package, root / plant, plant, rank, "--steps", "3", "--timeout", str(TIMEOUT)
        )
        for plant, rank in (("stop", 0), ("skip", 1))
    }
    stop = runs["stop"]
    try:
        seen = first_seen(runs, "train.py: hang diagnosis:", 90)
        stop.wait_for("lost contact", 60)
    finally:
        if (stop.directory / "rank0.pid").exists():
            os.kill(stop.pid(0), signal.SIGCONT)
    return {plant: (run, seen[plant]) for plant, run in runs.items()}


@pytest.mark.slow
def test_a_rank_stopped_with_sigstop_is_named(hung):
    """Rank 0 stops itself in step 1's forward of microbatch 0. Rank 1, waiting for it, notices
    at --timeout; rank 0 cannot answer; rank 1 prints the diagnosis naming rank 0 as stopped or
    dead, then gives up as before (lost contact, exit 3)."""
    run, seen = hung["stop"]
    assert run.finish() != 0
    stderr = run.stderr()
    text = the_diagnosis(stderr)
    assert seen - run.struck() < TIMEOUT + POLL_SECONDS + ANSWER_WAIT + 3, text
    assert text.startswith(
        "train.py: hang diagnosis: rank 1 waits for rank 0's forward of microbatch 0 (stage 1's "
        "input, step 1) for "
    ), text
    assert f"longer than --timeout {TIMEOUT} s" in text.splitlines()[0]
    assert "    -> rank 0 did not answer" in text
    assert f"did not answer within {ANSWER_WAIT:g} s: rank 0 (stage 0, pid {run.pid(0)} on" in text
    assert "likely cause: a dead or stopped rank: rank 0 did not answer" in text
    assert "    rank 1 (stage 1, pid" in text  # rank 1's stack
    assert "in _wait_batch_p2p" in text  # ... blocked in the transfer's wait
    assert stderr.index("train.py: hang diagnosis:") < stderr.index("lost contact")
    assert "train.py: error: rank 1 lost contact with another rank" in stderr


@pytest.mark.slow
def test_a_rank_sending_a_batch_of_another_shape_is_named(package, tmp_path):
    """Rank 0's stage returns an output one row longer at step 1: gloo would abort rank 1 as it
    receives it (NCCL would hang). Rank 0 names the mismatch before sending, at once."""
    run = Planted(package, tmp_path / "run", "shape", 0, "--steps", "3", "--timeout", str(TIMEOUT))
    assert run.finish() != 0
    ended = time.time()
    stderr = run.stderr()
    errors = [line for line in stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(errors) == 1, stderr[-4000:]
    assert errors[0].startswith(
        "train.py: error: step 1: a data-dependent shape mismatch: stage 0's forward of "
        "microbatch 0 returned output 0 ('transformer_h_1_out') as [3, 16, 32] float32, but "
        "the next stage receives it into a buffer of [2, 16, 32] float32"
    ), errors[0]
    assert errors[0].endswith("(rank 0, stage 0)")
    # rank 1, stopped by torchrun, names rank 0 if it gets to say anything: a heavily loaded
    # machine may let torchrun kill it first, so it may say nothing (``said`` empty) ...
    said = [line for line in stderr.splitlines() if line.startswith("train.py: rank 1 ")]
    assert all("because rank 0 failed" in line for line in said), said
    # ... but never a lost contact that hides the cause, whether it spoke or not
    assert "lost contact" not in stderr
    assert "SIGABRT" not in stderr and "hang diagnosis" not in stderr
    assert ended - run.struck() < TIMEOUT


@pytest.mark.slow
def test_a_collective_skipped_by_one_rank_is_named(hung):
    """Rank 1 leaves out the sum of tied gradients at step 1 and goes on to the gradient norm,
    while rank 0 waits in the sum: the diagnosis names rank 1 as the one that went past it."""
    run, seen = hung["skip"]
    assert run.finish() != 0
    stderr = run.stderr()
    text = the_diagnosis(stderr)
    assert seen - run.struck() < TIMEOUT + POLL_SECONDS + ANSWER_WAIT + 3, text
    assert (
        "likely cause: a collective issued by some ranks only: rank 0 waits in the sum of tied "
        "gradients with ranks 0, 1 (step 1), which rank 1 went past without taking part: it "
        "waits in the gradient norm's all-reduce with ranks 0, 1 (step 1)"
    ) in text, text
    assert "did not answer" not in text
    # then they give up, as before: the first whose wait ends says so; the other says so too,
    # unless torchrun's SIGTERM (sent once the first has ended) reaches it still waiting
    assert 1 <= stderr.count("lost contact") <= 2, stderr[-3000:]


@pytest.fixture(scope="module")
def slowed(package, tmp_path_factory) -> tuple[Planted, float]:
    """Rank 1 sleeps 50 ms in each stage forward, 4 s more in step 2's first, where SIGUSR1
    reaches rank 0 (blocked waiting for rank 1); the time it was sent."""
    directory = tmp_path_factory.mktemp("slowed")
    log = directory / "log.jsonl"
    run = Planted(
        package, directory / "run", "slow", 1, "--steps", "6", "--timeout", "60",
        "--log-json", str(log), PLANTED_SLOW="0.05", PLANTED_LONG="4",
    )  # fmt: skip
    run.wait_for("", 60, run.directory / "struck")
    time.sleep(0.5)  # rank 0 is blocked waiting for rank 1 by now
    sent = time.time()
    os.kill(run.pid(0), signal.SIGUSR1)
    assert run.finish() == 0, run.stderr()[-4000:]
    return run, sent


@pytest.mark.slow
def test_sigusr1_prints_the_diagnosis_and_the_run_goes_on(slowed):
    run, sent = slowed
    text = the_diagnosis(run.stderr())
    lines = text.splitlines()
    assert lines[0] == "train.py: hang diagnosis: SIGUSR1 to rank 0"
    assert lines[2].startswith(
        "    rank 0 waits for rank 1's backward of microbatch 0 (the gradient of stage 0's "
        "output, step 2) for "
    ), text
    assert lines[3].startswith(
        "    -> rank 1 is inside stage 1's forward of microbatch 0 (step 2) for "
    ), text
    assert "tests/planted_train.py:" in lines[3]  # where rank 1's code is: the planted sleep
    assert "likely cause: slow or stuck work, not communication: the wait ends at rank 1" in text
    assert "in _wait_batch_p2p" in text  # rank 0's main thread, blocked in C++, was read
    assert lines[-1] == "  SIGUSR1 only asked for this diagnosis: the run goes on"
    assert "step 5 loss" in run.out.read_text()  # every step ran


@pytest.mark.slow
def test_a_rank_slowed_on_purpose_is_named_a_straggler(slowed):
    run, _sent = slowed
    stdout = run.out.read_text()
    notes = [line for line in stdout.splitlines() if "is a straggler" in line]
    assert len(notes) == 1, stdout
    assert notes[0].startswith("rank 1 (stage 1) is a straggler: ")
    assert "for the other ranks (median) over the last 3 log steps" in notes[0]
    steps = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 6 and all(", slowest rank 1 (stage 1) " in line for line in steps)
    entries = [
        json.loads(line) for line in (run.directory.parent / "log.jsonl").read_text().splitlines()
    ]
    assert [e["slowest_rank"] for e in entries] == [1] * 6
    for entry in entries:
        ranks = [RankTimes.from_json(t) for t in entry["rank_times"]]
        assert [(t.rank, [s.stage for s in t.stages]) for t in ranks] == [(0, [0]), (1, [1])]
        assert ranks[1].stages[0].forward >= 4 * 0.05  # 4 microbatches, each 50 ms asleep
        assert ranks[1].vs_plan > 2 * ranks[0].vs_plan
        assert all(t.step > 0 for t in ranks)
