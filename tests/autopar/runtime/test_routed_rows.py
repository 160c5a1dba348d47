"""The expert load a run measures is its routing's (issue 20): under expert parallelism each
rank counts the rows its all-to-alls send and receive (`collectives.RoutedRows`, per step in
`StepResult.routed_rows`), and the program prints the busiest rank's load over the mean beside
the imbalance the plan priced (`CostOptions.moe_imbalance`).

Checked against one process: the tiny MoE's routers run on the whole global batch there, each
token's top k experts counted to the rank that owns them; on 2 gloo ranks (EP2 folded over
DP2) every rank's sent and received rows of the first step equal those counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import Case, run_ranks, task_of

from autopar.config import ParallelConfig as C
from autopar.models.moe import MoEBlock
from autopar.runtime.expert_parallel import expert_owner
from autopar.runtime.trainer import TrainOptions, train

CASE = Case("moe-tiny", C(dp=2, ep=2), global_batch_size=8)


def _measured(case: Case) -> list[tuple[int, int]]:
    steps = train(task_of(case), case.config, case.global_batch_size,
                  options=TrainOptions(steps=1, log=False))  # fmt: skip
    return [r.routed_rows for r in steps]


def _expected(case: Case, ranks: int) -> list[tuple[int, int]]:
    """Per rank (its data share: sequences [r * 4, r * 4 + 4)), the pairs it routes and the
    pairs of all ranks whose experts it owns, every MoE layer."""
    task = task_of(case)
    model = task.build()
    owners: list[torch.Tensor] = []  # per MoE layer, the owner of each (token, slot) pair
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]

    def hook(block: MoEBlock):
        def record(module, args, logits):  # as MoEBlock routes: softmax, then top k
            idx = F.softmax(logits.float(), dim=-1).topk(block.top_k, dim=-1).indices
            flat = idx.flatten().tolist()
            owners.append(torch.tensor([expert_owner(e, block.num_experts, ranks) for e in flat]))

        return record

    for block in blocks:
        block.router.register_forward_hook(hook(block))
    inputs, _ = task.batch(0, 0, case.global_batch_size)
    per_rank = case.global_batch_size // ranks
    out = []
    for r in range(ranks):
        owners.clear()
        with torch.no_grad():
            task.forward(model, tuple(t[r * per_rank : (r + 1) * per_rank] for t in inputs))
        sent = sum(len(o) for o in owners)
        out.append((sent, [torch.bincount(o, minlength=ranks) for o in owners]))
    return [
        (out[r][0], int(sum(counts[r] for _, layers in out for counts in layers)))
        for r in range(ranks)
    ]


@pytest.mark.multiprocess
def test_each_rank_counts_the_rows_its_routing_sends_and_receives():
    got = [steps[0] for steps in run_ranks(2, _measured, CASE)]
    want = _expected(CASE, 2)
    assert got == want, (got, want)
    assert got[0][0] == got[1][0]  # every rank routes as many pairs
    assert sum(s for s, _ in got) == sum(r for _, r in got)  # what is sent is received
    assert got[0][1] != got[1][1]  # this batch loads the ranks unevenly
