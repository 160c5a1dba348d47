"""Expert parallelism: all-to-all dispatch equals the dense MoE block (forward and gradients),
and EP folded over dp4 (ep2: experts on two ranks each; ep4: one per rank) trains moe-tiny
through the trainer as one process does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import Case, check_cases, run_ranks

from autopar.config import ParallelConfig as C
from autopar.models.moe import MoEBlock
from autopar.runtime.expert_parallel import ExpertGroups, apply_expert_parallel, expert_owner


def test_expert_owner_takes_contiguous_blocks():
    assert [expert_owner(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def _block() -> MoEBlock:
    torch.manual_seed(0)
    return MoEBlock(hidden=16, ffn_hidden=24, num_experts=4, top_k=2)


def _dispatch_errors() -> dict[str, float]:
    """Rank r's tokens through the EP block vs the same rows of the dense block run on every
    rank's tokens; gradients: experts (owner), router (summed over ranks), inputs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(world, 2, 5, 16, generator=gen)  # [rank, B, S, H]
    g_all = torch.randn(world, 2, 5, 16, generator=gen)
    dense = _block()
    x_dense = x_all.clone().requires_grad_()
    want = dense(x_dense.reshape(-1, 5, 16)).view_as(x_all)
    (want * g_all).sum().backward()

    block = _block()
    ep = apply_expert_parallel(block, ExpertGroups(dist.group.WORLD, None, None))
    x = x_all[rank].clone().requires_grad_()
    got = block(x)
    (got * g_all[rank]).sum().backward()
    router = block.router.weight.grad.clone()
    dist.all_reduce(router)
    dense_params = dict(dense.named_parameters())
    expert_err = max(
        (p.grad - dense_params[name].grad).abs().max().item()
        for name, p in block.named_parameters()
        if ep.is_expert(name)
    )
    return {
        "forward": (got - want[rank]).abs().max().item(),
        "input grad": (x.grad - x_dense.grad[rank]).abs().max().item(),
        "router grad": (router - dense.router.weight.grad).abs().max().item(),
        "expert grads": expert_err,
        "experts held": float(len(block.experts)),
    }


@pytest.mark.multiprocess
def test_all_to_all_dispatch_equals_dense_block_on_2_ranks():
    for errors in run_ranks(2, _dispatch_errors):
        assert errors.pop("experts held") == 2
        for what, err in errors.items():
            assert err < 1e-6, f"{what}: max abs error {err:.2e}"


@pytest.mark.multiprocess
def test_ep_with_expert_data_parallel_and_one_expert_per_rank_through_the_trainer():
    """dp4 with ep2: each expert on 2 ranks, synced over the expert data group; dp4 with ep4:
    one expert per rank. (EP2 over dp2, with TP2 and with CP2: test_numerics_cp_ep.py and
    test_numerics_4ranks.py.)"""
    check_cases(4, [Case("moe-tiny", C(dp=4, ep=2)), Case("moe-tiny", C(dp=4, ep=4))])
