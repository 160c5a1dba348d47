"""The planner offers only what the runtime can run (issue 19): a model `autopar.runtime.parts`
does not know is cut from its traced graph, so its pipeline plans keep tp = cp = ep = 1; one
without a single list of blocks gets no pipeline plan, one whose blocks the runtime cannot
split no tensor-parallel plan, and the plan says why; `evaluate` refuses the same configs,
naming the model and the reason (a Hugging Face MoE's expert parallelism among them). A model
the registry knows keeps every combination."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.errors import ConfigError
from autopar.models import hf, zoo
from autopar.runtime.capability import traced_roles
from autopar.runtime.parts import has_parts
from autopar.runtime.tensor_parallel import splits_every_block, tp_plan
from autopar.tracing import trace


def _plan(model: nn.Module, inputs: tuple, devices: int) -> autopar.Plan:
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=devices)
    options = autopar.PlanOptions(sensitivity=False)
    return autopar.parallelize(model, cluster, inputs, global_batch_size=16, options=options)


class Classifier(nn.Module):
    """An MLP in an nn.Sequential: no list of blocks to cut between."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.out = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.net(x))


def _starcoder2() -> nn.Module:
    """Llama-named projections (tensor parallelism splits them), no parts entry."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    config = Starcoder2Config(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, sliding_window=None,
    )  # fmt: skip
    return Starcoder2ForCausalLM(config)


def _llama4() -> nn.Module:
    """Llama 4's experts take every token (forward(hidden_states)): no token dispatch."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64,
    )  # fmt: skip
    return Llama4ForCausalLM(config)


def test_hugging_face_expert_stacks_get_expert_parallel_plans():
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    config = autopar.ParallelConfig(dp=4, ep=2, micro_batch_size=1)
    inputs = (torch.randint(0, 128, (1, 64)),)
    for name in ("mixtral-tiny-hf", "qwen3-moe-tiny-hf", "deepseek-v3-tiny-hf"):
        plan = autopar.evaluate(hf.build(name), cluster, config, inputs, global_batch_size=8)
        assert plan.config.ep == 2
        assert plan.breakdown["ep_comm"] > 0  # the dispatch and combine all-to-alls, priced


def test_a_traced_model_gets_pipeline_plans_without_tensor_or_context_parallelism():
    model = _starcoder2()
    assert not has_parts(model) and splits_every_block(model, 4)
    plan = _plan(model, (torch.randint(0, 128, (1, 128)),), 8)
    configs = [alt["config"] for alt in plan.alternatives] + [plan.config.as_text()]
    assert any(" pp=1 " not in c for c in configs), configs  # pipeline plans offered ...
    assert all(" tp=1 " in c and " cp=1 " in c for c in configs if " pp=1 " not in c)
    assert any("cut Starcoder2ForCausalLM from its traced graph" in n for n in plan.notes)
    assert not any("no tensor-parallel plans" in n for n in plan.notes)  # tp with pp = 1


def test_a_model_without_one_list_of_blocks_gets_no_pipeline_plan():
    plan = _plan(Classifier(), (torch.randn(1, 32),), 4)
    assert all(" pp=1 " in alt["config"] for alt in plan.alternatives)
    assert any(
        "cannot cut Classifier into pipeline stages: it has no nn.ModuleList of repeated "
        "blocks" in n
        for n in plan.notes
    ), plan.notes


def _olmo2() -> nn.Module:
    """OLMo2: q/k norms over all heads at once (weight = the projection's whole width); under
    tp=2 the runtime failed on the weight's shape (32 against a 16-wide shard) while evaluate
    priced it."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    config = Olmo2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    return Olmo2ForCausalLM(config)


def _falcon(**more: object) -> nn.Module:
    """Falcon calls torch's SDPA itself (its "sdpa" implementation cannot be set), which
    context parallelism redirects only under transformers' own causal mask: ALiBi adds its
    biases to the mask in the model's code, and "eager" multiplies by hand."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **more
    )
    return FalconForCausalLM(config)


