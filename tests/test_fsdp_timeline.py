"""FSDP2's actions in a traced step (issue 28, item 1): each unit's unshard, reshard and gradient
reduction read from the ranges FSDP2 marks for the profiler. Here on hand-made events of the
three ways a stage gathers (per block, per step, not at all) and of a CUDA run (the kernels'
span on the device); the real 4-rank sharded runs with ``--trace`` are in
tests/test_data_parallel.py, and a real profiler run of FSDP2 on 2 processes below
(tests/fsdp_marks.py on 2 ranks)."""

from __future__ import annotations

import json


from autopipe.runtime.core.timeline_format import TRACKS, UNITS, RankTimeline, Record, RunLayout
from autopipe.runtime.core.timeline_format import chrome_trace
from autopipe.runtime.fsdp_timeline import UNIT_KINDS, Mark, UnitAction
from autopipe.runtime.fsdp_timeline import unit_actions

from conftest import ROOT, run_ranks


class Events:
    """Host ranges on one thread, one time unit apart, as FSDP2 marks them."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []
        self.clock = 0

    def range(self, what: str, unit: str = "", length: int = 10, **extra: int) -> Mark:
        name = f"FSDP::{what}" + (f" ({unit})" if unit else "")
        mark = Mark(name, self.clock, self.clock + length, thread=1, **extra)
        self.marks.append(mark)
        self.clock += length + 1
        return mark

    def forward(self, units: list[str], gathers: bool) -> None:
        for unit in units:
            if gathers:
                self.range("all_gather", unit)
            self.range("pre_forward", unit)
            if gathers:
                self.range("all_gather_copy_out", unit)
            self.range("post_forward", unit)

    def backward(self, units: list[str], gathers: bool, reduces: bool) -> None:
        for unit in reversed(units):
            if gathers:
                self.range("all_gather", unit)
                self.range("all_gather_copy_out", unit)
            self.range("post_backward_reshard", unit)
            if reduces:
                self.range("post_backward_reduce", unit)


UNITS_OF_STAGE = ["stage.h.0", "stage.h.1", ""]


def kinds(actions: list[UnitAction]) -> list[tuple[str, str]]:
    return [(a.kind, a.unit) for a in actions]


def test_gathered_per_block_call_every_forward_and_backward_unshards_and_reshards():
    events = Events()
    for _ in range(2):
        events.forward(UNITS_OF_STAGE, gathers=True)
    for _ in range(2):
        events.backward(UNITS_OF_STAGE, gathers=True, reduces=True)
    actions = unit_actions(events.marks, root="stage")
    forward = [("unshard", "h.0"), ("reshard", "h.0"), ("unshard", "h.1"), ("reshard", "h.1")]
    forward += [("unshard", ""), ("reshard", "")]
    backward = [("unshard", ""), ("reshard", ""), ("fsdp_reduce", "")]
    backward += [("unshard", "h.1"), ("reshard", "h.1"), ("fsdp_reduce", "h.1")]
    backward += [("unshard", "h.0"), ("reshard", "h.0"), ("fsdp_reduce", "h.0")]
    assert kinds(actions) == forward * 2 + backward * 2
    gather, copy_out = events.marks[0], events.marks[2]
    assert (actions[0].start_ns, actions[0].end_ns) == (gather.start_ns, copy_out.end_ns)
    assert all(a.start_ns <= b.start_ns for a, b in zip(actions, actions[1:]))


def test_gathered_per_step_reshards_once_at_the_end():
    """``--gather step``: the first forward gathers each unit; the offers to reshard after
    every later forward and backward are not reshards, the step's last one is."""
    events = Events()
    events.forward(UNITS_OF_STAGE, gathers=True)
    events.forward(UNITS_OF_STAGE, gathers=False)
    events.backward(UNITS_OF_STAGE, gathers=False, reduces=False)
    events.backward(UNITS_OF_STAGE, gathers=False, reduces=True)
    last_offers = {m.name: m for m in events.marks if "post_backward_reshard" in m.name}
    actions = unit_actions(events.marks, root="stage")
    assert [k for k in kinds(actions) if k[0] == "unshard"] == [
        ("unshard", "h.0"),
        ("unshard", "h.1"),
        ("unshard", ""),
    ]
    reshards = [a for a in actions if a.kind == "reshard"]
    assert sorted(a.unit for a in reshards) == ["", "h.0", "h.1"]
    assert {a.start_ns for a in reshards} == {m.start_ns for m in last_offers.values()}
    assert [a.unit for a in actions if a.kind == "fsdp_reduce"] == ["", "h.1", "h.0"]


def test_replicated_units_gather_nothing_and_only_reduce():
    """``--dp`` alone (one shard): FSDP2 gathers nothing, so nothing is unsharded or freed."""
    events = Events()
    events.forward(UNITS_OF_STAGE, gathers=False)
    events.backward(UNITS_OF_STAGE, gathers=False, reduces=True)
    assert kinds(unit_actions(events.marks, root="stage")) == [
        ("fsdp_reduce", ""),
        ("fsdp_reduce", "h.1"),
        ("fsdp_reduce", "h.0"),
    ]


