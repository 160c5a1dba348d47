"""Software stacks (autopar.estimate.stacks): data that loads or is refused by field, and
prices through the mechanisms it names.

- Every shipped stack loads and names a source per table; bad files are refused by field.
- Kernel factors are relative to the stack the profile's curves describe: on dgx_h100
  (fitted to Megatron-LM) the megatron-lm stack prices as one's own factor-1 options, and the
  eager stacks' memory-bound ops take twice the traffic; a matmul factor scales the fp32
  GEMMs' curve with the tensor-core one; on local_cpu (measured through
  autopar's runtime) the autopar stack prices exactly as its measured curves.
- `logit_copies` adds whole logit tensors on the last stage, nothing else.
- `comm_interference` adds its fraction of the FSDP traffic the compute hid, and nothing to
  a config with no hidden communication.
- `param_hook_s` (the gradient's hook) adds its time per parameter tensor per micro-batch
  under ZeRO-2 and ZeRO-3, `param_fetch_hook_s` four times its time under ZeRO-3 only
  (gathers and releases), neither anything under ZeRO-1.
- `fsdp_over_cp` shards the model state fsdp x cp ways and drops the separate cp gradient
  all-reduce (torchtitan's and Megatron's layout); autopar's own stack keeps both apart.
  With fsdp = 1 ZeRO shards over the cp ranks alone (torchtitan's dp_shard 1 under cp), priced
  as fsdp x cp with the same product, and refused by name on a stack that does not.
- The plan records and prints its stack; a stack and options together are refused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.errors import AutoparError
from autopar.estimate import CostOptions, Estimator, build_tables, load_stack, stack_names
from autopar.estimate.layer_cost import _memory_ops_time
from autopar.estimate.stacks import StackError
from autopar.models import zoo

GOOD = """schema_version = 1
name = "{name}"
description = "a test stack"
[kernels]
memory_traffic = 1.5
source = "test"
[memory]
logit_copies = 3.0
source = "test"
[overlap]
grad_bytes = 2
source = "test"
"""


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama-tiny", device="meta", vocab_size=1024)
    graph = autopar.trace(model, zoo.example_inputs("llama-tiny", model))
    return model, graph


def test_every_shipped_stack_loads_with_its_sources():
    names = stack_names()
    assert {"autopar", "megatron-lm", "megatron-core", "torchtitan"} <= set(names)
    for name in names:
        stack = load_stack(name)
        assert stack.name == stack.options.stack == name
        assert set(stack.sources) - {"precision"} == {"kernels", "memory", "overlap"}
        assert stack.recipes is None or "precision" in stack.sources, name
        # the stacks that train a recipe with torchao run only the linears it converts
        torchao = name.startswith(("autopar", "torchtitan"))
        assert stack.options.torchao_linears == torchao, name
        assert all(len(text) > 10 for text in stack.sources.values()), name


def test_a_stack_file_of_ones_own(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(GOOD.format(name="mine"))
    stack = load_stack(path)
    assert stack.options.memory_traffic == 1.5 and stack.options.logit_copies == 3.0
    assert stack.options.grad_bytes == 2 and stack.options.stack == "mine"


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (("memory_traffic = 1.5", "memory_traffic = inf"), "kernels.memory_traffic: must be"),
        (("memory_traffic = 1.5", "memory_traffic = 0.0"), "memory_traffic must be a finite"),
        (("memory_traffic = 1.5", "warp_speed = 2.0"), "kernels.warp_speed: unknown"),
        (('source = "test"\n[memory]', "[memory]"), "kernels.source: must name"),
        (("grad_bytes = 2", "grad_bytes = true"), "overlap.grad_bytes: must be a finite int"),
        (("grad_bytes = 2", "grad_bytes = 3"), "grad_bytes must be 2 or 4"),
        (("grad_bytes = 2", "comm_interference = 1.5"), "comm_interference must be in [0, 1]"),
        (("grad_bytes = 2", "param_hook_s = -1.0"), "param_hook_s must be a finite number >= 0"),
        (
            ("grad_bytes = 2", "param_fetch_hook_s = -1.0"),
            "param_fetch_hook_s must be a finite number >= 0",
        ),
        (('name = "mine"', 'name = "other"'), "must equal the file stem 'mine'"),
        (
            (
                'grad_bytes = 2\nsource = "test"',
                'grad_bytes = 2\nsource = "test"\n[precision]\nrecipes = ["fp9"]\nsource = "x"',
            ),
            "precision.recipes: must be a list of fp8-",
        ),
        (
            (
                'grad_bytes = 2\nsource = "test"',
                'grad_bytes = 2\nsource = "test"\n[precision]\ntorchao_linears = 1\nsource = "x"',
            ),
            "precision.torchao_linears: must be a bool, got 1",
        ),
    ],
)
def test_bad_stack_files_are_refused_by_field(tmp_path, edit, fragment):
    path = tmp_path / "mine.toml"
    path.write_text(GOOD.format(name="mine").replace(*edit, 1))
    with pytest.raises(StackError, match="mine.toml: field ") as err:
        load_stack(path)
    assert fragment in str(err.value)


def test_an_unknown_stack_lists_the_shipped_ones():
    with pytest.raises(StackError, match="unknown software stack 'jax'.*torchtitan"):
        load_stack("jax")


def _compute(graph, profile: str, options: CostOptions) -> float:
    estimator = Estimator(
        build_tables(graph), autopar.Cluster.from_profile(profile), options=options
    )
    est = estimator.evaluate(autopar.ParallelConfig(dp=estimator.cluster.world_size), 64)
    return est.breakdown["compute_forward"] + est.breakdown["compute_backward"]


def test_kernel_factors_are_relative_to_the_profiles_own_stack(llama):
    _, graph = llama
    own = _compute(graph, "dgx_h100", CostOptions())  # unnamed: the profile's curves
    assert _compute(graph, "dgx_h100", load_stack("megatron-lm").options) == own
    assert _compute(graph, "dgx_h100", load_stack("torchtitan-compile").options) == own
    eager = _compute(graph, "dgx_h100", load_stack("torchtitan").options)
    assert eager > own
    # on the CPU profile, measured through autopar's runtime, autopar's stack is the curves
    cpu_own = _compute(graph, "local_cpu", CostOptions())
    assert _compute(graph, "local_cpu", load_stack("autopar").options) == cpu_own
    assert _compute(graph, "local_cpu", load_stack("megatron-lm").options) < cpu_own


def test_a_stacks_matmul_factor_scales_the_fp32_curve_as_the_tensor_core_one():
    from autopar.estimate.step import stack_device

    device = autopar.load_profile("dgx_v100").device
    half = stack_device(device, CostOptions(matmul_efficiency=0.5), CostOptions())
    assert half.matmul.max == pytest.approx(device.matmul.max / 2)
    assert half.matmul_fp32.max == pytest.approx(device.matmul_fp32.max / 2)
    assert half.matmul_fp32.half_size == device.matmul_fp32.half_size


def test_memory_traffic_prices_the_memory_bound_ops_with_more_bytes(llama):
    _, graph = llama
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile("dgx_h100")
    block = next(t for t in tables.layers if t.kind == "block")
    cfg = autopar.ParallelConfig(dp=8, micro_batch_size=4)
    plain = Estimator(tables, cluster, options=CostOptions())
    double = Estimator(tables, cluster, options=CostOptions(memory_traffic=2.0))
    scale = plain.act_scale
    extra = _memory_ops_time(block.memory_ops, cfg, plain.device, 2 * scale) - _memory_ops_time(
        block.memory_ops, cfg, plain.device, scale
    )
    assert extra > 0
    a = plain.layer_times(cfg, plain.mesh(cfg))[block.name]
    b = double.layer_times(cfg, double.mesh(cfg))[block.name]
    assert b.compute_forward_s - a.compute_forward_s == pytest.approx(extra)
    assert b.compute_backward_s - a.compute_backward_s == pytest.approx(2 * extra)


def test_hidden_fsdp_traffic_slows_compute_by_the_interference(llama):
    _, graph = llama
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile("dgx_h100")
    # ZeRO-3 over 8 ranks: every gather but the first, and every scatter but the last, hide
    # behind the compute they can; the covered part is recomputed from the collectives' prices
    cfg = autopar.ParallelConfig(fsdp=8, zero_stage=3, micro_batch_size=4)
    runs = {}
    for k in (0.0, 0.5):
        est = Estimator(tables, cluster, options=CostOptions(comm_interference=k))
        mesh = est.mesh(cfg)
        layers = [t for t in tables.layers if est.memory.params(cfg, [t])]
        st = est.timer.stage_times(cfg, mesh, layers, est.layer_times(cfg, mesh))
        runs[k] = (est, mesh, layers, st)
    est, mesh, layers, st = runs[0.0]
    gathers = [mesh.time("all_gather", est.memory.params(cfg, [t]) * 2, "fsdp") for t in layers]
    scatters = [mesh.time("reduce_scatter", est.memory.params(cfg, [t]) * 4, "fsdp")
                for t in layers]  # fmt: skip
    fwd_covered = min(sum(gathers[1:]), st["compute_forward"])
    bwd_covered = min(sum(gathers) + sum(scatters[:-1]), st["compute_backward"])
    assert fwd_covered > 0 and bwd_covered > 0
    extra = runs[0.5][3]["fsdp_comm"] - st["fsdp_comm"]
    assert extra == pytest.approx(0.5 * (fwd_covered + bwd_covered), rel=1e-9)
    # plain data parallelism with exposed reduction hides nothing: no change
    dp = autopar.ParallelConfig(dp=8)
    steps = [
        Estimator(tables, cluster, options=CostOptions(comm_interference=k,
                                                       overlap_grad_reduce=False))
        .evaluate(dp, 64).step_time_s
        for k in (0.0, 1.0)
    ]  # fmt: skip
    assert steps[0] == steps[1]


def test_per_tensor_hooks_cost_host_time_by_zero_stage(llama):
    _, graph = llama
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile("dgx_h100")
    tensors = sum(t.num_param_tensors for t in tables.layers)
    hooks = {"grad": dict(param_hook_s=1e-4), "fetch": dict(param_fetch_hook_s=1e-4)}
    # events per tensor per micro-batch, by ZeRO stage: (gradient hooks, gathers and releases)
    for stage, events in ((1, (0, 0)), (2, (1, 0)), (3, (1, 4))):
        cfg = autopar.ParallelConfig(fsdp=8, zero_stage=stage, micro_batch_size=2)
        backward = {}
        for name, options in (("none", {}), *hooks.items()):
            est = Estimator(tables, cluster, options=CostOptions(**options))
            mesh = est.mesh(cfg)
            layers = list(tables.layers)
            st = est.timer.stage_times(cfg, mesh, layers, est.layer_times(cfg, mesh))
            backward[name] = st["compute_backward"]
        for name, count in zip(hooks, events, strict=True):
            added = backward[name] - backward["none"]
            assert added == pytest.approx(count * 1e-4 * tensors, abs=1e-12), (stage, name)


def test_sharding_over_the_context_parallel_ranks(llama):
    _, graph = llama
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile("dgx_h100")
    cfg = autopar.ParallelConfig(fsdp=2, cp=4, zero_stage=3, micro_batch_size=1)
    plans = {
        over: Estimator(tables, cluster, options=CostOptions(fsdp_over_cp=over)).evaluate(cfg, 8)
        for over in (False, True)
    }
    apart, together = (plans[k].stages[0].memory for k in (False, True))
    for part in ("parameters", "gradients", "optimizer"):
        assert getattr(together, f"{part}_bytes") == pytest.approx(
            getattr(apart, f"{part}_bytes") / 4
        )
    assert plans[True].breakdown["dp_comm"] < plans[False].breakdown["dp_comm"]
    assert not load_stack("autopar").options.fsdp_over_cp
    assert load_stack("torchtitan").options.fsdp_over_cp


def test_logit_copies_add_whole_logit_tensors_on_the_last_stage(llama):
    model, graph = llama
    cluster = autopar.Cluster.from_profile("dgx_h100")
    config = autopar.ParallelConfig(dp=4, pp=2, micro_batch_size=2, schedule="gpipe")
    plans = {
        copies: autopar.evaluate(
            model, cluster, config, global_batch_size=16, graph=graph,
            options=replace(CostOptions(), logit_copies=copies),
        )
        for copies in (2.0, 5.0)
    }  # fmt: skip
    first = [p.stages[0].memory_bytes["activations"] for p in plans.values()]
    last = [p.stages[-1].memory_bytes["activations"] for p in plans.values()]
    assert first[0] == first[1]  # the first stage holds no logits
    seq, vocab = graph.input_shapes[0][-1], 1024
    logits = 2 * seq * vocab * 2  # micro-batch 2, bf16
    assert last[1] - last[0] == pytest.approx(3 * logits, rel=1e-9)


def test_the_plan_records_and_prints_its_stack(llama):
    model, graph = llama
    cluster = autopar.Cluster.from_profile("dgx_h100")
    plan = autopar.evaluate(
        model, cluster, autopar.ParallelConfig(dp=8), global_batch_size=64, graph=graph,
        stack="torchtitan",
    )  # fmt: skip
    assert plan.stack == "torchtitan"
    assert "priced for the torchtitan stack" in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()).stack == "torchtitan"
    default = autopar.evaluate(
        model, cluster, autopar.ParallelConfig(dp=8), global_batch_size=64, graph=graph
    )
    assert default.stack == "autopar"
    assert default.step_time_s > autopar.evaluate(
        model, cluster, autopar.ParallelConfig(dp=8), global_batch_size=64, graph=graph,
        stack="megatron-core",
    ).step_time_s  # fmt: skip


def test_a_stack_and_options_together_are_refused(llama):
    model, graph = llama
    cluster = autopar.Cluster.from_profile("dgx_h100")
    with pytest.raises(AutoparError, match="give stack='torchtitan' or options, not both"):
        autopar.evaluate(
            model, cluster, autopar.ParallelConfig(dp=8), global_batch_size=64, graph=graph,
            stack="torchtitan", options=CostOptions(),
        )  # fmt: skip


def test_zero_over_the_context_parallel_ranks_alone(llama):
    model, graph = llama
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile("dgx_h100")
    over = CostOptions(fsdp_over_cp=True, stack="torchtitan")
    alone = autopar.ParallelConfig(cp=8, zero_stage=3, micro_batch_size=1)
    beside = autopar.ParallelConfig(fsdp=2, cp=4, zero_stage=3, micro_batch_size=1)
    unsharded = autopar.ParallelConfig(cp=8, micro_batch_size=1)
    plans = {c: Estimator(tables, cluster, options=over).evaluate(c, 8) for c in (alone, beside)}
    # the same 8 ways as fsdp 2 x cp 4: model state and the ZeRO-3 gathers alike
    a, b = (plans[c].stages[0].memory for c in (alone, beside))
    for part in ("parameters", "gradients", "optimizer"):
        assert getattr(a, f"{part}_bytes") == pytest.approx(getattr(b, f"{part}_bytes"))
    assert plans[alone].breakdown["fsdp_comm"] > 0
    whole = Estimator(tables, cluster, options=over).evaluate(unsharded, 8).stages[0].memory
    assert a.optimizer_bytes == pytest.approx(whole.optimizer_bytes / 8)
    # a stack that shards over fsdp only refuses it, naming what does
    with pytest.raises(AutoparError, match="fsdp_over_cp is false.*torchtitan"):
        Estimator(tables, cluster, options=CostOptions(stack="autopar")).evaluate(alone, 8)
    with pytest.raises(AutoparError, match="does not do"):
        autopar.evaluate(model, cluster, alone, graph=graph, global_batch_size=8)
    # and without cp there is nothing to shard over, on any stack
    with pytest.raises(AutoparError, match="needs fsdp > 1 to shard over"):
        Estimator(tables, cluster, options=over).evaluate(
            autopar.ParallelConfig(tp=8, zero_stage=1), 8
        )
