"""The zoo's MoE: dense dispatch equals routed dispatch, top_k matters, FLOPs are E/k routed.

The reference is written here, one token at a time: softmax over the router logits, keep the
top k, renormalise, and sum the chosen experts' outputs, as Mixtral's routing does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from autopar.models import zoo
from autopar.models.layers import SwiGLU
from autopar.models.moe import MoEBlock


def routed_reference(block: MoEBlock, x_TH: torch.Tensor) -> torch.Tensor:
    """Loop over tokens; run only each token's top-k experts."""
    out_TH = torch.zeros_like(x_TH)
    for t in range(x_TH.shape[0]):
        probs_E = F.softmax(x_TH[t] @ block.router.weight.T, dim=-1)
        top_K, idx_K = probs_E.topk(block.top_k)
        top_K = top_K / top_K.sum()
        for weight, expert_idx in zip(top_K, idx_K.tolist(), strict=True):
            out_TH[t] += weight * block.experts[expert_idx](x_TH[t : t + 1])[0]
    return out_TH


def _block(top_k: int, num_experts: int = 6) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(hidden=16, ffn_hidden=24, num_experts=num_experts, top_k=top_k)
    for p in block.parameters():  # larger than the 0.02 init, so routing is far from uniform
        torch.nn.init.normal_(p, std=0.5)
    return block


@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_dense_dispatch_equals_the_routed_reference(top_k):
    block = _block(top_k)
    x_BSH = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    dense = block(x_BSH).reshape(10, 16)
    routed = routed_reference(block, x_BSH.reshape(10, 16))
    torch.testing.assert_close(dense, routed, rtol=1e-5, atol=1e-5)


def test_routing_weights_are_top_k_sparse_and_sum_to_one():
    block = _block(top_k=2)
    w_TE = block.routing_weights(torch.randn(7, 16))
    assert w_TE.shape == (7, 6)
    assert ((w_TE > 0).sum(-1) == 2).all()
    torch.testing.assert_close(w_TE.sum(-1), torch.ones(7))


def test_top_k_changes_the_output():
    model_k1 = zoo.build("moe-tiny", top_k=1)
    model_k2 = zoo.build("moe-tiny", top_k=2)
    (ids,) = zoo.example_inputs("moe-tiny", model_k1)
    # Same seed and shapes: the same weights, so only the routing differs.
    for p1, p2 in zip(model_k1.parameters(), model_k2.parameters(), strict=True):
        assert torch.equal(p1, p2)
    assert not torch.allclose(model_k1(ids), model_k2(ids))


def test_every_n_makes_every_nth_layer_moe():
    model = zoo.build("moe-tiny", num_layers=4, every_n=2)
    kinds = [type(layer.mlp) for layer in model.layers]
    assert kinds == [SwiGLU, MoEBlock, SwiGLU, MoEBlock]
    assert all(isinstance(layer.mlp, MoEBlock) for layer in zoo.build("moe-tiny").layers)


def test_block_exposes_what_the_tracer_reads():
    block = zoo.build("moe-tiny").layers[0].mlp
    assert (block.num_experts, block.top_k) == (4, 2)
    assert block.dense_dispatch is True
    assert block.routed_flop_fraction == 0.5
    assert isinstance(block.experts, torch.nn.ModuleList) and len(block.experts) == 4
    assert block.router.weight.shape == (4, 64) and block.router.bias is None


def test_dense_graph_holds_num_experts_over_top_k_times_the_routed_expert_flops():
    block = _block(top_k=2, num_experts=6)
    tokens, hidden, ffn = 10, 16, 24
    with FlopCounterMode(display=False) as counter:
        block(torch.randn(1, tokens, hidden))
    counts = counter.get_flop_counts()
    expert_flops = sum(sum(counts[f"MoEBlock.experts.{e}"].values()) for e in range(6))
    routed_flops = block.top_k * 3 * 2 * tokens * hidden * ffn  # gate, up, down GEMMs
    assert expert_flops * block.routed_flop_fraction == routed_flops