def test_a_prefetched_gather_lasts_from_its_issue_to_its_copy_out():
    events = Events()
    events.range("all_gather", "stage.h.1")
    events.range("all_gather_copy_out", "stage.h.1")
    issued = events.range("all_gather", "stage.h.0")  # prefetched during h.1's backward
    events.range("post_backward_reshard", "stage.h.1")
    copied = events.range("all_gather_copy_out", "stage.h.0")
    actions = unit_actions(events.marks, root="stage")
    (h0,) = [a for a in actions if a.unit == "h.0"]
    assert (h0.kind, h0.start_ns, h0.end_ns) == ("unshard", issued.start_ns, copied.end_ns)


def test_labels_of_several_parameter_groups_and_unknown_ranges():
    events = Events()
    events.range("all_gather", "stage.h.0 [pg=2]".replace(" [pg=2]", ""))
    events.marks.append(Mark("FSDP::all_gather_copy_out (stage.h.0) [pg=2]", 100, 110, 1))
    events.marks.append(Mark("FSDP::backward_prefetch for stage.h.1", 120, 130, 1))
    events.marks.append(Mark("aten::mm", 121, 125, 1))
    assert kinds(unit_actions(events.marks, root="stage")) == [("unshard", "h.0")]


def test_on_cuda_an_action_is_its_kernels_span_on_the_device():
    """A gather's all-gather and copy-out kernels run on the device later than the host
    launches them; a reshard launches none and keeps its host range."""
    marks = [
        Mark("FSDP::all_gather (stage.h.0)", 0, 50, thread=1, correlation=1),
        Mark("nccl:_all_gather_base", 10, 40, thread=1, correlation=2),
        Mark("ncclDevKernel_AllGather", 300, 900, thread=0, linked=2, device=True),
        Mark("FSDP::all_gather_copy_out (stage.h.0)", 60, 90, thread=1, correlation=3),
        Mark("aten::split_with_sizes_copy", 65, 80, thread=1, correlation=4),
        Mark("copy_kernel", 950, 1000, thread=0, linked=4, device=True),
        Mark("elementwise_kernel", 910, 940, thread=0, linked=3, device=True),
        Mark("FSDP::post_forward (stage.h.0)", 95, 99, thread=1, correlation=5),
        Mark("aten::mm", 120, 130, thread=2, correlation=6),  # another thread's
        Mark("gemm", 2000, 3000, thread=0, linked=6, device=True),
    ]
    assert unit_actions(marks, root="stage") == [
        UnitAction("reshard", "h.0", 95, 99),
        UnitAction("unshard", "h.0", 300, 1000),
    ]


def test_records_of_unit_actions_in_their_codec_names_and_tracks():
    record = Record(1, "unshard", 0, 3, 10, 20, unit="transformer.h.0")
    assert record.name == "unshard transformer.h.0 mb3 s0"
    assert Record(1, "fsdp_reduce", 1, None, 10, 20, unit="").name == "fsdp-reduce stage s1"
    assert Record(1, "reshard", 1, 2, 10, 20, 1, unit="").name == "reshard stage mb2.1 s1"
    assert set(UNIT_KINDS) == UNITS
    run = RunLayout("0123", "1f1b", 4, 1, 2, 2, 2)
    timeline = RankTimeline(0, 0, 0, (0,), "cpu", run, 0, (1, 2), (record,))
    assert RankTimeline.from_json(timeline.to_json()) == timeline
    trace = chrome_trace([timeline])
    assert '"tid":2,"args":{"name":"unshard"}' in trace
    assert '"unit":"transformer.h.0"' in trace
    assert TRACKS["unshard"][0] == 2


def test_fsdp2_really_marks_what_is_read_two_processes(tmp_path):
    """torch's own FSDP2 under the real profiler, over gloo: the names and order this module
    relies on. Each microbatch gathers and frees each block in forward and again in backward
    (the backward's gather of a block may be prefetched during the one after it); the second
    microbatch reduces their gradients."""
    run_ranks(ROOT / "tests" / "fsdp_marks.py", 2, str(tmp_path))
    actions = [UnitAction(**a) for a in json.loads((tmp_path / "0.json").read_text())]
    for unit in ("0", "2"):  # blocks (the root unit holds no parameter here)
        mine = [a.kind for a in actions if a.unit == unit]
        assert mine == ["unshard", "reshard"] * 4 + ["fsdp_reduce"], unit
    forward_of_0, forward_of_2 = (next(a for a in actions if a.unit == u) for u in ("0", "2"))
    assert forward_of_0.end_ns <= forward_of_2.start_ns  # the blocks' order
    assert all(a.start_ns <= a.end_ns for a in actions)
