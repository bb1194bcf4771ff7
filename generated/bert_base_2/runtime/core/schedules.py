"""The schedule catalogue and schedule orders: which schedules there are, where each places the
stages, and which actions each rank runs, in which order.

An action is the forward (``F``), backward (``B``), or input / weight backward (``I`` / ``W``) of one
stage on one microbatch, written like torch's ``_Action`` (``"2F0"``: stage 2, forward,
microbatch 0). This file is shared by autopipe's partitioners and simulator and the generated
pipelines (copied into each as ``runtime/core/schedules.py``), so the schedules the compiler plans
for are the ones train.py accepts, and the order the cost model predicts is the order train.py
runs. It needs only the standard library.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field, replace

__all__ = [
    "COMPILE_SCHEDULES",
    "GREEDY_POLICIES",
    "INPUT_GRAD_FRACTION",
    "MULTI_STAGE",
    "SCHEDULES",
    "SINGLE_STAGE",
    "INPUT_GRADIENTS_FREED",
    "SPLIT_BACKWARD",
    "V_SHAPED",
    "Action",
    "MemoryPeak",
    "PipelineCosts",
    "ScheduleError",
    "dependencies",
    "device_memory",
    "event_times",
    "greedy_orders",
    "peak_memory",
    "placement",
    "schedule_problem_for",
    "single_stage_order",
]

# -- the catalogue ----------------------------------------------------------------------------
#: --schedule names -> torch.distributed.pipelining classes running one stage per rank, in order
SINGLE_STAGE = {"gpipe": "GPipe", "1f1b": "1F1B"}
#: ... and running several stages per rank: looped placements (stage s on rank s mod ranks) or V
MULTI_STAGE = {
    "interleaved-1f1b": "Interleaved1F1B",
    "looped-bfs": "LoopedBFS",
    "interleaved-zero-bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
#: "auto": autopipe's order for any placement (:func:`greedy_orders`), run by torch's schedule
#: runtime
SCHEDULES = (*SINGLE_STAGE, *MULTI_STAGE, "auto")
#: the same schedules in the order ``autopipe compile --schedule`` lists them (auto before the
#: multi-stage ones)
COMPILE_SCHEDULES = (*SINGLE_STAGE, "auto", *MULTI_STAGE)
#: schedules that split each backward into an input part and a weight part (zero bubble)
SPLIT_BACKWARD = ("interleaved-zero-bubble", "zbv", "dualpipev")
#: schedules freeing the gradients of a stage's received inputs as they go: their ranks wait
#: for a backward's sends within the next actions (torch's Schedule1F1B), so that a stage holds
#: one microbatch's, the last it sent; the others wait for every send at the end of the step,
#: holding them all
INPUT_GRADIENTS_FREED = ("1f1b",)
V_SHAPED = ("zbv", "dualpipev")


def placement(schedule: str, num_stages: int, ranks: int) -> list[int]:
    """The stage -> rank placement a torch schedule runs: in order, looped, or V-shaped."""
    if schedule in V_SHAPED:
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages)]
    return [s % ranks for s in range(num_stages)]


def schedule_problem_for(name: str, placed: list[int], ranks: int, microbatches: int) -> str | None:
    """Why schedule ``name`` cannot run stages placed on ``placed`` ranks (of ``ranks``) with
    ``microbatches`` microbatches, naming what would; None if it can."""
    num_stages = len(placed)
    if name in SINGLE_STAGE:
        if placed != list(range(num_stages)):
            fits = [s for s in MULTI_STAGE if placed == placement(s, num_stages, ranks)]
            return (
                f"--schedule {name} runs one stage per rank, in order, but this pipeline places its "
                f"{num_stages} stages on ranks {placed}; use --schedule {' or '.join(['auto', *fits])}"
            )
        if name == "1f1b" and microbatches < num_stages:
            return (
                f"--schedule 1f1b needs at least as many microbatches as stages ({num_stages}); got "
                f"--microbatches {microbatches}. Use --microbatches {num_stages} or more, or --schedule gpipe."
            )
    elif name in MULTI_STAGE:
        expected = placement(name, num_stages, ranks)
        if num_stages % ranks or placed != expected:
            shape = "V-shaped" if name in V_SHAPED else "looped"
            fits = [
                s
                for s in (*SINGLE_STAGE, *MULTI_STAGE)
                if s != name and placed == placement(s, num_stages, ranks)
            ]
            return (
                f"--schedule {name} needs stage s on rank {expected} ({shape}), but this pipeline "
                f"places its stages on ranks {placed}; use --schedule {' or '.join(['auto', *fits])}, "
                f"or compile with --schedule {name}"
            )
        if name in V_SHAPED and num_stages != 2 * ranks:
            return f"--schedule {name} runs exactly two stages per rank; this pipeline has {num_stages} stages on {ranks} ranks"
        rounds = max(1, microbatches // ranks)
        if name in ("interleaved-1f1b", "interleaved-zero-bubble") and microbatches % rounds:
            counts = [
                m
                for m in range(microbatches, 2 * microbatches + ranks)
                if m % max(1, m // ranks) == 0
            ]
            return (
                f"--schedule {name} runs microbatches in rounds of the {ranks} ranks and needs a "
                f"multiple of the rounds; --microbatches {microbatches} is not. Use --microbatches {counts[0]}"
            )
        if name == "dualpipev" and microbatches < num_stages:
            return (
                f"--schedule dualpipev needs at least as many microbatches as stages ({num_stages}); "
                f"use --microbatches {num_stages} or more"
            )
    return None


# -- orders -------------------------------------------------------------------------------------
#: Fraction of a stage's backward time spent on input gradients (the rest is weight gradients).
INPUT_GRAD_FRACTION = 0.5


class ScheduleError(ValueError):
    """A schedule that cannot run: a deadlock, or a placement it does not fit."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str  # "F" | "B" | "I" | "W"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        match = re.fullmatch(r"(\d+)([FBIW])(\d+)", text)
        if not match:
            raise ValueError(f"not an action: {text!r}")
        return cls(int(match[1]), match[2], int(match[3]))


