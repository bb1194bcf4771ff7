"""The compile options (autopipe/options.py): each declared once, the command line built from the
declarations, and each checked once, by a rule the command line and the Python API share."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from autopipe.cli import build_parser
from autopipe.errors import AutopipeError
from autopipe.options import COUNT, OPTIONS, CompileOptions, Count, Fraction, flag_of

#: a value each ruled option rejects
BAD = {
    "stages": 0,
    "devices": 0,
    "profile": "fast",
    "method": "magic",
    "depth": -1,
    "basic_blocks": "GPT2Block",
    "keep_whole": ("encoder rnn",),
    "inline_blocks": 1,
    "bf16": "yes",
    "dynamic": "seq",
    "expected": {"seq": 1},
    "batch_dims": {"h0": -1},
    "link": "warp",
    "network": "carrier-pigeon",
    "schedule": "magic",
    "microbatches": 0,
    "optimizer": "adam",
    "dp_shard": 0,
    "tp": 0,
    "sequence_parallel": "sometimes",
    "accumulate": 0,
    "global_batch": 0,
    "memory_margin": 1.0,
    "max_stages_per_device": 0,
    "search_seconds": 0,
    "search_workers": 0,
    "split_points": "layers.4:middle",
    "gpus_per_node": 0,
}


def test_every_ruled_option_is_checked():
    ruled = {name for name, option in OPTIONS.items() if option.rule is not None}
    assert ruled == set(BAD)
    for name, value in BAD.items():
        with pytest.raises(AutopipeError):
            CompileOptions(**{"stages": 2, name: value})


def test_options_are_frozen_and_normalised():
    options = CompileOptions(stages=2, dynamic=["seq=x:1"])
    assert options.dynamic[0].name == "seq"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.stages = 3  # type: ignore[misc]


def test_one_rule_two_messages():
    with pytest.raises(
        argparse.ArgumentTypeError, match="^must be an integer of at least 1, got '0'$"
    ):
        COUNT.parse("0")
    with pytest.raises(AutopipeError, match="^--top must be an integer of at least 1, got 0$"):
        COUNT.check(0, "--top")
    assert Count(0).parse("0") == 0
    margin = Fraction("memory")
    with pytest.raises(argparse.ArgumentTypeError, match="^must be less than 1, got '1'$"):
        margin.parse("1")
    with pytest.raises(argparse.ArgumentTypeError, match="finite number of at least 0, got 'x'"):
        margin.parse("x")
    with pytest.raises(AutopipeError, match=r"fraction of memory in \[0, 1\), got 1"):
        margin.check(1, "--memory-margin")


def _actions(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


@pytest.mark.parametrize("command", ["compile", "plan", "trace", "profile", "partition"])
def test_cli_is_built_from_the_declarations(command):
    actions = _actions(command)
    given = [name for name in OPTIONS if name in actions]
    assert given, command
    for name in given:
        action = actions[name]
        assert action.option_strings == [flag_of(name)]
        assert action.default is None  # the default is CompileOptions'
        if not (command == "plan" and name == "devices"):
            assert action.help == OPTIONS[name].help
