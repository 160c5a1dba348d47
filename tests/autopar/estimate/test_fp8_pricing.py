"""Low-precision recipes priced (autopar.config.precision, estimate.layer_cost): what could go
wrong if the mechanism were miswired.

- Only the blocks' linear GEMMs change rate: attention, the head and the embedding are priced
  as in BF16; the converted GEMMs' time is the BF16 time at the FP8 peak, plus the casts.
- Under a stack that converts with torchao (`torchao_linears`: autopar's runtime,
  torchtitan) the recipe prices exactly the linears the runtime converts, the rest in BF16;
  TransformerEngine's stacks price every linear of the covered blocks.
- Under MXFP8 on a torchao stack a dispatched expert's GEMMs run its rows padded to whole
  blocks of 32, as the runtime pads them: the expected padded rows over a real router's
  counts, and the expert layer's time only where rows are dispatched.
- NVFP4 keeps its edge blocks in BF16; FSDP's FP8 all-gather halves the converted weights'
  gathered bytes and leaves the gradient reduce-scatter alone.
- A device without the recipe's tensor cores, and an unknown precision, are refused by name.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.config.precision import RECIPES, base_precision, canonical, recipe_of
from autopar.errors import ConfigError
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.layer_cost import in_recipe, mx_padded_rows
from autopar.models import hf, zoo
from cost_models.compute import op_time_s


@pytest.fixture(scope="module")
def tables():
    model = zoo.build("llama-tiny", device="meta", vocab_size=1024, num_layers=4)
    return build_tables(autopar.trace(model, zoo.example_inputs("llama-tiny", model)))


def _times(tables, profile: str, precision: str, options: CostOptions | None = None):
    est = Estimator(
        tables, autopar.Cluster.from_profile(profile), precision=precision, options=options
    )
    cfg = autopar.ParallelConfig(dp=8, micro_batch_size=2)
    return est, est.layer_times(cfg, est.mesh(cfg))


def test_names_resolve_and_unknown_ones_are_refused():
    assert canonical("fp8") == "fp8-tensorwise" and base_precision("mxfp8") == "bf16"
    assert recipe_of("bf16") is None and recipe_of("fp8") is RECIPES["fp8-tensorwise"]
    with pytest.raises(ConfigError, match="precision must be one of .*fp8-rowwise.*'int4'"):
        canonical("int4")


def test_only_the_blocks_linears_change(tables):
    no_casts = CostOptions(cast_traffic=1e-9)  # the casts priced at ~0 bytes
    _, bf16 = _times(tables, "dgx_h100", "bf16", no_casts)
    est, fp8 = _times(tables, "dgx_h100", "fp8", no_casts)
    for t in tables.layers:
        if t.kind != "block":  # embedding, final norm, head: untouched
            assert fp8[t.name] == bf16[t.name]
    # a block's forward: its linears' BF16 GEMM time traded for the same FLOPs at the FP8
    # peak, plus one cast op per linear (here ~0 bytes: its latency alone)
    block = next(t for t in tables.layers if t.kind == "block")
    mb = 2
    change = 0.0
    linears = [op for op in block.matmuls if op.weight_bytes]
    for op in linears:
        io = (op.activation_bytes * mb + op.weight_bytes) * est.act_scale
        flops = op.flops * mb
        change += op_time_s(est.device, "matmul", flops, io, "fp8") - op_time_s(
            est.device, "matmul", flops, io, "bf16"
        )
        acts, weights = op.activation_bytes * mb * est.act_scale, op.weight_bytes * est.act_scale
        fa, fw = RECIPES["fp8-tensorwise"].cast_forward
        change += op_time_s(est.device, "elementwise", 0.0, (fa * acts + fw * weights) * 1e-9,
                            "fp32")  # fmt: skip
    got = fp8[block.name].compute_forward_s - bf16[block.name].compute_forward_s
    assert got == pytest.approx(change, rel=1e-6, abs=1e-12)


def test_fp8_pays_off_on_large_linears_only():
    # llama-8b's 4096-wide linears at 8192 tokens: faster in FP8; llama-tiny's: the casts'
    # launches cost more than the GEMMs save
    wide = zoo.build("llama-8b", device="meta", num_layers=2)
    big = build_tables(autopar.trace(wide, zoo.example_inputs("llama-8b", wide)))
    tiny = zoo.build("llama-tiny", device="meta", num_layers=2)
    small = build_tables(autopar.trace(tiny, zoo.example_inputs("llama-tiny", tiny)))
    for tabs, faster in ((big, True), (small, False)):
        block = next(t.name for t in tabs.layers if t.kind == "block")
        _, b = _times(tabs, "dgx_h100", "bf16")
        _, f = _times(tabs, "dgx_h100", "fp8")
        assert (f[block].compute_forward_s < b[block].compute_forward_s) is faster


def test_casts_cost_memory_traffic(tables):
    _, fused = _times(tables, "dgx_h100", "fp8", CostOptions(cast_traffic=1.0))
    _, eager = _times(tables, "dgx_h100", "fp8", CostOptions(cast_traffic=2.0))
    block = next(t.name for t in tables.layers if t.kind == "block")
    assert eager[block].compute_forward_s > fused[block].compute_forward_s
    assert eager[block].compute_backward_s > fused[block].compute_backward_s


def test_an_eager_hosts_dispatch_floors_a_layers_fp8_time(tables):
    """`CostOptions.recipe_host_s`: a layer's forward takes at least that per converted
    linear and its backward twice that; a floor under the device's time, not added to it."""
    _, gpu = _times(tables, "dgx_h100", "fp8")
    block = next(t for t in tables.layers if t.kind == "block")
    converted = sum(1 for op in block.matmuls if op.weight_bytes)  # llama-tiny: all of them
    slow = 10 * gpu[block.name].compute_backward_s / converted  # the host well behind
    _, host = _times(tables, "dgx_h100", "fp8", CostOptions(recipe_host_s=slow))
    assert host[block.name].compute_forward_s == pytest.approx(converted * slow)
    assert host[block.name].compute_backward_s == pytest.approx(2 * converted * slow)
    fast = 1e-3 * gpu[block.name].compute_forward_s / converted  # the host well ahead
    _, hidden = _times(tables, "dgx_h100", "fp8", CostOptions(recipe_host_s=fast))
    assert hidden[block.name] == gpu[block.name]
    _, bf16 = _times(tables, "dgx_h100", "bf16", CostOptions(recipe_host_s=slow))
    _, bf16_plain = _times(tables, "dgx_h100", "bf16")
    assert bf16 == bf16_plain  # no recipe, no floor
    for t in tables.layers:
        if t.kind != "block":  # no converted linear
            assert host[t.name] == gpu[t.name]


