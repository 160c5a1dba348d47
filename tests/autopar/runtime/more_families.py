"""Twenty-three more model families for the any-model script (`test_any_model.py --more`), beside
`family_factories`: tiny configs of the same sizes, no dropout, each seeded. The suite runs none
of them (the script does, on 2 and 4 ranks): a trial of new families, as a user would bring them.
"""

from __future__ import annotations

from model_factories import HEADS, HIDDEN, LAYERS, VOCAB, _hf
from torch import nn

_H = HIDDEN // HEADS
_D = dict(
    num_hidden_layers=LAYERS,
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_attention_heads=HEADS,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_ALTERNATING = ["sliding_attention", "full_attention"] * (LAYERS // 2)


def mistral() -> nn.Module:
    return _hf("MistralConfig", "MistralForCausalLM", **_D, num_key_value_heads=2, sliding_window=8)


def mixtral() -> nn.Module:
    return _hf(
        "MixtralConfig",
        "MixtralForCausalLM",
        **_D,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )


def phi() -> nn.Module:
    return _hf(
        "PhiConfig",
        "PhiForCausalLM",
        **_D,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attention_dropout=0.0,
        qk_layernorm=False,
        partial_rotary_factor=0.5,
    )


def gemma() -> nn.Module:
    return _hf("GemmaConfig", "GemmaForCausalLM", **_D, num_key_value_heads=1, head_dim=_H)


def gptj() -> nn.Module:
    return _hf(
        "GPTJConfig",
        "GPTJForCausalLM",
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=64,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def bloom() -> nn.Module:
    return _hf(
        "BloomConfig",
        "BloomForCausalLM",
        n_layer=LAYERS,
        hidden_size=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def starcoder2() -> nn.Module:
    return _hf(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        **_D,
        num_key_value_heads=2,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        sliding_window=None,
    )


def qwen2_moe() -> nn.Module:
    return _hf(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        **_D,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=HIDDEN,
        shared_expert_intermediate_size=HIDDEN,
    )


def nemotron() -> nn.Module:
    return _hf("NemotronConfig", "NemotronForCausalLM", **_D, num_key_value_heads=2, head_dim=_H)


def glm4() -> nn.Module:
    return _hf("Glm4Config", "Glm4ForCausalLM", **_D, num_key_value_heads=2, head_dim=_H)


def gpt_bigcode() -> nn.Module:
    return _hf(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=64,
        multi_query=True,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def gpt_neo() -> nn.Module:
    return _hf(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_heads=HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_types=[[["global", "local"], 2]],
        window_size=8,
        resid_dropout=0.0,
        embed_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def persimmon() -> nn.Module:
    return _hf(
        "PersimmonConfig",
        "PersimmonForCausalLM",
        **_D,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        partial_rotary_factor=0.5,
    )


def deepseek_v2() -> nn.Module:
    return _hf(
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        **_D,
        num_key_value_heads=HEADS,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=HIDDEN,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    )


def gpt_oss() -> nn.Module:
    return _hf(
        "GptOssConfig",
        "GptOssForCausalLM",
        **_D,
        num_key_value_heads=2,
        head_dim=_H,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=_ALTERNATING,
    )


def olmo3() -> nn.Module:
    return _hf(
        "Olmo3Config",
        "Olmo3ForCausalLM",
        **_D,
        num_key_value_heads=HEADS,
        sliding_window=8,
        layer_types=_ALTERNATING,
    )


def exaone4() -> nn.Module:
    return _hf(
        "Exaone4Config",
        "Exaone4ForCausalLM",
        **_D,
        num_key_value_heads=2,
        head_dim=_H,
        sliding_window=8,
        layer_types=_ALTERNATING,
    )


def ernie4_5() -> nn.Module:
    return _hf("Ernie4_5Config", "Ernie4_5ForCausalLM", **_D, num_key_value_heads=2, head_dim=_H)


def helium() -> nn.Module:
    return _hf("HeliumConfig", "HeliumForCausalLM", **_D, num_key_value_heads=2, head_dim=_H)


def arcee() -> nn.Module:
    return _hf("ArceeConfig", "ArceeForCausalLM", **_D, num_key_value_heads=2, head_dim=_H)


def dbrx() -> nn.Module:
    return _hf(
        "DbrxConfig",
        "DbrxForCausalLM",
        d_model=HIDDEN,
        n_heads=HEADS,
        n_layers=LAYERS,
        max_seq_len=64,
        vocab_size=VOCAB,
        attn_config={"kv_n_heads": 2, "attn_pdrop": 0.0, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": HIDDEN, "moe_num_experts": 4, "moe_top_k": 2},
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
    )


def codegen() -> nn.Module:
    return _hf(
        "CodeGenConfig",
        "CodeGenForCausalLM",
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=64,
        n_ctx=64,
        rotary_dim=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def lfm2() -> nn.Module:
    return _hf(
        "Lfm2Config",
        "Lfm2ForCausalLM",
        **_D,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"] * (LAYERS // 2),
    )
