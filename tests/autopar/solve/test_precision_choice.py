"""precision as a searched dimension (parallelize(precision="auto")) and FP8 plans as data.

- On DGX H100 "auto" returns the fastest of BF16 and the torchao recipes, an FP8 one for a
  model whose linears dominate, with the speed-up in its notes; the recipe's plan is the same
  as planning it directly.
- On DGX A100 it returns BF16 and says why; an explicit FP8 request there is refused.
- An FP8 plan's JSON loads back; its precision is the recipe's full name.
"""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.models import hf, zoo
from autopar.plan.check import plan_problems


@pytest.fixture(scope="module")
def wide():
    model = zoo.build("llama-8b", device="meta", num_layers=4)
    return model, autopar.trace(model, zoo.example_inputs("llama-8b", model))


def _plan(wide, profile: str, precision: str) -> autopar.Plan:
    model, graph = wide
    cluster = autopar.Cluster.from_profile(profile, num_nodes=2)
    return autopar.parallelize(
        model, cluster, global_batch_size=64, precision=precision, graph=graph
    )


def test_auto_on_h100_picks_the_fastest_recipe_and_says_what_it_bought(wide):
    auto = _plan(wide, "dgx_h100", "auto")
    bf16 = _plan(wide, "dgx_h100", "bf16")
    assert auto.precision.startswith("fp8-")
    assert auto.step_time_s < bf16.step_time_s
    said = next(n for n in auto.notes if n.startswith("precision auto:"))
    assert f"{bf16.step_time_s / auto.step_time_s:.2f}x the speed of bf16" in said
    assert "fp8-rowwise" in said and "fp8-tensorwise" in said
    direct = _plan(wide, "dgx_h100", auto.precision)
    assert direct.config == auto.config and direct.step_time_s == auto.step_time_s


def test_auto_on_a100_stays_bf16_and_says_why(wide):
    auto = _plan(wide, "dgx_a100_80g", "auto")
    assert auto.precision == "bf16"
    assert any("no FP8 tensor cores" in n for n in auto.notes)
    with pytest.raises(ConfigError, match="cannot run on dgx_a100_80g"):
        _plan(wide, "dgx_a100_80g", "fp8")


def test_auto_offers_only_the_recipes_the_stack_trains(wide):
    """Megatron has no per-row FP8 recipe, DeepSpeed's config no FP8 at all (their stacks'
    [precision] tables): auto chooses among what the stack would run."""
    model, graph = wide
    cluster = autopar.Cluster.from_profile("dgx_h100", num_nodes=2)
    common = dict(global_batch_size=64, precision="auto", graph=graph)
    megatron = autopar.parallelize(model, cluster, stack="megatron-core", **common)
    said = next(n for n in megatron.notes if n.startswith("precision auto:"))
    assert "fp8-tensorwise" in said and "fp8-rowwise" not in said
    deepspeed = autopar.parallelize(model, cluster, stack="deepspeed", **common)
    assert deepspeed.precision == "bf16"
    assert any("the deepspeed stack trains none of the recipes" in n for n in deepspeed.notes)


def test_an_fp8_plan_round_trips_through_json(wide):
    model, graph = wide
    cluster = autopar.Cluster.from_profile("dgx_h100")
    plan = autopar.evaluate(
        model, cluster, autopar.ParallelConfig(fsdp=8, zero_stage=3), global_batch_size=8,
        precision="fp8", graph=graph,
    )  # fmt: skip
    assert plan.precision == "fp8-tensorwise" and "(fp8-tensorwise," in plan.summary()
    assert "MFU " in plan.summary() and " of the bf16 peak " in plan.summary()
    back = autopar.Plan.from_json(plan.to_json())
    assert back.precision == "fp8-tensorwise" and back.step_time_s == plan.step_time_s
    assert plan_problems(json.loads(plan.to_json())) == []
    assert "precision must be one of" in plan_problems({**json.loads(plan.to_json()),
                                                        "precision": "int4"})[0]  # fmt: skip


def test_the_ilp_reprices_fp8_tensor_parallel_configs_in_fp8():
    """The intra-layer ILP's re-pricing scales the search's own layer times: an FP8 config's
    re-priced step stays near its analytic FP8 price (it once re-priced the GEMMs in BF16:
    +27% for Llama 3 70B on 8 DGX H100, which made the search return a slower plan)."""
    model = hf.build("llama3-70b", num_hidden_layers=8)
    graph = autopar.trace(model, hf.example_inputs("llama3-70b", model, seq_len=8192))
    cluster = autopar.Cluster.from_profile("dgx_h100", 1)
    options = autopar.PlanOptions(sensitivity=False)
    plan = autopar.parallelize(
        model, cluster, graph=graph, global_batch_size=32, precision="fp8-tensorwise",
        options=options,
    )  # fmt: skip
    repriced = [c for c in plan.report["refine"]["candidates"] if c["layers"]]
    assert any(" tp=2 " in c["config"] for c in repriced)
    for c in repriced:
        assert c["step_time_s"] / c["analytic_step_time_s"] - 1 < 0.02, c