def _phi3_gqa(**more: int) -> nn.Module:
    """Phi-3 with fewer key/value heads than query heads (Phi-3-medium's 40 and 10): its fused
    qkv_proj is sliced into q, k, v of unequal widths, which no piece-by-piece split gives each
    tp rank its share of."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **more,
    )  # fmt: skip
    return Phi3ForCausalLM(config)


def test_evaluate_refuses_what_the_runtime_cannot_run_naming_the_model_and_why():
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    cases = [
        (_starcoder2(), (torch.randint(0, 128, (1, 64)),), dict(pp=2, tp=2),
         "pp=2 cuts Starcoder2ForCausalLM from its traced graph"),
        (_phi3_gqa(), (torch.randint(0, 128, (1, 64)),), dict(dp=2, tp=2),
         "tp=2: autopar's runtime would leave Phi3ForCausalLM's blocks replicated"),
        (Classifier(), (torch.randn(1, 32),), dict(pp=2, dp=2),
         "pp=2: autopar's runtime cannot cut Classifier into pipeline stages"),
        (_olmo2(), (torch.randint(0, 128, (1, 64)),), dict(dp=2, tp=2),
         "tp=2: model.layers.0.self_attn.q_norm (Olmo2RMSNorm) normalises the whole output of "
         "a column-parallel projection"),
        (_llama4(), (torch.randint(0, 128, (1, 64)),), dict(dp=2, cp=2),
         "cp=2: autopar's runtime computes causal attention under context parallelism: "
         "model.layers.0.self_attn attends under a mask made from the run's own tensors (a "
         "chunked mask)"),
        (_falcon(alibi=True), (torch.randint(0, 128, (1, 64)),), dict(dp=2, cp=2),
         "cp=2: autopar's runtime computes causal attention under context parallelism: "
         "transformer.h.0.self_attention is handed an attention mask FalconForCausalLM's own "
         "code made"),
        (_falcon(), (torch.randint(0, 128, (1, 64)),), dict(dp=2, tp=2),
         "its code fails with transformer.h.0.self_attention.query_key_value and 7 other "
         "projections at 1/2 of their features (RuntimeError: shape '[1, 64, 6, 8]' is invalid "
         "for input of size 1536); the runtime hands that code each rank's share of the heads: "
         "a head count taken from the tensor (view(..., -1, head_dim)) splits, one read from "
         "the config or a weight over every head ([heads, head_dim], a q/k norm's) would"),
        (_falcon(is_causal=False), (torch.randint(0, 128, (1, 64)),), dict(dp=2, cp=2),
         "transformer.h.0.self_attention attends under a mask that is neither causal nor"),
        (_falcon(attn_implementation="eager"), (torch.randint(0, 128, (1, 64)),),
         dict(dp=2, cp=2), "FalconForCausalLM runs its attention as 'eager', which cannot be set"),
        (_llama4(), (torch.randint(0, 128, (1, 64)),), dict(dp=4, ep=2),
         "ep=2: autopar's runtime dispatches tokens to experts over ranks for its own MoE "
         "blocks (autopar.models.moe) and Hugging Face expert stacks"),
    ]  # fmt: skip
    for model, inputs, degrees, said in cases:
        config = autopar.ParallelConfig(**degrees, micro_batch_size=1)
        try:
            autopar.evaluate(model, cluster, config, inputs, global_batch_size=8)
        except ConfigError as e:
            assert said in str(e), str(e)
        else:
            raise AssertionError(f"{config.as_text()} was priced for {type(model).__name__}")


def test_a_plan_for_another_stack_is_that_frameworks_to_run():
    """Megatron splits a fused QKV of fewer key/value heads and dispatches Llama 4's experts:
    priced for its stack, neither is refused (the refusals are autopar's runtime's)."""
    cluster = autopar.Cluster.from_profile("dgx_h100", 1)
    cases = [
        (_phi3_gqa(), dict(tp=2, dp=4)),
        (_llama4(), dict(dp=8, ep=2)),
    ]
    for model, degrees in cases:
        config = autopar.ParallelConfig(**degrees, micro_batch_size=1)
        inputs = (torch.randint(0, 128, (1, 64)),)
        plan = autopar.evaluate(
            model, cluster, config, inputs, global_batch_size=8, stack="megatron-core"
        )
        assert plan.config == config
        with pytest.raises(ConfigError, match="autopar's runtime"):
            autopar.evaluate(model, cluster, config, inputs, global_batch_size=8)


def test_a_model_the_runtime_can_cut_keeps_pipeline_plans_in_the_space():
    model = zoo.build("llama-tiny")
    assert has_parts(model)
    plan = _plan(model, zoo.example_inputs("llama-tiny", model), 4)
    assert not any("into stages" in note for note in plan.notes)
    assert (
        plan.report["num_degree_choices"]
        > _plan(Classifier(), (torch.randn(1, 32),), 4).report["num_degree_choices"]
    )


def test_a_model_whose_blocks_the_runtime_cannot_split_gets_no_tensor_parallel_plan():
    """Phi-3's fused qkv_proj of unequal pieces: tp would run its blocks replicated while the
    estimate priced them sharded. GPT-2's Conv1D projections (weights stored [in, out]) split,
    as Llama's nn.Linear ones do."""
    model = _phi3_gqa()
    assert not splits_every_block(model, 2)
    plan = _plan(model, (torch.randint(0, 128, (1, 64)),), 4)
    assert plan.config.tp == 1 and all(" tp=1 " in alt["config"] for alt in plan.alternatives)
    assert any("blocks replicated" in note for note in plan.notes)
    assert splits_every_block(hf.build("llama-tiny-hf"), 2)
    gpt2 = hf.build("gpt2-tiny-hf")  # use_cache=False: its mask code reads position values
    assert splits_every_block(gpt2, 2)
    roles, why = traced_roles(gpt2, trace(gpt2, (torch.randint(0, 128, (1, 64)),)))[:2]
    assert roles["transformer.h.1.attn.c_attn"] == "col/3" and why == "", (roles, why)


