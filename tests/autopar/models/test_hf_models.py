"""Hugging Face presets: published parameter counts, export on meta, zoo equivalence, errors.

The published shapes are built on the meta device (no memory); the tiny variants on the CPU.
The zoo's Llama and MoE are checked against transformers' Llama and Mixtral by loading the
same weights into both and comparing logits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autopar.models import zoo

pytest.importorskip("transformers")
from autopar.models import hf  # noqa: E402  (after the importorskip)

TINY = [name for name in hf.names() if name.endswith("-tiny-hf")]
MOE_PUBLISHED = ["mixtral-8x7b", "qwen1.5-moe-a2.7b", "deepseek-v3"]


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# sum(p.numel()) of the built models. Each equals the count its authors publish:
# - Llama 3 8B / 70B / 405B: 8.03 B / 70.55 B / 405.85 B on the Hub's model pages.
# - GPT-2: 124,439,808, the "124M"; the head is tied to wte, so parameters() yields it once
#   (an untied head would add 50257 * 768 = 38,597,376).
# - Mixtral 8x7B: 46.7 B (Jiang et al. 2024).
# - Qwen1.5-MoE-A2.7B: 14.3 B total (Qwen blog, "A2.7B" counts activated parameters).
# - DeepSeek-V3: 671 B main model. The Hub checkpoint's 685 B adds the 14 B multi-token-
#   prediction module, which transformers does not build; the router's 256-wide
#   e_score_correction_bias is a buffer in transformers, not a parameter.
@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        ("llama3-405b", 405_853_388_800),
        ("gpt2", 124_439_808),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen1.5-moe-a2.7b", 14_315_784_192),
        ("deepseek-v3", 671_026_404_352),
    ],
)
def test_published_shape_has_the_published_parameter_count(name, expected):
    model = hf.build(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.config.use_cache is False
    assert _num_params(model) == expected


@pytest.mark.parametrize("name", TINY)
def test_tiny_variant_runs_on_cpu_and_exports_on_meta(name):
    model = hf.build(name)
    assert all(p.device.type == "cpu" for p in model.parameters())
    (ids,) = hf.example_inputs(name, model, batch_size=2)
    assert model(ids).logits.shape == (2, 32, 128)

    meta_model = hf.build(name, device="meta")
    program = torch.export.export(meta_model, hf.example_inputs(name, meta_model), strict=False)
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "aten.scaled_dot_product_attention.default" in ops
    if hf.preset(name).is_moe:  # grouped_mm: the routed expert GEMMs as one grouped GEMM
        assert any("grouped_mm" in op for op in ops), ops


@pytest.mark.parametrize("name", MOE_PUBLISHED)
def test_published_moe_exports_on_meta_with_grouped_mm(name):
    # One MoE layer each (DeepSeek-V3: after one dense layer, as its first three are dense).
    layers = {"num_hidden_layers": 1}
    if name == "deepseek-v3":
        layers = {"num_hidden_layers": 2, "first_k_dense_replace": 1}
    model = hf.build(name, **layers)
    assert model.config._experts_implementation == "grouped_mm"
    inputs = hf.example_inputs(name, model, seq_len=64)
    program = torch.export.export(model, inputs, strict=False)
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert sum("grouped_mm" in op for op in ops) == 2, ops  # gate+up, then down


def test_grouped_mm_counts_the_routed_expert_flops():
    from autopar.tracing.ops import _register_grouped_mm

    _register_grouped_mm()  # the grouped GEMM's FLOP formulas, as every trace registers them
    model = hf.build("mixtral-tiny-hf")
    cfg = model.config
    (ids,) = hf.example_inputs("mixtral-tiny-hf", model)
    with FlopCounterMode(display=False) as counter:
        model(ids)
    counts = counter.get_flop_counts()
    experts = [k for k in counts if k.endswith(".mlp.experts")]
    assert len(experts) == cfg.num_hidden_layers
    tokens, hidden, ffn = ids.numel(), cfg.hidden_size, cfg.intermediate_size
    routed = cfg.num_experts_per_tok * 3 * 2 * tokens * hidden * ffn  # gate, up, down GEMMs
    assert all(sum(counts[k].values()) == routed for k in experts)


def _zoo_state_from_hf(hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers Llama/Mixtral names -> the zoo's (the same, except the MoE experts)."""
    state = {}
    for key, value in hf_model.state_dict().items():
        key = key.removeprefix("model.")
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, H]: gate rows, then up rows
            for e, gate_up in enumerate(value):
                gate, up = gate_up.chunk(2, dim=0)
                state[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                state[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif key.endswith("mlp.experts.down_proj"):  # [E, H, F]
            for e, down in enumerate(value):
                state[key.replace("down_proj", f"{e}.down_proj.weight")] = down
        else:
            state[key.replace("mlp.gate.", "mlp.router.")] = value
    return state


@pytest.mark.parametrize(
    "zoo_name, hf_name", [("llama-tiny", "llama-tiny-hf"), ("moe-tiny", "mixtral-tiny-hf")]
)
def test_zoo_model_equals_transformers_on_the_same_weights(zoo_name, hf_name):
    hf_model = hf.build(hf_name)
    zoo_model = zoo.build(zoo_name)
    zoo_model.load_state_dict(_zoo_state_from_hf(hf_model), strict=True)
    (ids,) = zoo.example_inputs(zoo_name, zoo_model, batch_size=2)
    torch.testing.assert_close(zoo_model(ids), hf_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_names_and_errors():
    assert {"llama3-8b", "llama3-70b", "llama3-405b", "gpt2", "mixtral-8x7b"} <= set(hf.names())
    assert {"llama-tiny-hf", "gpt2-tiny-hf", "mixtral-tiny-hf"} <= set(TINY)
    with pytest.raises(ValueError, match="unknown hf model 'llama-9b'.*llama3-8b"):
        hf.build("llama-9b")
    with pytest.raises(ValueError, match=r"\['num_layers'\].*num_hidden_layers"):
        hf.build("llama3-8b", num_layers=2)  # transformers alone would ignore the typo
    assert hf.config("llama3-8b", num_hidden_layers=2).num_hidden_layers == 2
    assert hf.config("llama3-405b").rope_parameters["rope_type"] == "llama3"


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ImportError, match=r"pip install autopar\[hf\]"):
        hf.build("gpt2")


def test_importing_the_models_package_does_not_import_transformers():
    code = (
        "import sys, autopar.models, autopar.models.hf\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "assert autopar.models.hf.names()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