@pytest.mark.parametrize(
    ("source", "name", "precision", "converted", "linears"),
    [
        (zoo, "llama-tiny", "fp8", 14, 14),  # every dimension a multiple of 16
        (zoo, "llama-tiny", "mxfp8", 8, 14),  # the 176-wide MLP is not a multiple of 32
        (hf, "gpt2-tiny-hf", "fp8", 0, 8),  # transformers' Conv1D: torchao converts none
        (hf, "qwen2-moe-tiny-hf", "mxfp8", None, None),  # biased q/k/v, experts
    ],
)
def test_under_torchao_the_recipe_prices_the_linears_the_runtime_converts(
    source, name, precision, converted, linears
):
    from autopar.runtime.low_precision import block_linears, covered_linears
    from autopar.runtime.tensor_parallel import find_blocks

    model = source.build(name, device="meta")
    graph = autopar.trace(model, source.example_inputs(name, model))
    tabs = build_tables(graph)
    recipe = recipe_of(precision)
    runtime = covered_linears(find_blocks(model), recipe)
    if converted is not None:
        assert (len(runtime), len(block_linears(find_blocks(model), recipe))) == (
            converted,
            linears,
        )
    blocks = recipe.covered([t for t in tabs.layers if t.kind == "block"])
    priced = [op for t in blocks for op in t.matmuls if in_recipe(op, recipe, True)]
    assert len(priced) == len(runtime)
    every = [op for t in blocks for op in t.matmuls if in_recipe(op, recipe, False)]
    assert len(every) >= len(priced)
    # a block with no converted linear prices exactly as in BF16, unless every linear runs
    profile = "dgx_b200" if precision == "mxfp8" else "dgx_h100"
    torchao = CostOptions(torchao_linears=True)
    _, low = _times(tabs, profile, precision, torchao)
    _, base = _times(tabs, profile, "bf16", torchao)
    _, all_linears = _times(tabs, profile, precision, CostOptions(torchao_linears=False))
    block = blocks[0].name
    assert (low[block] == base[block]) == (not priced)
    assert all_linears[block] != base[block]


@pytest.mark.parametrize("tokens", [16, 40, 64, 192, 1024, 4096])
def test_the_padded_rows_priced_are_what_the_runtime_pads_a_routers_counts_to(tokens):
    """moe-tiny's own router (4 experts, top 2, at its random init) routes ``tokens`` tokens,
    20 times; each expert's rows go through the runtime's padding (`mx_padded`). The mean
    rows the padding gives an expert are `mx_padded_rows` of the mean count, within 3%."""
    from autopar.runtime.low_precision import mx_padded

    model = zoo.build("moe-tiny", seed=0)
    block = next(m for m in model.modules() if hasattr(m, "routing_weights"))
    hidden = block.router.in_features
    gen = torch.Generator().manual_seed(0)
    padded, counts = [], []
    with torch.no_grad():
        for _ in range(20):
            x = torch.randn(tokens, hidden, generator=gen)
            idx = F.softmax(block.router(x).float(), -1).topk(block.top_k, -1).indices
            for n in torch.bincount(idx.flatten(), minlength=block.num_experts).tolist():
                padded.append(mx_padded(x[:n]).shape[0])
                counts.append(n)
    mean = sum(counts) / len(counts)
    assert mean == tokens * block.top_k / block.num_experts
    measured = sum(padded) / len(padded)
    assert mx_padded_rows(mean) == pytest.approx(measured, rel=0.03)
    assert measured > mean  # something is padded at every size here


