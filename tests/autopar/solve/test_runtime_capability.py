"""The planner offers only what the runtime can run (issue 19, first part): a model the runtime
cannot cut into pipeline stages (`autopar.runtime.parts`) gets no pipeline plan, one whose
blocks it cannot split no tensor-parallel plan, and the plan says why; a model it can cut and
split still may."""

from __future__ import annotations

import torch
from torch import nn

import autopar
from autopar.models import hf, zoo
from autopar.runtime.parts import has_parts
from autopar.runtime.tensor_parallel import splits_every_block


class TinyTransformer(nn.Module):
    """Written as a user would, with torch's own attention: no ModelParts entry."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True) for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _plan(model: nn.Module, inputs: tuple, devices: int) -> autopar.Plan:
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=devices)
    options = autopar.PlanOptions(sensitivity=False)
    return autopar.parallelize(model, cluster, inputs, global_batch_size=16, options=options)


def test_a_model_the_runtime_cannot_cut_gets_no_pipeline_plan():
    model = TinyTransformer()
    assert not has_parts(model)
    inputs = (torch.randint(0, 256, (1, 128)),)
    for devices in (2, 4):
        plan = _plan(model, inputs, devices)
        assert plan.config.pp == 1
        assert all(" pp=1 " in alt["config"] for alt in plan.alternatives)
        assert any("cannot cut TinyTransformer into stages" in note for note in plan.notes)


def test_a_model_the_runtime_can_cut_keeps_pipeline_plans_in_the_space():
    model = zoo.build("llama-tiny")
    assert has_parts(model)
    plan = _plan(model, zoo.example_inputs("llama-tiny", model), 4)
    assert not any("into stages" in note for note in plan.notes)
    assert (
        plan.report["num_degree_choices"]
        > _plan(TinyTransformer(), (torch.randint(0, 256, (1, 128)),), 4).report[
            "num_degree_choices"
        ]
    )


def test_a_model_whose_blocks_the_runtime_cannot_split_gets_no_tensor_parallel_plan():
    """GPT-2's projections are Conv1D, not nn.Linear: tp would run them replicated while the
    estimate priced them sharded."""
    model = hf.build("gpt2-tiny-hf")
    assert not splits_every_block(model, 2)
    plan = _plan(model, (torch.randint(0, 128, (1, 64)),), 4)
    assert plan.config.tp == 1 and all(" tp=1 " in alt["config"] for alt in plan.alternatives)
    assert any("blocks replicated" in note for note in plan.notes)
    assert splits_every_block(hf.build("llama-tiny-hf"), 2)
