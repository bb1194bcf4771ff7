"""Per-step metrics of a generated pipeline: console lines or a progress bar, JSON lines, and
the sinks of ``sinks.py`` (TensorBoard, Weights & Biases).

Copied into every generated pipeline as ``runtime/metrics.py``; it needs only torch. The rank of
the last stage of the first replica reports; every rank contributes its peak memory.

A ``--log-json`` line of a training step holds ``step``, ``loss``, ``time`` (seconds),
``samples_per_s``, ``lr``, ``grad_norm``, ``peak_memory`` and ``state_bytes`` (bytes, one per
rank, in rank order), and where known ``tokens_per_s``, ``mfu`` and ``skipped``. The lines of the
``--log-every`` steps also hold ``rank_times``, one entry per rank in rank order, each a mean per
step over the steps since the previous such line (``stragglers.RankTimes``)::

    {"rank": 2, "step": 0.41, "busy": 0.30, "planned": 0.17, "vs_plan": 1.8,
     "stages": [{"stage": 2, "forward": 0.11, "backward": 0.19, "planned": 0.17}]}

(seconds: ``step`` the rank's step time, ``busy`` its stages' forward and backward compute,
``planned`` what the plan predicts for it, ``vs_plan`` their ratio or null without a prediction),
and ``slowest_rank``, the rank slowest against its plan. An evaluation's line is described at
:meth:`Metrics.record_eval`.

Every line is valid JSON: a number that is not finite (the NaN loss of a skipped step, the
infinite perplexity of a huge loss) is written as null, and the line's ``not_finite`` names each
such field with the value it had (``{"loss": null, ..., "not_finite": {"loss": "nan"}}``). A run
that trains truncates or continues its log (see :class:`Metrics`); an evaluation alone
(``--eval-only``) only ever appends to it.
"""

from __future__ import annotations

import json
import math
import re
import resource
import sys
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO

import torch
import torch.distributed as dist
from torch import nn

from .core.memory import LiveTensorBytes
from .core.pipeline import PIPELINE_INNERMOST, Pipeline
from .evaluation import EvalResult
from .guards import is_step_log, write_atomically
from .options import TrainConfig
from .sinks import ConfigValue, Sink
from .stragglers import RankTimes, Stragglers, slowest
from .support import local_shard


def peak_memory(device: torch.device, tracker: LiveTensorBytes | None = None) -> int:
    """Bytes: the most CUDA memory allocated, the most tensor bytes ``tracker`` saw alive, or
    on CPU the process's peak resident size."""
    if tracker is not None:
        return tracker.peak
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def plan_device_problem(plan_device: str, device: torch.device) -> str | None:
    """Why this run cannot be compared with its plan, or None when it can. The plan's times and
    peak FLOP/s are those of the device spec it was made for (``plan_device``), so the run
    compares its stages' compute with the plan and shows its model FLOPs utilisation only on
    that device: on CUDA, a GPU whose name holds the spec's (``H100`` in ``NVIDIA H100 80GB
    HBM3``, or a spec ``autopipe calibrate`` named after the GPU); on the CPU, a calibrated CPU
    spec (named ``cpu...``, as ``--device-spec cpu`` and ``autopipe calibrate`` name one)."""
    if device.type == "cuda":
        running = torch.cuda.get_device_name(device)
        if _same_device(plan_device, running):
            return None
        how = "--device-spec cuda on this machine (it calibrates this GPU once)"
    else:
        if plan_device.lower().startswith("cpu"):
            return None
        running = f"the {device.type}"
        how = "--device-spec cpu (it calibrates this machine once, then keeps the spec)"
    return (
        f"the plan was made for {plan_device or 'an unknown device'}, this run is on {running}: "
        f"its stage times are not compared with the plan's and MFU is not shown; for a plan "
        f"of this machine, compile with {how}"
    )


def _same_device(spec: str, running: str) -> bool:
    """Whether a device spec's name names the GPU ``running``: each of its words is a word of
    the GPU's name, or two adjacent ones run together (``RTX4090`` in ``GeForce RTX 4090``)."""
    words = re.findall(r"[a-z0-9]+", spec.lower())
    gpu = re.findall(r"[a-z0-9]+", running.lower())
    known = set(gpu) | {a + b for a, b in zip(gpu, gpu[1:])}
    return bool(words) and all(word in known for word in words)


def state_bytes(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes this rank holds of its stages' parameters, gradients and optimizer state (only its
    shards where FSDP2 shards them)."""
    params = [p for module in modules for p in module.parameters()]
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
    return sum(local_shard(t).numel() * t.element_size() for t in tensors)


def gather_per_rank(value: int, device: torch.device) -> list[int]:
    """Every rank's ``value``, in rank order (collective)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [int(v) for v in torch.cat(every).tolist()]  # one copy to the host, not one a rank


