"""A user's factory may return a model whose output is not a tensor (issue 19): a Hugging Face
ModelOutput, a tuple or a dict. The task takes the tensor the loss reads from it, so the
single-process run trains the user's own transformers model as it trains autopar's preset."""

from __future__ import annotations

import textwrap

import pytest
import torch

from autopar.runtime.task import _first_tensor, task_from_source
from autopar.runtime.trainer import TrainOptions, reference_run

FACTORIES = textwrap.dedent(
    """
    import torch
    from torch import nn
    import transformers

    def llama(seed=0):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        )
        return transformers.LlamaForCausalLM(config)  # use_cache left at its default

    class AsDict(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, ids):
            return {"aux": torch.zeros(()), "logits": self.inner(ids).logits}

    def llama_dict(seed=0):
        return AsDict(llama(seed))
    """
)


@pytest.fixture()
def factories(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    (tmp_path / "user_models.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_models"


def test_outputs_of_any_structure_give_their_tensor():
    t = torch.ones(2)
    assert _first_tensor(t) is t and _first_tensor((t, None)) is t
    assert _first_tensor({"logits": t, "x": 1}) is t and _first_tensor([{"y": t}]) is t
    with pytest.raises(TypeError, match="returned str, which holds no tensor"):
        _first_tensor("no")


def test_a_users_transformers_model_trains_as_its_tensor_twin(factories):
    options = TrainOptions(steps=2, log=False)
    runs = []
    for name in ("llama", "llama_dict"):
        task = task_from_source(f"{factories}:{name}", {}, global_batch_size=4, seq_len=32)
        runs.append([(r.loss, r.grad_norm) for r in reference_run(task, 4, options)])
    assert runs[0] == runs[1]  # the same model and data: the same losses, whatever it returns
    assert all(torch.isfinite(torch.tensor(run)).all() for run in runs)
