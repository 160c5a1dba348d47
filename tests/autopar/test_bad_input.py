"""Bad input is refused with an error that names the problem and the numbers.

Profiles, degrees and untraceable models have their own tests (test_hardware, test_config,
tracing/test_trace_basic); here: shapes the degrees do not divide, and plan files that are
corrupt, truncated, of another schema version or not plans at all.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.models import zoo
from autopar.plan import Plan, PlanError


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama-tiny", device="meta")  # 4 heads, 2 kv heads, 2 layers
    return model, autopar.trace(model, zoo.example_inputs("llama-tiny", model))


@pytest.fixture(scope="module")
def moe():
    model = zoo.build("moe-tiny", device="meta")  # 4 experts
    return model, autopar.trace(model, zoo.example_inputs("moe-tiny", model))


def _evaluate(model_graph, world, **degrees):
    model, graph = model_graph
    cluster = autopar.Cluster.from_profile("local_cpu", num_devices=world)
    cfg = ParallelConfig(**degrees)
    return autopar.evaluate(model, cluster, cfg, global_batch_size=8, graph=graph)


@pytest.mark.parametrize(
    ("world", "degrees", "fragment"),
    [
        (8, {"tp": 8}, "tp=8 does not divide the model's 4 attention heads"),
        (4, {"tp": 4}, "tp=4 does not divide the model's 2 key/value heads"),
        (4, {"pp": 4}, "4 model chunks but the model has 2 repeated layers"),
        (2, {"pp": 2, "schedule": "interleaved_1f1b", "virtual_stages": 2}, "4 model chunks"),
        (2, {"dp": 2, "ep": 2}, "ep=2 does not divide the model's experts: it has no expert"),
        (3, {"cp": 3}, "cp=3 needs the sequence in 2 x cp = 6 equal chunks, but seq_len=32"),
    ],
)
def test_shapes_the_degrees_do_not_divide(llama, world, degrees, fragment):
    with pytest.raises(ConfigError) as err:
        _evaluate(llama, world, **degrees)
    assert fragment in str(err.value)
    assert "local_cpu" in str(err.value)


def test_experts_the_expert_degree_does_not_divide(moe):
    with pytest.raises(ConfigError, match="ep=8 does not divide the model's experts: it has 4"):
        _evaluate(moe, 8, dp=8, ep=8)
    assert _evaluate(moe, 8, dp=8, ep=4).config.ep == 4  # and a degree that divides passes


def test_every_shape_problem_is_named_at_once(llama):
    with pytest.raises(ConfigError) as err:
        _evaluate(llama, 3, tp=3)
    assert "4 attention heads" in str(err.value) and "2 key/value heads" in str(err.value)


@pytest.fixture(scope="module")
def plan_text(llama):
    return _evaluate(llama, 2, dp=2).to_json()


def test_a_saved_plan_loads_back_equal(plan_text):
    assert Plan.from_json(plan_text).to_json() == plan_text


@pytest.mark.parametrize(
    ("mangle", "fragment"),
    [
        (lambda t: t[: len(t) // 2], "not valid JSON (truncated or corrupt?)"),
        (lambda t: "\x00\x01" + t, "not valid JSON"),
        (lambda t: "[1, 2, 3]", "no schema_version: not an autopar plan"),
        (lambda t: json.dumps({"schema_version": 0}), "schema version 0 is not the"),
        (lambda t: _drop(t, "config"), "config must be an object, got None"),
        (
            lambda t: _edit(t, "config", {"tp": 2, "bogus": 1}),
            "unexpected keyword argument 'bogus'",
        ),
        (lambda t: _drop(t, "stages"), "stages must be a non-empty list, got None"),
    ],
)
def test_corrupt_plans_are_refused(plan_text, mangle, fragment):
    with pytest.raises(PlanError) as err:
        Plan.from_json(mangle(plan_text))
    assert fragment in str(err.value)


def _drop(text: str, key: str) -> str:
    data = json.loads(text)
    del data[key]
    return json.dumps(data)


def _edit(text: str, key: str, value) -> str:
    return json.dumps({**json.loads(text), key: value})