class Metrics:
    """Prints and logs each step on the reporting rank; silent elsewhere."""

    def __init__(
        self,
        reporting: bool,
        steps: int,
        samples_per_step: int,
        tokens_per_step: int | None,
        log_json: str | None,
        log_every: int,
        resumed_at: int | None,
        utilisation: Callable[[float], float | None] = lambda seconds: None,
        sinks: Iterable[Sink] = (),
        stragglers: Stragglers | None = None,
        appends: bool = False,
        perplexity: bool = True,
    ):
        """``resumed_at``: the step a resumed run starts at; the log keeps the steps before it
        (its later lines were written after the checkpoint, and are trained again); a run that
        starts afresh replaces the log. ``appends``: the run adds to the log and changes none of
        its lines (an evaluation alone, ``--eval-only``: it trains no step again).
        ``utilisation(seconds)``: the model FLOPs utilisation of a step that long, or None.
        ``sinks``: where the scalars also go (the reporting rank's; closed by :meth:`close`).
        ``stragglers``: names a rank consistently slower than its peers, from the ranks' times.
        ``perplexity``: whether an evaluation's console line gives the loss's exponential (a
        loss over tokens, ``Pipeline.loss_over_tokens``); the log and the sinks always have it."""
        self.sinks = list(sinks)
        self.perplexity = perplexity
        self.stragglers = stragglers
        self.reporting = reporting
        self.utilisation = utilisation
        self.steps = steps
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.log_every = log_every
        self.bar = reporting and sys.stdout.isatty()
        self.log: IO[str] | None = None
        if reporting and log_json:
            # a file that is no run's log (replaced under --force) is written anew
            ours = not Path(log_json).exists() or is_step_log(Path(log_json))
            if resumed_at is not None and not appends and ours:
                _truncate_log(Path(log_json), resumed_at)
            mode = "a" if (resumed_at is not None or appends) and ours else "w"
            Path(log_json).parent.mkdir(parents=True, exist_ok=True)  # checked writable
            self.log = open(log_json, mode, encoding="utf-8")

    def record(
        self,
        step: int,
        loss: float,
        seconds: float,
        lr: float,
        grad_norm: float,
        memory: list[int],
        state: list[int],
        skipped: bool = False,
        times: Sequence[RankTimes] = (),
    ) -> None:
        """``memory``: every rank's peak bytes; ``state``: every rank's bytes of parameters,
        gradients and optimizer state; ``times``: every rank's step and compute times (at the
        ``--log-every`` steps), the slowest named on the line."""
        if not self.reporting:
            return
        samples_per_s = self.samples_per_step / seconds
        tokens_per_s = self.tokens_per_step / seconds if self.tokens_per_step else None
        mfu = self.utilisation(seconds)
        entry: dict[str, object] = {
            "step": step,
            "loss": loss,
            "time": seconds,
            "samples_per_s": samples_per_s,
            "lr": lr,
            "grad_norm": grad_norm,
            "peak_memory": memory,
            "state_bytes": state,
        }
        if tokens_per_s is not None:
            entry["tokens_per_s"] = tokens_per_s
        if mfu is not None:
            entry["mfu"] = mfu
        if skipped:
            entry["skipped"] = True
        late, slowness = slowest(times) if len(times) > 1 else (None, "")
        if times:
            entry["rank_times"] = [t.to_json() for t in times]
        if late is not None:
            entry["slowest_rank"] = late.rank
        self._to_log(entry)
        scalars = {
            "train/loss": loss,
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/step_time": seconds,
            "train/samples_per_s": samples_per_s,
        }
        if tokens_per_s is not None:
            scalars["train/tokens_per_s"] = tokens_per_s
        if mfu is not None:
            scalars["train/mfu"] = mfu
        for rank, (peak, held) in enumerate(zip(memory, state)):
            scalars[f"memory/peak_mib/rank{rank}"] = peak / 2**20
            scalars[f"memory/state_mib/rank{rank}"] = held / 2**20
        self._to_sinks(step, scalars)
        rate = f"{samples_per_s:.1f} samples/s" + (
            f", {tokens_per_s:.0f} tokens/s" if tokens_per_s is not None else ""
        )
        if mfu is not None:
            rate += f", MFU {mfu * 100:.3g}%"
        line = (
            f"step {step} loss {loss:.6f} ({seconds:.3f} s, {rate}, lr {lr:.3g}, "
            f"grad norm {grad_norm:.3g}, peak memory {max(memory) / 2**20:.0f} MiB)"
        )
        if late is not None:
            line += f", slowest {late.label} {slowness}"
        if self.bar:
            done = step + 1
            eta = (self.steps - done) * seconds
            print(
                f"\r{_bar(done, self.steps)} loss {loss:.4f} {rate} eta {eta:.0f} s ",
                end="" if done < self.steps else "\n",
                flush=True,
            )
        elif self.logs(step) or skipped:
            print(line + (" skipped: not finite" if skipped else ""), flush=True)
        straggler = self.stragglers.observe(times) if self.stragglers and times else None
        if straggler:
            self.note(straggler)

    def logs(self, step: int) -> bool:
        """Whether ``step`` is logged in full: every ``--log-every`` steps, and the last (the
        steps every rank's times are gathered at)."""
        return step % self.log_every == 0 or step == self.steps - 1

    def record_eval(self, done: int, result: EvalResult) -> None:
        """An evaluation after ``done`` optimizer steps: a JSON line ``{"step": done - 1,
        "eval_loss", "eval_perplexity", "eval_batches", "eval_time"}`` (after the training line
        of the same step), with ``eval_microbatches_without_labels`` where microbatches
        without label tokens were left out, and a console line."""
        if not self.reporting:
            return
        entry: dict[str, object] = {
            "step": done - 1,
            "eval_loss": result.loss,
            "eval_perplexity": result.perplexity,
            "eval_batches": result.batches,
            "eval_time": result.seconds,
        }
        if result.empty:
            entry["eval_microbatches_without_labels"] = result.empty
        self._to_log(entry)
        scalars = {
            "eval/loss": result.loss,
            "eval/perplexity": result.perplexity,
            "eval/time": result.seconds,
        }
        self._to_sinks(max(done - 1, 0), scalars)  # the sinks' steps start at 0
        when = f"after step {done - 1}" if done else "before training"  # steps count from 0
        left_out = (
            f", {result.empty} microbatch{'es' if result.empty > 1 else ''} without label "
            "tokens left out"
            if result.empty
            else ""
        )
        perplexity = f", perplexity {result.perplexity:.4g}" if self.perplexity else ""
        self.note(
            f"eval {when}: loss {result.loss:.6f}{perplexity} "
            f"({result.batches} held-out batch{'es' if result.batches > 1 else ''}, "
            f"{result.seconds:.3f} s{left_out})"
        )

    def progress(self, phase: str, done: int, total: int) -> None:
        """A progress bar of a long phase (an evaluation's batches), drawn over itself, where
        the reporting rank's terminal is interactive."""
        if not self.bar or total < 2:
            return
        print(
            f"\r{phase} {_bar(done, total)} ",
            end="" if done < total else "\r",
            flush=True,
        )

    def note(self, message: str) -> None:
        if self.reporting:
            print(("\n" if self.bar else "") + message, flush=True)

    def close(self) -> None:
        """Close the JSON log and every sink (the others even if one fails)."""
        if self.log:
            self.log.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks[:-1]:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - the next sink still gets closed
                print(f"train.py: warning: closing {type(sink).__name__}: {exc}", file=sys.stderr)
        if sinks:
            sinks[-1].close()

    def _to_log(self, entry: Mapping[str, object]) -> None:
        """A line of ``--log-json`` (:func:`json_line`), flushed at once (a crash keeps every
        line before it)."""
        if self.log:
            self.log.write(json_line(entry) + "\n")
            self.log.flush()

    def _to_sinks(self, step: int, scalars: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, scalars)


