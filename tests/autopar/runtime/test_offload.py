"""Activation offloading at run time (ParallelConfig.offload_layers): the first k blocks of each
chunk run under torch's save_on_cpu, and training is exactly one process's: PP2 with full
recompute on 1 block and offload on 1 per stage, DP2 with offload on 2 of 4 blocks, on 2 gloo
ranks in one spawn; in one process, the hooks are live (a saved tensor changed in place after
the forward no longer reaches the backward) and the gradients are unchanged."""

from __future__ import annotations

import pytest
import torch
from harness import Case, max_rel_error, reference, run_cases, run_ranks, task_of

import autopar
from autopar.config import ParallelConfig as C
from autopar.models import zoo
from autopar.runtime.mesh import build_mesh
from autopar.runtime.offload import apply_offload
from autopar.runtime.parallelize import PipelineSpec, parallelize_model

L4 = {"num_layers": 4}
CASES = [
    Case("gpt-tiny", C(pp=2, recompute="full", recompute_layers=1, offload_layers=1), overrides=L4),
    Case("llama-tiny", C(dp=2, offload_layers=2), overrides=L4),
]
# per case, per pp rank: the blocks whose forward runs under save_on_cpu
OFFLOADED = [[["blocks.0"], ["blocks.2"]], [["layers.0", "layers.1"]] * 2]


def _offloaded(case: Case) -> list[str]:
    task = task_of(case)
    model, config = task.build(), case.config
    spec = PipelineSpec(4, task.loss) if config.pp > 1 else None
    pm = parallelize_model(model, build_mesh(config), config, pipeline=spec)
    return [
        name
        for name in pm.blocks
        if getattr(pm.model.get_submodule(name).forward, "offloads_activations", False)
    ]


def _rank(cases: list[Case]) -> tuple[list, list[list[str]]]:
    return run_cases(cases), [_offloaded(case) for case in cases]


@pytest.mark.multiprocess
def test_offload_on_some_layers_matches_single_process():
    per_rank = run_ranks(2, _rank, CASES)
    for i, case in enumerate(CASES):
        assert [names[i] for _, names in per_rank] == OFFLOADED[i], case.label
        want = reference(case)
        err = max(max_rel_error(results[i], want) for results, _ in per_rank)
        assert err <= 1e-5, f"{case.label}: {err:.2e}"


def test_saved_tensors_are_copies_and_gradients_unchanged():
    torch.manual_seed(0)
    plain, moved = zoo.build("gpt-tiny", num_layers=2), zoo.build("gpt-tiny", num_layers=2)
    moved.load_state_dict(plain.state_dict())
    blocks = list(moved.blocks.named_children())
    assert apply_offload(blocks, 5) == 2  # fewer blocks than asked: all of them
    with pytest.raises(ValueError, match="offload_layers must be >= 0, got -1"):
        apply_offload(blocks, -1)
    x = torch.randn(2, 8, plain.blocks[0].ln_1.normalized_shape[0], requires_grad=True)
    # the block saves its input for the norm's backward: changed in place after the forward,
    # autograd refuses the plain block, while the offloaded one saved a copy
    for model, raises in ((plain, True), (moved, False)):
        h = x.clone()
        out = model.blocks[0](h)
        h.add_(1.0)
        if raises:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
        else:
            out.sum().backward()
    tokens = zoo.example_inputs("gpt-tiny", plain)[0].repeat(2, 1)
    grads = []
    for model in (plain, moved):
        model.zero_grad()
        zoo.loss_fn("gpt-tiny")(model(tokens), tokens).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0)


def test_the_compiled_stack_refuses_offload_by_name():
    model = zoo.build("gpt-tiny", device="meta", num_layers=2)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    with pytest.raises(autopar.ConfigError, match="offload_layers=1 on the autopar-compile"):
        autopar.evaluate(
            model, cluster, C(dp=2, offload_layers=1), zoo.example_inputs("gpt-tiny", model),
            global_batch_size=4, stack="autopar-compile",
        )  # fmt: skip
