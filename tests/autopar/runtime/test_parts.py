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


# family -> its config's window arguments (Qwen2: sliding layers after the first)
WINDOWED = {
    "Phi3": {},
    "Mistral": {},
    "Qwen2": {"use_sliding_window": True, "max_window_layers": 1},
    "Gemma2": {"head_dim": 8},
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_a_sliding_window_narrower_than_the_sequence_is_kept(family: str) -> None:
    """Phi-3 and Mistral mask every layer to their sliding window, Qwen2 and Gemma 2 the
    layers whose attention type says so: the stages' context does too (a whole causal mask
    differed past the window: Mistral's logits by 0.15)."""
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0,
        **WINDOWED[family],
    )  # fmt: skip
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    ids = torch.randint(0, 64, (2, 16))
    assert parts.sliding_window(model) == 4
    torch.testing.assert_close(parts.run(model, (ids,)), model(ids).logits, rtol=0, atol=0)
