"""Hugging Face models as users have them (issue 42, item 1): a ``PreTrainedModel`` with its
config's defaults (caches on) is traced as ``transformers`` trains it, ``use_cache=False`` on
every configuration its modules read, and left as it was. The zoo (tests/zoo/models.py) builds
every family with the defaults, so test_zoo checks that each compiles and matches; this file
checks what the trace sets and says."""

from __future__ import annotations

import json

from autopipe.ir import Graph
from autopipe.spec import load_example
from autopipe.report.summary import trace_settings_lines
from autopipe.tracing.export import trace
from autopipe.tracing.huggingface import huggingface_configs, traced_as_transformers_trains

from models import mlp


def test_a_stock_model_is_traced_without_its_cache_and_left_as_it_was():
    example = load_example("tests/zoo/models.py:llava")
    model = example.model
    configs = [model.config, model.config.text_config, model.config.vision_config]
    before = [getattr(c, "use_cache", None) for c in configs]
    assert model.config.text_config.use_cache is True  # the default, as from_config gives it
    graph = trace(example)
    assert graph.model.trace_settings == {"use_cache": False}
    assert [getattr(c, "use_cache", None) for c in configs] == before  # restored
    # the package's config.json is the model's own: its use_cache stays the default
    assert huggingface_configs(model)["config"]["text_config"].get("use_cache", True) is True
    (line,) = trace_settings_lines(graph)
    assert line.startswith("traced as transformers trains: use_cache=False")
    again = Graph.from_json(json.loads(graph.json_text()))
    assert again.model.trace_settings == {"use_cache": False}


def test_the_settings_are_restored_when_the_trace_fails():
    model = load_example("tests/zoo/models.py:gpt_j").model
    try:
        with traced_as_transformers_trains(model) as settings:
            assert settings == {"use_cache": False} and model.config.use_cache is False
            raise RuntimeError("export failed")
    except RuntimeError:
        pass
    assert model.config.use_cache is True


def test_other_models_and_configs_set_already_are_traced_as_they_are():
    model, args = mlp()
    with traced_as_transformers_trains(model) as settings:
        assert settings == {}
    example = load_example("tests/models.py:gpt2")  # its config sets use_cache=False itself
    graph = trace(example)
    assert graph.model.trace_settings == {} and not trace_settings_lines(graph)
    assert example.model.config.use_cache is False