@dataclass
class PipelineCosts:
    """What the simulator needs to know about each stage, for one microbatch (bytes per stage:
    empty lists read as zeros)."""

    forward: list[float]
    backward: list[float]
    activations: list[float]  # bytes a microbatch keeps alive from its forward to its backward
    static_memory: list[float]  # parameters, gradients, optimizer state (for the whole step)
    send_forward: list[float]  # seconds to move stage s's outputs to stage s + 1
    send_backward: list[float]  # seconds to move the gradients of those back
    device_of_stage: list[int]
    memory_capacity: float = float("inf")  # bytes per device
    gradients: list[float] = field(default_factory=list)  # of static_memory: from 1st backward
    buffers: list[float] = field(default_factory=list)  # receive buffers of every microbatch
    input_gradients: list[float] = field(default_factory=list)  # sent by a backward: kept ...
    #: ... the last one sent alone (True: :data:`INPUT_GRADIENTS_FREED`), or every one to step end
    input_gradients_freed: bool = False
    transient_forward: list[float] = field(default_factory=list)  # during a forward
    transient_backward: list[float] = field(default_factory=list)  # during a backward
    transient_optimizer: list[float] = field(default_factory=list)  # during the optimizer step
    #: seconds each stage's forward (backward) waits on its receives from another rank before
    #: it computes (a device spec's ``receive_overhead``): part of the action, not of its
    #: compute, which ``forward`` and ``backward`` alone hold (empty: no wait)
    receive_forward: list[float] = field(default_factory=list)
    receive_backward: list[float] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @property
    def num_devices(self) -> int:
        return max(self.device_of_stage) + 1

    def for_schedule(self, schedule: str) -> PipelineCosts:
        """These costs, whose memory walk frees the gradients of received inputs as
        ``schedule`` does (:data:`INPUT_GRADIENTS_FREED`)."""
        freed = schedule in INPUT_GRADIENTS_FREED
        return (
            self
            if self.input_gradients_freed == freed
            else replace(self, input_gradients_freed=freed)
        )

    def link(self, stage: int, table: list[float]) -> float:
        """Transfer time across the boundary after ``stage``: free on one device."""
        same = self.device_of_stage[stage] == self.device_of_stage[stage + 1]
        return 0.0 if same else table[stage]

    def duration(self, action: Action) -> float:
        """The action's seconds: its compute, and the wait on its receives (a forward's
        activations; a full or input backward's gradients)."""
        return self.compute(action) + self.receive_wait(action)

    def compute(self, action: Action) -> float:
        """The action's compute alone: what a trace's span of it measures (it begins once the
        tensors it receives are there)."""
        s = action.stage
        if action.kind == "F":
            return self.forward[s]
        if action.kind == "B":
            return self.backward[s]
        if action.kind == "I":
            return self.backward[s] * INPUT_GRAD_FRACTION
        return self.backward[s] * (1 - INPUT_GRAD_FRACTION)

    def receive_wait(self, action: Action) -> float:
        """The action's wait on its receives from another rank (none for a weight backward)."""
        if action.kind == "F":
            return self.receive_forward[action.stage] if self.receive_forward else 0.0
        if action.kind == "W":
            return 0.0
        return self.receive_backward[action.stage] if self.receive_backward else 0.0


