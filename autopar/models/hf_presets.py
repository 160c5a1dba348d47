"""The Hugging Face presets as data: config class name, config kwargs, device, sequence length.

In: nothing (constants). Out: `HF_PRESETS`, a read-only mapping name -> `HFPreset`, read by
`autopar.models.hf`. No transformers import here: a config class is named by its string.

Each published shape cites its source, the model's `config.json` on the Hugging Face Hub (as
published by its authors) or its paper. Parameter counts, as `sum(p.numel())` of the built model
(tests/autopar/models/test_hf_models.py checks them): Llama 3 8B 8,030,261,248; 70B
70,553,706,496; 405B 405,853,388,800; GPT-2 124,439,808 (head tied to the token embedding, so
counted once); Mixtral 8x7B 46,702,792,704; Qwen1.5-MoE-A2.7B 14,315,784,192;
DeepSeek-V3 671,026,404,352 (no multi-token-prediction module: transformers does not build it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# All presets: no KV cache (training), SDPA attention (exports, and FLOP counters know it).
_COMMON: dict[str, Any] = {"use_cache": False, "attn_implementation": "sdpa"}
# MoE presets: the experts implementation that exports, keeps routed FLOPs visible and runs
# as a grouped GEMM (see autopar/models/hf.py's docstring).
_MOE: dict[str, Any] = {**_COMMON, "experts_implementation": "grouped_mm"}


@dataclass(frozen=True)
class HFPreset:
    """A transformers model: `config_class(**kwargs)`, where it is built, its training length.

    `seq_len` is the sequence length the model was pre-trained with, the default length of
    `hf.example_inputs`; `max_position_embeddings` in `kwargs` may be longer (context extension).
    """

    config_class: str
    kwargs: Mapping[str, Any]
    device: str
    seq_len: int
    source: str
    is_moe: bool = False


def _llama3(hidden: int, ffn: int, layers: int, heads: int, **extra: Any) -> dict[str, Any]:
    """Llama 3 family: vocab 128256, 8 kv heads, rope_theta 500000, untied head (Meta 2024)."""
    kwargs = {
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        **_COMMON,
    }
    return {**kwargs, **extra}


# Llama 3.1 405B: meta-llama/Llama-3.1-405B config.json (only a 3.1 release exists): 128K context
# by "llama3" RoPE scaling; pre-trained at 8K (Llama 3 paper, Dubey et al. 2024, section 3.4).
_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json; pre-trained at 4K (tech report, section 4.2)
# and extended with YaRN to 128K (max_position_embeddings 163840).
_DEEPSEEK_V3 = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    **_MOE,
}

# Tiny variants: the same classes at test size, real weights on the CPU, sequence 32. The Llama
# and Mixtral ones have the shapes of the zoo's "llama-tiny" and "moe-tiny" (same norm eps and
# RoPE theta), so tests can load one's weights into the other and compare logits.
_TINY_DECODER = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

HF_PRESETS: Mapping[str, HFPreset] = MappingProxyType(
    {
        # meta-llama/Meta-Llama-3-8B config.json
        "llama3-8b": HFPreset(
            "LlamaConfig", _llama3(4096, 14336, 32, 32), "meta", 8192, "Llama 3 8B"
        ),
        # meta-llama/Meta-Llama-3-70B config.json
        "llama3-70b": HFPreset(
            "LlamaConfig", _llama3(8192, 28672, 80, 64), "meta", 8192, "Llama 3 70B"
        ),
        "llama3-405b": HFPreset(
            "LlamaConfig",
            _llama3(
                16384,
                53248,
                126,
                128,
                max_position_embeddings=131072,
                rope_parameters=_LLAMA31_ROPE,
            ),
            "meta",
            8192,
            "Llama 3.1 405B",
        ),
        # openai-community/gpt2 config.json (dropout 0.1 as published)
        "gpt2": HFPreset(
            "GPT2Config",
            {
                "vocab_size": 50257,
                "n_positions": 1024,
                "n_embd": 768,
                "n_layer": 12,
                "n_head": 12,
                **_COMMON,
            },
            "meta",
            1024,
            "GPT-2 124M",
        ),
        # mistralai/Mixtral-8x7B-v0.1 config.json; trained at 32K (Jiang et al. 2024, section 2)
        "mixtral-8x7b": HFPreset(
            "MixtralConfig",
            {
                "vocab_size": 32000,
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "max_position_embeddings": 32768,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False,
                **_MOE,
            },
            "meta",
            32768,
            "Mixtral 8x7B",
            is_moe=True,
        ),
        # Qwen/Qwen1.5-MoE-A2.7B config.json: 60 routed experts, top 4, plus a gated shared expert
        "qwen1.5-moe-a2.7b": HFPreset(
            "Qwen2MoeConfig",
            {
                "vocab_size": 151936,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "num_experts": 60,
                "num_experts_per_tok": 4,
                "norm_topk_prob": False,
                "decoder_sparse_step": 1,
                "max_position_embeddings": 8192,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
                **_MOE,
            },
            "meta",
            8192,
            "Qwen1.5-MoE-A2.7B",
            is_moe=True,
        ),
        "deepseek-v3": HFPreset(
            "DeepseekV3Config", _DEEPSEEK_V3, "meta", 4096, "DeepSeek-V3 671B", is_moe=True
        ),
        "llama-tiny-hf": HFPreset(
            "LlamaConfig", {**_TINY_DECODER, "intermediate_size": 176, **_COMMON}, "cpu", 32, "test"
        ),
        "gpt2-tiny-hf": HFPreset(
            "GPT2Config",
            {"vocab_size": 128, "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}
            | {"bos_token_id": 0, "eos_token_id": 0}
            | {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **_COMMON},
            "cpu",
            32,
            "test",
        ),
        "mixtral-tiny-hf": HFPreset(
            "MixtralConfig",
            {**_TINY_DECODER, "intermediate_size": 128, "num_local_experts": 4, **_MOE}
            | {"num_experts_per_tok": 2},
            "cpu",
            32,
            "test",
            is_moe=True,
        ),
        "qwen2-moe-tiny-hf": HFPreset(
            "Qwen2MoeConfig",
            {**_TINY_DECODER, "intermediate_size": 128, "moe_intermediate_size": 32, **_MOE}
            | {"shared_expert_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2},
            "cpu",
            32,
            "test",
            is_moe=True,
        ),
        "qwen3-moe-tiny-hf": HFPreset(
            "Qwen3MoeConfig",
            {**_TINY_DECODER, "intermediate_size": 128, "moe_intermediate_size": 32, **_MOE}
            | {"num_experts": 8, "num_experts_per_tok": 2, "head_dim": 16},
            "cpu",
            32,
            "test",
            is_moe=True,
        ),
        "deepseek-v3-tiny-hf": HFPreset(
            "DeepseekV3Config",
            {**_TINY_DECODER, "num_hidden_layers": 3, "first_k_dense_replace": 1, **_MOE}
            | {"num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32}
            | {"n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2}
            | {"n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16}
            | {"qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
            "cpu",
            32,
            "test",
            is_moe=True,
        ),
    }
)
