"""Clusters of several sites and the training algorithms priced over them (issue 48).

The sites level prices what crosses the wide-area link (a data-parallel sum, a pipeline hop)
at the link's share per device; DiLoCo's cross-site bytes are the synchronous gradient sum's
divided by H exactly (fp32 gradients and pseudo-gradients); fault-tolerant groups lose less
to failures than checkpoint-restart; bad inputs are refused naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import autopar
from autopar.config import ParallelConfig as C
from autopar.errors import ProfileError
from autopar.estimate.algorithms import (
    AlgorithmOptions,
    cross_site_bytes,
    ft_step_cost,
    outer_allreduce_s,
    price_diloco,
    price_ft,
    price_sync,
)
from autopar.estimate.mesh import MeshGroups
from autopar.models import zoo
from cost_models.comm import flat_chunks

SHAPE = dict(vocab_size=32000, seq_len=2048, num_layers=8, hidden=2048, ffn_hidden=5632)
SHAPE |= dict(num_heads=16, num_kv_heads=8)


def two_sites(gbps: float = 100.0, nodes: int = 2) -> autopar.Cluster:
    return autopar.Cluster.from_profile("dgx_h100", nodes, sites=2, site_link_gbps=gbps)


@pytest.fixture(scope="module")
def model_and_ids():
    model = zoo.build("llama-tiny", device="meta", **SHAPE)
    (ids,) = zoo.example_inputs("llama-tiny", model)
    return model, ids


def test_groups_crossing_sites_run_over_the_link():
    c = two_sites(100.0)
    assert (c.level_of([0, 7]), c.level_of([0, 8])) == ("nvlink", "sites")
    # each of a site's 8 devices gets 1/8 of the 12.5 GB/s uplink at 80%: 1.25 GB/s
    est = c.collective_time("send_recv", 1.25e9, [0, 8])
    assert est.time_s == pytest.approx(1.0 + 0.01, rel=0.02)
    one = c.one_site()
    assert (one.world_size, one.sites, one.level_of([0, 7])) == (8, 1, "nvlink")
    same = autopar.Cluster.from_profile("dgx_h100", 2)
    assert c.collective_time("all_reduce", 1e6, range(8)).time_s == pytest.approx(
        same.collective_time("all_reduce", 1e6, range(8)).time_s
    )


def test_each_pipeline_hop_is_priced_on_its_own_link():
    """pp=4 over 2 sites of 2 nodes: stage 1's hop to stage 2 crosses the sites, stage 0's and
    stage 2's stay in a site, and the wrap from stage 3 to stage 0 crosses back; each hop is
    priced on its own link."""
    c = two_sites(100.0, nodes=2)
    mesh = MeshGroups(c, C(pp=4, tp=4))
    pairs = [mesh.ranks[f"pp_hop{s}"] for s in range(4)]
    assert pairs == [(0, 4), (4, 8), (8, 12), (12, 0)]
    times = mesh.hop_times("send_recv", 1e8)
    assert times == tuple(c.collective_time("send_recv", 1e8, p).time_s for p in pairs)
    assert times[1] == times[3] > 2 * times[0] and times[0] == times[2]
    assert MeshGroups(c.one_site(), C(pp=2, tp=4)).ranks["pp_hop0"] == (0, 4)


def test_diloco_moves_one_h_th_of_the_synchronous_gradient_sum(model_and_ids):
    model, ids = model_and_ids
    # one device a site: dp's two ranks on the two sites, every gradient crosses once (with
    # tp the replicated norms would cross once per tp rank, as the runtime sums them)
    c = autopar.Cluster.from_profile("dgx_h100", 2, devices_per_node=1, sites=2, site_link_gbps=100)
    cfg = C(dp=2)
    plan = autopar.evaluate(
        model, c, cfg, (ids,), global_batch_size=16, precision="fp32", optimizer="adamw"
    )
    sync_bytes = cross_site_bytes(plan.communication, cfg, c)
    # a two-party ring moves the whole buffer each way: all fp32 gradients, and the clip's
    # 16-byte sum over the world
    assert sync_bytes == pytest.approx(plan.num_params * 4 + 16, rel=1e-9)
    options = AlgorithmOptions(outer_bytes_per_param=4.0)
    dl = price_diloco(
        plan.step_time_s, cfg, 16 * 2048, 1e12, c, None, plan.num_params, "adamw", options, 8, 1
    )
    assert dl.cross_site_bytes_per_step == pytest.approx((sync_bytes - 16) / 8, rel=1e-12)
    # blocking: the outer all-reduce (the link at 80%, 2 messages' latency) over 8 steps
    outer = plan.num_params * 4 / (12.5e9 * 0.8) + 2 * 0.01
    assert outer_allreduce_s(plan.num_params, c, options) == pytest.approx(outer)
    assert dl.step_time_s == pytest.approx(plan.step_time_s + outer / 8)
    streaming = price_diloco(
        plan.step_time_s, cfg, 16 * 2048, 1e12, c, None, plan.num_params, "adamw", options, 8, 4
    )
    hidden = max(0.0, outer - 8 * plan.step_time_s)
    assert streaming.step_time_s == pytest.approx(plan.step_time_s + hidden / 8)
    assert dl.token_multiplier == 1.05 and dl.time_to_budget_s > 0


def test_a_diloco_failure_stops_every_group_until_the_failed_one_is_back():
    """Every outer step takes every group (the runtime's DiLoCo Manager asks for all), so a
    failure costs the whole job the failed group's restart, the inner steps it redoes since
    the last fragment sync (H / 2F on average) and its heal -- not one group's share of them,
    as where the others could step on without it (fault-tolerant groups)."""
    c = autopar.Cluster.from_profile("dgx_h100", 32, sites=2, site_link_gbps=100)  # 256 GPUs
    rel = c.profile.reliability
    options = AlgorithmOptions()
    args = (5.0, C(dp=2, fsdp=16, tp=8), 4e6, 1e12, c, rel, 70e9, "adamw", options, 500)
    blocking, streaming = price_diloco(*args, 1), price_diloco(*args, 4)
    rate = c.world_size * rel.failure_rate_per_device_hour / 3600
    heal = blocking.extra["heal_s"]
    assert blocking.goodput == pytest.approx(1 - rate * (rel.restart_s + 500 * 5.0 / 2 + heal))
    assert streaming.goodput == pytest.approx(1 - rate * (rel.restart_s + 500 * 5.0 / 8 + heal))
    assert blocking.goodput < streaming.goodput < 1


def test_fault_tolerant_groups_lose_less_than_a_restart():
    c = autopar.Cluster.from_profile("dgx_h100", 128)
    rel = c.profile.reliability
    cfg = C(dp=8, fsdp=16, tp=8)
    sync = price_sync(10.0, cfg, 4e6, 0.0, 0.99, 1e12)
    ft = price_ft(10.0, cfg, 4e6, 0.0, 1e12, c, rel, 70e9, "adamw", 8, timeout_s=30.0)
    # failures a second on 1,024 H100, each costing the timeout, the step in flight and 1/8
    # of the group's restart and heal
    rate = 1024 * rel.failure_rate_per_device_hour / 3600
    heal = ft.extra["heal_s"]
    assert ft.goodput == pytest.approx(1 - rate * (30.0 + 10.0 + (rel.restart_s + heal) / 8))
    assert ft.goodput > sync.goodput
    assert ft.time_to_budget_s < sync.time_to_budget_s


def test_a_rejoining_group_costs_diloco_all_of_it_and_ft_groups_their_share(tmp_path):
    """The restarted group's rejoining (its first quorum and the heal's set-up,
    `Reliability.rejoin_s`) comes on top of its restart: every DiLoCo group waits for it at the
    outer step, while fault-tolerant groups lose one group's share of it; a profile that does
    not state it prices 0, and a negative one is refused."""
    c = autopar.Cluster.from_profile("dgx_h100", 32, sites=2, site_link_gbps=100)
    rel = c.profile.reliability
    assert rel.rejoin_s == 0.0  # not measured for the GPU profiles
    slow = replace(rel, rejoin_s=120.0)
    cfg = C(dp=2, fsdp=16, tp=8)
    rate = c.world_size * rel.failure_rate_per_device_hour / 3600
    args = (5.0, cfg, 4e6, 1e12, c)
    tail = (70e9, "adamw", AlgorithmOptions(), 500, 4)
    before, after = price_diloco(*args, rel, *tail), price_diloco(*args, slow, *tail)
    assert before.goodput - after.goodput == pytest.approx(rate * 120.0)
    ft = [price_ft(*args[:4], 1e12, c, r, 70e9, "adamw", 2) for r in (rel, slow)]
    assert ft[0].goodput - ft[1].goodput == pytest.approx(rate * 120.0 / 2)
    assert "120.0 s more to rejoin" in ft[1].detail and "rejoin" not in ft[0].detail
    assert autopar.Cluster.from_profile("local_cpu", num_devices=2).profile.reliability.rejoin_s
    text = (
        Path(c.profile.path)
        .read_text()
        .replace("[reliability]\n", "[reliability]\nrejoin_s = -1.0\n")
    )
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    with pytest.raises(ProfileError, match=r"reliability.rejoin_s: must be >= 0, got -1"):
        autopar.Cluster.from_profile(bad, num_devices=8)


def test_torchft_adds_its_exposed_all_reduce_and_control_to_each_step():
    """The groups' gradient all-reduce runs after the backward, in the runtime's flat chunks
    (`flat_chunks`, as its other gradient syncs): its time over the
    groups (the plan's dp axis) less what the synchronous step already exposed, plus the
    quorum and commit; a step priced with it is that much longer, and its goodput and time to
    the budget follow."""
    c = autopar.Cluster.from_profile("dgx_h100", 16)
    cfg = C(dp=4, fsdp=32)
    grads = 70e9 * 4 / 32  # a rank's fp32 gradient shards of 70 B parameters
    cost, reduce = ft_step_cost(cfg, c, grads, 0.0, 0.005)
    mesh = MeshGroups(c, cfg)
    chunks = flat_chunks(grads)
    assert len(chunks) > 1
    want = sum(mesh.time("all_reduce", chunk, "dp") for chunk in chunks)
    assert reduce == pytest.approx(want) and cost == pytest.approx(reduce + 0.005)
    assert reduce > mesh.time("all_reduce", grads, "dp")  # each chunk's latency
    # what the synchronous step already exposed is not paid twice, and never below the RPCs
    assert ft_step_cost(cfg, c, grads, reduce / 2, 0.005)[0] == pytest.approx(cost - reduce / 2)
    assert ft_step_cost(cfg, c, grads, 1e3, 0.005)[0] == pytest.approx(0.005)
    rel = c.profile.reliability
    plain = price_ft(10.0, cfg, 4e6, 0.0, 1e12, c, rel, 70e9, "adamw", 4)
    paid = price_ft(10.0, cfg, 4e6, 0.0, 1e12, c, rel, 70e9, "adamw", 4, step_cost_s=cost)
    assert paid.step_time_s == pytest.approx(10.0 + cost)
    assert paid.time_to_budget_s / plain.time_to_budget_s == pytest.approx(
        (10.0 + cost) / 10.0 * plain.goodput / paid.goodput
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_nodes=3, sites=2, site_link_gbps=100), "do not split over 2 sites"),
        (dict(num_nodes=2, sites=2), "need site_link_gbps > 0"),
        (dict(num_nodes=2, sites=0, site_link_gbps=100), "sites must be an integer >= 1"),
        (dict(num_nodes=2, sites=2, site_link_gbps=-1), "need site_link_gbps > 0"),
    ],
)
def test_bad_sites_are_refused(kwargs, message):
    with pytest.raises(ProfileError, match=message):
        autopar.Cluster.from_profile("dgx_h100", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(choose="local-sgd"), "choose must be auto, sync, ft or diloco"),
        (dict(token_budget=0), "token_budget must be > 0"),
        (dict(inner_steps=(0,)), "inner_steps must be whole numbers >= 1"),
        (dict(diloco_token_overhead=-0.1), "diloco_token_overhead must be in"),
    ],
)
def test_bad_algorithm_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AlgorithmOptions(**kwargs)
