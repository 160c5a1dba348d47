"""Asynchronous tensor parallelism as a config choice (ParallelConfig.async_tp): priced by the
stack's async_tp_overlap (the TP collectives' hidden share), refused by name on a stack that
cannot run it or without sequence parallelism, and offered by the search where it hides more
than the stack's own TP overlap."""

from __future__ import annotations

from dataclasses import replace

import pytest

import autopar
from autopar.config import ParallelConfig
from autopar.estimate.stacks import load_stack
from autopar.models import zoo
from autopar.solve.space import SpaceLimits, inner_choices


@pytest.fixture(scope="module")
def tiny():
    model = zoo.build("llama-tiny", device="meta", num_layers=2)
    inputs = zoo.example_inputs("llama-tiny", model, batch_size=1)
    return model, autopar.trace(model, inputs)


def _tp_comm(tiny, config: ParallelConfig, stack: str) -> float:
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    plan = autopar.evaluate(model, cluster, config, global_batch_size=8, graph=graph, stack=stack)
    return plan.breakdown["tp_comm"]


def test_async_tp_hides_the_stacks_share_of_the_tp_collectives(tiny):
    plain = ParallelConfig(tp=2, sequence_parallel=True)
    exposed = _tp_comm(tiny, plain, "torchtitan-compile")
    options = load_stack("torchtitan-compile").options
    assert options.async_tp_overlap == pytest.approx(0.8)
    # the hidden share still slows the GEMMs it overlaps (the stack's comm_interference)
    hidden = options.async_tp_overlap * (1 - options.comm_interference)
    overlapped = _tp_comm(tiny, replace(plain, async_tp=True), "torchtitan-compile")
    assert overlapped == pytest.approx(exposed * (1 - hidden))
    # Megatron-Core's --tp-comm-overlap is its async TP: the same share either way
    core = _tp_comm(tiny, plain, "megatron-core")
    assert _tp_comm(tiny, replace(plain, async_tp=True), "megatron-core") == pytest.approx(core)


def test_async_tp_is_refused_where_it_cannot_run(tiny):
    model, graph = tiny
    cluster = autopar.Cluster.from_profile("dgx_h100", num_devices=2)
    config = ParallelConfig(tp=2, sequence_parallel=True, async_tp=True)
    with pytest.raises(autopar.ConfigError, match="async_tp: the autopar stack does not"):
        autopar.evaluate(model, cluster, config, global_batch_size=8, graph=graph)
    with pytest.raises(autopar.ConfigError, match="needs tp > 1 and sequence_parallel"):
        ParallelConfig(tp=2, async_tp=True).validate()


def test_the_search_offers_async_tp_instead_of_plain_tp_with_sp_only_where_asked():
    """Where the stack runs async TP, a plain TP + SP config is never faster at the same
    memory: the space offers the async one in its place."""
    lim = SpaceLimits(
        world_size=2, devices_per_node=2, num_blocks=2, num_heads=4, seq_len=64,
        num_experts=0, global_batch_size=4, micro_batch_sizes=(1,),
    )  # fmt: skip
    degrees = (1, 1, 1, 2, 1, 1)  # tp=2
    plain = list(inner_choices(lim, degrees))
    both = list(inner_choices(replace(lim, async_tp=True), degrees))
    assert not any(c.async_tp for c in plain)
    assert {c for c in both if not c.async_tp} == {c for c in plain if not c.sequence_parallel}
    assert {replace(c, async_tp=False) for c in both if c.async_tp} == {
        c for c in plain if c.sequence_parallel
    }
