"""Megatron-Core's module recompute (ParallelConfig.recompute_modules) found in the trace and
priced: each named part of a block is found by structure (`module_regions`), recomputing it
drops exactly the saved values made inside it (and, for the regions Megatron checkpoints
without their output, the output too), costs its forward again, and is searched and exported
only for the stacks that run it."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.estimate import CostOptions, Estimator, build_tables
from autopar.estimate.module_regions import block_regions, model_regions, module_sets
from autopar.estimate.saved_split import value_bytes
from autopar.models import hf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _traced(name: str, seq_len: int = 32):
    model = hf.build(name, device="meta")
    graph = autopar.trace(model, hf.example_inputs(name, model, seq_len=seq_len))
    return model, graph


@pytest.fixture(scope="module")
def llama():
    return _traced("llama-tiny-hf")


def _under(graph, paths: tuple[str, ...]) -> set[str]:
    """The nodes whose module is one of ``paths`` or inside one."""
    return {
        n
        for n, node in graph.nodes.items()
        if any(node.module_path == p or node.module_path.startswith(p + ".") for p in paths)
    }


def test_a_llama_block_has_megatrons_three_parts(llama):
    model, graph = llama
    assert model_regions(graph) == ("core_attn", "mlp", "layernorm")
    for layer in (x for x in graph.layers if x.kind == "block"):
        regions = block_regions(layer, graph.nodes)
        saved = set(layer.saved_values["none"])
        mlp = regions["mlp"]
        assert mlp.module_paths == (f"{layer.name}.mlp",)
        # a plain checkpoint: every saved value the MLP makes goes (its output is not saved)
        assert mlp.frees == saved & _under(graph, mlp.module_paths) and mlp.frees
        norms = regions["layernorm"]
        assert norms.module_paths == (
            f"{layer.name}.input_layernorm",
            f"{layer.name}.post_attention_layernorm",
        )
        # checkpointed without their output: the normalised values the projections save go
        made = saved & _under(graph, norms.module_paths)
        assert norms.frees == made
        assert any(graph.nodes[v].op == "aten.mul.Tensor" for v in norms.frees)
        (op,) = regions["core_attn"].ops
        assert graph.nodes[op].op_class == "attention"


def test_dropped_bytes_are_the_parts_saved_values(llama):
    _, graph = llama
    tables = build_tables(graph)
    # in fp32: the eager norms' upcasts are then as wide as traced (`kernel_savings`)
    est = Estimator(tables, autopar.Cluster.from_profile("dgx_h100", num_devices=1),
                    precision="fp32", options=CostOptions())  # fmt: skip
    blocks = [x for x in graph.layers if x.kind == "block"]
    table = next(t for t in tables.layers if t.name == blocks[0].name)
    regions = block_regions(blocks[0], graph.nodes)

    def kept(mods) -> float:
        cfg = ParallelConfig(recompute="selective" if mods else "none", recompute_modules=mods)
        return est.memory.activation_bytes(cfg, table, est.memory.policy(cfg, table, None))

    def nbytes(values) -> float:
        return sum(value_bytes(graph.nodes[v]) for v in values) * est.act_scale

    saved = set(blocks[0].saved_values["none"])
    none = kept(())
    for mods in (("mlp",), ("layernorm",), ("mlp", "layernorm")):
        freed = set().union(*(regions[m].frees for m in mods))
        # a checkpoint keeps its inputs (the norms': the block's input and the residual, which
        # the eager norms' upcasts alias), unless another part frees them (the MLP's input)
        added = set().union(*(regions[m].keeps for m in mods)) - saved - freed
        assert none - kept(mods) == pytest.approx(nbytes(freed) - nbytes(added)), mods
        assert nbytes(freed) > 0
    assert regions["mlp"].keeps <= regions["layernorm"].frees


def test_recompute_time_is_the_parts_forward(llama):
    _, graph = llama
    tables = build_tables(graph)
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    est = Estimator(tables, cluster, options=CostOptions())

    def recompute(mods=(), policy="selective", **degrees) -> float:
        cfg = ParallelConfig(recompute=policy, recompute_modules=mods, **degrees)
        times = est.layer_times(cfg, est.mesh(cfg))
        return sum(t.recompute_s for name, t in times.items() if name.startswith("model.layers"))

    parts = {m: recompute((m,)) for m in ("core_attn", "mlp", "layernorm")}
    assert all(v > 0 for v in parts.values())
    together = recompute(("core_attn", "mlp", "layernorm"))
    assert together == pytest.approx(sum(parts.values()))
    # the parts leave out the q/k/v/o projections, the rotary and the residual adds
    assert together < recompute(policy="full", dp=2)
    # under tp with SP the MLP's re-run gathers and scatters again: its row-parallel matmul's
    # share of the layer's tp traffic (one of two equal all-reduces); the norms' none
    tp = ParallelConfig(tp=2, sequence_parallel=True, recompute="selective")
    hidden = Estimator(tables, cluster, options=CostOptions(tp_comm_overlap=1.0))
    for mods, share in ((("mlp",), 0.5), (("layernorm",), 0.0)):
        cfg = replace(tp, recompute_modules=mods)
        (shown, covered) = (
            [t for n, t in e.layer_times(cfg, e.mesh(cfg)).items() if n.startswith("model.layers")]
            for e in (est, hidden)
        )
        for a, b in zip(shown, covered, strict=True):
            assert a.tp_forward_s > 0 and b.tp_forward_s == 0
            assert a.recompute_s - b.recompute_s == pytest.approx(share * a.tp_forward_s), mods


def test_moe_parts_found_and_the_dispatch_kept_unless_the_layer_reruns():
    _, graph = _traced("qwen2-moe-tiny-hf")
    present = model_regions(graph)
    assert present == ("core_attn", "moe", "moe_act", "shared_experts", "layernorm")
    layer = next(x for x in graph.layers if x.kind == "block" and x.moe)
    regions = block_regions(layer, graph.nodes)
    assert regions["moe"].module_paths == (layer.moe.router.rsplit(".", 1)[0],)
    assert all(".shared_expert" in p for p in regions["shared_experts"].module_paths)
    act_ops = {graph.nodes[n].op for n in regions["moe_act"].ops}
    assert "aten.silu.default" in act_ops and "aten.mm.default" not in act_ops
    assert set(regions["moe_act"].ops) < set(regions["moe"].ops)
    # the search's sets: the cheap parts together, the MoE layer with the norms
    assert module_sets(present) == (("moe_act", "layernorm"), ("moe", "layernorm"))
    assert module_sets(model_regions(_traced("llama-tiny-hf")[1])) == (
        ("layernorm",),
        ("mlp", "layernorm"),
    )


def test_module_recompute_runs_on_megatron_and_is_refused_by_autopars_runtime(llama):
    model, graph = llama
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    cfg = ParallelConfig(dp=2, recompute="selective", recompute_modules=("mlp", "layernorm"))
    with pytest.raises(autopar.AutoparError, match="Megatron-Core recomputes named parts"):
        autopar.evaluate(model, cluster, cfg, global_batch_size=4, graph=graph)
    plan = autopar.evaluate(
        model, cluster, cfg, global_batch_size=4, graph=graph, stack="megatron-core"
    )
    assert plan.config.recompute_modules == ("mlp", "layernorm")
    assert plan.breakdown["recompute"] > 0
    again = autopar.Plan.from_json(plan.to_json())
    assert again.config == plan.config
