"""Per-layer recompute at run time (ParallelConfig.recompute_layers): only the first k blocks of
each pipeline chunk (or of the model) run under torch's checkpoint, and training is exactly one
process's: PP2 with full recompute on 1 of 2 blocks per stage, PP2 interleaved (1 of 2 per
chunk) and DP2 with selective recompute on 1 of 4 blocks, on 2 gloo ranks in one spawn."""

from __future__ import annotations

import pytest
import torch
from harness import Case, max_rel_error, reference, run_cases, run_ranks, task_of

from autopar.config import ParallelConfig as C
from autopar.models import zoo
from autopar.runtime.mesh import build_mesh
from autopar.runtime.parallelize import PipelineSpec, parallelize_model
from autopar.runtime.recompute import apply_recompute

L4, L8 = {"num_layers": 4}, {"num_layers": 8}
CASES = [
    Case("gpt-tiny", C(pp=2, recompute="full", recompute_layers=1), overrides=L4),
    Case(
        "llama-tiny",
        C(
            pp=2,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            recompute="full",
            recompute_layers=1,
        ),
        overrides=L8,
    ),  # fmt: skip
    Case("llama-tiny", C(dp=2, recompute="selective", recompute_layers=1), overrides=L4),
]
# per case, per pp rank: the blocks whose forward runs under checkpoint
WRAPPED = [
    [["blocks.0"], ["blocks.2"]],
    [["layers.0", "layers.4"], ["layers.2", "layers.6"]],
    [["layers.0"], ["layers.0"]],
]


def _wrapped(case: Case) -> list[str]:
    """On one rank: the blocks parallelize_model wrapped (their forward has __wrapped__)."""
    task = task_of(case)
    model, config = task.build(), case.config
    spec = PipelineSpec(4, task.loss) if config.pp > 1 else None
    pm = parallelize_model(model, build_mesh(config), config, pipeline=spec)
    return [b for b in pm.blocks if hasattr(pm.model.get_submodule(b).forward, "__wrapped__")]


def _rank(cases: list[Case]) -> tuple[list, list[list[str]]]:
    return run_cases(cases), [_wrapped(case) for case in cases]


@pytest.mark.multiprocess
def test_recompute_on_some_layers_matches_single_process():
    per_rank = run_ranks(2, _rank, CASES)
    for i, case in enumerate(CASES):
        assert [wrapped[i] for _, wrapped in per_rank] == WRAPPED[i], case.label
        want = reference(case)
        err = max(max_rel_error(results[i], want) for results, _ in per_rank)
        print(f"{case.label}: max relative error {err:.1e}")
        assert err <= 1e-5, f"{case.label}: {err:.2e}"


def test_apply_recompute_wraps_the_first_k_blocks_and_keeps_the_gradients():
    torch.manual_seed(0)
    plain, wrapped = zoo.build("gpt-tiny", num_layers=3), zoo.build("gpt-tiny", num_layers=3)
    blocks = list(wrapped.blocks.named_children())
    assert apply_recompute(blocks, "full", 2) == 2
    assert [hasattr(b.forward, "__wrapped__") for _, b in blocks] == [True, True, False]
    assert apply_recompute(list(plain.blocks.named_children())[:1], "selective", 5) == 1
    assert apply_recompute(blocks, "none", 2) == 0
    with pytest.raises(ValueError, match="recompute_layers must be None or >= 1, got 0"):
        apply_recompute(blocks, "full", 0)
    plain = zoo.build("gpt-tiny", num_layers=3)
    tokens = zoo.example_inputs("gpt-tiny", plain)[0].repeat(2, 1)
    grads = []
    for model in (plain, wrapped):
        model.zero_grad()
        model(tokens).float().pow(2).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
