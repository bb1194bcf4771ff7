"""The measured timeline (issue 28, item 1): ``train.py --trace DIR --trace-steps A:B`` records
every schedule action of the traced steps on every rank, once each, in the schedule's order,
without overlaps, aligned across ranks; ``rankR.json`` round-trips through its strict codec
and ``trace.json`` is a Chrome / Perfetto trace with one process per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopipe.runtime.core.pipeline import Pipeline
from autopipe.runtime.core.schedules import single_stage_order
from autopipe.runtime.guards import output_problems
from autopipe.runtime.options import parse_config
from autopipe.runtime.core.timeline_format import (
    COMPUTE,
    INSTANTS,
    KINDS,
    RECEIVES,
    TRANSFERS,
    RankTimeline,
    Record,
    RunLayout,
    TimelineFormatError,
    chrome_trace,
)
from autopipe.runtime.timeline import Timeline, default_steps, parse_steps

from conftest import ROOT, compile_model, run_ranks

STAGES, MICROBATCHES, STEPS = 4, 4, 3

RUN = RunLayout(
    "0123456789abcdef", "1f1b", microbatches=4, accumulate=1, num_stages=2, pp_size=2, dp_size=1
)

FIXED = RankTimeline(
    rank=1,
    pp_rank=1,
    dp_rank=0,
    stages=(1,),
    device="cpu",
    run=RUN,
    clock_offset_ns=0,
    steps=(1, 2),
    records=(
        Record(1, "step", None, None, 1000, 9000),
        Record(1, "recv_activation", 1, 3, 1500, 2000, 0, 0),
        Record(1, "forward", 1, 3, 2000, 4500),
        Record(1, "optimizer", 1, None, 5000, 8000),
    ),
)

#: chrome_trace(FIXED), byte for byte
FIXED_TRACE = (
    '{"traceEvents":[{"ph":"M","name":"process_name","pid":1,"tid":0,"args":{"name":"rank 1 (stage 1'
    ')"}},{"ph":"M","name":"process_sort_index","pid":1,"tid":0,"args":{"sort_index":1}},{"ph":"M","'
    'name":"thread_name","pid":1,"tid":0,"args":{"name":"actions"}},{"ph":"M","name":"thread_name","'
    'pid":1,"tid":1,"args":{"name":"receives"}},{"name":"step","cat":"step","pid":1,"tid":0,"ts":1.0'
    ',"args":{"step":1,"stage":null,"microbatch":null,"round":0},"ph":"X","dur":8.0},{"name":"recv F'
    '3 s1 from rank 0","cat":"recv_activation","pid":1,"tid":1,"ts":1.5,"args":{"step":1,"stage":1,"'
    'microbatch":3,"round":0,"peer":0},"ph":"X","dur":0.5},{"name":"F3 s1","cat":"forward","pid":1,"'
    'tid":0,"ts":2.0,"args":{"step":1,"stage":1,"microbatch":3,"round":0},"ph":"X","dur":2.5},{"name'
    '":"optimizer s1","cat":"optimizer","pid":1,"tid":0,"ts":5.0,"args":{"step":1,"stage":1,"microba'
    'tch":null,"round":0},"ph":"X","dur":3.0}],"displayTimeUnit":"ms"}\n'
)


# -- the files, in process ----------------------------------------------------------------------
def test_rank_timeline_round_trips_byte_stable():
    text = FIXED.to_json()
    assert RankTimeline.from_json(text) == FIXED
    assert RankTimeline.from_json(text).to_json() == text
    assert "\n" not in text.rstrip("\n")  # compact: one line


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="other"), "format"),
        (lambda d: d.update(version=2), "timeline.version must be 3"),
        (lambda d: d.update(extra=1), "timeline.extra is not a field of a timeline"),
        (lambda d: d.pop("rank"), "timeline.rank is missing"),
        (lambda d: d["run"].update(microbatches=0), "run.microbatches must be an integer >= 1"),
        (lambda d: d["run"].pop("schedule"), "run.schedule"),
        (lambda d: d["run"].update(pipeline=""), "run.pipeline must be a digest"),
        (lambda d: d["run"].update(recompute=[2]), "run.recompute must be stages of the pipeline"),
        (
            lambda d: d["run"].update(recompute_blocks=[1]),
            r"run.recompute_blocks\[0\] must be a str",
        ),
        (lambda d: d.update(stages=["1"]), "timeline.stages"),
        (lambda d: d.update(steps=[1]), "timeline.steps"),
        (lambda d: d["records"][0].update(kind="jump"), r"records\[0\].kind"),
        (lambda d: d["records"][2].update(start_ns=1.5), r"records\[2\].start_ns"),
        (lambda d: d["records"][2].update(end_ns=0), r"records\[2\].end_ns 0 is before"),
        (lambda d: d["records"][1].pop("peer"), r"records\[1\].peer is missing"),
        (lambda d: d["records"][1].update(unit="h.0"), r"records\[1\].unit must be a unit's"),
        (lambda d: d["records"][1].update(kind="unshard"), r"records\[1\].unit must be a unit's"),
        (lambda d: d.update(records=[1]), r"timeline.records\[0\] must be a record"),
    ],
)
def test_rank_timeline_codec_names_the_first_bad_field(edit, message):
    data = json.loads(FIXED.to_json())
    edit(data)
    with pytest.raises(TimelineFormatError, match=message):
        RankTimeline.from_json(json.dumps(data))


def test_chrome_trace_is_byte_stable():
    assert chrome_trace([FIXED]) == FIXED_TRACE
    other = RankTimeline(0, 0, 0, (0, 2), "cpu", RUN, 0, (1, 2), ())
    trace = json.loads(chrome_trace([FIXED, other]))
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0 (stages 0, 2)", "rank 1 (stage 1)"]  # sorted by rank


def test_record_names():
    assert Record(1, "forward", 1, 3, 0, 1).name == "F3 s1"
    assert Record(1, "backward_input", 0, 2, 0, 1, round=1).name == "I2.1 s0"
    assert Record(1, "send_gradient", 2, 0, 0, 0, peer=1).name == "send B0 s2 to rank 1"
    assert Record(1, "reduce", None, None, 0, 1).name == "reduce"
    assert Record(1, "recv_activation", 1, 0, 0, 5, peer=0).name == "recv F0 s1 from rank 0"
    assert set(KINDS) >= COMPUTE | TRANSFERS and TRANSFERS == INSTANTS | RECEIVES


def test_trace_steps_option():
    assert parse_steps("1:3") == (1, 3) and parse_steps("0:1") == (0, 1)
    assert [parse_steps(t) for t in ("3:3", "2:1", "-1:2", "1", "a:b", "1:2:3")] == [None] * 6
    assert default_steps(0, 10) == (1, 3) and default_steps(0, 1) == (0, 1)
    assert default_steps(5, 10) == (6, 8)  # after a resume at step 5
    pipeline = Pipeline.from_json(
        json.loads((ROOT / "generated" / "gpt2_4" / "pipeline.json").read_text())
    )
    config = parse_config(["--trace", "t", "--trace-steps", "2:5"], pipeline)
    assert (config.trace, config.trace_steps) == ("t", (2, 5))
    assert parse_config([], pipeline).trace is None
    for argv in (["--trace", "t", "--trace-steps", "3:2"], ["--trace-steps", "1:2"]):
        with pytest.raises(SystemExit):
            parse_config(argv, pipeline)


def test_trace_directory_is_checked_before_training(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    problems = output_problems(save=None, log_json=None, checkpoint_dir=None, trace=str(file))
    assert problems == [f"--trace {file}: {file} is a file, not a directory"]
    assert (
        output_problems(save=None, log_json=None, checkpoint_dir=None, trace=str(tmp_path / "new"))
        == []
    )


def test_timeline_records_and_writes_in_one_process(tmp_path, single_process_group):
    timeline = Timeline(
        tmp_path / "trace",
        (1, 2),
        rank=0,
        pp_rank=0,
        dp_rank=0,
        stages=(0,),
        device=torch.device("cpu"),
        run=RUN,
    )
    timeline.align()
    with timeline.span("forward", 0, 0):  # step 0 is not traced
        pass
    timeline.begin_step(1)
    with timeline.span("step"):
        timeline.instant("recv_activation", 0, 0, 2)  # waited for until the forward starts
        timeline.instant("recv_gradient", 0, 5, 2)  # consumed by no action: kept as an instant
        with timeline.span("forward", 0, 0):
            pass
        timeline.instant("send_activation", 0, 0, 1)
        with timeline.span("optimizer", 0):
            pass
    timeline.end_step()
    timeline.write()
    written = RankTimeline.from_json((tmp_path / "trace" / "rank0.json").read_text())
    assert [(r.step, r.kind, r.peer) for r in written.records] == [
        (1, "step", None),
        (1, "recv_activation", 2),
        (1, "recv_gradient", 2),
        (1, "forward", None),
        (1, "send_activation", 1),
        (1, "optimizer", None),
    ]
    receive, unconsumed, forward = written.records[1:4]
    assert receive.start_ns < receive.end_ns == forward.start_ns  # one clock reading
    assert unconsumed.start_ns == unconsumed.end_ns
    assert written.records[0].start_ns >= 0  # from the common origin
    trace = json.loads((tmp_path / "trace" / "trace.json").read_text())
    assert {e["name"] for e in trace["traceEvents"]} >= {"F0 s0", "optimizer s0", "step"}
    assert not list((tmp_path / "trace").glob(".*.tmp"))  # written atomically


class DeviceClock:
    """A GPU's clock for CUDA events played on the CPU: it moves only when the test says the
    device worked, while the host runs ahead."""

    def __init__(self) -> None:
        self.ns = 0

    def event(self, enable_timing: bool = False) -> "DeviceClock.Event":
        return DeviceClock.Event(self)

    class Event:
        def __init__(self, clock: "DeviceClock") -> None:
            self.clock, self.at = clock, None

        def record(self) -> None:
            self.at = self.clock.ns

        def elapsed_time(self, other: "DeviceClock.Event") -> float:
            return (other.at - self.at) / 1e6  # milliseconds, as CUDA's


def test_a_cuda_timeline_reads_sends_off_the_device_clock(
    tmp_path, single_process_group, monkeypatch
):
    """On CUDA a send is placed where the device's stream reached when it was posted, as the
    spans are: after the forward that made what it sends, though the host posted it before the
    GPU ran that forward."""
    clock = DeviceClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    timeline = Timeline(tmp_path / "trace", (1, 2), rank=0, pp_rank=0, dp_rank=0, stages=(0,),
                        device=torch.device("cuda"), run=RUN)  # fmt: skip
    timeline.align()
    timeline.begin_step(1)
    with timeline.span("forward", 0, 0):
        clock.ns += 5_000_000  # the GPU runs the forward for 5 ms
    timeline.instant("send_activation", 0, 0, 1)
    with timeline.span("forward", 0, 1):  # starts on the device where the send was posted
        clock.ns += 5_000_000
    timeline.end_step()
    forward, send, after = timeline.records
    assert (forward.kind, send.kind, after.microbatch) == ("forward", "send_activation", 1)
    assert forward.end_ns - forward.start_ns == 5_000_000
    assert send.start_ns == send.end_ns == forward.end_ns  # not at the host's time, 5 ms early
    assert after.start_ns == send.start_ns  # the send first, as it was posted


# -- a 4-rank run -------------------------------------------------------------------------------
@pytest.mark.slow
def test_trace_of_a_four_rank_run_has_every_action_once_in_order(tmp_path):
    package = tmp_path / "pipe"
    compile_model("gpt2", package, STAGES)
    out = tmp_path / "trace"
    run_ranks(
        package / "train.py",
        STAGES,
        "--steps",
        str(STEPS),
        "--microbatches",
        str(MICROBATCHES),
        "--schedule",
        "1f1b",
        "--trace",
        str(out),
        "--trace-steps",
        "1:3",
    )
    timelines = {}
    for rank in range(STAGES):
        text = (out / f"rank{rank}.json").read_text()
        timeline = RankTimeline.from_json(text)
        assert timeline.to_json() == text
        assert (timeline.rank, timeline.stages, timeline.steps) == (rank, (rank,), (1, 3))
        digest = Pipeline.from_json(json.loads((package / "pipeline.json").read_text())).digest()
        assert timeline.run == RunLayout(digest, "1f1b", MICROBATCHES, 1, STAGES, STAGES, 1)
        timelines[rank] = timeline
    letters = {"forward": "F", "backward": "B"}
    for rank, timeline in timelines.items():
        records = timeline.records
        assert {r.step for r in records} == {1, 2}  # the warm-up step 0 is left out
        expected = [
            (a.kind, a.stage, a.microbatch)
            for a in single_stage_order("1f1b", rank, STAGES, MICROBATCHES)
        ]
        for step in (1, 2):
            mine = [r for r in records if r.step == step]
            compute = [(letters[r.kind], r.stage, r.microbatch) for r in mine if r.kind in COMPUTE]
            assert compute == expected, f"rank {rank}, step {step}"  # once each, in order
            (whole,) = [r for r in mine if r.kind == "step"]
            assert all(whole.start_ns <= r.start_ns <= r.end_ns <= whole.end_ns for r in mine)
            (reduce,) = [r for r in mine if r.kind == "reduce"]
            (optimizer,) = [r for r in mine if r.kind == "optimizer"]
            last_backward = max(r.end_ns for r in mine if r.kind == "backward")
            assert last_backward <= reduce.start_ns <= reduce.end_ns <= optimizer.start_ns
            (dp_reduce,) = [r for r in mine if r.kind == "dp_reduce"]  # the schedule's, per stage
            assert last_backward <= dp_reduce.start_ns and dp_reduce.end_ns <= reduce.start_ns
            sends = [r for r in mine if r.kind == "send_activation"]
            receives = [r for r in mine if r.kind == "recv_activation"]
            assert [r.peer for r in sends] == ([rank + 1] * MICROBATCHES if rank < 3 else [])
            assert [r.peer for r in receives] == ([rank - 1] * MICROBATCHES if rank else [])
            # a receive lasts from its creation to the start of the forward that waited for it
            consumers = {(r.kind, r.microbatch): r for r in mine if r.kind in COMPUTE}
            for received in receives:
                forward = consumers["forward", received.microbatch]
                assert received.start_ns <= received.end_ns == forward.start_ns
            gradients = [r for r in mine if r.kind == "recv_gradient"]
            assert len(gradients) == (MICROBATCHES if rank < 3 else 0)
            for received in gradients:
                assert received.end_ns == consumers["backward", received.microbatch].start_ns
        intervals = [
            r for r in records if r.kind not in TRANSFERS and r.kind != "step"
        ]  # the receives are a track of their own
        for before, after in zip(intervals, intervals[1:]):
            assert before.end_ns <= after.start_ns, f"rank {rank}: {before} overlaps {after}"
    # aligned across ranks: a microbatch's forward leaves a stage before the next one starts it
    actions = {
        (r.step, r.kind, r.stage, r.microbatch): r
        for t in timelines.values()
        for r in t.records
        if r.kind in COMPUTE
    }
    for step in (1, 2):
        for m in range(MICROBATCHES):
            for s in range(STAGES - 1):
                assert (
                    actions[step, "forward", s, m].end_ns
                    <= actions[step, "forward", s + 1, m].start_ns
                )
                assert (
                    actions[step, "backward", s + 1, m].end_ns
                    <= actions[step, "backward", s, m].start_ns
                )
    trace = json.loads((out / "trace.json").read_text())
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {r: f"rank {r} (stage {r})" for r in range(STAGES)}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(
        1 for t in timelines.values() for r in t.records if r.kind not in INSTANTS
    )
    assert {"F3 s1", "B0 s3"} <= {e["name"] for e in complete}
