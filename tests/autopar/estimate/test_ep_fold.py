"""Expert parallelism folded over the tensor-parallel ranks (Megatron-Core's MoE parallel
folding, `ParallelConfig.ep_folds_over_tp`): ep may exceed dp x fsdp x cp where each tp rank
holds its own sequence shard and whole experts; the expert layers then regroup the stage's
ranks as ep (innermost) x the experts' replicas. Priced, searched for the stacks that run it,
refused by name on autopar's runtime, and written for Megatron without a folding gap."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar import ConfigError, ParallelConfig
from autopar.codegen.export import export_plan
from autopar.estimate.memory import expert_replicas, token_summed_params
from autopar.estimate.mesh import expert_data_ranks, expert_ranks
from autopar.models import zoo
from autopar.solve.limits import space_limits
from autopar.solve.space import degree_choices, inner_choices

FOLD = ParallelConfig(fsdp=4, zero_stage=1, tp=2, ep=8, sequence_parallel=True)


def test_the_fold_needs_sequence_shards_and_whole_experts():
    assert FOLD.ep_folds_over_tp and not FOLD.problems()
    for bad in ({"sequence_parallel": False}, {"etp": 2}):
        cfg = ParallelConfig(**{**FOLD.to_dict(), **bad})
        assert not cfg.ep_folds_over_tp
        assert any("or dp x fsdp x cp x tp = 8 with etp=1 and sequence_parallel" in p
                   for p in cfg.problems())  # fmt: skip
    inside = ParallelConfig(fsdp=4, zero_stage=1, tp=2, ep=4, sequence_parallel=True)
    assert not inside.ep_folds_over_tp  # ep fits the data ranks: the runtime's fold
    with pytest.raises(ConfigError, match="ep=16 must divide"):
        ParallelConfig(fsdp=4, zero_stage=1, tp=2, ep=16, sequence_parallel=True).validate()


def test_the_fold_groups_ep_innermost_and_sums_experts_over_their_replicas_only():
    wide = ParallelConfig(fsdp=8, zero_stage=1, tp=2, ep=8, sequence_parallel=True)
    assert not wide.ep_folds_over_tp  # 8 divides fsdp: over the token ranks
    fold = ParallelConfig(dp=2, fsdp=4, zero_stage=1, tp=2, ep=16, sequence_parallel=True)
    assert fold.ep_folds_over_tp
    assert expert_ranks(fold) == tuple(range(16))  # tp innermost, then fsdp: 16 ranks
    assert expert_data_ranks(fold) == (0,)  # 16 ranks hold 16 ep ranks: no replica
    assert expert_replicas(fold) == 1
    assert expert_data_ranks(FOLD) == (0,) and expert_replicas(FOLD) == 1
    half = ParallelConfig(dp=2, fsdp=4, zero_stage=1, tp=2, ep=8, sequence_parallel=False)
    assert not half.ep_folds_over_tp
    model = zoo.build("moe-tiny", device="meta", num_experts=16)
    tables = autopar.estimate.build_tables(
        autopar.trace(model, zoo.example_inputs("moe-tiny", model))
    )
    layers = list(tables.layers)
    routers = sum(t.params_router for t in layers) / fold.fsdp
    # folded, each tp rank holds other experts: only the routers are summed over tp
    assert token_summed_params(fold, layers) == pytest.approx(routers)
    unfolded = ParallelConfig(dp=2, fsdp=4, zero_stage=1, tp=2, ep=8, sequence_parallel=True)
    assert token_summed_params(unfolded, layers) > routers


def test_the_fold_is_priced_on_megatron_core_refused_on_autopars_runtime_and_exported():
    model = zoo.build("moe-tiny", device="meta", num_experts=8)
    graph = autopar.trace(model, zoo.example_inputs("moe-tiny", model))
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=8)
    plan = autopar.evaluate(
        model, cluster, FOLD, global_batch_size=8, graph=graph, stack="megatron-core"
    )
    assert plan.breakdown["ep_comm"] > 0
    with pytest.raises(ConfigError, match="ep=8 folds over the tp ranks too .* Megatron-Core"):
        autopar.evaluate(model, cluster, FOLD, global_batch_size=8, graph=graph)
    gaps = export_plan(plan, "megatron").gaps
    assert not any("Megatron folds the experts" in g for g in gaps)
    # the space offers the fold where the stack runs it (SpaceLimits.ep_over_tp, set by
    # parallelize for every stack but autopar's own), each config valid
    lim = space_limits(model, graph, cluster, 8)
    ours = [c for d in degree_choices(lim) for c in inner_choices(lim, d)]
    theirs_lim = replace(lim, ep_over_tp=True)
    theirs = [c for d in degree_choices(theirs_lim) for c in inner_choices(theirs_lim, d)]
    assert not any(c.ep_folds_over_tp for c in ours)
    folds = [c for c in theirs if c.ep_folds_over_tp]
    assert folds and all(not c.problems(cluster) for c in folds)
    assert all(c.sequence_parallel and c.etp == 1 for c in folds)
    assert {c for c in theirs if not c.ep_folds_over_tp} == set(ours)
