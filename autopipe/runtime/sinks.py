"""Where a run's metrics go besides the console and ``--log-json``: TensorBoard event files
(``--tensorboard DIR``, written through ``torch.utils.tensorboard``) and Weights & Biases runs
(``--wandb PROJECT``; with ``WANDB_MODE=offline`` a run directory under ``WANDB_DIR``, no network).

Copied into every generated pipeline as ``runtime/sinks.py``; it needs only torch. Each sink's
library is imported when its option asks for it, by the one rank that reports (the last stage's
of the first replica), which knows the loss. Scalars are named ``train/...``, ``eval/...`` and
``memory/...``; the run's options and the compiled plan are the run's configuration.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from collections.abc import Mapping
from typing import Any, Protocol

from .core.errors import PipelineRunError, first_line

__all__ = [
    "SINK_PACKAGES",
    "Sink",
    "TensorBoardSink",
    "WandbSink",
    "missing_package",
    "open_sinks",
]

#: a run configuration's values: what TensorBoard's hyperparameters and W&B's config both take
ConfigValue = str | int | float | bool

#: the package each sink's option needs, and what installs it
SINK_PACKAGES = {"--tensorboard": "tensorboard", "--wandb": "wandb"}


class Sink(Protocol):
    """A destination of the reporting rank's scalars."""

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """The scalars of training step ``step`` (evaluations carry the step they follow)."""

    def close(self) -> None:
        """Flush everything written and release the destination."""


def missing_package(option: str) -> str | None:
    """Why ``option``'s sink cannot be used here (its package is not installed), or None."""
    package = SINK_PACKAGES[option]
    if importlib.util.find_spec(package) is not None:
        return None
    return f"{option} needs the {package} package, which is not installed: pip install {package}"


class TensorBoardSink:
    """TensorBoard event files in ``directory``: each scalar under its name, the configuration
    as hyperparameters and as a text table. A resumed run purges the events a crashed attempt
    wrote after its checkpoint (``purge_step``), so each step's curve is drawn once."""

    def __init__(
        self, directory: str, configuration: Mapping[str, ConfigValue], resumed_at: int | None
    ):
        self.directory = directory
        module = _import("--tensorboard", "torch.utils.tensorboard")
        try:
            self.writer = module.SummaryWriter(log_dir=directory, purge_step=resumed_at)
            self.writer.add_text("run configuration", _markdown_table(configuration))
            self.writer.add_hparams(dict(configuration), {}, run_name=".")
        except OSError as exc:
            raise PipelineRunError(f"--tensorboard {directory}: {first_line(exc)}") from exc

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run of ``project`` with the configuration as its config; a resumed
    attempt is a run of its own, named for the step it resumed at. The W&B environment
    variables apply (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_ENTITY`` ...)."""

    def __init__(
        self,
        project: str,
        name: str,
        configuration: Mapping[str, ConfigValue],
        resumed_at: int | None,
    ):
        wandb = _import("--wandb", "wandb")
        if resumed_at is not None:
            name += f" (resumed at step {resumed_at})"
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                config=dict(configuration),
                dir=os.environ.get("WANDB_DIR"),
            )
        except Exception as exc:  # noqa: BLE001 - wandb raises its own errors for its service
            raise PipelineRunError(
                f"--wandb {project}: W&B did not start a run ({first_line(exc)}); without a "
                "network, set WANDB_MODE=offline (wandb sync uploads the run later)"
            ) from exc

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        # W&B stores NaN and infinities as strings; a skipped step's loss is NaN
        self.run.log({k: v for k, v in scalars.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(
    *,
    tensorboard: str | None,
    wandb: str | None,
    run_name: str,
    configuration: Mapping[str, ConfigValue],
    resumed_at: int | None,
) -> list[Sink]:
    """The sinks the options ask for (none when neither is given). ``resumed_at``: the step a
    resumed run starts at."""
    sinks: list[Sink] = []
    try:
        if tensorboard:
            sinks.append(TensorBoardSink(tensorboard, configuration, resumed_at))
        if wandb:
            sinks.append(WandbSink(wandb, run_name, configuration, resumed_at))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def _import(option: str, module: str) -> Any:
    """The module an option's sink writes through, or an error saying what to install."""
    problem = missing_package(option)
    if problem:
        raise PipelineRunError(problem)
    return importlib.import_module(module)


def _markdown_table(configuration: Mapping[str, ConfigValue]) -> str:
    rows = [f"| {name} | {value} |" for name, value in configuration.items()]
    return "\n".join(["| setting | value |", "|---|---|", *rows])
