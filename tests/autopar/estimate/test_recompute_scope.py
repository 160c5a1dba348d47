"""Recompute reaches the repeated blocks only, as the runtime wraps them
(`autopar.runtime.recompute.apply_recompute` over the blocks): the embedding, the head and
any other non-block layer keep their activations and re-run nothing, also with
recompute_layers None (every layer)."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import Estimator, build_tables
from autopar.estimate.stages import recomputed_layers
from autopar.models import zoo

BATCH = 8


@pytest.fixture(scope="module")
def estimator() -> Estimator:
    model = zoo.build("llama-tiny", device="meta")
    graph = autopar.trace(model, zoo.example_inputs("llama-tiny", model))
    cluster = Cluster.from_profile("local_cpu", num_devices=4)
    return Estimator(build_tables(graph), cluster, precision="fp32")


CONFIGS = [
    ParallelConfig(dp=4),
    ParallelConfig(dp=2, tp=2, sequence_parallel=True),
    ParallelConfig(fsdp=4, zero_stage=3),
    ParallelConfig(dp=2, pp=2, schedule="1f1b"),
]


@pytest.mark.parametrize("policy", ["selective", "full"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.as_text().split(" | ")[0])
def test_embedding_and_head_price_as_without_recompute(estimator, cfg, policy):
    """Per non-block layer, the recomputed config's forward, backward and recompute times and
    its activation bytes equal the config's without recompute."""
    rec_cfg = replace(cfg, recompute=policy)
    mesh = estimator.mesh(cfg)
    plain_t = estimator.layer_times(cfg, mesh)
    rec_t = estimator.layer_times(rec_cfg, mesh)
    rec = recomputed_layers(rec_cfg, estimator.chunks(rec_cfg, rec_t))
    others = [t for t in estimator.tables.layers if t.kind != "block"]
    assert {"embed_tokens", "lm_head"} <= {t.name for t in others}
    for table in others:
        plain = estimator.timer.stage_times(cfg, mesh, [table], plain_t)
        again = estimator.timer.stage_times(rec_cfg, mesh, [table], rec_t, rec)
        for term in ("forward", "backward", "recompute", "fsdp_comm"):
            assert again[term] == pytest.approx(plain[term], rel=1e-12, abs=0.0), (table, term)
        a = estimator.memory.stage_phases(cfg, [table], 1.0).peak()
        b = estimator.memory.stage_phases(rec_cfg, [table], 1.0, rec).peak()
        assert b.total_bytes == a.total_bytes, table.name


@pytest.mark.parametrize("policy", ["selective", "full"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.as_text().split(" | ")[0])
def test_every_layer_equals_every_block(estimator, cfg, policy):
    """recompute_layers None prices as recompute_layers = the blocks of the fullest chunk
    (every block named): same step time, breakdown and memory per stage."""
    every = estimator.evaluate(replace(cfg, recompute=policy), BATCH)
    chunks = cfg.pp * cfg.virtual_stages
    blocks = sum(t.kind == "block" for t in estimator.tables.layers)
    named = estimator.evaluate(
        replace(cfg, recompute=policy, recompute_layers=-(-blocks // chunks)), BATCH
    )
    assert every.step_time_s == pytest.approx(named.step_time_s, rel=1e-12)
    assert every.breakdown == pytest.approx(named.breakdown, rel=1e-12, abs=1e-15)
    assert [s.memory.total_bytes for s in every.stages] == [
        s.memory.total_bytes for s in named.stages
    ]