def test_plans_for_the_compiled_stack_keep_blocks_whole_on_each_rank():
    """autopar's runtime compiles blocks with data, sharded and pipeline parallelism only: a plan
    priced for the autopar-compile stack offers no tp, cp or ep, and says so."""
    model = zoo.build("llama-tiny")
    inputs = zoo.example_inputs("llama-tiny", model)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    options = autopar.PlanOptions(sensitivity=False)
    plans = {
        stack: autopar.parallelize(
            model, cluster, inputs, global_batch_size=16, options=options, stack=stack
        )
        for stack in ("autopar", "autopar-compile")
    }
    compiled = plans["autopar-compile"]
    configs = [alt["config"] for alt in compiled.alternatives] + [compiled.config.as_text()]
    assert all(" tp=1 " in c and " cp=1 " in c and " ep=1 " in c for c in configs), configs
    assert any("no tensor-, context- or expert-parallel plans" in n for n in compiled.notes)
    eager = plans["autopar"].report["num_degree_choices"]
    assert compiled.report["num_degree_choices"] < eager  # the eager stack's space has tp


class _ScaledBlock(nn.Module):
    """A pre-norm attention block whose residual branch has a learned scale (LayerScale)."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.attn = nn.ModuleDict({n: nn.Linear(h, h) for n in ("q_proj", "v_proj", "o_proj")})
        self.gamma = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.gamma * self.attn["o_proj"](self.attn["q_proj"](y) * self.attn["v_proj"](y))


def test_sequence_parallelism_is_refused_for_a_block_weight_no_style_takes():
    """The learned scale would see a rank's sequence shard, its gradient a partial sum; the
    routers and experts of an MoE block are taken (their gradients summed over tp), and so is
    every weight of DeepSeek-V3's block (MLA's down-projections run on the gathered sequence)."""
    model = nn.Sequential()
    model.layers = nn.ModuleList([_ScaledBlock(), _ScaledBlock()])
    with pytest.raises(ValueError, match=r"sequence_parallel: layers.0 \(_ScaledBlock\) holds a "
                       "weight no tensor-parallel style takes"):  # fmt: skip
        tp_plan(model, autopar.ParallelConfig(tp=2, sequence_parallel=True))
    for name in ("mixtral-tiny-hf", "deepseek-v3-tiny-hf"):
        plan = tp_plan(hf.build(name), autopar.ParallelConfig(tp=2, sequence_parallel=True))
        assert plan["model.layers.1.mlp.gate"] == "token_sum"
        assert plan["model.layers.1.mlp.experts"] == "token_sum"
    assert plan["model.layers.1.self_attn"] == "gather_seq_local/3"
    assert plan["model.layers.1.self_attn.kv_a_proj_with_mqa"] == "latent_kv/8"


def test_a_model_whose_code_views_heads_by_its_config_gets_no_tensor_parallel_plan():
    """StableLM views q, k and v by the config's head count (issue 47): its projections carry
    the Megatron names, so the runtime would split them and the first forward would fail.
    The fake-tensor run of the split now covers named projections too: no tp is offered,
    and evaluate refuses tp=2 naming the code's failure."""
    import transformers

    config = transformers.StableLmConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.StableLmForCausalLM(config)
    inputs = (torch.randint(0, 128, (1, 16), device="meta"),)
    plan = _plan(model, inputs, 4)
    assert plan.config.tp == 1 and all(" tp=1 " in alt["config"] for alt in plan.alternatives)
    assert any("own code does not run with its projections split" in n for n in plan.notes)
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    with pytest.raises(ConfigError, match=r"tp=2: StableLmForCausalLM's own code .* is invalid"):
        autopar.evaluate(model, cluster, autopar.ParallelConfig(tp=2, dp=2), inputs,
                         global_batch_size=4)  # fmt: skip
    llama = hf.build("llama-tiny-hf")  # its code reads heads by -1: the named split runs
    found = traced_roles(llama, trace(llama, hf.example_inputs("llama-tiny-hf", llama)))
    assert found.unsplittable == "", found