def test_mxfp8_prices_the_padding_only_where_experts_get_dispatched_rows():
    """moe-tiny with 32 experts (so that torchao converts its router too) in MXFP8 on a
    B200: with ep = 2 (tokens dispatched to their experts) an MoE
    block costs more on a torchao stack, which pads, than on TransformerEngine's, which the
    estimate does not pad; with ep = 1 (every expert on every token, whole blocks) the two
    are equal, and so are the dense layers."""
    model = zoo.build("moe-tiny", device="meta", num_experts=32)
    tabs = build_tables(autopar.trace(model, zoo.example_inputs("moe-tiny", model)))
    cluster = autopar.Cluster.from_profile("dgx_b200")
    moe = next(t.name for t in tabs.layers if t.moe_num_experts)
    head = tabs.layers[-1].name
    for ep, padded in ((1, False), (2, True)):
        cfg = autopar.ParallelConfig(dp=8, ep=ep, micro_batch_size=1)
        times = []
        for torchao in (True, False):
            est = Estimator(tabs, cluster, precision="mxfp8",
                            options=CostOptions(torchao_linears=torchao))  # fmt: skip
            times.append(est.layer_times(cfg, est.mesh(cfg)))
        pads, plain = times
        assert (pads[moe].compute_forward_s > plain[moe].compute_forward_s) == padded, ep
        assert pads[head] == plain[head]


def test_nvfp4_keeps_the_edge_blocks_in_bf16(tables):
    est, _ = _times(tables, "dgx_b200", "nvfp4")
    blocks = [t.name for t in tables.layers if t.kind == "block"]
    assert sorted(est.converted) == sorted(blocks[1:-1])
    est8, _ = _times(tables, "dgx_b200", "mxfp8")
    assert sorted(est8.converted) == sorted(blocks)


def test_fsdp_gathers_the_cast_weights_when_the_stack_does(tables):
    cluster = autopar.Cluster.from_profile("dgx_h100")
    cfg = autopar.ParallelConfig(fsdp=8, zero_stage=3, micro_batch_size=2)
    comm = {}
    for gather in (False, True):
        options = CostOptions(fp8_all_gather=gather, fsdp_prefetch=False)
        est = Estimator(tables, cluster, precision="fp8", options=options)
        mesh = est.mesh(cfg)
        layers = list(tables.layers)
        comm[gather] = est.timer.stage_times(cfg, mesh, layers, est.layer_times(cfg, mesh))
    est = Estimator(tables, cluster, precision="fp8")
    block = next(t for t in tables.layers if t.kind == "block")
    fraction = est.converted[block.name]
    assert 0.9 < fraction <= 1.0  # a block's parameters are mostly its linears' weights
    # without prefetch every gather and scatter is exposed: gathers shrink, scatters stay
    assert comm[True]["fsdp_comm"] < comm[False]["fsdp_comm"]
    assert est.timer.gather_scale == {}  # the default stack options gather BF16
    est_on = Estimator(tables, cluster, precision="fp8", options=CostOptions(fp8_all_gather=True))
    assert est_on.timer.gather_scale[block.name] == pytest.approx(1 - fraction / 2)
    rowwise = Estimator(
        tables, cluster, precision="fp8-rowwise", options=CostOptions(fp8_all_gather=True)
    )
    assert rowwise.timer.gather_scale == {}  # rowwise scales: torchao gathers BF16


@pytest.mark.parametrize(
    ("profile", "precision", "fragment"),
    [
        ("dgx_a100_80g", "fp8", "cannot run on dgx_a100_80g .*no fp8 tensor cores"),
        ("dgx_h100", "mxfp8", "cannot run on dgx_h100 .*no mxfp8 tensor cores"),
        ("tpu_v5p", "fp8", "cannot run on tpu_v5p .*TPUs and CPUs"),
        ("local_cpu", "fp8-rowwise", "cannot run on local_cpu"),
    ],
)
def test_a_device_without_the_recipes_tensor_cores_is_refused(tables, profile, precision, fragment):
    shape = {"slice_shape": (2, 2, 1)} if profile.startswith("tpu") else {}
    with pytest.raises(ConfigError, match=fragment):
        Estimator(tables, autopar.Cluster.from_profile(profile, **shape), precision=precision)


def test_recipes_are_frozen_data():
    with pytest.raises(AttributeError):
        RECIPES["fp8-tensorwise"].gemm_efficiency = 2.0  # type: ignore[misc]
    assert replace(RECIPES["mxfp8"], name="x").gemm_dtype == "mxfp8"
