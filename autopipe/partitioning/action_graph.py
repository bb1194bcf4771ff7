"""The simulator's event times, fast: per-device action orders compiled once, timed per costs.

:func:`~autopipe.runtime.core.schedules.event_times` is the reference: it walks the devices
round-robin, runs each action whose inputs have arrived, and looks its dependencies up by
name, for every action of every candidate the partitioner judges. The times it finds only
depend on the orders (which actions wait for which) and on the costs (how long each takes):
an :class:`ActionGraph` resolves the orders once into arrays (each action's previous action on
its device, the actions it waits for and which link each crosses) and groups the actions into
levels, each depending only on earlier levels; :meth:`ActionGraph.events` then times a whole
level at once with numpy. It computes the very same floating-point expressions as the
reference (a start is the largest of 0, the device's previous end and each input's arrival;
an end is the start plus the duration), so the times are equal to the last bit, and so are the
events in the order the reference lists them (by device, each device's in its order), which
the memory walk and the simulation's sort see.

Orders the reference would refuse (a deadlock, an action waiting for one that no order runs)
or that it resolves at run time (both a full and an input backward of one microbatch) are not
compiled: :func:`compile_orders` returns None and callers use the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..runtime.core.schedules import (
    INPUT_GRAD_FRACTION,
    Action,
    MemoryPeak,
    PipelineCosts,
    dependencies,
)

__all__ = ["ActionGraph", "compile_orders"]

#: a dependency's link: none (same stage), the activations' (after the dependency's stage), the
#: gradients' (after the waiting action's stage)
_NO_LINK, _FORWARD, _BACKWARD = 0, 1, 2
#: the most inputs an action waits for (a backward: its forward and the next stage's backward)
_MAX_DEPENDENCIES = 2


@dataclass(frozen=True)
class ActionGraph:
    """Every action of the orders, with what it waits for, as arrays indexed by action
    (``n`` actions; index ``n`` is a sentinel that ended at 0, standing for "nothing")."""

    orders: dict[int, list[Action]]
    actions: list[Action]  # by device, each device's in its order: the reference's listing
    device: np.ndarray  # int, per action
    stage: np.ndarray  # int, per action
    kind: np.ndarray  # 0 F, 1 B, 2 I, 3 W
    previous: np.ndarray  # the previous action on the device, or n
    waits: np.ndarray  # (n, 2): the actions waited for, n where fewer
    link: np.ndarray  # (n, 2): each wait's link (_NO_LINK, _FORWARD, _BACKWARD)
    link_stage: np.ndarray  # (n, 2): the stage boundary the link crosses (after that stage)
    levels: list[np.ndarray]  # action indices, each level waiting only on earlier ones
    position: np.ndarray  # each action's place in the reference's round-robin listing

    def events(self, costs: PipelineCosts) -> list[tuple[int, Action, float, float]]:
        """``(device, action, start, end)`` of every action: what
        :func:`~autopipe.runtime.core.schedules.event_times` returns for these orders and
        ``costs``, in its order."""
        start, end = self.times(costs)
        return self.listing(start, end)

    def listing(self, start: np.ndarray, end: np.ndarray) -> list[tuple[int, Action, float, float]]:
        """The events of these times, in the reference's order."""
        order = np.argsort(self.position, kind="stable")
        starts, ends = start.tolist(), end.tolist()
        return [(int(self.device[i]), self.actions[i], starts[i], ends[i]) for i in order.tolist()]

    def times(self, costs: PipelineCosts) -> tuple[np.ndarray, np.ndarray]:
        """Each action's start and end (by action index), as the reference times them."""
        n = len(self.actions)
        forward = np.asarray(costs.forward, dtype=np.float64)
        backward = np.asarray(costs.backward, dtype=np.float64)
        duration = np.where(self.kind == 0, forward[self.stage], backward[self.stage])
        duration = np.where(self.kind == 2, backward[self.stage] * INPUT_GRAD_FRACTION, duration)
        duration = np.where(
            self.kind == 3, backward[self.stage] * (1 - INPUT_GRAD_FRACTION), duration
        )
        # each boundary's transfer times, zero between stages of one device
        boundaries = max(costs.num_stages - 1, 0)
        links = np.zeros((3, boundaries + 1), dtype=np.float64)
        for b in range(boundaries):
            links[_FORWARD, b] = costs.link(b, costs.send_forward)
            links[_BACKWARD, b] = costs.link(b, costs.send_backward)
        delay = links[self.link, self.link_stage]  # (n, 2)
        end = np.zeros(n + 1, dtype=np.float64)
        start = np.zeros(n, dtype=np.float64)
        zero = np.zeros(1, dtype=np.float64)
        for level in self.levels:
            waits = self.waits[level]
            ready = np.maximum(
                np.maximum(zero, end[waits[:, 0]] + delay[level, 0]),
                end[waits[:, 1]] + delay[level, 1],
            )
            begin = np.maximum(ready, end[self.previous[level]])
            start[level] = begin
            end[level] = begin + duration[level]
        return start, end[:n]

    # -- what a simulation derives from the times, without listing the events ---------------
    def busy(self, start: np.ndarray, end: np.ndarray, num_devices: int) -> list[float]:
        """Each device's seconds computing: its actions' durations summed in its order, as the
        simulation sums them (a device's actions start in its order)."""
        duration = end - start
        return [
            float(np.cumsum(duration[first:last])[-1]) if last > first else 0.0
            for first, last in self._spans(num_devices)
        ]

    def held(self, start: np.ndarray, end: np.ndarray, num_stages: int) -> list[int]:
        """The most microbatches of each stage alive at once: from a forward's start to the end
        of its full or weight backward (at equal times the end first), as the simulation
        counts them from its events."""
        forward, freeing = self.kind == 0, (self.kind == 1) | (self.kind == 3)
        chosen = forward | freeing
        times = np.where(forward, start, end)[chosen]
        deltas = np.where(forward, 1, -1)[chosen]
        stages = self.stage[chosen]
        order = np.lexsort((deltas, times, stages))
        running = np.cumsum(deltas[order])
        stages = stages[order]
        held = [0] * num_stages
        if not len(order):
            return held
        firsts = np.flatnonzero(np.r_[True, stages[1:] != stages[:-1]])
        before = np.r_[0, running[:-1]][firsts]  # the running count before each stage's first
        peaks = np.maximum.reduceat(running, firsts) - before
        for stage, peak in zip(stages[firsts].tolist(), peaks.tolist()):
            held[stage] = max(0, int(peak))
        return held

    def memory_peaks(self, costs: PipelineCosts) -> list[MemoryPeak]:
        """:func:`~autopipe.runtime.core.schedules.device_memory` of these orders, equal to it
        to the last bit: a device's actions run in its order whatever the times, so its memory
        at each action depends on the order and the memory tables alone; each running sum is a
        cumulative sum over the device's actions of the very terms the walk adds in turn."""
        num_stages = costs.num_stages

        def table(name: str) -> np.ndarray:
            values = getattr(costs, name) or [0.0] * num_stages
            return np.asarray(values, dtype=np.float64)

        act, grads, buffers = table("activations"), table("gradients"), table("buffers")
        in_grads, optimizer = table("input_gradients"), table("transient_optimizer")
        during_forward, during_backward = table("transient_forward"), table("transient_backward")
        grads_list, buffers_list = grads.tolist(), buffers.tolist()
        optimizer_list = optimizer.tolist()
        peaks = []
        for device, (first, last) in enumerate(self._spans(costs.num_devices)):
            stages = [s for s, d in enumerate(costs.device_of_stage) if d == device]
            state0 = sum(costs.static_memory[s] - grads_list[s] for s in stages)
            buffered = sum(buffers_list[s] for s in stages)
            full = sum(costs.static_memory[s] for s in stages)
            transient_optimizer = sum(optimizer_list[s] for s in stages)
            start_peak = MemoryPeak(state0, buffered, 0.0, 0, 0.0, 0.0, "start")
            m = last - first
            if m == 0:
                step = MemoryPeak(full, buffered, 0.0, 0, 0.0, transient_optimizer, "optimizer")
                peaks.append(step if step.total > start_peak.total else start_peak)
                continue
            stage, kind = self.stage[first:last], self.kind[first:last]
            forward = kind == 0
            freeing = (kind == 1) | (kind == 3)
            # activations: + at a forward (before its moment), - after a full or weight backward
            steps = np.zeros(2 * m, dtype=np.float64)
            steps[0::2] = np.where(forward, act[stage], 0.0)
            steps[1::2] = np.where(freeing, -act[stage], 0.0)
            running = np.cumsum(steps)
            live, live_end = running[0::2], running[-1]
            counts = np.zeros(2 * m, dtype=np.int64)
            counts[0::2], counts[1::2] = forward, -freeing.astype(np.int64)
            counting = np.cumsum(counts)
            count, count_end = counting[0::2], counting[-1]
            # the stage's gradients appear with its first backward on the device
            added = np.zeros(m + 1, dtype=np.float64)
            added[0] = state0
            backward = np.flatnonzero(~forward)
            if len(backward):
                seen, firsts = np.unique(stage[backward], return_index=True)
                added[backward[firsts] + 1] = grads[seen]
            state = np.cumsum(added)[1:]
            # gradients of received inputs: kept after each full or input backward
            keeping = np.where((kind == 1) | (kind == 2), in_grads[stage], 0.0)
            kept_running = np.cumsum(keeping)
            kept = np.r_[0.0, kept_running[:-1]]
            transient = np.where(forward, during_forward[stage], during_backward[stage])
            total = state + buffered + live + kept + transient
            best = start_peak
            top = int(np.argmax(total))
            if total[top] > start_peak.total:
                best = MemoryPeak(
                    float(state[top]),
                    buffered,
                    float(live[top]),
                    int(count[top]),
                    float(kept[top]),
                    float(transient[top]),
                    str(self.actions[first + top]),
                )
            step = MemoryPeak(
                full,
                buffered,
                float(live_end),
                int(count_end),
                float(kept_running[-1]),
                transient_optimizer,
                "optimizer",
            )
            peaks.append(step if step.total > best.total else best)
        return peaks

    def _spans(self, num_devices: int) -> list[tuple[int, int]]:
        """Each device's actions: a range of indices (actions are listed device by device)."""
        bounds = np.searchsorted(self.device, np.arange(num_devices + 1), side="left").tolist()
        return list(zip(bounds[:-1], bounds[1:]))


