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

from dataclasses import dataclass, field

import numpy as np

from ..runtime.core.schedules import (
    INPUT_GRAD_FRACTION,
    Action,
    MemoryPeak,
    PipelineCosts,
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
    position: np.ndarray  # each action's place in the reference's round-robin listing
    #: the actions by level, each level waiting only on earlier ones: the permutation, each
    #: level's range in it, and each action's previous action and waits in its numbering
    #: (``n``: nothing), so that a level's figures are slices
    by_level: np.ndarray
    level_bounds: list[tuple[int, int]]
    previous_by_level: np.ndarray
    waits_by_level: np.ndarray
    #: each device count's :class:`_Rows`, made on first use
    _layouts: dict[int, _Rows] = field(default_factory=dict, compare=False, repr=False)

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
        stages = costs.num_stages
        wait_forward = np.asarray(costs.receive_forward or [0.0] * stages, dtype=np.float64)
        wait_backward = np.asarray(costs.receive_backward or [0.0] * stages, dtype=np.float64)
        # as PipelineCosts.duration: compute, plus the wait on the receives of F, B and I
        duration = np.where(
            self.kind == 0,
            forward[self.stage] + wait_forward[self.stage],
            backward[self.stage] + wait_backward[self.stage],
        )
        duration = np.where(
            self.kind == 2,
            backward[self.stage] * INPUT_GRAD_FRACTION + wait_backward[self.stage],
            duration,
        )
        duration = np.where(
            self.kind == 3, backward[self.stage] * (1 - INPUT_GRAD_FRACTION), duration
        )
        # each boundary's transfer times, zero between stages of one device
        boundaries = max(costs.num_stages - 1, 0)
        links = np.zeros((3, boundaries + 1), dtype=np.float64)
        for b in range(boundaries):
            links[_FORWARD, b] = costs.link(b, costs.send_forward)
            links[_BACKWARD, b] = costs.link(b, costs.send_backward)
        order = self.by_level
        delay = links[self.link[order], self.link_stage[order]]  # (n, 2), by level
        first_delay, second_delay = delay[:, 0], delay[:, 1]
        length = duration[order]
        first, second = self.waits_by_level[:, 0], self.waits_by_level[:, 1]
        previous = self.previous_by_level
        end = np.zeros(n + 1, dtype=np.float64)
        start = np.zeros(n, dtype=np.float64)
        zero = np.zeros(1, dtype=np.float64)
        for a, b in self.level_bounds:
            ready = np.maximum(
                np.maximum(zero, end[first[a:b]] + first_delay[a:b]),
                end[second[a:b]] + second_delay[a:b],
            )
            begin = np.maximum(ready, end[previous[a:b]])
            start[a:b] = begin
            end[a:b] = begin + length[a:b]
        by_action_start = np.empty(n, dtype=np.float64)
        by_action_end = np.empty(n, dtype=np.float64)
        by_action_start[order] = start
        by_action_end[order] = end[:n]
        return by_action_start, by_action_end

    # -- what a simulation derives from the times, without listing the events ---------------
    def busy(self, start: np.ndarray, end: np.ndarray, num_devices: int) -> list[float]:
        """Each device's seconds computing: its actions' durations summed in its order, as the
        simulation sums them (a device's actions start in its order)."""
        rows = self._rows(num_devices)
        summed = np.cumsum(rows.table(end - start, 0.0), axis=1)
        return [float(summed[d, -1]) if rows.counts[d] else 0.0 for d in range(num_devices)]

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
        cumulative sum over the device's actions of the very terms the walk adds in turn (all
        devices at once: a row each, padded with terms that add nothing)."""
        num_stages, num_devices = costs.num_stages, costs.num_devices

        def table(name: str) -> np.ndarray:
            values = getattr(costs, name) or [0.0] * num_stages
            return np.asarray(values, dtype=np.float64)

        act, grads, buffers = table("activations"), table("gradients"), table("buffers")
        in_grads, optimizer = table("input_gradients"), table("transient_optimizer")
        during_forward, during_backward = table("transient_forward"), table("transient_backward")
        grads_list, buffers_list = grads.tolist(), buffers.tolist()
        optimizer_list = optimizer.tolist()
        rows = self._rows(num_devices)
        width = rows.width
        stage, kind = self.stage, self.kind
        forward = kind == 0
        freeing = (kind == 1) | (kind == 3)
        # activations: + at a forward (before its moment), - after a full or weight backward
        steps = np.zeros((num_devices, 2 * width), dtype=np.float64)
        steps[:, 0::2] = rows.table(np.where(forward, act[stage], 0.0), 0.0)
        steps[:, 1::2] = rows.table(np.where(freeing, -act[stage], 0.0), 0.0)
        running = np.cumsum(steps, axis=1)
        live, live_end = running[:, 0::2], running[:, -1]
        counts = np.zeros((num_devices, 2 * width), dtype=np.int64)
        counts[:, 0::2] = rows.table(forward.astype(np.int64), 0)
        counts[:, 1::2] = rows.table(-freeing.astype(np.int64), 0)
        counting = np.cumsum(counts, axis=1)
        count, count_end = counting[:, 0::2], counting[:, -1]
        # the stage's gradients appear with its first backward on its device (a stage runs on
        # one device: its first backward anywhere)
        added = np.zeros((num_devices, width + 1), dtype=np.float64)
        state0, buffered, full, transient_optimizer = [], [], [], []
        for device in range(num_devices):
            stages = [s for s, d in enumerate(costs.device_of_stage) if d == device]
            state0.append(sum(costs.static_memory[s] - grads_list[s] for s in stages))
            buffered.append(sum(buffers_list[s] for s in stages))
            full.append(sum(costs.static_memory[s] for s in stages))
            transient_optimizer.append(sum(optimizer_list[s] for s in stages))
        added[:, 0] = state0
        backward = np.flatnonzero(~forward)
        if len(backward):
            seen, firsts = np.unique(stage[backward], return_index=True)
            at = backward[firsts]
            added[self.device[at], rows.column[at] + 1] = grads[seen]
        state = np.cumsum(added, axis=1)[:, 1:]
        # gradients of received inputs: kept after each full or input backward (after the
        # stage's first alone where a backward's input gradients replace the last ones sent)
        sends = (kind == 1) | (kind == 2)
        if costs.input_gradients_freed:
            sending = np.flatnonzero(sends)
            sends = np.zeros_like(sends)
            sends[sending[np.unique(stage[sending], return_index=True)[1]]] = True
        keeping = rows.table(np.where(sends, in_grads[stage], 0.0), 0.0)
        kept_running = np.cumsum(keeping, axis=1)
        kept = np.c_[np.zeros(num_devices), kept_running[:, :-1]]
        transient = rows.table(
            np.where(forward, during_forward[stage], during_backward[stage]), 0.0
        )
        total = state + np.asarray(buffered)[:, None] + live + kept + transient
        total = np.where(rows.valid, total, -np.inf)
        tops = np.argmax(total, axis=1).tolist() if width else [0] * num_devices
        peaks = []
        for device in range(num_devices):
            start_peak = MemoryPeak(state0[device], buffered[device], 0.0, 0, 0.0, 0.0, "start")
            if not rows.counts[device]:
                step = MemoryPeak(
                    full[device], buffered[device], 0.0, 0, 0.0, transient_optimizer[device],
                    "optimizer",
                )  # fmt: skip
                peaks.append(step if step.total > start_peak.total else start_peak)
                continue
            best = start_peak
            top = tops[device]
            if total[device, top] > start_peak.total:
                best = MemoryPeak(
                    float(state[device, top]),
                    buffered[device],
                    float(live[device, top]),
                    int(count[device, top]),
                    float(kept[device, top]),
                    float(transient[device, top]),
                    str(self.actions[rows.first[device] + top]),
                )
            step = MemoryPeak(
                full[device],
                buffered[device],
                float(live_end[device]),
                int(count_end[device]),
                0.0 if costs.input_gradients_freed else float(kept_running[device, -1]),
                transient_optimizer[device],
                "optimizer",
            )
            peaks.append(step if step.total > best.total else best)
        return peaks

    def _rows(self, num_devices: int) -> _Rows:
        """Each device's actions as a row (actions are listed device by device)."""
        known = self._layouts.get(num_devices)
        if known is None:
            known = self._layouts[num_devices] = _Rows.of(self.device, num_devices)
        return known

    def _spans(self, num_devices: int) -> list[tuple[int, int]]:
        """Each device's actions: a range of indices (actions are listed device by device)."""
        bounds = np.searchsorted(self.device, np.arange(num_devices + 1), side="left").tolist()
        return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class _Rows:
    """Actions listed device by device, as a table with a row per device: each action's
    column, each row's first action and count, and which cells hold an action."""

    row: np.ndarray
    column: np.ndarray
    first: list[int]
    counts: list[int]
    width: int
    valid: np.ndarray  # (devices, width)

    @classmethod
    def of(cls, device: np.ndarray, num_devices: int) -> _Rows:
        counts = np.bincount(device, minlength=num_devices)
        first = np.r_[0, np.cumsum(counts)[:-1]]
        column = np.arange(len(device)) - np.repeat(first, counts)
        width = int(counts.max()) if len(counts) else 0
        valid = np.arange(width)[None, :] < counts[:, None]
        return cls(device, column, first.tolist(), counts.tolist(), width, valid)

    def table(self, values: np.ndarray, pad: float | int) -> np.ndarray:
        """``values`` (one per action) in their rows, ``pad`` in the cells past a row's end."""
        out = np.full((len(self.counts), self.width), pad, dtype=values.dtype)
        out[self.row, self.column] = values
        return out