def test_mxfp8_is_planned_only_as_the_runtime_trains_it(wide):
    """torchao's MXFP8 linear takes each GEMM's tokens and each tp shard's width in blocks of
    32 (`runtime.capability`): on B200 the search offers only the tp degrees whose shards
    keep whole blocks and no etp, evaluate refuses a finer tp, etp and a sequence share under
    32 tokens, an odd sequence length is refused, and auto plans without MXFP8 there, saying
    why."""
    from autopar.runtime.capability import runtime_limits
    from autopar.solve.limits import space_limits

    model, graph = wide
    cluster = autopar.Cluster.from_profile("dgx_b200", num_nodes=2)
    limits, notes = runtime_limits(
        model, space_limits(model, graph, cluster, 64), precision="mxfp8"
    )
    # llama-8b's narrowest split linears, k and v, are 1024 wide: every tp up to 32 keeps blocks
    assert (limits.max_tp, limits.tp_width, limits.token_multiple) == (0, 1024, 32)
    assert not any("tensor-parallel" in n for n in notes)
    plan = _plan(wide, "dgx_b200", "mxfp8")
    assert plan.precision == "mxfp8"
    common = dict(global_batch_size=64, precision="mxfp8", graph=graph)
    tp2 = autopar.ParallelConfig(tp=2, fsdp=8, zero_stage=3, sequence_parallel=True)
    tp2 = autopar.evaluate(model, cluster, tp2, **common)
    assert tp2.precision == "mxfp8" and tp2.config.tp == 2

    def tiny(seq_len: int):
        m = zoo.build("llama-tiny", device="meta", seq_len=seq_len)
        return m, autopar.trace(m, zoo.example_inputs("llama-tiny", m))

    m, g = tiny(64)
    one = autopar.Cluster.from_profile("dgx_b200", num_devices=4)
    small = autopar.parallelize(m, one, global_batch_size=4, precision="mxfp8", graph=g)
    assert any("keeps 6 of the blocks' 14 linear layers in BF16" in n for n in small.notes)
    cp4 = autopar.ParallelConfig(cp=4)
    with pytest.raises(ConfigError, match=r"share of the sequence \(seq_len 64 / cp=4\)"):
        autopar.evaluate(m, one, cp4, global_batch_size=4, precision="mxfp8", graph=g)
    # experts: dispatched with their rows padded to blocks of 32, and split over tp (etp = tp)
    # where each expert's slice is a multiple of 32 wide
    wide_moe = dict(seq_len=64, hidden=128, ffn_hidden=256)
    moe = zoo.build("moe-tiny", device="meta", **wide_moe)
    moe_graph = autopar.trace(moe, zoo.example_inputs("moe-tiny", moe))
    limits, notes = runtime_limits(moe, space_limits(moe, moe_graph, one, 4), precision="mxfp8")
    assert limits.num_experts == 4 and limits.expert_width == 128
    assert not any("expert tensor-parallel" in n for n in notes)
    etp = autopar.ParallelConfig(tp=2, ep=2, etp=2, sequence_parallel=True, dp=2)
    split = autopar.evaluate(moe, one, etp, global_batch_size=4, precision="mxfp8", graph=moe_graph)
    assert (split.precision, split.config.etp) == ("mxfp8", 2)
    narrow = zoo.build("moe-tiny", device="meta", expert_ffn_hidden=96, **wide_moe)
    narrow_graph = autopar.trace(narrow, zoo.example_inputs("moe-tiny", narrow))
    with pytest.raises(
        ConfigError, match="etp=2 in mxfp8 slices the experts' .* 96 of MoE into 48"
    ):
        autopar.evaluate(
            narrow, one, etp, global_batch_size=4, precision="mxfp8", graph=narrow_graph
        )
    assert (
        autopar.evaluate(narrow, one, etp, global_batch_size=4, graph=narrow_graph).config.etp == 2
    )
    # llama-tiny's k and v projections are 32 wide: tp = 2 would leave shards of 16
    tp2 = autopar.ParallelConfig(tp=2, dp=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="greatest common divisor 32"):
        autopar.evaluate(m, one, tp2, global_batch_size=4, precision="mxfp8", graph=g)
    assert small.config.tp == 1
    m, g = tiny(48)
    with pytest.raises(ConfigError, match="'mxfp8' needs sequences of a multiple of 32"):
        autopar.parallelize(m, one, global_batch_size=4, precision="mxfp8", graph=g)
    auto = autopar.parallelize(m, one, global_batch_size=4, precision="auto", graph=g)
    assert auto.precision != "mxfp8"
    assert any(n.startswith("mxfp8 not planned: precision 'mxfp8' needs") for n in auto.notes)
