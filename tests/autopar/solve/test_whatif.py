"""What-ifs re-plan on a changed cluster: the bounded search (the chosen config's time as the
incumbent) must find exactly what a full search of the changed cluster finds."""

from __future__ import annotations

import pytest

import autopar
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.models import zoo
from autopar.solve.limits import space_limits
from autopar.solve.search import search
from autopar.solve.whatif import scaled_cluster, sensitivity


@pytest.mark.parametrize("profile, nodes", [("dgx_h100", 2), ("dgx_a100_40g", 2)])
def test_bounded_what_ifs_equal_full_searches(profile, nodes):
    model = zoo.build("gpt-tiny", device="meta", num_layers=8, hidden=512, num_heads=8)
    graph = autopar.trace(model, zoo.example_inputs("gpt-tiny", model))
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile(profile, nodes)
    limits = space_limits(model, graph, cluster, 64)
    options = CostOptions()
    base = Estimator(tables, cluster, options=options)
    best = search(base, limits).best
    got = sensitivity(tables, cluster, limits, best, precision="bf16", optimizer="adamw",
                      options=options)  # fmt: skip
    changed = [
        scaled_cluster(cluster, inter_node_bandwidth=2.0),
        scaled_cluster(cluster, memory=1.5),
    ]
    assert len(got) == 2
    for entry, where in zip(got, changed, strict=True):
        full = search(Estimator(tables, where, options=options), limits).best
        # never slower than the chosen config re-priced, and as fast as the full search
        assert entry["step_time_s"] <= entry["same_config_step_time_s"]
        assert entry["step_time_s"] == pytest.approx(
            min(full.step_time_s, entry["same_config_step_time_s"]), rel=1e-12
        )