def compile_orders(orders: dict[int, list[Action]], num_stages: int) -> ActionGraph | None:
    """The orders as an :class:`ActionGraph`, or None where only the reference can run them
    (see the module's note). Each action's waits are :func:`~autopipe.runtime.core.schedules.dependencies`' rule, resolved for
    all actions at once by looking the needed actions up in a table by stage, kind and
    microbatch."""
    devices = sorted(orders)
    actions = [a for d in devices for a in orders[d]]
    n = len(actions)
    kinds = {"F": 0, "B": 1, "I": 2, "W": 3}
    stage = np.fromiter((a.stage for a in actions), dtype=np.int64, count=n)
    kind = np.fromiter((kinds[a.kind] for a in actions), dtype=np.int64, count=n)
    microbatch = np.fromiter((a.microbatch for a in actions), dtype=np.int64, count=n)
    counts = [len(orders[d]) for d in devices]
    device = np.repeat(np.asarray(devices, dtype=np.int64), counts)
    firsts = np.r_[0, np.cumsum(counts)[:-1]].astype(np.int64)
    previous = np.arange(n, dtype=np.int64) - 1
    previous[firsts[np.asarray(counts) > 0]] = n  # a device's first action follows nothing
    waits = np.full((n, _MAX_DEPENDENCIES), n, dtype=np.int64)
    link = np.zeros((n, _MAX_DEPENDENCIES), dtype=np.int64)
    link_stage = np.zeros((n, _MAX_DEPENDENCIES), dtype=np.int64)
    if n:
        stages = max(num_stages, int(stage.max()) + 1)
        width = int(microbatch.max()) + 1
        key = (stage * 4 + kind) * width + microbatch
        if len(np.unique(key)) != n:
            return None  # an action listed twice
        table = np.full(stages * 4 * width + 1, -1, dtype=np.int64)  # the last: "none"
        table[key] = np.arange(n)

        def found(at_stage: np.ndarray, of_kind: int, mb: np.ndarray) -> np.ndarray:
            inside = (at_stage >= 0) & (at_stage < stages)
            keys = np.where(inside, (at_stage * 4 + of_kind) * width + mb, len(table) - 1)
            return table[keys]

        forward, weight, backward = kind == 0, kind == 3, (kind == 1) | (kind == 2)
        # a forward after the first stage waits for the previous stage's forward
        later = forward & (stage > 0)
        needed = found(stage - 1, 0, microbatch)
        if (needed[later] < 0).any():
            return None  # waits forever (a deadlock)
        waits[later, 0] = needed[later]
        link[later, 0], link_stage[later, 0] = _FORWARD, stage[later] - 1
        # a weight backward waits for its input backward; a full or input backward for its
        # forward, and before the last stage for the next stage's full or input backward
        own = found(stage, 2, microbatch), found(stage, 0, microbatch)
        for chosen, needed in ((weight, own[0]), (backward, own[1])):
            if (needed[chosen] < 0).any():
                return None
            waits[chosen, 0] = needed[chosen]
        before_last = backward & (stage < num_stages - 1)
        full, inputs = found(stage + 1, 1, microbatch), found(stage + 1, 2, microbatch)
        present = (full >= 0).astype(np.int64) + (inputs >= 0)
        if (present[before_last] != 1).any():
            return None  # waits forever, or on whichever runs first
        waits[before_last, 1] = np.maximum(full, inputs)[before_last]
        link[before_last, 1], link_stage[before_last, 1] = _BACKWARD, stage[before_last]
    level = _levels(previous, waits, n)
    if level is None:
        return None  # a cycle: the reference finds the deadlock and says where
    listing = _listing(orders, dict(zip(devices, firsts.tolist())), waits, n)
    if listing is None:
        return None
    order = np.argsort(np.asarray(level, dtype=np.int64), kind="stable")
    sizes = np.bincount(np.asarray(level, dtype=np.int64))
    ends = np.cumsum(sizes).tolist()
    bounds = [(a, b) for a, b in zip([0, *ends[:-1]], ends) if b > a]
    renumbered = np.empty(n + 1, dtype=np.int64)
    renumbered[order] = np.arange(n)
    renumbered[n] = n
    return ActionGraph(
        orders=orders,
        actions=actions,
        device=device,
        stage=stage,
        kind=kind,
        previous=previous,
        waits=waits,
        link=link,
        link_stage=link_stage,
        position=np.array(listing, dtype=np.int64),
        by_level=order,
        level_bounds=bounds,
        previous_by_level=renumbered[previous[order]],
        waits_by_level=renumbered[waits[order]],
    )


def _levels(previous: np.ndarray, waits: np.ndarray, n: int) -> list[int] | None:
    """Each action's level: one more than the highest of what it waits for (its device's
    previous action included); None on a cycle."""
    after: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n
    for a, needs in enumerate(zip(previous.tolist(), *waits.T.tolist())):
        for b in needs:
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
    orders: dict[int, list[Action]], first: dict[int, int], waits: np.ndarray, n: int
) -> list[int] | None:
    """Each action's place in the reference's listing: it sweeps the devices in turn, running
    each device's actions while their inputs have ended (in that sweep or before). ``first``:
    each device's first action's index (actions are numbered device by device)."""
    done = [False] * (n + 1)
    done[n] = True
    position = [0] * n
    first_wait, second_wait = waits[:, 0].tolist(), waits[:, 1].tolist()
    cursor = dict.fromkeys(orders, 0)
    listed = 0
    while listed < n:
        progressed = False
        for d, order in orders.items():
            while cursor[d] < len(order):
                a = first[d] + cursor[d]
                if not (done[first_wait[a]] and done[second_wait[a]]):
                    break
                done[a] = True
                position[a] = listed
                listed += 1
                cursor[d] += 1
                progressed = True
        if not progressed:
            return None
    return position
