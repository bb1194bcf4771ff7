"""What a stage's units add up to, for any assignment of units to stages, with numpy.

The cost model sums per stage what its units cost (seconds, bytes saved for backward, the
parameters it holds, the bytes crossing each boundary, what its forward and backward hold
besides) for every assignment a partitioner, the recomputation planner or the plan search
judges: thousands of assignments of a thousand units or more. :class:`StageSums` holds the
units' figures as arrays once and answers each assignment with a few array operations instead
of a Python loop over units and values.

Every figure equals the unit-by-unit loop it replaces to the last bit, which the tests check
against those loops: seconds (and bytes divided among shards) are added per stage in unit
order, as the loop adds them (``np.bincount`` adds its weights in order; a cumulative sum along
a row adds in order); other bytes are whole numbers, which floating point adds exactly in any
order while the totals stay below 2**53 bytes (8 PiB).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from .handed_values import HandedValue

__all__ = ["StageSums"]

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


def _floats(values: Sequence[float]) -> Floats:
    return np.asarray(values, dtype=np.float64)


def _ints(values: Sequence[int]) -> Ints:
    return np.asarray(values, dtype=np.int64)


def _summed(where: Ints, weights: Floats, length: int) -> Floats:
    """``weights`` added up by ``where`` (in order) into ``length`` bins."""
    summed: Floats = np.bincount(where, weights=weights, minlength=length).astype(
        np.float64, copy=False
    )
    return summed


class StageSums:
    """The units' figures as arrays, and their sums per stage for any ``stage_of_unit``.

    ``exchanges`` are ``(producer, last reader, activation bytes, gradient bytes)`` (producer
    -1: a model input; last reader ``num_units``: a model output), the activation bytes in the
    traced dtype a stage sends and receives; ``held`` each one's bytes as a stage holds it and
    whether autocast made it in another dtype than that (a product's output in bf16: a stage
    sends a copy), default the activation bytes as sent; ``savers`` the units that save
    each exchanged value among their activations, per exchange; ``handed`` the values handed
    between units that none keeps (:mod:`.handed_values`: locals of the generated code);
    ``unit_params`` each unit's parameters (bytes by name, in the unit's order); ``step_time``
    the seconds a step spends once on a trained parameter of so many bytes after its pipeline
    runs (every copy's), ``norm_time`` those of its gradient's norm (a tied parameter's first
    copy alone), ``accumulation_time`` those of a backward adding
    its gradient into the step's; ``blocks`` each block's units;
    ``block_gathers`` each block's parameter and trained parameter bytes where FSDP2 gathers
    the stages block by block (see :meth:`transients`), else None; ``gather_scale`` the bytes
    FSDP2 gathers per parameter byte (a half for fp32 parameters gathered in bf16)."""

    def __init__(
        self,
        *,
        num_units: int,
        forward: Sequence[float],
        backward: Sequence[float],
        activations: Sequence[float],
        temporaries: Sequence[float],
        backward_memory: Sequence[float],
        trainable_bytes: Sequence[int],
        dp_shard: int,
        unit_params: Sequence[dict[str, int]],
        frozen: frozenset[str],
        step_time: Callable[[int], float],
        norm_time: Callable[[int], float] | None = None,
        accumulation_time: Callable[[int], float] | None = None,
        exchanges: Sequence[tuple[int, int, int, int]],
        savers: Sequence[Sequence[int]],
        blocks: Sequence[Sequence[int]],
        handed: Sequence[HandedValue] = (),
        held: Sequence[tuple[float, bool]] | None = None,
        block_gathers: Sequence[tuple[float, float]] | None = None,
        gather_scale: float = 1.0,
    ) -> None:
        self.num_units = num_units
        self.forward, self.backward = _floats(forward), _floats(backward)
        self.activations, self.temporaries = _floats(activations), _floats(temporaries)
        self.backward_memory = _floats(backward_memory)
        #: each unit's gradient bytes held by one shard, as the loops divide them
        self.trainable = _floats(trainable_bytes)
        self.shard_gradients = _floats([t / dp_shard for t in trainable_bytes])
        # parameters: (unit, parameter, bytes, trained) in the units' order, each unit's own
        # in its order, a parameter again in every unit reading it
        names: dict[str, int] = {}
        reads = [(u, names.setdefault(n, len(names)), b, n not in frozen)
                for u, params in enumerate(unit_params) for n, b in params.items()]  # fmt: skip
        self.param_unit = _ints([h[0] for h in reads])
        self.param_id = _ints([h[1] for h in reads])
        self.param_bytes = _floats([h[2] for h in reads])
        self.param_trained = _floats([h[2] if h[3] else 0 for h in reads])
        #: each trained parameter's step after the runs (seconds), frozen ones' none: every
        #: copy's, and the norm's of its first copy alone (see ``optimizer_steps``)
        self.param_step = _floats([step_time(h[2]) if h[3] else 0.0 for h in reads])
        norm = norm_time or (lambda nbytes: 0.0)
        self.param_norm = _floats([norm(h[2]) if h[3] else 0.0 for h in reads])
        #: and of adding its gradient into the step's, each backward (see ``tied_accumulations``)
        adding = accumulation_time or (lambda nbytes: 0.0)
        self.param_accumulation = _floats([adding(h[2]) if h[3] else 0.0 for h in reads])
        self.num_params = len(names)
        #: each parameter's first entry in the model (its first reader's), by parameter id
        self.param_first: Ints = np.unique(self.param_id, return_index=True)[1]
        self.producer = _ints([e[0] for e in exchanges])
        self.last = _ints([e[1] for e in exchanges])
        self.exchange_activation = _floats([e[2] for e in exchanges])
        self.exchange_gradient = _floats([e[3] for e in exchanges])
        held = held if held is not None else [(e[2], False) for e in exchanges]
        self.exchange_held = _floats([h[0] for h in held])
        #: the exchanges a stage holds in the dtype it sends (one tensor, not a cast copy)
        self.sent_as_held = np.array([not h[1] for h in held], dtype=bool)
        #: bytes of the model's outputs (their exchanges' last reader is the model)
        self.model_outputs = float(sum(e[2] for e in exchanges if e[1] == num_units))
        self.handed_producer = _ints([h.producer for h in handed])
        self.handed_bytes = _floats([h.nbytes for h in handed])
        self.handed_block = _ints([h.block for h in handed])
        self.handed_reader_value = _ints([i for i, h in enumerate(handed) for _ in h.readers])
        self.handed_reader = _ints([u for h in handed for u in h.readers])
        self.saver_exchange = _ints([e for e, units in enumerate(savers) for _ in units])
        self.saver_unit = _ints([u for units in savers for u in units])
        self.block_units = _ints([u for units in blocks for u in units])
        self.block_starts = _ints(np.cumsum([0, *(len(units) for units in blocks)])[:-1].tolist())
        self.block_temporaries = _floats(
            [float(sum(temporaries[u] for u in units)) for units in blocks]
        )
        self.num_blocks = len(blocks)
        self.block_lengths = _ints([len(units) for units in blocks])
        self.gather_scale = gather_scale
        self.block_gathers = (
            None
            if block_gathers is None
            else np.asarray(block_gathers, dtype=np.float64).reshape(len(blocks), 2)
        )

    def with_activations(self, activations: Sequence[float]) -> StageSums:
        """These sums with other bytes saved per unit (a model assuming recomputation)."""
        other = copy.copy(self)
        other.activations = _floats(activations)
        return other

    # -- sums ----------------------------------------------------------------------------------
    @staticmethod
    def assignment(stage_of_unit: Sequence[int]) -> Ints:
        return _ints(stage_of_unit)

    def per_stage(self, values: Floats, stages: Ints, num_stages: int) -> Floats:
        """``values`` (one per unit) summed per stage, in unit order."""
        return _summed(stages, values, num_stages)

    def parameters(self, stages: Ints, num_stages: int) -> tuple[Floats, Floats]:
        """Parameter bytes each stage holds (a parameter once per stage, whichever of its
        units read it), and of those the trained ones'."""
        if not self.num_params:
            return np.zeros(num_stages), np.zeros(num_stages)
        first, owner = self._held(stages)
        return (
            _summed(owner, self.param_bytes[first], num_stages),
            _summed(owner, self.param_trained[first], num_stages),
        )

    def optimizer_steps(self, stages: Ints, num_stages: int) -> Floats:
        """Seconds of each stage's step after its pipeline runs: its trained parameters'
        (each once) gradients and optimizer step, and the norm of those it holds first (a
        tied parameter's later copies are left out of the norm)."""
        if not self.num_params:
            return np.zeros(num_stages)
        first, owner = self._held(stages)
        again = self._again(first)
        return _summed(owner, self.param_step[first], num_stages) + _summed(
            owner[~again], self.param_norm[first[~again]], num_stages
        )

    def tied_accumulations(self, stages: Ints, num_stages: int) -> Floats:
        """Seconds each stage's backward spends adding the gradients of the trained parameters
        it shares with an earlier unit of another stage into the step's: each stage holds its
        own copy of a tied parameter, which the units' backwards (charged to a parameter's
        first reader in the model) do not count again."""
        if not self.num_params:
            return np.zeros(num_stages)
        first, owner = self._held(stages)
        again = self._again(first)
        return _summed(owner[again], self.param_accumulation[first[again]], num_stages)

    def _again(self, first: Ints) -> npt.NDArray[np.bool_]:
        """Which of the parameter entries ``first`` (a stage's first of each parameter) are
        not the parameter's first entry in the model: a tied parameter's later copies."""
        again: npt.NDArray[np.bool_] = first != self.param_first[self.param_id[first]]
        return again

    def _held(self, stages: Ints) -> tuple[Ints, Ints]:
        """Each parameter's first entry in each stage holding it, and that stage."""
        where = stages[self.param_unit]
        _, first = np.unique(where * self.num_params + self.param_id, return_index=True)
        return first, where[first]

    def exchange_stages(self, stages: Ints, num_stages: int) -> tuple[Ints, Ints]:
        """Each exchanged value's producing stage (0 for a model input) and the stage of its
        last reader (``num_stages - 1`` for a model output)."""
        n = self.num_units
        first = np.where(self.producer >= 0, stages[np.maximum(self.producer, 0)], 0)
        end = np.where(self.last < n, stages[np.minimum(self.last, n - 1)], num_stages - 1)
        return first, end

    def crossing(self, stages: Ints, num_stages: int) -> tuple[Floats, Floats]:
        """Activation and gradient bytes crossing each boundary (after stage b, for b in
        0 .. num_stages - 2): every value from its producer's stage to its last reader's."""
        boundaries = max(num_stages - 1, 0)
        first, end = self.exchange_stages(stages, num_stages)
        crossing = []
        for moved in (self.exchange_activation, self.exchange_gradient):
            change = _summed(first, moved, num_stages + 1)
            change -= _summed(np.maximum(end, first), moved, num_stages + 1)
            crossing.append(np.cumsum(change)[:boundaries])
        return crossing[0], crossing[1]

    def counted_twice(self, stages: Ints, num_stages: int) -> Floats:
        """Bytes per stage the units' saved activations count more than once: a value its
        producer and its readers in one stage all save (one tensor), or that a stage saves
        and also holds as an output (until its backward) or a receive buffer (where the stage
        holds it in the dtype it sends: else these are its cast copies)."""
        if not len(self.saver_unit):
            return np.zeros(num_stages)
        n = self.num_units
        stage = stages[self.saver_unit]
        groups, first, count = np.unique(
            self.saver_exchange * num_stages + stage, return_index=True, return_counts=True
        )
        exchange, stage = groups // num_stages, stage[first]
        producer = self.producer[exchange]
        home = np.where(producer >= 0, stages[np.maximum(producer, 0)], -1)
        last = self.last[exchange]
        end = np.where(last < n, stages[np.minimum(last, n - 1)], num_stages)
        held = ((home >= 0) & (stage != home)) | (end > stage)
        counted = self.exchange_held[exchange] * (count - 1) + np.where(
            held & self.sent_as_held[exchange], self.exchange_activation[exchange], 0.0
        )
        return _summed(stage, counted, num_stages)

    def block_stages(self, stages: Ints) -> Ints:
        """Each block's stage, or -1 where a stage boundary cuts it."""
        if not self.num_blocks:
            return np.zeros(0, dtype=np.int64)
        held = stages[self.block_units]
        low = np.minimum.reduceat(held, self.block_starts)
        high = np.maximum.reduceat(held, self.block_starts)
        return np.where(low == high, low, -1)

    def _before(self, values: Floats, stages: Ints, num_stages: int) -> Floats:
        """Per unit, ``values`` summed over its stage's units before it (in unit order)."""
        order = np.argsort(stages, kind="stable")
        ran = np.cumsum(values[order])  # in each stage's unit order, stage by stage
        before = np.empty(self.num_units)
        before[order] = ran - values[order]
        starts: Floats = np.r_[0.0, np.cumsum(_summed(stages, values, num_stages))[:-1]]
        return before - starts[stages]

    def _saved_after(self, stages: Ints, num_stages: int) -> tuple[Floats, Floats]:
        """Per unit, the activations its stage's units after it save (not saved yet while it
        runs), and those it and they save."""
        total = _summed(stages, self.activations, num_stages)[stages]
        since = total - self._before(self.activations, stages, num_stages)
        return since - self.activations, since

    def _saved_existing(self, stages: Ints, num_stages: int, last: Ints, home: Ints) -> Floats:
        """Per block (its last unit ``last``, in stage ``home``), the bytes the stage's units
        after it save of values that exist as it ends: made by it or before it, received from
        another stage or read from the batch."""
        if not len(self.saver_unit) or not self.num_blocks:
            return np.zeros(self.num_blocks)
        saver = self.saver_unit
        where = stages[saver]
        producer = self.producer[self.saver_exchange]
        local = (producer >= 0) & (stages[np.maximum(producer, 0)] == where)
        since = np.where(local, producer, -1)
        # the blocks ending in [since, saver) by their last unit: a range of the sorted ends
        by_end = np.argsort(last, kind="stable")
        ends = last[by_end]
        low = np.searchsorted(ends, since, side="left")
        high = np.searchsorted(ends, saver, side="left")
        steps = np.zeros((num_stages, self.num_blocks + 1))
        moved = self.exchange_held[self.saver_exchange]
        np.add.at(steps, (where, low), moved)
        np.add.at(steps, (where, high), -moved)
        existing = np.empty(self.num_blocks)
        existing[by_end] = np.cumsum(steps, axis=1)[home[by_end], np.arange(self.num_blocks)]
        return existing

    def transients(
        self,
        stages: Ints,
        num_stages: int,
        blocks: Ints | None = None,
        stage_parameters: tuple[Floats, Floats] | None = None,
    ) -> tuple[Floats, Floats]:
        """The most a stage's forward holds beyond its microbatch's activations, and the most a
        backward holds beyond them and the stage's gradients (a unit's backward, less the
        activations of the units after it in the stage, freed by then, and the gradients of
        those before it, not allocated yet). ``blocks``: :meth:`block_stages`, and
        ``stage_parameters``: :meth:`parameters`, if known.

        A forward holds its own code's locals until it returns: the temporaries of its units in
        no whole block and the values handed between units that none saves (``handed``).
        While a block runs it holds the block's locals (its units' temporaries) and the stage's
        made before the block, and has not saved yet the activations of the stage's units after
        the block: the forward's peak is the larger of the two moments.

        Where FSDP2 gathers block by block (``block_gathers``; the stage's state counts one
        block's parameters gathered and its gradients unsharded, :meth:`CostModel.gathered`):
        a block's forward also holds the flat buffer its parameters were gathered into (FSDP2
        keeps it until the next block's are copied out), while the activations after the block
        are not saved yet; the moment a block's are copied out holds two such buffers (the
        first block's, and the rest's, gathered as the stage's forward starts), and none of the
        stage's locals or of the activations from the block on. Where the stage trains
        parameters outside blocks, a forward holds their gradients' reduce-scatter input (the
        stage's last), not a block's. A block's backward also holds the previous unit's
        gradients, still being reduce-scattered (before the stage's last block, the rest's from
        the previous backward), and, but for the stage's first block, the next block's gather
        (prefetched); where the rest runs before the blocks (an embedding), its gradients, which
        the state counts, do not exist yet, and neither do those of the block's units before the
        one running."""
        blocks = self.block_stages(stages) if blocks is None else blocks
        # forward: the stage's own locals (the temporaries of units in no whole block, and the
        # values handed between its units that none keeps), all alive as it returns; and while
        # a block runs, the block's, the stage's made before it, less the activations the stage
        # saves after it (not saved yet)
        inline = self.temporaries.copy()
        whole = np.repeat(blocks >= 0, self.block_lengths)
        inline[self.block_units[whole]] = 0.0
        block_locals = np.zeros(self.num_blocks)
        if len(self.handed_producer):
            made_in = stages[self.handed_producer]
            count = len(self.handed_producer)
            latest = np.full(count, -1)
            np.maximum.at(latest, self.handed_reader_value, stages[self.handed_reader])
            earliest = np.full(count, num_stages)
            np.minimum.at(earliest, self.handed_reader_value, stages[self.handed_reader])
            own = self.handed_block >= 0
            own[own] = blocks[self.handed_block[own]] >= 0  # the block whole in a stage
            block_locals = _summed(self.handed_block[own], self.handed_bytes[own], self.num_blocks)
            staged = ~own & (latest == made_in) & (earliest == made_in)
            inline += _summed(
                self.handed_producer[staged], self.handed_bytes[staged], self.num_units
            )
        forward = _summed(stages, inline, num_stages)
        largest = np.zeros(num_stages)
        kept = blocks >= 0
        extra = np.zeros(self.num_units)  # a unit's backward's, in a whole block
        if self.num_blocks:
            after, since = self._saved_after(stages, num_stages)
            last = np.maximum.reduceat(self.block_units, self.block_starts)
            first = np.minimum.reduceat(self.block_units, self.block_starts)
            home = np.maximum(blocks, 0)
            made = self._before(inline, stages, num_stages)  # the stage's locals made so far
            # a block's peak, above the stage's locals at its end: of what the stage saves after
            # the block, the values made before its end exist already
            unsaved = after[last] - self._saved_existing(stages, num_stages, last, home)
            held = self.block_temporaries + block_locals + made[first] - unsaved - forward[home]
        if self.block_gathers is not None and self.num_blocks:
            params, trained = self.block_gathers[:, 0], self.block_gathers[:, 1]
            params_here, trained_here = stage_parameters or self.parameters(stages, num_stages)
            rest_params = params_here - _summed(blocks[kept], params[kept], num_stages)
            rest_trained = trained_here - _summed(blocks[kept], trained[kept], num_stages)
            # the buffers hold what FSDP2 gathers: bf16 copies of fp32 parameters under --bf16
            params, rest_params = params * self.gather_scale, rest_params * self.gather_scale
            # the reduce-scatter input a forward holds is the stage's last reduced unit's: the
            # rest's, where it trains parameters, not a block's (which the state counts)
            rest = rest_trained > 0
            unheld = np.where(rest[home], trained, 0.0)
            opening = np.full(num_stages, self.num_units)  # each stage's first block's first unit
            np.minimum.at(opening, blocks[kept], first[kept])
            closing = np.full(num_stages, -1)  # and its last block's
            np.maximum.at(closing, blocks[kept], first[kept])
            opens, closes = first == opening[home], first == closing[home]
            # at a block's copy-out, the flat buffer of the unit gathered before it: the rest's
            # (gathered as the stage's forward starts) before the stage's first block
            before = np.where(opens, np.maximum(rest_params[home], 0.0), params)
            copy_out = before + params - since[first] + made[first] - forward[home] - unheld
            compute = held + params - unheld
            held = np.maximum(np.maximum(held, compute), copy_out)
            # the stage's first block gathers no block after its backward (the rest is gathered)
            prefetched = np.where(opens, 0.0, params)
            # the reduce-scatter input still held: the block after's (a block's size), or before
            # the stage's last block the rest's, reduced last in the previous backward, where it
            # trains parameters
            reducing = np.where(closes & rest[home], rest_trained[home], trained)
            # the rest's gradients the state counts do not exist yet while the blocks run their
            # backward where the rest runs before them (an embedding)
            in_block = np.zeros(self.num_units, dtype=bool)
            in_block[self.block_units[whole]] = True
            early = (np.arange(self.num_units) < opening[stages]) & ~in_block
            not_yet = _summed(stages[early], self.trainable[early], num_stages)
            per_block = np.repeat(prefetched + reducing - not_yet[home], self.block_lengths)
            # the state counts the block's gradients whole: a unit's backward runs before those
            # of the block's units before it (their gradients are not computed yet)
            trained_units = self.trainable[self.block_units]
            ran = np.cumsum(trained_units)
            block_start = np.repeat(ran[self.block_starts] - trained_units[self.block_starts],
                                    self.block_lengths)  # fmt: skip
            not_computed = ran - trained_units - block_start
            extra[self.block_units[whole]] = (per_block - not_computed)[whole]
        if self.num_blocks:
            np.maximum.at(largest, blocks[kept], held[kept])
        forward = forward + largest
        # backward: each stage's units in a row (unit order), walked from the last as the loop
        # does, in columns padded with zeros (which change no sum)
        order = np.argsort(stages, kind="stable")
        counts = np.bincount(stages, minlength=num_stages)
        starts = np.r_[0, np.cumsum(counts)[:-1]]
        column = np.arange(len(order)) - np.repeat(starts, counts)
        width = int(counts.max()) if len(counts) else 0
        row = stages[order]

        def table(values: Floats, reverse: bool) -> Floats:
            out = np.zeros((num_stages, width))
            at = np.repeat(counts, counts) - 1 - column if reverse else column
            out[row, at] = values[order]
            return out

        gradients = table(self.shard_gradients, reverse=False)
        total = np.cumsum(gradients, axis=1)[:, -1] if width else np.zeros(num_stages)
        # pending (gradients not allocated yet) at each unit from the last: the total less the
        # unit and those after it, subtracted one at a time
        pending = np.subtract.accumulate(
            np.c_[total, table(self.shard_gradients, reverse=True)], axis=1
        )[:, 1:]
        freed = np.cumsum(np.c_[np.zeros(num_stages), table(self.activations, True)], axis=1)
        beyond = (table(self.backward_memory + extra, True) - freed[:, :-1]) - pending
        beyond[np.arange(width)[None, :] >= counts[:, None]] = -np.inf
        backward: Floats = np.maximum(beyond.max(axis=1, initial=-np.inf), 0.0)
        return forward, backward
