"""embed -> blocks -> head equals the model's own forward, for every registered family."""

from __future__ import annotations

import pytest
import torch

from autopar.models import hf, zoo
from autopar.runtime import parts


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_zoo_parts_equal_forward(name: str) -> None:
    model = zoo.build(name, num_layers=3)
    (ids,) = zoo.example_inputs(name, model, batch_size=2)
    torch.testing.assert_close(parts.run(model, (ids,)), model(ids), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama-tiny-hf", "mixtral-tiny-hf", "gpt2-tiny-hf"])
def test_hf_parts_equal_forward(name: str) -> None:
    model = hf.build(name, num_hidden_layers=3)
    (ids,) = hf.example_inputs(name, model, batch_size=2)
    torch.testing.assert_close(parts.run(model, (ids,)), model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["Phi3", "Mistral"])
def test_a_sliding_window_narrower_than_the_sequence_is_kept(family: str) -> None:
    """Phi-3 and Mistral mask every layer to their sliding window: the stages' context does
    too (a whole causal mask differed past the window)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, sliding_window=4, pad_token_id=0,
    )  # fmt: skip
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    ids = torch.randint(0, 64, (2, 16))
    assert parts.sliding_window(model) == 4
    torch.testing.assert_close(parts.run(model, (ids,)), model(ids).logits, rtol=0, atol=0)


def test_positions_are_explicit() -> None:
    """A shard's global positions give the shard's rows of the whole-sequence output's
    position-dependent part: the embedding of tokens 8..15 at positions 8..15."""
    model = zoo.build("gpt-tiny")
    p = parts.parts_of(model)
    (ids,) = zoo.example_inputs("gpt-tiny", model)
    whole = p.embed(model, (ids,), torch.arange(ids.shape[1]))
    shard = p.embed(model, (ids[:, 8:16],), torch.arange(8, 16))
    torch.testing.assert_close(shard, whole[:, 8:16], rtol=0, atol=0)
    cos, sin = parts.rope_at(torch.arange(8, 16), 16, 10000.0)
    from autopar.models.layers import rope_cos_sin

    cos_all, sin_all = rope_cos_sin(32, 16, 10000.0, torch.device("cpu"))
    torch.testing.assert_close(cos, cos_all[8:16], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_all[8:16], rtol=0, atol=0)


def test_tied_and_unknown() -> None:
    gpt = zoo.build("gpt-tiny")
    assert parts.tied_parameters(gpt, parts.parts_of(gpt)) == (
        ("lm_head.weight", "tok_emb.weight"),
    )
    llama = zoo.build("llama-tiny")
    assert parts.tied_parameters(llama, parts.parts_of(llama)) == ()
    assert not parts.has_parts(zoo.build("mlp-tiny"))
    with pytest.raises(ValueError, match="does not know how to cut MLP"):
        parts.parts_of(zoo.build("mlp-tiny"))