def run_configuration(
    pipeline: Pipeline, config: TrainConfig, world: int
) -> dict[str, ConfigValue]:
    """What a run's sinks record as its configuration: the compiled plan (stages, ranks, their
    mesh order unless it is the default, schedule, microbatches, predicted step time) and every
    train.py option as given."""
    plan = pipeline.plan
    settings: dict[str, ConfigValue] = {
        "model": pipeline.model_class,
        "plan/stages": pipeline.num_stages,
        "plan/ranks": pipeline.num_ranks,
        "plan/schedule": pipeline.schedule.name,
        "plan/microbatches": pipeline.default_microbatches,
        "plan/accumulate": pipeline.default_accumulate,
        "plan/dp_shard": pipeline.dp_shard,
        "world_size": world,
    }
    if pipeline.mesh != PIPELINE_INNERMOST:  # the order of the ranks, outermost first
        settings["plan/mesh"] = ",".join(pipeline.mesh)
    if plan is not None and plan.step_time:
        settings["plan/predicted_step_time"] = plan.step_time
        settings["plan/device"] = plan.device
    for name, value in sorted(vars(config).items()):
        if isinstance(value, frozenset):
            value = ",".join(str(v) for v in sorted(value))
        elif isinstance(value, tuple):  # --trace-steps A:B
            value = ":".join(str(v) for v in value)
        settings[f"option/{name}"] = "" if value is None else value
    return settings


def json_line(entry: Mapping[str, object]) -> str:
    """``entry`` as one line of strict JSON: each number that is not finite, at any depth, is
    null, and ``not_finite`` maps its field (``rank_times[1].vs_plan`` where nested) to the
    value it had (``"nan"``, ``"inf"``, ``"-inf"``)."""
    problems: dict[str, str] = {}

    def finite(value: object, where: str) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            problems[where] = str(value)
            return None
        if isinstance(value, Mapping):
            return {k: finite(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [finite(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    clean = finite(entry, "")
    assert isinstance(clean, dict)  # a mapping stays one
    if problems:
        clean["not_finite"] = problems
    return json.dumps(clean, allow_nan=False)


def _bar(done: int, total: int) -> str:
    """``[#####.....] 5/10``: a progress bar of 30 characters."""
    filled = round(30 * done / total) if total else 30
    return f"[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}"


def _truncate_log(path: Path, step: int) -> None:
    """Keep the lines of a JSON-lines log for steps before ``step`` (rewritten atomically)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by the crash
        if isinstance(entry, dict) and isinstance(entry.get("step"), int) and entry["step"] < step:
            kept.append(line + "\n")
    write_atomically(path, "".join(kept))
