"""A traced run read back (autopipe/run_trace.py): the measures ``report --run`` and ``replan``
rest on, against a hand-made trace whose stage times, pipeline runs, bubble and step times are
known, with data-parallel replicas kept apart and FSDP2's actions counted apart."""

from __future__ import annotations

import pytest

from autopipe.report.run_trace import RunTrace
from autopipe.runtime.core.timeline_format import RankTimeline, Record, RunLayout

MS = 1_000_000  # nanoseconds

RUN = RunLayout("digest", "gpipe", microbatches=2, accumulate=1, num_stages=2, pp_size=2, dp_size=2)


#: GPipe over 2 microbatches on 2 stages: stage 0's forwards take 1 ms, stage 1's 3 ms, every
#: backward 2 ms; (kind, microbatch, start, end) in ms from the replica's start
SPANS = {
    0: [
        ("forward", 0, 0, 1),
        ("forward", 1, 1, 2),
        ("backward", 0, 9, 11),
        ("backward", 1, 11, 13),
    ],
    1: [("forward", 0, 1, 4), ("forward", 1, 4, 7), ("backward", 0, 7, 9), ("backward", 1, 9, 11)],
}


def _timeline(rank: int, pp_rank: int, dp_rank: int, offset: int) -> RankTimeline:
    """Rank ``rank``'s one traced step, its replica starting ``offset`` ms after the origin."""
    records = [Record(1, "step", None, None, offset * MS, (offset + 20) * MS)]
    for kind, microbatch, begin, end in SPANS[pp_rank]:
        start = (offset + begin) * MS
        records.append(Record(1, kind, pp_rank, microbatch, start, (offset + end) * MS))
        # FSDP2's: a quarter of a ms gathering in each forward, half a ms reducing in each
        # backward (measures of compute leave them out)
        unit = ("unshard", MS // 4) if kind == "forward" else ("fsdp_reduce", MS // 2)
        records.append(Record(1, unit[0], pp_rank, microbatch, start, start + unit[1], unit=""))
    return RankTimeline(rank, pp_rank, dp_rank, (pp_rank,), "cpu", RUN, 0, (1, 2), tuple(records))


@pytest.fixture
def trace(tmp_path):
    # replica 0 starts at 0 ms, replica 1 at 100 ms (another host's skew must not join them)
    for rank, pp_rank, dp_rank, offset in (
        (0, 0, 0, 0),
        (1, 1, 0, 0),
        (2, 0, 1, 100),
        (3, 1, 1, 100),
    ):
        timeline = _timeline(rank, pp_rank, dp_rank, offset)
        (tmp_path / f"rank{rank}.json").write_text(timeline.to_json())
    return RunTrace.load(tmp_path)


def test_measures_of_a_known_trace(trace):
    forward, backward = {s.stage: s.forward for s in trace.stage_times}, {
        s.stage: s.backward for s in trace.stage_times
    }
    assert forward == {0: pytest.approx(1e-3), 1: pytest.approx(3e-3)}
    assert backward == {0: pytest.approx(2e-3), 1: pytest.approx(2e-3)}
    assert [s.count for s in trace.stage_times] == [4, 4]  # 2 microbatches x 2 replicas
    # one pipeline run per replica: stage 0's F0 at 0 to its last backward's end at 13 ms
    assert [(r.replica, r.start_ns, r.end_ns) for r in trace.runs] == [
        (0, 0, 13 * MS),
        (1, 100 * MS, 113 * MS),
    ]
    assert trace.runs[0].busy_ns == (6 * MS, 10 * MS)
    assert trace.run_time == pytest.approx(13e-3)
    # busy 6 + 10 of 2 x 13 ms: the rest idle
    assert trace.bubble == pytest.approx(1 - 16 / 26)
    assert trace.step_times == {1: pytest.approx(120e-3)}  # both replicas' step records
    # per rank and step: 2 forwards' gathers, 2 backwards' reductions
    assert trace.unit_times == {"fsdp_reduce": pytest.approx(1e-3), "unshard": pytest.approx(5e-4)}
