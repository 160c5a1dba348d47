"""The profile's [runtime] layer overheads: parsed, priced per layer and micro-batch by style,
and recovered by the profiler's arithmetic from synthetic measurements."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import autopar
from autopar import Cluster, ParallelConfig
from autopar.errors import ProfileError
from autopar.estimate import Estimator, build_tables
from autopar.estimate.layer_cost import runtime_overhead_s, split_backward_overhead_s
from autopar.estimate.stages import stage_layers, stage_of_chunk
from autopar.hardware import profile_from_text
from autopar.models import zoo
from autopar.profiler import runtime_overhead as ro

OVERHEADS = {"plain": 1e-3, "tp": 3e-3, "tp_sp": 5e-3, "fsdp": 2e-3, "fsdp3": 4e-3}
RECOMPUTE = {**OVERHEADS, "selective": 3e-3, "full": 2e-3}


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama-tiny", device="meta")
    graph = autopar.trace(model, zoo.example_inputs("llama-tiny", model))
    return model, graph, build_tables(graph)


@pytest.fixture(scope="module")
def llama6():
    """Six blocks: enough for DualPipe-V's four chunks on pp 2."""
    model = zoo.build("llama-tiny", device="meta", num_layers=6)
    return build_tables(autopar.trace(model, zoo.example_inputs("llama-tiny", model)))


def with_overheads(
    cluster: Cluster,
    overheads: dict[str, float],
    optimizer: dict[str, float] | None = None,
    model: dict[str, float] | None = None,
) -> Cluster:
    """``cluster`` with these layer overheads, optimizer and model ones (none by default)."""
    profile = dataclasses.replace(
        cluster.profile,
        runtime_overhead_s=overheads,
        optimizer_overhead_s=optimizer or {},
        model_overhead_s=model or {},
    )
    return dataclasses.replace(cluster, profile=profile)


@pytest.mark.parametrize(
    "cfg, expected",
    [
        (ParallelConfig(dp=4), 1e-3),
        (ParallelConfig(dp=2, tp=2), 3e-3),
        (ParallelConfig(dp=2, tp=2, sequence_parallel=True), 5e-3),
        (ParallelConfig(fsdp=4, zero_stage=1), 2e-3),
        (ParallelConfig(fsdp=4, zero_stage=3), 4e-3),
        # TP + FSDP: the TP style plus FSDP's extra over plain tensors
        (ParallelConfig(fsdp=2, tp=2, zero_stage=3, sequence_parallel=True), 5e-3 + 3e-3),
    ],
)
def test_styles_combine(cfg, expected):
    assert runtime_overhead_s(OVERHEADS, cfg) == pytest.approx(expected)
    assert runtime_overhead_s({}, cfg) == 0.0


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=4, micro_batch_size=2),
        ParallelConfig(dp=2, tp=2, sequence_parallel=True),
        ParallelConfig(fsdp=4, zero_stage=3),
        ParallelConfig(dp=2, tp=2, recompute="full"),
    ],
)
def test_each_layer_and_micro_batch_pays_the_overhead(llama, cfg):
    """The step grows by layers x micro-batches x overhead (and a third more with full
    recompute, which re-runs the forward); forward gets a third, backward two thirds."""
    _, _, tables = llama
    bare = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), {})
    base = Estimator(tables, bare, precision="fp32").evaluate(cfg, 8)
    est = Estimator(tables, with_overheads(bare, OVERHEADS), precision="fp32").evaluate(cfg, 8)
    layers = sum(t.kind == "block" for t in tables.layers)
    o = runtime_overhead_s(OVERHEADS, cfg)
    m = est.num_microbatches
    extra = layers * m * o * (4 / 3 if cfg.recompute == "full" else 1.0)
    assert est.step_time_s - base.step_time_s == pytest.approx(extra, rel=1e-6)
    fwd = est.breakdown["compute_forward"] - base.breakdown["compute_forward"]
    assert fwd == pytest.approx(layers * m * o / 3, rel=1e-6)


