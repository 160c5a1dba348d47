"""Uneven pipeline stage boundaries: the partition is optimal and the planner uses it."""

from __future__ import annotations

import itertools
import random

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.stages import linear_partition
from autopar.models import zoo


def _brute_force(weights: list[float], parts: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def test_linear_partition_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        weights = [rng.uniform(0.1, 5.0) for _ in range(n)]
        sizes = linear_partition(weights, parts)
        assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == n
        starts = list(itertools.accumulate([0, *sizes]))
        worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(starts))
        assert worst == pytest.approx(_brute_force(weights, parts), rel=1e-9)


def test_heavy_head_gets_a_shorter_last_stage():
    # a 128k vocabulary on a 1k-wide model: the head costs about as much as ten blocks
    model = zoo.build("llama-tiny", device="meta", vocab_size=131072, num_layers=8, hidden=1024,
                      num_heads=8, num_kv_heads=2, ffn_hidden=2816, seq_len=2048)  # fmt: skip
    tables = build_tables(autopar.trace(model, zoo.example_inputs("llama-tiny", model)))
    cluster = Cluster.from_profile("dgx_h100", num_devices=2)
    cfg = ParallelConfig(pp=2)
    even = Estimator(tables, cluster).evaluate(cfg, 16)
    balanced = Estimator(tables, cluster, options=CostOptions(balance_stages=True)).evaluate(
        cfg, 16
    )
    blocks = [sum(1 for name in s.layers if name.startswith("layers.")) for s in balanced.stages]
    assert [sum(1 for n in s.layers if n.startswith("layers.")) for s in even.stages] == [4, 4]
    assert blocks[0] > blocks[1]
    assert balanced.step_time_s < even.step_time_s
