"""The zoo: every preset builds on CPU and meta, runs, exports, trains; names and errors.

Big presets are checked against published parameter counts on the meta device and exported
with two layers (export time grows with depth; two layers hold every op the preset has).
"""

from __future__ import annotations

import pytest
import torch

from autopar.models import zoo

TINY = [name for name in zoo.names() if name.endswith("-tiny")]
BIG = [name for name in zoo.names() if not name.endswith("-tiny")]
LANGUAGE_MODELS = [n for n in zoo.names() if zoo.preset(n).kind is zoo.LANGUAGE_MODEL]


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_names_cover_the_families_and_the_planning_shapes():
    names = zoo.names()
    for required in ["gpt-tiny", "llama-tiny", "moe-tiny", "mlp-tiny", "convnet-tiny"]:
        assert required in names
    assert {"gpt-1.3b", "llama-7b"} <= set(names)
    assert list(names) == sorted(names)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown zoo model 'gpt-huge'") as err:
        zoo.build("gpt-huge")
    for name in zoo.names():
        assert name in str(err.value)
    with pytest.raises(ValueError, match="llama-tiny"):
        zoo.example_inputs("nope", torch.nn.Linear(1, 1))


def test_unknown_override_names_the_field():
    with pytest.raises(ValueError, match="num_layer.*num_layers"):
        zoo.build("gpt-tiny", num_layer=3)


def test_bad_shapes_name_the_numbers():
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by num_kv_heads=3"):
        zoo.build("llama-tiny", num_kv_heads=3)
    with pytest.raises(ValueError, match="top_k=5 must be in 1..num_experts=4"):
        zoo.build("moe-tiny", top_k=5)
    with pytest.raises(ValueError, match="seq_len=33 must be in 1..config.seq_len=32"):
        zoo.example_inputs("gpt-tiny", zoo.build("gpt-tiny"), seq_len=33)


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_runs_on_cpu_with_the_right_output_shape(name):
    model = zoo.build(name)
    inputs = zoo.example_inputs(name, model, batch_size=2)
    out = model(*inputs)
    cfg = model.config
    if name in LANGUAGE_MODELS:
        assert inputs[0].shape == (2, cfg.seq_len) and inputs[0].dtype == torch.long
        assert out.shape == (2, cfg.seq_len, cfg.vocab_size)
    else:
        assert out.shape == (2, cfg.num_classes)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_exports_on_meta(name):
    model = zoo.build(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    inputs = zoo.example_inputs(name, model)
    assert all(t.device.type == "meta" for t in inputs)
    program = torch.export.export(model, inputs, strict=False)
    (out,) = [n for n in program.graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].shape == model(*inputs).shape


@pytest.mark.parametrize("name", BIG)
def test_big_preset_exports_on_meta_with_two_layers(name):
    model = zoo.build(name, device="meta", num_layers=2)
    inputs = zoo.example_inputs(name, model, seq_len=64)
    program = torch.export.export(model, inputs, strict=False)
    (out,) = [n for n in program.graph.nodes if n.op == "output"][0].args[0]
    assert out.meta["val"].shape == (1, 64, model.config.vocab_size)


# Published parameter counts. GPT-2 small and Llama 3 8B / Mixtral 8x7B equal Hugging Face's
# models of the same shape (test_hf_models.py); Llama 2 7B is meta-llama/Llama-2-7b-hf's
# 6,738,415,616. GPT-3 XL's "1.3B" is 1,315,723,264 with a tied head and vocab 50257.
@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpt-124m", 124_439_808),
        ("gpt-1.3b", 1_315_723_264),
        ("llama-7b", 6_738_415_616),
        ("llama-8b", 8_030_261_248),
        ("moe-8x7b", 46_702_792_704),
    ],
)
def test_big_preset_has_the_published_parameter_count(name, expected):
    assert _num_params(zoo.build(name, device="meta")) == expected


def test_build_is_deterministic_and_leaves_the_callers_rng_alone():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a, b = zoo.build("llama-tiny"), zoo.build("llama-tiny")
    assert torch.equal(torch.random.get_rng_state(), state)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    c = zoo.build("llama-tiny", seed=1)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_gpt_head_is_tied_by_default_and_untied_on_request():
    tied = zoo.build("gpt-tiny")
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = zoo.build("gpt-tiny", tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert _num_params(untied) - _num_params(tied) == 128 * 64
    assert isinstance(tied.blocks, torch.nn.ModuleList) and len(tied.blocks) == 2


def test_llama_uses_grouped_query_attention_and_a_layers_list():
    model = zoo.build("llama-tiny")
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    assert attn.k_proj.weight.shape == (2 * 16, 64)
    assert model.lm_head.weight is not model.embed_tokens.weight


def test_language_models_are_causal():
    for name in ["gpt-tiny", "llama-tiny", "moe-tiny"]:
        model = zoo.build(name)
        (ids,) = zoo.example_inputs(name, model)
        changed = ids.clone()
        changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
        assert torch.equal(model(ids)[:, :-1], model(changed)[:, :-1]), name


def test_dropout_is_configurable_and_off_in_eval():
    model = zoo.build("gpt-tiny", dropout=0.5)
    (ids,) = zoo.example_inputs("gpt-tiny", model)
    assert not torch.equal(model(ids), model(ids))
    model.eval()
    assert torch.equal(model(ids), model(ids))


def test_lm_loss_shifts_targets_by_one():
    logits = torch.full((1, 3, 4), -1e4)
    ids = torch.tensor([[0, 1, 2]])
    logits[0, 0, 1] = logits[0, 1, 2] = 1e4  # position t predicts ids[t + 1]
    assert zoo.lm_loss(logits, ids).item() == 0.0
    assert zoo.loss_fn("gpt-tiny") is zoo.lm_loss
    assert zoo.loss_fn("convnet-tiny") is zoo.classification_loss


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_trains_on_cpu(name):
    model = zoo.build(name)
    inputs, targets = zoo.example_batch(name, model, batch_size=4)
    loss_fn = zoo.loss_fn(name)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = loss_fn(model(*inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
