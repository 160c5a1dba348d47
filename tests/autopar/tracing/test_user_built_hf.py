"""Hugging Face models as a user builds them (issue 19): the config's default key/value cache,
which torch.export cannot flatten, is switched off for the capture and restored; a block whose
graph holds export's alias nodes hashes (Phi-3 raised KeyError: 'label')."""

from __future__ import annotations

import pytest
import torch

import autopar

transformers = pytest.importorskip("transformers")


def test_phi3_built_with_its_defaults_traces_with_two_equal_blocks():
    config = transformers.Phi3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(config)
    assert model.config.use_cache  # the default a user gets
    graph = autopar.trace(model, (torch.randint(0, 128, (1, 64), device="meta"),))
    blocks = [layer for layer in graph.layers if layer.kind == "block"]
    assert len(blocks) == 2
    assert len({b.class_id for b in blocks}) == 1  # one repeated class
    assert model.config.use_cache  # given back as it was
