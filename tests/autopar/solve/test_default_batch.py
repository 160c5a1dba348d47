"""The global batch when none is given (autopar.solve.limits.default_global_batch): 4M tokens on
accelerators, a step of seconds on CPU ranks, and always a multiple of the world size's odd
factor (3 CPU devices had no plan at all)."""

from __future__ import annotations

import autopar
from autopar.models import zoo
from autopar.solve.limits import DEFAULT_BATCH_TOKENS, default_global_batch


def test_accelerators_keep_four_million_tokens():
    assert default_global_batch(8192, 16) == 512  # 4,194,304 tokens
    assert default_global_batch(4096, 16384) == 1024
    assert default_global_batch(8192, 16, 1e15, 1e16) * 8192 == DEFAULT_BATCH_TOKENS  # no cap


def test_the_odd_factor_of_the_world_divides_it():
    for world in (1, 2, 3, 6, 12, 24, 48, 96, 384):
        batch = default_global_batch(8192, world)
        odd = world // (world & -world)
        assert batch % odd == 0 and batch * 8192 <= DEFAULT_BATCH_TOKENS
        assert batch * 8192 > DEFAULT_BATCH_TOKENS // 2  # the largest such batch


def test_a_cap_in_seconds_at_peak_bounds_the_batch():
    # 1e12 FLOPs a sequence, 4e12 FLOP/s: 1 s at peak holds 4 sequences
    assert default_global_batch(64, 2, 1e12, 4e12, max_step_at_peak_s=1.0) == 4
    assert default_global_batch(64, 3, 1e12, 4e12, max_step_at_peak_s=1.0) == 3


def test_three_cpu_devices_plan_a_step_of_seconds():
    model = zoo.build("llama-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=3)
    plan = autopar.parallelize(model, cluster, options=autopar.PlanOptions(sensitivity=False))
    assert plan.global_batch_size % 3 == 0
    assert plan.step_time_s < 10
    assert any("a step of seconds on CPU ranks" in note for note in plan.notes)