@pytest.mark.parametrize("policy, extra", [("selective", 3e-3 - 1e-3), ("full", 2e-3 - 4e-3 / 3)])
def test_a_recomputed_layer_pays_its_policys_extra(llama, policy, extra):
    """o[policy] - o[plain] on top (full: less the third of o[plain] its re-run forward pays),
    only on the recomputed layers."""
    _, _, tables = llama
    bare = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), {})
    plain = Estimator(tables, with_overheads(bare, OVERHEADS), precision="fp32")
    rc = Estimator(tables, with_overheads(bare, RECOMPUTE), precision="fp32")
    layers = sum(t.kind == "block" for t in tables.layers)
    for k in (None, 1):
        cfg = ParallelConfig(dp=4, micro_batch_size=1, recompute=policy, recompute_layers=k)
        a, b = plain.evaluate(cfg, 8), rc.evaluate(cfg, 8)
        n = layers if k is None else k
        extra_s = b.breakdown["recompute"] - a.breakdown["recompute"]
        assert extra_s == pytest.approx(n * b.num_microbatches * extra, rel=1e-6)


def test_optimizer_overhead_is_paid_per_layer_per_step(llama):
    _, _, tables = llama
    bare = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), {})
    cluster = with_overheads(bare, {}, OVERHEADS)
    layers = sum(t.kind == "block" for t in tables.layers)
    for cfg in (ParallelConfig(dp=4), ParallelConfig(fsdp=2, tp=2, zero_stage=3)):
        cfg = dataclasses.replace(cfg, micro_batch_size=1)
        base = Estimator(tables, bare, precision="fp32").evaluate(cfg, 8)
        est = Estimator(tables, cluster, precision="fp32").evaluate(cfg, 8)
        extra = layers * runtime_overhead_s(OVERHEADS, cfg)  # once per step, any micro-batches
        assert est.breakdown["optimizer"] - base.breakdown["optimizer"] == pytest.approx(extra)
        assert est.step_time_s - base.step_time_s == pytest.approx(extra)


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=4, micro_batch_size=1),
        ParallelConfig(dp=2, tp=2, sequence_parallel=True),
        ParallelConfig(fsdp=2, tp=2, zero_stage=3),
        ParallelConfig(dp=2, pp=2, micro_batch_size=1, schedule="gpipe"),
    ],
)
def test_model_overhead_is_paid_once_per_micro_batch_on_the_last_stage(llama, cfg):
    """Embedding, head and loss: the styles' model overhead once per micro-batch, on the
    stage holding the head (the last), combined as the layer overheads are."""
    _, _, tables = llama
    bare = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), {})
    base = Estimator(tables, bare, precision="fp32").evaluate(cfg, 8)
    est = Estimator(tables, with_overheads(bare, {}, model=OVERHEADS), precision="fp32")
    est = est.evaluate(cfg, 8)
    m = est.num_microbatches
    o = runtime_overhead_s(OVERHEADS, cfg)
    for a, b in zip(base.stages, est.stages, strict=True):
        extra = (b.forward_s + b.backward_s) - (a.forward_s + a.backward_s)
        assert extra == pytest.approx(o if b.index == cfg.pp - 1 else 0.0, rel=1e-6, abs=1e-12)
    if cfg.pp == 1:
        assert est.step_time_s - base.step_time_s == pytest.approx(m * o, rel=1e-6)


def test_time_sharing_scales_the_overheads():
    """4 ranks on a 2-slot node each get half the time: every overhead doubles."""
    two = Cluster.from_profile("local_cpu", num_devices=2)
    four = Cluster.from_profile("local_cpu", num_devices=4)
    assert two.profile.compute_slots == 2
    assert two.profile.runtime_overhead_s and two.profile.optimizer_overhead_s
    for style, value in two.profile.runtime_overhead_s.items():
        assert four.profile.runtime_overhead_s[style] == pytest.approx(2 * value)
    for style, value in two.profile.optimizer_overhead_s.items():
        assert four.profile.optimizer_overhead_s[style] == pytest.approx(2 * value)
    assert two.profile.model_overhead_s
    for style, value in two.profile.model_overhead_s.items():
        assert four.profile.model_overhead_s[style] == pytest.approx(2 * value)