def compile_orders(orders: dict[int, list[Action]], num_stages: int) -> ActionGraph | None:
    """The orders as an :class:`ActionGraph`, or None where only the reference can run them
    (see the module's note)."""
    actions = [a for device in sorted(orders) for a in orders[device]]
    index = {a: i for i, a in enumerate(actions)}
    if len(index) != len(actions):
        return None  # an action listed twice
    n = len(actions)
    device = np.empty(n, dtype=np.int64)
    previous = np.full(n, n, dtype=np.int64)
    waits = np.full((n, _MAX_DEPENDENCIES), n, dtype=np.int64)
    link = np.zeros((n, _MAX_DEPENDENCIES), dtype=np.int64)
    link_stage = np.zeros((n, _MAX_DEPENDENCIES), dtype=np.int64)
    i = 0
    for d in sorted(orders):
        for place, action in enumerate(orders[d]):
            device[i] = d
            if place:
                previous[i] = i - 1
            needs = dependencies(action, num_stages)
            if len(needs) > _MAX_DEPENDENCIES:
                return None
            for k, (options, direction) in enumerate(needs):
                present = [index[o] for o in options if o in index]
                if len(present) != 1:
                    return None  # waits forever (a deadlock) or on whichever runs first
                waits[i, k] = present[0]
                if direction == "forward":
                    link[i, k], link_stage[i, k] = _FORWARD, options[0].stage
                elif direction == "backward":
                    link[i, k], link_stage[i, k] = _BACKWARD, action.stage
            i += 1
    level = _levels(previous, waits, n)
    if level is None:
        return None  # a cycle: the reference finds the deadlock and says where
    listing = _listing(orders, index, waits, n)
    if listing is None:
        return None
    by_level: dict[int, list[int]] = {}
    for a, lv in enumerate(level):
        by_level.setdefault(lv, []).append(a)
    kinds = {"F": 0, "B": 1, "I": 2, "W": 3}
    return ActionGraph(
        orders=orders,
        actions=actions,
        device=device,
        stage=np.array([a.stage for a in actions], dtype=np.int64),
        kind=np.array([kinds[a.kind] for a in actions], dtype=np.int64),
        previous=previous,
        waits=waits,
        link=link,
        link_stage=link_stage,
        levels=[np.array(by_level[lv], dtype=np.int64) for lv in sorted(by_level)],
        position=np.array(listing, dtype=np.int64),
    )