def dependencies(action: Action, num_stages: int) -> list[tuple[tuple[Action, ...], str]]:
    """What must end before ``action`` starts: for each need, the actions that satisfy it (the
    next stage's input gradients come from its full backward or its input backward), with the
    link direction crossed."""
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [((Action(s - 1, "F", m),), "forward")] if s > 0 else []
    if action.kind == "W":
        return [((Action(s, "I", m),), "")]
    needs: list[tuple[tuple[Action, ...], str]] = [((Action(s, "F", m),), "")]
    if s < num_stages - 1:
        needs.append(((Action(s + 1, "B", m), Action(s + 1, "I", m)), "backward"))
    return needs


def single_stage_order(
    schedule: str, stage: int, num_stages: int, microbatches: int
) -> list[Action]:
    forwards = [Action(stage, "F", m) for m in range(microbatches)]
    backwards = [Action(stage, "B", m) for m in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(microbatches, num_stages - stage)  # as torch's Schedule1F1B
    order = forwards[:warmup]
    for m in range(warmup, microbatches):
        order += [backwards[m - warmup], forwards[m]]
    return order + backwards[microbatches - warmup :]


#: Policies the greedy scheduler tries: (alternate F and B, forward priority, in-flight cap).
GREEDY_POLICIES = (
    (True, "late", "stages"),
    (True, "early", "stages"),
    (True, "late", "none"),
    (True, "early", "none"),
    (False, "late", "stages"),
)


def greedy_orders(costs: PipelineCosts, microbatches: int) -> dict[int, list[Action]]:
    """List scheduling for any stage -> device map, under a few policies; the order with the
    shortest simulated step that fits the devices' memory wins (ties: the first policy).

    Whenever a device is free it runs a ready action: alternating forward and backward once both
    are available (1F1B), backward of the latest stage first, forwards of the latest (or the
    earliest) stage first, with at most ``stages - s`` microbatches in flight in stage ``s`` (or
    no cap)."""
    best: tuple[tuple[bool, float], dict[int, list[Action]]] | None = None
    for policy in GREEDY_POLICIES:
        orders = _greedy(costs, microbatches, *policy)
        events = event_times(orders, costs)
        fits = max(peak_memory(events, costs)) <= costs.memory_capacity
        key = (not fits, max(end for _, _, _, end in events))
        if (
            best is None
            or key[0] < best[0][0]
            or (key[0] == best[0][0] and key[1] < best[0][1] * (1 - 1e-12))
        ):
            best = (key, orders)
    assert best is not None  # GREEDY_POLICIES is not empty
    return best[1]


def _greedy(
    costs: PipelineCosts, microbatches: int, alternate: bool, forward_first: str, cap: str
) -> dict[int, list[Action]]:
    num_stages, num_devices = costs.num_stages, costs.num_devices
    if cap == "stages":
        limit = [max(1, min(microbatches, num_stages - s)) for s in range(num_stages)]
    else:
        limit = [microbatches] * num_stages
    stages_of = {
        d: [s for s in range(num_stages) if costs.device_of_stage[s] == d]
        for d in range(num_devices)
    }
    in_flight = [0] * num_stages
    next_forward = [0] * num_stages
    # per stage, a heap of the microbatches whose backward's inputs have run (its forward and
    # the next stage's backward): the earliest of them is the backward it may run next
    arrived: list[list[int]] = [[] for _ in range(num_stages)]
    done: dict[Action, float] = {}
    free = [0.0] * num_devices
    last_kind = ["B"] * num_devices
    orders: dict[int, list[Action]] = {d: [] for d in range(num_devices)}
    known: dict[Action, float] = {}  # ready times found: fixed once an action's inputs ran

    def ready_time(action: Action) -> float | None:
        if action not in known:
            ready = _ready_time(action, done, costs)
            if ready is None:
                return None
            known[action] = ready
        return known[action]

    total = 2 * num_stages * microbatches
    while len(done) < total:
        candidates: list[tuple[float, tuple[int, ...], int, Action]] = []
        for device, stages in stages_of.items():
            turn = alternate and last_kind[device] == "F"  # backward's turn
            for s in stages:
                if arrived[s]:
                    m = arrived[s][0]
                    ready = ready_time(Action(s, "B", m))
                    assert ready is not None  # its inputs have run
                    key = (0 if (turn or not alternate) else 1, 0, -s, m)
                    candidates.append((max(ready, free[device]), key, device, Action(s, "B", m)))
                m = next_forward[s]
                if m < microbatches and in_flight[s] < limit[s]:
                    ready = ready_time(Action(s, "F", m))
                    if ready is not None:
                        order = (-s, m) if forward_first == "late" else (s, m)
                        key = (0 if (alternate and not turn) else 1, 1, *order)
                        candidates.append(
                            (max(ready, free[device]), key, device, Action(s, "F", m))
                        )
        if not candidates:
            raise ScheduleError(
                "the greedy scheduler found no runnable action (a bug: please report)"
            )
        start = min(c[0] for c in candidates)
        _, _, device, action = min(
            (c for c in candidates if c[0] <= start), key=lambda c: (c[1], c[2])
        )
        finish = start + costs.duration(action)
        done[action] = finish
        free[device] = finish
        last_kind[device] = action.kind
        orders[device].append(action)
        if action.kind == "F":
            next_forward[action.stage] += 1
            in_flight[action.stage] += 1
            if action.stage == num_stages - 1:
                heapq.heappush(arrived[action.stage], action.microbatch)
        else:
            in_flight[action.stage] -= 1
            heapq.heappop(arrived[action.stage])  # the earliest: the only one offered
            if action.stage > 0:
                heapq.heappush(arrived[action.stage - 1], action.microbatch)
    return orders


def event_times(
    orders: dict[int, list[Action]], costs: PipelineCosts
) -> list[tuple[int, Action, float, float]]:
    """``(device, action, start, end)`` of every action when each device runs its order: an
    action starts once its device is free and its inputs have arrived. Raises on a deadlock."""
    end: dict[Action, float] = {}
    position = dict.fromkeys(orders, 0)
    free = dict.fromkeys(orders, 0.0)
    events: list[tuple[int, Action, float, float]] = []
    remaining = sum(len(o) for o in orders.values())
    while remaining:
        progressed = False
        for device, order in orders.items():
            while position[device] < len(order):
                action = order[position[device]]
                ready = _ready_time(action, end, costs)
                if ready is None:
                    break
                start = max(ready, free[device])
                end[action] = free[device] = start + costs.duration(action)
                events.append((device, action, start, end[action]))
                position[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {d: str(o[position[d]]) for d, o in orders.items() if position[d] < len(o)}
            raise ScheduleError(f"the schedule deadlocks: each device waits on another ({stuck})")
    return events


def _ready_time(action: Action, done: dict[Action, float], costs: PipelineCosts) -> float | None:
    """When the inputs of ``action`` are available, or None if a dependency has not run."""
    ready = 0.0
    for options, direction in dependencies(action, costs.num_stages):
        dep = next((d for d in options if d in done), None)
        if dep is None:
            return None
        delay = 0.0
        if direction == "forward":
            delay = costs.link(dep.stage, costs.send_forward)
        elif direction == "backward":
            delay = costs.link(action.stage, costs.send_backward)
        ready = max(ready, done[dep] + delay)
    return ready


@dataclass
class MemoryPeak:
    """What one device holds at its peak."""

    state: float  # parameters, gradients, optimizer state (and what FSDP2 gathers)
    buffers: float  # receive buffers
    activations: float  # saved by the microbatches in flight, and their outputs
    in_flight: int  # microbatches whose activations are alive
    input_gradients: float  # gradients of received inputs sent and not yet freed
    transient: float  # inside the action running at the peak, or the optimizer step
    moment: str  # the action at the peak ("0F1"), or "optimizer"

    @property
    def total(self) -> float:
        return self.state + self.buffers + self.activations + self.input_gradients + self.transient


def device_memory(
    events: list[tuple[int, Action, float, float]], costs: PipelineCosts
) -> list[MemoryPeak]:
    """Each device's peak, walking its actions in the order it runs them: a forward adds its
    microbatch's activations, freed by its full (or weight) backward; a stage's gradients appear
    with its first backward, the gradients of received inputs a backward sends stay to the end
    of the step (or, where ``costs.input_gradients_freed``, until the next one replaces them, all
    freed by the optimizer step), and each action (and the optimizer step after them) adds its
    own transient bytes."""

    def table(name: str) -> list[float]:
        return getattr(costs, name) or [0.0] * costs.num_stages

    act, grads, buffers = costs.activations, table("gradients"), table("buffers")
    in_grads = table("input_gradients")
    during = {"F": table("transient_forward"), "B": table("transient_backward")}
    during["I"] = during["W"] = during["B"]
    optimizer = table("transient_optimizer")
    by_device: list[list[tuple[int, Action, float, float]]] = [[] for _ in range(costs.num_devices)]
    for event in events:
        by_device[event[0]].append(event)
    peaks = []
    for device in range(costs.num_devices):
        stages = [s for s, d in enumerate(costs.device_of_stage) if d == device]
        state = sum(costs.static_memory[s] - grads[s] for s in stages)
        buffered = sum(buffers[s] for s in stages)
        live, count, kept, backward_seen, sent = 0.0, 0, 0.0, set(), set()
        best = MemoryPeak(state, buffered, 0.0, 0, 0.0, 0.0, "start")
        # the device's actions in the order they run (a stable sort: ties keep their order)
        for _device, action, _start, _end in sorted(by_device[device], key=lambda e: (e[2], e[3])):
            s = action.stage
            if action.kind != "F" and s not in backward_seen:
                backward_seen.add(s)
                state += grads[s]
            if action.kind == "F":
                live, count = live + act[s], count + 1
            now = MemoryPeak(
                state, buffered, live, count, kept, during[action.kind][s], str(action)
            )
            if action.kind in ("B", "W"):
                live, count = live - act[s], count - 1
            if action.kind in ("B", "I") and not (costs.input_gradients_freed and s in sent):
                kept += in_grads[s]  # (freed: each backward's replace the stage's last ones)
                sent.add(s)
            if now.total > best.total:
                best = now
        full = sum(costs.static_memory[s] for s in stages)
        kept = 0.0 if costs.input_gradients_freed else kept
        step = MemoryPeak(
            full, buffered, live, count, kept, sum(optimizer[s] for s in stages), "optimizer"
        )
        peaks.append(step if step.total > best.total else best)
    return peaks


def peak_memory(
    events: list[tuple[int, Action, float, float]], costs: PipelineCosts
) -> list[float]:
    """Each device's peak bytes (see :func:`device_memory`)."""
    return [peak.total for peak in device_memory(events, costs)]