def test_profiler_recovers_known_overheads():
    """Synthetic measurements = the bare profile's prediction + a known per-layer overhead
    (and a fixed cost for embedding, head and loss): `overheads` gives the overhead back."""
    profile = autopar.load_profile("local_cpu")
    bare = dataclasses.replace(profile, runtime_overhead_s={}, model_overhead_s={})
    truth = {
        "plain": 2e-3, "tp": 0.0, "tp_sp": 7e-3, "fsdp": 1e-3, "fsdp3": 4e-3,
        "selective": 5e-3, "full": 3e-3, "split": 6e-3,
    }  # fmt: skip
    # split is priced per layer only: no optimizer or model overhead of its own
    step_truth = {k: v / 2 for k, v in truth.items() if k != "split"}
    fake = []
    for style, o in truth.items():
        for layers in ro.LAYERS:
            predicted = ro.predicted_s(bare, style, layers, 2)
            step = ro.predicted_s(bare, style, layers, 2, "optimizer_s")
            fake.append(
                ro.RuntimeMeasurement(
                    style, layers, predicted + 0.05 + layers * o, step + 0.01 + layers * o / 2
                )
            )
    assert ro.overheads(bare, fake, 2) == pytest.approx(truth, abs=1e-9)
    assert ro.overheads(bare, fake, 2, "optimizer_s") == pytest.approx(step_truth, abs=1e-9)
    # the fixed 0.05 s outside the repeated layers is the model overhead
    assert ro.model_overheads(bare, fake, 2) == pytest.approx(dict.fromkeys(step_truth, 0.05))
    # faster than predicted: no negative overhead
    fast = [dataclasses.replace(m, time_s=m.time_s * 0.1) for m in fake]
    assert all(v == 0.0 for v in ro.overheads(bare, fast, 2).values())


def test_style_configs_use_every_rank_and_refuse_odd_groups():
    for style in ("plain", "tp", "tp_sp", "fsdp", "fsdp3", "selective", "full", "split"):
        assert ro.style_config(style, 4).world_size == 4
    # split measures the plain config; only its backward differs
    assert ro.style_config("split", 4) == ro.style_config("plain", 4)
    with pytest.raises(ValueError, match="even number of ranks, got 3"):
        ro.style_config("tp", 3)


def test_bad_runtime_tables_are_refused():
    text = Path(autopar.load_profile("local_cpu").path).read_text()
    base = text.split("\n[runtime]")[0].split("\n# host time per")[0]
    base = base.split("\n# The raw measurements")[0]
    good = '\n[runtime]\nlayer_overhead_s = { plain = 1e-3 }\nsource = "test"\n'
    assert profile_from_text(base + good).runtime_overhead_s == {"plain": 1e-3}
    assert profile_from_text(base + good).optimizer_overhead_s == {}
    assert profile_from_text(base + good).model_overhead_s == {}
    model = good.replace("source", "model_overhead_s = { tp = 2e-3 }\nsource")
    assert profile_from_text(base + model).model_overhead_s == {"tp": 2e-3}
    with pytest.raises(ProfileError, match=r"model_overhead_s: unknown style\(s\) gpu"):
        profile_from_text(base + model.replace("tp = 2e-3", "gpu = 2e-3"))
    with pytest.raises(ProfileError, match=r"unknown style\(s\) gpu.*known: plain, tp"):
        profile_from_text(base + good.replace("plain", "gpu"))
    with pytest.raises(ProfileError, match=r"runtime.layer_overhead_s.plain: must be >= 0"):
        profile_from_text(base + good.replace("1e-3", "-1e-3"))
    split = good.replace("plain = 1e-3", "plain = 1e-3, split = 3e-3")
    assert profile_from_text(base + split).runtime_overhead_s == {"plain": 1e-3, "split": 3e-3}
    with pytest.raises(ProfileError, match=r"runtime.layer_overhead_s.split: must be >= 0"):
        profile_from_text(base + split.replace("3e-3", "-3e-3"))
    with pytest.raises(ProfileError, match=r"layer_overhead_s.split: must be a number"):
        profile_from_text(base + split.replace("3e-3", '"fast"'))
    with pytest.raises(ProfileError, match="runtime.source: missing"):
        profile_from_text(base + good.replace('source = "test"', ""))


SPLIT = {**OVERHEADS, "split": 2.5e-3}  # the split backward costs 1.5 ms more than plain


def split_blocks(estimator: Estimator, cfg: ParallelConfig) -> list[int]:
    """Per stage, its blocks outside model chunk 0 (chunk 0 runs one full backward)."""
    chunks = estimator.chunks(cfg, estimator.layer_times(cfg, estimator.mesh(cfg)))
    out = [0] * cfg.pp
    for k, chunk in enumerate(chunks[1:], start=1):
        out[stage_of_chunk(cfg, k)] += sum(t.kind == "block" for t in chunk)
    return out