def _levels(previous: np.ndarray, waits: np.ndarray, n: int) -> list[int] | None:
    """Each action's level: one more than the highest of what it waits for (its device's
    previous action included); None on a cycle."""
    after: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n
    for a in range(n):
        for b in (int(previous[a]), *map(int, waits[a])):
            if b < n:
                after[b].append(a)
                missing[a] += 1
    level = [0] * n
    ready = [a for a in range(n) if missing[a] == 0]
    done = 0
    while ready:
        a = ready.pop()
        done += 1
        for c in after[a]:
            level[c] = max(level[c], level[a] + 1)
            missing[c] -= 1
            if missing[c] == 0:
                ready.append(c)
    return level if done == n else None


def _listing(
    orders: dict[int, list[Action]],
    index: dict[Action, int],
    waits: np.ndarray,
    n: int,
) -> list[int] | None:
    """Each action's place in the reference's listing: it sweeps the devices in turn, running
    each device's actions while their inputs have ended (in that sweep or before)."""
    done = [False] * (n + 1)
    done[n] = True
    position = [0] * n
    cursor = dict.fromkeys(orders, 0)
    listed = 0
    while listed < n:
        progressed = False
        for d, order in orders.items():
            while cursor[d] < len(order):
                a = index[order[cursor[d]]]
                if not (done[int(waits[a, 0])] and done[int(waits[a, 1])]):
                    break
                done[a] = True
                position[a] = listed
                listed += 1
                cursor[d] += 1
                progressed = True
        if not progressed:
            return None
    return position
