"""The search places the mesh axes on the topology: a non-default axis order wins where it
should, and the default stays where tensor parallelism belongs inside the node."""

from __future__ import annotations

from dataclasses import replace

import autopar
from autopar import Cluster
from autopar.estimate import Estimator, build_tables
from autopar.estimate.layout import mesh_axes
from autopar.models import zoo
from autopar.solve.space import axis_orders


def _traced(name: str, **overrides):
    model = zoo.build(name, device="meta", **overrides)
    return model, autopar.trace(model, zoo.example_inputs(name, model))


def test_axis_orders_move_only_the_axes_of_degree_above_one():
    assert axis_orders((1, 1, 1, 1, 2, 1)) == [None]  # pp alone: nothing to place
    assert axis_orders((1, 8, 1, 2, 1, 1)) == [None, ("fsdp", "cp", "tp", "dp")]
    orders = axis_orders((2, 2, 2, 2, 1, 1))
    assert len(orders) == 24 == len(set(orders)) and orders[0] is None


def test_fsdp_inside_the_node_and_tp_across_when_tp_messages_are_small(tmp_path):
    # A 70B-wide model (hidden 8192, 8 layers) on 2 x DGX H100 with short sequences (1024) and
    # 16 sequences a step: ZeRO-3 gathers every layer's 1.6 GB of weights each micro-batch,
    # TP's all-reduces move only 2 x 1024 x 8192 x 2 B = 32 MiB of activations. With tp
    # innermost the fsdp group strides over both nodes and every gather crosses InfiniBand;
    # fsdp innermost keeps the gathers on NVLink and sends only TP's activations across.
    # Priced for Megatron-LM, whose hidden gathers cost its GEMMs nothing: on a stack whose
    # hidden traffic slows compute (torchtitan's FSDP2) ZeRO-1 with tp=4 x pp=2 wins instead.
    model, graph = _traced(
        "llama-8b", num_layers=8, seq_len=1024, hidden=8192, num_heads=64, num_kv_heads=8,
        ffn_hidden=28672,
    )  # fmt: skip
    cluster = Cluster.from_profile("dgx_h100", num_nodes=2)
    plan = autopar.parallelize(
        model, cluster, global_batch_size=16, graph=graph, stack="megatron-lm"
    )
    cfg = plan.config
    assert (cfg.fsdp, cfg.tp, cfg.axis_order) == (8, 2, ("fsdp", "cp", "tp", "dp"))
    assert "order=fsdp,cp,tp,dp" in cfg.as_text()
    where = {a["axis"]: a for a in mesh_axes(cluster, cfg)}
    assert where["fsdp"]["num_nodes"] == 1 and where["tp"]["num_nodes"] == 2
    estimator = Estimator(build_tables(graph), cluster)
    mine = estimator.evaluate(cfg, 16).step_time_s
    default = estimator.evaluate(replace(cfg, axis_order=None), 16).step_time_s
    assert mine < 0.9 * default  # the fsdp gathers on NVLink save more than 10%
    plan.save(tmp_path)  # plan.json keeps the order; train.py's mesh comment names it
    assert autopar.Plan.from_json((tmp_path / "plan.json").read_text()).config == cfg
    assert "axis order fsdp,cp,tp,dp innermost first" in (tmp_path / "train.py").read_text()


def test_llama3_8b_on_two_dgx_h100_keeps_the_default_order():
    model, graph = _traced("llama-8b", num_layers=32)
    cluster = Cluster.from_profile("dgx_h100", num_nodes=2)
    plan = autopar.parallelize(model, cluster, global_batch_size=64, graph=graph)
    assert plan.config.axis_order is None
    assert "axis_order" not in plan.to_json()
