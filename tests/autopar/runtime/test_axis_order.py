"""Axis orders at run time: the DeviceMesh in the plan's order has the estimator's groups, and a
non-default order (dp or fsdp inner, tp outer; ep over inner dp) matches one process."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from harness import Case, max_rel_error, reference, run_cases, run_ranks

from autopar.config import ParallelConfig as C
from autopar.estimate.mesh import axis_ranks
from autopar.runtime.mesh import AXES, build_mesh, mesh_layout

DP_TP = ("dp", "cp", "fsdp", "tp")  # dp inner, tp outer
LAYOUTS = [
    C(dp=2, tp=2),
    C(dp=2, tp=2, axis_order=DP_TP),
    C(fsdp=2, cp=2, zero_stage=3, axis_order=("tp", "fsdp", "cp", "dp")),
    C(dp=2, tp=2, ep=2, axis_order=DP_TP),
    C(dp=2, tp=2, ep=2),
    # ep folded over fsdp x cp (cp first), and over dp x cp with an expert data group
    C(fsdp=2, cp=2, zero_stage=3, ep=2, axis_order=("tp", "fsdp", "cp", "dp")),
    C(dp=2, cp=2, ep=2),
]
CASES = [
    Case("gpt-tiny", C(dp=2, tp=2, axis_order=DP_TP)),
    Case("llama-tiny", C(fsdp=2, tp=2, zero_stage=2, sequence_parallel=True, axis_order=DP_TP)),
    Case("moe-tiny", C(dp=2, ep=2, tp=2, axis_order=DP_TP)),
]


def test_mesh_layout_follows_the_strides():
    for cfg in [*LAYOUTS, C(dp=2, fsdp=2, cp=2, tp=2, pp=2, zero_stage=1, axis_order=DP_TP)]:
        layout, strides = mesh_layout(cfg), cfg.strides
        for coords in layout.flatten().tolist():
            index = [coords // strides[a] % getattr(cfg, a) for a in AXES]
            assert layout[tuple(index)].item() == coords
    # the default order is today's arange(world).reshape(pp, dp, fsdp, cp, tp)
    assert mesh_layout(C(dp=2, tp=2)).flatten().tolist() == [0, 1, 2, 3]
    assert mesh_layout(C(dp=2, tp=2, axis_order=DP_TP)).flatten().tolist() == [0, 2, 1, 3]


def _groups_then_train(layouts: list[C], cases: list[Case]) -> tuple[list, list]:
    """On one rank: per layout, the ranks of each axis' group holding this rank (and the ep
    group); then the cases' (loss, grad norm) per step."""
    from autopar.runtime.parallelize import _expert_groups

    groups = []
    for cfg in layouts:
        mesh = build_mesh(cfg, "cpu")
        got = {a: dist.get_process_group_ranks(mesh.group(a)) for a in AXES if mesh.size(a) > 1}
        expert = _expert_groups(mesh, cfg)
        if expert is not None:
            got["ep"] = dist.get_process_group_ranks(expert.ep)
            if expert.data is not None:
                got["expert_dp"] = dist.get_process_group_ranks(expert.data)
        groups.append(got)
    return groups, run_cases(cases)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_runtime_groups_equal_the_estimators_and_reordered_meshes_match_one_process():
    per_rank = run_ranks(4, _groups_then_train, LAYOUTS, CASES)
    for i, cfg in enumerate(LAYOUTS):
        want = axis_ranks(cfg)
        for rank, (groups, _) in enumerate(per_rank):
            for axis, ranks in groups[i].items():
                if 0 in ranks:  # the estimator prices the group that holds rank 0
                    assert tuple(sorted(ranks)) == want[axis], (cfg.as_text(), axis, rank)
                if axis not in ("ep", "expert_dp"):  # the ranks differing in that coordinate
                    stride = cfg.strides[axis]
                    base = rank - rank // stride % getattr(cfg, axis) * stride
                    assert sorted(ranks) == [base + k * stride for k in range(getattr(cfg, axis))]
    # tp outer: rank 0's tp partner is 2, its dp partner 1 (the default has them the other way)
    assert per_rank[0][0][1]["tp"] == [0, 2] and per_rank[0][0][1]["dp"] == [0, 1]
    assert per_rank[0][0][0]["tp"] == [0, 1]
    assert per_rank[0][0][3]["ep"] == [0, 1] and per_rank[0][0][4]["ep"] == [0, 2]
    for i, case in enumerate(CASES):
        want = reference(case)
        err = max(max_rel_error(results[i], want) for _, results in per_rank)
        print(f"{case.label}: max relative error {err:.1e}")
        assert err <= 1e-5, f"{case.label}: max relative error {err:.2e}"
