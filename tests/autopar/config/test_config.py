"""ParallelConfig validation against a Cluster."""

from __future__ import annotations

import pytest

from autopar import Cluster, ConfigError, ParallelConfig


@pytest.fixture(scope="module")
def h100x2() -> Cluster:
    return Cluster.from_profile("dgx_h100", num_nodes=2)


def test_valid_config_passes(h100x2):
    cfg = ParallelConfig(dp=2, tp=8, sequence_parallel=True)
    assert cfg.validate(h100x2) is cfg
    assert ParallelConfig(fsdp=4, zero_stage=3, tp=2, pp=2).validate(h100x2).world_size == 16


def test_world_size_mismatch_names_every_degree_and_the_world_size(h100x2):
    with pytest.raises(ConfigError) as err:
        ParallelConfig(dp=2, tp=4, pp=4, cp=2).validate(h100x2)
    message = str(err.value)
    for part in ("dp=2", "fsdp=1", "cp=2", "tp=4", "pp=4", "= 64", "world size 16", "dgx_h100"):
        assert part in message


def test_every_problem_is_reported_at_once():
    cfg = ParallelConfig(
        dp=3, tp=1, ep=2, zero_stage=2, schedule="interleaved_1f1b", sequence_parallel=True
    )
    problems = cfg.problems()
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "zero_stage=2 needs fsdp > 1" in text
    assert "needs at least 2 virtual_stages, got 1" in text
    assert "sequence_parallel needs tp > 1" in text
    assert "ep=2 must divide the dp x fsdp x cp = 3 ranks" in text


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tp": 0}, "tp must be an integer >= 1, got 0"),
        ({"fsdp": 2}, "fsdp=2 shards nothing with zero_stage=0"),
        ({"zero_stage": 4, "fsdp": 2}, "zero_stage must be 0, 1, 2 or 3, got 4"),
        ({"schedule": "pipedream"}, "schedule must be one of"),
        ({"recompute": "some"}, "recompute must be one of none, selective, full, got 'some'"),
        ({"pp": 2, "schedule": "dualpipe_v", "virtual_stages": 3}, "needs exactly 2"),
        ({"virtual_stages": 2}, "needs an interleaved or V schedule"),
    ],
)
def test_single_rule_violations(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ParallelConfig(**kwargs).validate()


def test_ep_refolds_the_data_parallel_ranks(h100x2):
    # ep is not a factor of the world size: 4-way expert parallel inside dp=4 x tp=2 x pp=2,
    # or inside dp=2 x fsdp=2 (the experts then sharded over the ranks holding the same ones)
    assert ParallelConfig(dp=4, tp=2, pp=2, ep=4).validate(h100x2).world_size == 16
    ParallelConfig(dp=2, fsdp=2, zero_stage=3, tp=2, pp=2, ep=4).validate(h100x2)
    # the runtime folds ep over dp x fsdp x cp only (Megatron-Core's fold over tp is not run)
    with pytest.raises(ConfigError, match="ep=8 must divide the dp x fsdp x cp = 2 ranks"):
        ParallelConfig(dp=2, tp=4, pp=2, ep=8).validate(h100x2)


def test_recompute_with_a_split_backward_schedule_is_refused():
    """zero_bubble and DualPipe-V run input and weight gradients as two backward passes:
    torch's selective checkpoint raises on the second, and full recompute re-runs the forward
    per pass; the config says so, and the search space leaves these pairs out."""
    from autopar.config import SPLIT_BACKWARD
    from autopar.solve.space import SpaceLimits, inner_choices

    for schedule, v in (("zero_bubble", 1), ("dualpipe_v", 2)):
        for recompute in ("full", "selective"):
            cfg = ParallelConfig(pp=2, schedule=schedule, virtual_stages=v, recompute=recompute)
            with pytest.raises(ConfigError, match=f"schedule {schedule} runs the input and"):
                cfg.validate()
        ParallelConfig(pp=2, schedule=schedule, virtual_stages=v).validate()
    ParallelConfig(pp=2, schedule="1f1b", recompute="selective").validate()
    lim = SpaceLimits(
        world_size=2, devices_per_node=2, global_batch_size=8, micro_batch_sizes=(1, 2),
        num_blocks=4, num_heads=4, num_kv_heads=4, num_experts=0, seq_len=64,
    )  # fmt: skip
    configs = list(inner_choices(lim, (1, 1, 1, 1, 2, 1)))
    assert {c.schedule for c in configs} >= set(SPLIT_BACKWARD)
    assert not [c for c in configs if c.schedule in SPLIT_BACKWARD and c.recompute != "none"]
    assert all(not c.problems() for c in configs)
