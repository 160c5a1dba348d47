"""Plan.summary() and Plan.explain(): the axis mapping, the what-if lines and their direction."""

from __future__ import annotations

import pytest

import autopar
from autopar.models import zoo
from autopar.solve.whatif import scaled_cluster


def _plan(name: str, profile: str, nodes: int, batch: int) -> autopar.Plan:
    model = zoo.build(name, device="meta")
    cluster = autopar.Cluster.from_profile(profile, num_nodes=nodes)
    return autopar.parallelize(
        model, cluster, zoo.example_inputs(name, model), global_batch_size=batch
    )


@pytest.fixture(scope="module")
def plans() -> list[autopar.Plan]:
    return [
        _plan("gpt-tiny", "dgx_h100", 2, 64),
        _plan("llama-tiny", "dgx_a100_40g", 4, 128),
        _plan("moe-tiny", "dgx_h100", 2, 32),
    ]


def test_summary_maps_axes_onto_topology() -> None:
    model = zoo.build("llama-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    cfg = autopar.ParallelConfig(fsdp=8, zero_stage=3, tp=2, sequence_parallel=True)
    plan = autopar.evaluate(
        model, cluster, cfg, zoo.example_inputs("llama-tiny", model), global_batch_size=16
    )
    text = plan.summary()
    assert "tp=2     2 ranks inside one nvlink domain (the node)" in text
    assert "fsdp=8   8 ranks across 2 nodes over infiniband" in text
    assert "Sensitivity: not computed" in plan.explain()


def test_pipeline_axis_says_neighbouring_stages() -> None:
    model = zoo.build("gpt-tiny", device="meta")
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    cfg = autopar.ParallelConfig(dp=2, tp=4, pp=2, sequence_parallel=True)
    plan = autopar.evaluate(
        model, cluster, cfg, zoo.example_inputs("gpt-tiny", model), global_batch_size=8
    )
    assert "pp=2     neighbouring stages across 2 nodes over infiniband" in plan.summary()


def test_the_pipeline_axis_names_its_outermost_hop_not_the_whole_pipeline() -> None:
    """pp 4 x tp 8 on 4 nodes: each hop crosses two nodes, not the four the stages span; pp 4
    x tp 4 on 2 nodes: the hop between the nodes, not the first one inside a node."""
    from autopar.estimate.layout import mesh_axes

    wide = autopar.Cluster.from_profile("dgx_h100", num_nodes=4)
    (pp,) = [a for a in mesh_axes(wide, autopar.ParallelConfig(tp=8, pp=4)) if a["axis"] == "pp"]
    assert (pp["ranks"], pp["num_nodes"], pp["level"]) == ([0, 8], 2, "infiniband")
    two = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    (pp,) = [a for a in mesh_axes(two, autopar.ParallelConfig(tp=4, pp=4)) if a["axis"] == "pp"]
    assert (pp["ranks"], pp["num_nodes"], pp["level"]) == ([4, 8], 2, "infiniband")


def test_summary_and_explain_are_deterministic(plans: list[autopar.Plan]) -> None:
    for plan in plans:
        loaded = autopar.Plan.from_json(plan.to_json())
        assert loaded == plan
        assert loaded.summary() in plan.summary()  # the live plan adds only its timings line
        assert "planned in" not in loaded.summary() and "Timings" not in loaded.explain()


def test_explain_has_every_part(plans: list[autopar.Plan]) -> None:
    for plan in plans:
        text = plan.explain()
        for head in ("Bottleneck:", "Binding constraint:", "Memory: stage", "Divisibility:"):
            assert head in text
        assert "2x inter-node bandwidth:" in text and "+50% HBM:" in text
        if plan.alternatives:
            assert "Runners-up:" in text


def test_sensitivity_never_slower(plans: list[autopar.Plan]) -> None:
    for plan in plans:
        assert [e["what"] for e in plan.sensitivity] == ["2x inter-node bandwidth", "+50% HBM"]
        for entry in plan.sensitivity:
            assert entry["step_time_s"] <= plan.step_time_s * (1 + 1e-12)
            assert entry["same_config_step_time_s"] <= plan.step_time_s * (1 + 1e-12)


def test_one_node_has_no_inter_node_what_if() -> None:
    plan = _plan("gpt-tiny", "dgx_h100", 1, 32)
    assert plan.sensitivity[0]["skipped"].startswith("one node")
    assert "2x inter-node bandwidth: n/a" in plan.explain()


def test_scaled_cluster_touches_only_what_it_says() -> None:
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    fast = scaled_cluster(cluster, inter_node_bandwidth=2.0)
    nvlink, ib = cluster.profile.levels
    assert fast.profile.levels[0] == nvlink
    assert fast.profile.levels[1].bandwidth_bytes_per_s == 2 * ib.bandwidth_bytes_per_s
    big = scaled_cluster(cluster, memory=1.5)
    assert big.profile.device.memory_bytes == 1.5 * cluster.profile.device.memory_bytes
    assert big.profile.levels == cluster.profile.levels


def test_plan_plot_kinds(plans: list[autopar.Plan], tmp_path) -> None:
    for kind in ("pipeline", "memory", "breakdown"):
        assert plans[0].plot(kind, tmp_path / f"{kind}.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="unknown plot kind"):
        plans[0].plot("nope", tmp_path / "x.png")