@pytest.mark.parametrize(
    "schedule, v, paid",
    [("gpipe", 1, False), ("1f1b", 1, False), ("zero_bubble", 1, True), ("dualpipe_v", 2, True)],
)
def test_split_backward_is_paid_per_layer_per_micro_batch_under_split_schedules(
    llama6, schedule, v, paid
):
    """o[split] - o[plain] per block per micro-batch on each stage's backward (its weight
    pass), outside model chunk 0; nothing under the other schedules nor on the forward."""
    tables = llama6
    bare = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), {})
    cfg = ParallelConfig(dp=2, pp=2, micro_batch_size=1, schedule=schedule, virtual_stages=v)
    base = Estimator(tables, with_overheads(bare, OVERHEADS), precision="fp32")
    est = Estimator(tables, with_overheads(bare, SPLIT), precision="fp32")
    a, b = base.evaluate(cfg, 8), est.evaluate(cfg, 8)
    assert split_backward_overhead_s(SPLIT, cfg) == pytest.approx(1.5e-3 if paid else 0.0)
    blocks = split_blocks(est, cfg)
    assert blocks[0] < sum(blocks) or not paid  # chunk 0 (stage 0) pays less or nothing
    for sa, sb, n in zip(a.stages, b.stages, blocks, strict=True):
        assert sb.forward_s == pytest.approx(sa.forward_s, rel=1e-12)
        extra = n * 1.5e-3 if paid else 0.0
        assert sb.backward_s - sa.backward_s == pytest.approx(extra, rel=1e-6, abs=1e-12)
    # on the weight-gradient part of the backward compute (what a split schedule delays)
    chunks = est.chunks(cfg, est.layer_times(cfg, est.mesh(cfg)))
    for layers, n in zip(stage_layers(cfg, chunks), blocks, strict=True):
        sa, sb = (
            e.timer.stage_times(cfg, e.mesh(cfg), layers, e.layer_times(cfg, e.mesh(cfg)),
                           first_chunk=chunks[0])
            for e in (base, est)
        )  # fmt: skip
        for key in ("weight_grad", "compute_backward", "backward"):
            assert sb[key] - sa[key] == pytest.approx(n * 1.5e-3 if paid else 0.0, abs=1e-12)
    assert (b.step_time_s > a.step_time_s) if paid else (b.step_time_s == a.step_time_s)
    # no pipeline, no split: a zero_bubble schedule on pp 1 changes nothing
    flat = ParallelConfig(dp=4, micro_batch_size=1, schedule="zero_bubble")
    assert split_backward_overhead_s(SPLIT, flat) == 0.0


def test_split_overhead_does_not_leak_through_the_layer_time_cache(llama):
    """zero_bubble and 1f1b share their cached layer times; priced by one Estimator in either
    order each gets what a fresh Estimator gives it."""
    _, _, tables = llama
    cluster = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), SPLIT)
    zb = ParallelConfig(dp=2, pp=2, micro_batch_size=1, schedule="zero_bubble")
    ofob = dataclasses.replace(zb, schedule="1f1b")
    assert Estimator.times_key(zb) == Estimator.times_key(ofob)
    fresh = {
        c: Estimator(tables, cluster, precision="fp32").evaluate(c, 8).step_time_s
        for c in (zb, ofob)
    }
    assert fresh[zb] != fresh[ofob]
    for order in ((zb, ofob), (ofob, zb)):
        shared = Estimator(tables, cluster, precision="fp32")
        for c in order * 2:
            assert shared.evaluate(c, 8).step_time_s == fresh[c]


def test_a_profile_without_the_split_style_prices_as_before(llama):
    """No "split" in [runtime] (every profile before it, local_cpu's too), or a split no
    dearer than plain: a split schedule is priced with no extra."""
    _, _, tables = llama
    bare = with_overheads(Cluster.from_profile("local_cpu", num_devices=4), {})
    cfg = ParallelConfig(dp=2, pp=2, micro_batch_size=1, schedule="zero_bubble")
    assert split_backward_overhead_s(OVERHEADS, cfg) == 0.0
    assert split_backward_overhead_s({}, cfg) == 0.0
    cheaper = {**OVERHEADS, "split": 0.5e-3}  # below plain: at least 0
    assert split_backward_overhead_s(cheaper, cfg) == 0.0
    times = {
        Estimator(tables, with_overheads(bare, o), precision="fp32").evaluate(cfg, 8).step_time_s
        for o in (OVERHEADS, cheaper, {**OVERHEADS, "split": 1e-3})
    }
    assert len(times) == 1
