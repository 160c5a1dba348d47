"""Expert parallelism in the search space is what the runtime runs.

The runtime folds ep over the ranks holding different tokens (ep divides dp x fsdp x cp;
`autopar.runtime.parallelize._expert_groups`, `expert_parallel.build_expert_groups`). Every
config the space yields for an MoE model, in every axis order, is handed to the runtime's own
group construction under torch's fake process group (no ranks spawned): none is refused. A
config outside that fold is refused by `ParallelConfig.validate` with the numbers, and the
plan `parallelize` returns for an MoE model on 8 ranks (and its alternatives) validates. On 1
to 64 nodes, for the zoo MoE and transformers' Mixtral, Qwen3-MoE and DeepSeek-V3 presets, no
expert config of the space is one `runtime_problems` refuses, with its experts whole on every
tp rank or split over them (etp = tp).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import autopar
from autopar import ConfigError, ParallelConfig
from autopar.models import zoo
from autopar.runtime.mesh import build_mesh
from autopar.runtime.parallelize import _expert_groups
from autopar.solve.limits import space_limits
from autopar.solve.space import axis_orders, degree_choices


@pytest.fixture(scope="module")
def moe():
    model = zoo.build("moe-tiny", device="meta", num_experts=8)
    return model, autopar.trace(model, zoo.example_inputs("moe-tiny", model))


@pytest.mark.parametrize(("num_nodes", "per_node"), [(1, 8), (2, 8)])
def test_every_expert_config_of_the_space_builds_its_runtime_groups(moe, num_nodes, per_node):
    model, graph = moe
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes, devices_per_node=per_node)
    lim = space_limits(model, graph, cluster, global_batch_size=64)
    expert = [d for d in degree_choices(lim) if d[5] > 1]
    assert expert, "the space holds no expert-parallel degrees"
    assert {d[5] for d in expert} >= {2, 4, 8}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cluster.world_size)
    try:
        built = 0
        for dp, fsdp, cp, tp, pp, ep in expert:
            for order in axis_orders((dp, fsdp, cp, tp, pp, ep)):
                cfg = ParallelConfig(
                    dp=dp, fsdp=fsdp, cp=cp, tp=tp, pp=pp, ep=ep, axis_order=order,
                    zero_stage=1 if fsdp > 1 else 0,
                )  # fmt: skip
                cfg.validate(cluster)
                groups = _expert_groups(build_mesh(cfg, "cpu"), cfg)  # raises if refused
                assert groups is not None and dist.get_world_size(groups[0]) == ep
                built += 1
        assert built >= len(expert)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("degrees", "fragments"),
    [
        (
            {"dp": 2, "tp": 8, "ep": 4},
            ["ep=4 must divide the dp x fsdp x cp = 2 ranks", "got dp=2, fsdp=1, cp=1"],
        ),
        ({"fsdp": 2, "zero_stage": 3, "tp": 8, "ep": 4}, ["dp=1, fsdp=2, cp=1"]),
    ],
)
def test_expert_degrees_the_runtime_cannot_fold_are_refused(degrees, fragments):
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    with pytest.raises(ConfigError) as err:
        ParallelConfig(**degrees).validate(cluster)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_runtime_refuses_what_validate_refuses():
    """The runtime's own check, for a config the refusals name (validate not called)."""
    cfg = ParallelConfig(dp=2, tp=2, ep=4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match="ep=4 must divide 2"):
            _expert_groups(build_mesh(cfg, "cpu"), cfg)
    finally:
        dist.destroy_process_group()


def test_moe_plan_and_its_alternatives_run_on_the_runtime(moe):
    model, graph = moe
    cluster = autopar.Cluster.from_profile("dgx_h100", 2, devices_per_node=8)
    plan = autopar.parallelize(model, cluster, global_batch_size=64, graph=graph)
    plan.config.validate(cluster)
    texts = [plan.config.as_text()] + [a["config"] for a in plan.alternatives]
    for text in texts:  # "dp=8 fsdp=1 cp=1 tp=1 pp=2 ep=1 | ..."
        d = {k: int(v) for k, v in (kv.split("=") for kv in text.split("|")[0].split())}
        assert d["ep"] == 1 or (d["dp"] * d["fsdp"] * d["cp"]) % d["ep"] == 0, text


@pytest.mark.parametrize(
    "name", ["moe-tiny", "mixtral-tiny-hf", "qwen3-moe-tiny-hf", "deepseek-v3-tiny-hf"]
)
def test_no_expert_config_of_the_space_is_one_the_runtime_refuses(moe, name):
    """A property over the MoE zoo and transformers' MoE presets on 1 to 64 nodes: every
    expert-parallel config the planner's space yields (bounded by `runtime_limits`, as
    `parallelize` bounds it) validates on the cluster, folds ep over the token ranks and
    divides the experts, and `runtime_problems` finds nothing to refuse."""
    from autopar.models import hf
    from autopar.runtime.capability import runtime_limits, runtime_problems

    if name == "moe-tiny":
        model, graph = moe
    else:
        model = hf.build(name)
        graph = autopar.trace(model, hf.example_inputs(name, model, seq_len=64))
    num_experts = next(layer.moe.num_experts for layer in graph.layers if layer.moe)
    checked = split_checked = 0
    for nodes in (1, 8, 64):
        cluster = autopar.Cluster.from_profile("dgx_h100", nodes)
        lim = space_limits(model, graph, cluster, global_batch_size=512)
        lim, _ = runtime_limits(model, lim)
        for dp, fsdp, cp, tp, pp, ep in degree_choices(lim):
            if ep == 1:
                continue
            cfg = ParallelConfig(
                dp=dp, fsdp=fsdp, cp=cp, tp=tp, pp=pp, ep=ep, zero_stage=1 if fsdp > 1 else 0
            )
            cfg.validate(cluster)
            assert (dp * fsdp * cp) % ep == 0 and num_experts % ep == 0, cfg.as_text()
            assert not runtime_problems(model, cfg, lim.num_blocks), cfg.as_text()
            checked += 1
            # the experts split over tp, where the space offers it (inner_choices)
            assert lim.expert_width > 0, name  # every family here has Mixtral's layout
            if tp > 1 and lim.expert_width % tp == 0:
                split = replace(cfg, etp=tp)
                assert not runtime_problems(model, split, lim.num_blocks), split.as_text()
                split_checked += 1
    assert checked > 20 and split_checked > 5, (checked, split_checked)
