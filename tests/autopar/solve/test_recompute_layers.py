"""Per-layer recompute (ParallelConfig.recompute_layers): the search against brute force where
memory is tight, rediscovery of partial recompute, the estimator's monotone terms, the config's
checks and text, and plan JSON with and without the field.

The instance: gpt-tiny with 8 layers (hidden 256, seq 1024) on the round test machine with its
memory cut to a few hundred MiB, where no recompute does not fit and recomputing every layer
is slower than recomputing only some of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar import Cluster, ConfigError
from autopar import ParallelConfig as C
from autopar.estimate import Estimator, build_tables
from autopar.models import zoo
from autopar.plan import Plan
from autopar.solve.limits import attention_heads
from autopar.solve.space import (
    SpaceLimits,
    degree_choices,
    inner_choices,
    recompute_layer_choices,
    shape_problems,
)

MiB = 2**20
ROUND = Path(__file__).parents[1] / "estimate" / "round.toml"
LAYERS = 8


@pytest.fixture(scope="module")
def gpt():
    shape = {"num_layers": LAYERS, "hidden": 256, "num_heads": 4, "seq_len": 1024}
    model = zoo.build("gpt-tiny", device="meta", **shape)
    return model, autopar.trace(model, zoo.example_inputs("gpt-tiny", model))


def _cluster(
    tmp_path: Path, memory_mib: float, num_devices: int, host_copy: float | None = None
) -> Cluster:
    """The round machine with ``memory_mib`` per device; with ``host_copy`` (bytes/s) a
    reliability table stating it, so offloading can be priced (none without: not tried)."""
    profile = tmp_path / f"round_{memory_mib:g}_{host_copy}.toml"
    text = ROUND.read_text().replace("memory_bytes = 80e9", f"memory_bytes = {memory_mib * MiB}")
    if host_copy is not None:
        text += (
            "\n[reliability]\nfailure_rate_per_device_hour = 1e-5\nrestart_s = 60.0\n"
            "storage_bytes_per_s_per_device = 1e9\n"
            f"host_copy_bytes_per_s = {host_copy:g}\ncheckpoint_overhead_s = 1.0\n"
            'source = "test: a host link fast enough that offloading is nearly free"\n'
        )
    profile.write_text(text)
    return Cluster.from_profile(profile, num_devices=num_devices)


def _limits(graph, world: int, batch: int) -> SpaceLimits:
    return SpaceLimits(
        world_size=world,
        devices_per_node=world,
        num_blocks=LAYERS,
        num_heads=attention_heads(graph),
        seq_len=graph.input_shapes[0][-1],
        num_experts=0,
        global_batch_size=batch,
    )


# 330 MiB: PP2 (v=4) with full recompute of 1 block per chunk; 350 and 360: ZeRO-3 with selective
# recompute on 7 and 5 of 8
@pytest.mark.parametrize("memory_mib", [330, 350, 360])
def test_search_equals_brute_force_with_per_layer_recompute(gpt, tmp_path, memory_mib):
    model, graph = gpt
    cluster = _cluster(tmp_path, memory_mib, 2)
    plan = autopar.parallelize(model, cluster, global_batch_size=8, graph=graph)
    estimator = Estimator(build_tables(graph), cluster, options=autopar.PlanOptions().cost)
    limits = _limits(graph, 2, 8)
    best, count, partial = None, 0, 0
    for degrees in degree_choices(limits):
        for cfg in inner_choices(limits, degrees):
            for k in (None, *recompute_layer_choices(limits, cfg)):
                est = estimator.evaluate(replace(cfg, recompute_layers=k), 8)
                count += 1
                if est.peak_memory_bytes > cluster.profile.device.memory_bytes:
                    continue
                partial += k is not None
                if best is None or est.step_time_s < best.step_time_s:
                    best = est
    assert partial > 0  # the space holds per-layer configs that fit
    assert plan.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert plan.report["num_configs"] == count
    assert plan.config.recompute_layers is not None  # the tight memory asks for it


def test_offload_fallback_equals_brute_force_where_host_copies_are_cheap(gpt, tmp_path):
    """With a host link fast enough that copies cost nearly nothing, a config that keeps every
    activation and does not fit is priced again with the fewest offloaded blocks that fit, and
    that beats recomputing: the search's best equals brute force over every offload count."""
    model, graph = gpt
    cluster = _cluster(tmp_path, 330, 2, host_copy=1e15)
    plan = autopar.parallelize(model, cluster, global_batch_size=8, graph=graph)
    estimator = Estimator(build_tables(graph), cluster, options=autopar.PlanOptions().cost)
    limits = _limits(graph, 2, 8)
    capacity = cluster.profile.device.memory_bytes
    best = None
    for degrees in degree_choices(limits):
        for cfg in inner_choices(limits, degrees):
            ks = [(k, 0) for k in (None, *recompute_layer_choices(limits, cfg))]
            if cfg.recompute == "none":  # and every offload count
                ks += [(None, k) for k in range(1, limits.num_blocks // cfg.pp + 1)]
            for k, off in ks:
                try:
                    variant = replace(cfg, recompute_layers=k, offload_layers=off)
                    est = estimator.evaluate(variant, 8)
                except ConfigError:  # more blocks than a chunk holds
                    continue
                if est.peak_memory_bytes <= capacity and (
                    best is None or est.step_time_s < best.step_time_s
                ):
                    best = est
    assert plan.config.offload_layers > 0 and plan.config.recompute == "none"
    assert plan.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    offloaded = estimator.fewest_offloaded_layers(plan.config, 8, capacity)
    assert offloaded == plan.config.offload_layers  # the fewest that fit


def test_tight_memory_gets_partial_recompute(gpt, tmp_path):
    model, graph = gpt
    cluster = _cluster(tmp_path, 420, 1)
    plan = autopar.parallelize(model, cluster, global_batch_size=8, graph=graph)
    cfg = plan.config
    assert cfg.recompute != "none" and 0 < cfg.recompute_layers < LAYERS
    assert plan.fits
    summary = plan.summary()
    assert f"recompute={cfg.recompute}:{cfg.recompute_layers}" in summary
    assert f"first {cfg.recompute_layers} of {LAYERS}" in plan.explain()
    options = autopar.PlanOptions().cost
    every_layer = replace(cfg, recompute_layers=None)
    for other in (every_layer, replace(every_layer, recompute="full")):
        whole = autopar.evaluate(
            model, cluster, other, global_batch_size=8, graph=graph, options=options
        )
        assert plan.step_time_s < whole.step_time_s  # partial beats every layer recomputed
    none = replace(every_layer, recompute="none")
    nothing = autopar.evaluate(model, cluster, none, global_batch_size=8, graph=graph)
    assert not nothing.fits  # and recomputing nothing does not fit


@pytest.mark.parametrize(
    "base",
    [
        C(recompute="full"),
        C(fsdp=2, zero_stage=3, recompute="full"),
        C(pp=2, schedule="interleaved_1f1b", virtual_stages=2, recompute="selective"),
    ],
    ids=["pp1", "zero3", "pp2v2"],
)
def test_memory_falls_and_time_rises_with_recomputed_layers(gpt, base):
    _, graph = gpt
    world = base.world_size
    cluster = Cluster.from_profile(ROUND, num_devices=world)
    estimator = Estimator(build_tables(graph), cluster)
    top = recompute_layer_choices(_limits(graph, world, 8), base)[-1]
    assert top == LAYERS // (base.pp * base.virtual_stages)
    ests = [estimator.evaluate(replace(base, recompute_layers=k), 8) for k in range(1, top + 1)]
    memory = [e.peak_memory_bytes for e in ests]
    times = [e.step_time_s for e in ests]
    recompute = [e.breakdown["recompute"] for e in ests]
    assert memory == sorted(memory, reverse=True) and memory[0] > memory[-1]
    assert times == sorted(times) and times[0] < times[-1]
    # one more recomputed block per chunk adds the same recompute time each time
    steps = [b - a for a, b in zip(recompute, recompute[1:], strict=False)]
    assert steps == pytest.approx([recompute[0]] * len(steps), rel=1e-9)
    for cap in sorted(set(memory)):  # the bisection finds the smallest k that fits
        want = next(k for k, m in enumerate(memory, 1) if m <= cap)
        assert estimator.fewest_recomputed_layers(replace(base), 8, cap) == want
    assert estimator.fewest_recomputed_layers(base, 8, min(memory) - 1) is None


def test_unset_recompute_layers_prices_as_before(gpt):
    _, graph = gpt
    estimator = Estimator(build_tables(graph), Cluster.from_profile(ROUND, num_devices=2))
    cfg = C(fsdp=2, zero_stage=3, recompute="full")
    a, b = estimator.evaluate(cfg, 8), estimator.evaluate(C(**cfg.to_dict()), 8)
    assert a == b and "recompute_layers" not in cfg.to_dict()
    # every block per chunk recomputed: the blocks' terms are the all-layer config's
    every = estimator.evaluate(replace(cfg, recompute_layers=LAYERS), 8)
    assert every.step_time_s <= a.step_time_s  # all-layer also re-runs embedding and head


def test_bad_recompute_layers_are_refused_with_the_numbers(gpt):
    _, graph = gpt
    problems = C(recompute="full", recompute_layers=0).problems()
    assert problems == ["recompute_layers must be None or an integer >= 1, got 0"]
    problems = C(recompute_layers=3).problems()
    assert problems == ["recompute_layers=3 needs recompute full or selective, got recompute=none"]
    cfg = C(pp=2, recompute="full", recompute_layers=5)
    (problem,) = shape_problems(cfg, _limits(graph, 2, 8))
    assert "recompute_layers=5" in problem and "at most 4 of the model's 8" in problem
    estimator = Estimator(build_tables(graph), Cluster.from_profile(ROUND, num_devices=2))
    with pytest.raises(ConfigError, match="recompute_layers=5 but the fullest of the 2"):
        estimator.evaluate(cfg, 8)


def test_text_and_plan_json(gpt, tmp_path):
    model, graph = gpt
    cfg = C(dp=2, recompute="selective", recompute_layers=3)
    assert cfg.as_text().endswith("recompute=selective:3")
    assert C(recompute="full").as_text().endswith("recompute=full")
    cluster = Cluster.from_profile(ROUND, num_devices=2)
    plan = autopar.evaluate(model, cluster, cfg, global_batch_size=8, graph=graph)
    loaded = Plan.from_json(plan.to_json())
    assert loaded.config == cfg and loaded.to_json() == plan.to_json()
    old = autopar.evaluate(model, cluster, C(dp=2), global_batch_size=8, graph=graph)
    data = json.loads(old.to_json())
    assert "recompute_layers" not in data["config"]  # unchanged plan.json for unset configs
    assert Plan.from_json(old.to_json()).config.recompute_layers is None


def test_plan_communication_counts_the_recompute_of_the_first_k_blocks_only():
    # TP2 without SP, full recompute: a recomputed block all-reduces 3 times per micro-batch
    model = zoo.build("gpt-tiny", num_layers=8)
    cluster = Cluster.from_profile("local_cpu", 1, num_devices=4)
    cfg = C(tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2, recompute="full")
    thrice = []
    for k in (None, 1):
        plan = autopar.evaluate(
            model,
            cluster,
            replace(cfg, recompute_layers=k),
            zoo.example_inputs("gpt-tiny", model),
            global_batch_size=4,
        )
        thrice.append(
            [
                sorted({c["layer"] for c in st if c["part"] == "tp" and c["count"] == 3 * 4})
                for st in plan.communication
            ]
        )
    every = [[f"blocks.{i}" for i in (0, 1, 4, 5)], [f"blocks.{i}" for i in (2, 3, 6, 7)]]
    assert thrice == [every, [["blocks.0", "blocks.4"], ["blocks.2", "blocks.6"]]]