def test_context_parallelism_is_decided_from_the_models_own_attention_calls():
    """Issue 47: a sliding window narrower than the sequence runs under cp (each layer passes
    its window to the attention function, which cp applies across the shards), as does MLA;
    soft-capped scores do not, and the refusal names the module and what it does."""
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=4)
    config = autopar.ParallelConfig(dp=2, cp=2, micro_batch_size=1)
    inputs = (torch.randint(0, 128, (1, 64)),)
    windowed = autopar.evaluate(_phi3_gqa(sliding_window=16), cluster, config, inputs,
                                global_batch_size=8)  # fmt: skip
    assert windowed.config.cp == 2
    # MLA's values narrower than its queries (DeepSeek-V3): the probe's calls return its width
    mla = hf.build("deepseek-v3-tiny-hf")
    mla_inputs = hf.example_inputs("deepseek-v3-tiny-hf", mla)
    assert autopar.evaluate(mla, cluster, config, mla_inputs, global_batch_size=8).config.cp == 2
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
    ))  # fmt: skip
    with pytest.raises(ConfigError, match=r"cp=2: .*model.layers.0.self_attn soft-caps"):
        autopar.evaluate(gemma2, cluster, config, inputs, global_batch_size=8)


class _OwnAttention(nn.Module):
    """A language model of the user's own: blocks of nn.TransformerEncoderLayer (``mask``: a
    causal mask its forward makes), or of a projection and torch's SDPA, causal, called in
    its own code (``sdpa``)."""

    def __init__(self, mask: bool = False, sdpa: bool = False) -> None:
        super().__init__()
        self.mask, self.sdpa = mask, sdpa
        self.embed = nn.Embedding(64, 32)
        block = (lambda: _CausalSDPA()) if sdpa else (
            lambda: nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        )  # fmt: skip
        self.layers = nn.ModuleList(block() for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        seq = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=ids.device)
        for layer in self.layers:
            h = layer(h) if self.sdpa or not self.mask else layer(h, src_mask=mask, is_causal=True)
        return self.head(h)


class _CausalSDPA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).unflatten(-1, (3, 4, 8)).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + out.transpose(1, 2).flatten(2)


@pytest.mark.parametrize(
    ("model", "words"),
    [
        (_OwnAttention(), r"layers.0.self_attn calls torch's scaled_dot_product_attention with "
                          r"no mask and is_causal=False: it attends both ways"),
        (_OwnAttention(mask=True), r"layers.0.self_attn is handed an attention mask "
                                   r"_OwnAttention's own code made"),
        (_OwnAttention(sdpa=True), r"layers.0 attends causally, but _OwnAttention has no Hugging "
                                   r"Face config .* nor an autopar.runtime.parts entry"),
        (Classifier(), r"Classifier calls no scaled dot-product attention"),
    ],
)  # fmt: skip
def test_context_parallelism_on_a_users_own_model_is_refused_naming_its_attention(model, words):
    """Issue 47: a model with no Hugging Face config and no parts entry is refused cp by what
    its own attention calls do (nn.MultiheadAttention's included), not by its class name."""
    cluster = autopar.Cluster.from_profile("local_cpu", 1, num_devices=2)
    config = autopar.ParallelConfig(cp=2, micro_batch_size=1)
    inputs = (torch.randn(1, 32),) if isinstance(model, Classifier) else (
        torch.randint(0, 64, (1, 16)),
    )  # fmt: skip
    with pytest.raises(ConfigError, match=rf"cp=2: .*on {type(model).__name__}: {words}"):
        autopar.evaluate(model, cluster, config, inputs, global_batch_size=4, precision="fp32")
