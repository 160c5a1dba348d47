"""How a model is cut for pipelining: embed -> repeated blocks -> head, with explicit positions.

In: a model instance. Out: its `ModelParts` -- the module paths of the embedding step, of the
`nn.ModuleList` of repeated blocks and of the head, and four functions that run them:

    h   = parts.embed(m, inputs, positions)    # token ids + positions -> hidden   (first stage)
    ctx = parts.context(m, h, positions)       # per-stage context: RoPE tables, causal mask
    h   = parts.block(block, h, ctx)           # one repeated block
    out = parts.head(m, h)                     # hidden -> logits                  (last stage)

`m` is the model itself or any module that holds the same submodules under the same paths
(a pipeline chunk, `autopar.runtime.pipeline.StageModule`), so the functions run unchanged on
either. Invariant (tests/autopar/runtime/test_parts.py): `run(model, inputs)` -- embed, every
block, head -- equals `model(*inputs)` (HF: `.logits`).

Positions are explicit: `positions_S` holds the global position of each of the S tokens of
the inputs, `arange(S)` for a whole sequence. Context parallelism
(`autopar.runtime.context_parallel`) passes a sequence shard's global positions, so the
learned position table (GPT) and the rotary tables (Llama) are those of the shard's tokens.

The registry `PARTS` is keyed by class name ("module.QualName") so that transformers is not
imported to look up a zoo model; `parts_of(model)` walks the class's MRO (the zoo's `Llama`
and `MoE` share `DecoderLM`'s entry).

Public functions:
    parts_of(model) -> ModelParts              # KeyError-free: ValueError names the class
    has_parts(model) -> bool
    run(model, inputs, positions=None) -> out  # embed -> blocks -> head, without pipelining
    default_positions(inputs) -> positions_S   # arange over the sequence dim of inputs[0]
    tied_parameters(model, parts) -> ((head param path, embed param path), ...)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class ModelParts:
    """A model's pipeline anatomy (see the module docstring).

    Paths are dotted module paths from the model's root. `shared` modules hold no trainable
    parameters and are needed on every stage (HF's rotary embedding with its `inv_freq`).
    """

    embed_modules: tuple[str, ...]
    blocks: str
    head_modules: tuple[str, ...]
    embed: Callable[[nn.Module, tuple[Tensor, ...], Tensor], Tensor]
    context: Callable[[nn.Module, Tensor, Tensor], Any]
    block: Callable[[nn.Module, Tensor, Any], Tensor]
    head: Callable[[nn.Module, Tensor], Tensor]
    shared_modules: tuple[str, ...] = ()

    def num_blocks(self, model: nn.Module) -> int:
        return len(model.get_submodule(self.blocks))


def default_positions(inputs: tuple[Tensor, ...]) -> Tensor:
    """`arange(S)` on the inputs' device, S = inputs[0].shape[1] (token ids `[B, S]`)."""
    ids = inputs[0]
    return torch.arange(ids.shape[1], device=ids.device)


def rope_at(positions_S: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary tables at given positions; equals `layers.rope_cos_sin` (same ops, same order)
    when ``positions_S`` is `arange(S)`."""
    device = positions_S.device
    inv_freq_D2 = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    pos_S = positions_S.to(torch.float32)
    freqs_SD2 = pos_S[:, None] * inv_freq_D2[None, :]
    emb_SD = torch.cat((freqs_SD2, freqs_SD2), dim=-1)
    return emb_SD.cos(), emb_SD.sin()


# ------------------------------------------------------------------ zoo GPT


def _gpt_parts(model: nn.Module) -> ModelParts:
    def embed(m: nn.Module, inputs: tuple[Tensor, ...], positions_S: Tensor) -> Tensor:
        (ids_BS,) = inputs
        return m.emb_dropout(m.tok_emb(ids_BS) + m.pos_emb(positions_S))

    return ModelParts(
        embed_modules=("tok_emb", "pos_emb", "emb_dropout"),
        blocks="blocks",
        head_modules=("ln_f", "lm_head"),
        embed=embed,
        context=lambda m, h, positions_S: None,
        block=lambda block, h, ctx: block(h),
        head=lambda m, h: m.lm_head(m.ln_f(h)),
    )


# ------------------------------------------------------------------ zoo Llama / MoE


def _decoder_parts(model: nn.Module) -> ModelParts:
    head_dim, theta = model.head_dim, model.config.rope_theta

    def embed(m: nn.Module, inputs: tuple[Tensor, ...], positions_S: Tensor) -> Tensor:
        (ids_BS,) = inputs
        return m.embed_tokens(ids_BS)

    return ModelParts(
        embed_modules=("embed_tokens",),
        blocks="layers",
        head_modules=("norm", "lm_head"),
        embed=embed,
        context=lambda m, h, positions_S: rope_at(positions_S, head_dim, theta),
        block=lambda layer, h, ctx: layer(h, *ctx),
        head=lambda m, h: m.lm_head(m.norm(h)),
    )


# ------------------------------------------------------------------ Hugging Face decoders


def sliding_window(model: nn.Module) -> int | None:
    """The window of local attention a Hugging Face model's config sets (Mistral's 4096, Phi-3
    mini's 2047), or None. Context parallelism computes whole causal attention."""
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    return int(window) if window else None


@dataclass(frozen=True)
class _Names:
    """Where a Llama-like Hugging Face decoder keeps its parts (GPT-NeoX names them apart)."""

    base: str = "model"
    embed: str = "embed_tokens"
    norm: str = "norm"
    dropout: str | None = None  # after the embedding (GPT-NeoX's emb_dropout)


_GPT_NEOX = _Names("gpt_neox", "embed_in", "final_layer_norm", "emb_dropout")


@functools.cache
def _cache_argument() -> str:
    """The name transformers' mask functions give their cache: ``cache`` in recent releases
    (where ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values``
    before. Asked when a Hugging Face model's parts are built, so importing autopar does not
    import transformers."""
    from transformers.masking_utils import create_causal_mask

    names = inspect.signature(create_causal_mask).parameters
    return "cache" if "cache" in names else "past_key_values"


def _hf_decoder_parts(
    model: nn.Module, sliding: bool = False, names: _Names = _Names()
) -> ModelParts:
    """LlamaForCausalLM and its look-alikes (Mistral, Phi-3, Qwen2/3, Mixtral, Qwen2/3-MoE,
    DeepSeek-V3, GPT-NeoX, Gemma 2): `model.embed_tokens`, `model.layers`, `model.norm`,
    `model.rotary_emb`, `lm_head` (or as ``names`` calls them), as `LlamaModel.forward`.
    Masks as the family's forward makes them: per layer by its attention type where the config
    lists them (Qwen2/3, Gemma 2: whole or sliding-window causal), else sliding-window causal
    for every layer where ``sliding`` and the config sets a window (Mistral, Phi-3, Mixtral),
    else whole causal."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = model.config
    base = names.base
    embeds = (f"{base}.{names.embed}",) + ((f"{base}.{names.dropout}",) if names.dropout else ())
    types = getattr(config, "layer_types", None) or ()
    per_layer = "sliding_attention" in types
    whole = create_causal_mask
    if sliding and sliding_window(model) and not per_layer:
        whole = create_sliding_window_causal_mask

    def embed(m: nn.Module, inputs: tuple[Tensor, ...], positions_S: Tensor) -> Tensor:
        (h,) = inputs
        for path in embeds:
            h = m.get_submodule(path)(h)
        return h

    def context(m: nn.Module, h: Tensor, positions_S: Tensor) -> dict[str, Any]:
        position_ids = positions_S[None, :]
        given = {"config": config, "inputs_embeds": h, "attention_mask": None,
                 _cache_argument(): None, "position_ids": position_ids}  # fmt: skip
        rope = m.get_submodule(f"{base}.rotary_emb")(h, position_ids=position_ids)
        masks = {"full_attention": whole(**given)}
        if per_layer:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**given)
        return {
            "masks": masks,
            "position_embeddings": rope,
            "position_ids": position_ids,
            "use_cache": False,
        }

    def block(layer: nn.Module, h: Tensor, ctx: dict[str, Any]) -> Tensor:
        masks, rest = ctx["masks"], {k: v for k, v in ctx.items() if k != "masks"}
        kind = types[layer.self_attn.layer_idx] if per_layer else "full_attention"
        return layer(h, attention_mask=masks[kind], **rest)

    def head(m: nn.Module, h: Tensor) -> Tensor:
        return m.lm_head(m.get_submodule(f"{base}.{names.norm}")(h))

    return ModelParts(
        embed_modules=embeds,
        blocks=f"{base}.layers",
        head_modules=(f"{base}.{names.norm}", "lm_head"),
        embed=embed,
        context=context,
        block=block,
        head=head,
        shared_modules=(f"{base}.rotary_emb",),
    )


def _gpt2_parts(model: nn.Module) -> ModelParts:
    """GPT2LMHeadModel: `transformer.wte` + `transformer.wpe` (positions) -> `transformer.h`
    -> `transformer.ln_f`, `lm_head` (tied to wte), as `GPT2Model.forward`."""
    from transformers.masking_utils import create_causal_mask

    config = model.config

    def embed(m: nn.Module, inputs: tuple[Tensor, ...], positions_S: Tensor) -> Tensor:
        (ids_BS,) = inputs
        h = m.get_submodule("transformer.wte")(ids_BS)
        h = h + m.get_submodule("transformer.wpe")(positions_S[None, :])
        return m.get_submodule("transformer.drop")(h)

    def context(m: nn.Module, h: Tensor, positions_S: Tensor) -> dict[str, Any]:
        position_ids = positions_S[None, :]
        mask = create_causal_mask(
            config=config,
            inputs_embeds=h,
            attention_mask=None,
            position_ids=position_ids,
            **{_cache_argument(): None},
        )
        return {"attention_mask": mask, "position_ids": position_ids, "use_cache": False}

    return ModelParts(
        embed_modules=("transformer.wte", "transformer.wpe", "transformer.drop"),
        blocks="transformer.h",
        head_modules=("transformer.ln_f", "lm_head"),
        embed=embed,
        context=context,
        block=lambda layer, h, ctx: layer(h, **ctx),
        head=lambda m, h: m.lm_head(m.get_submodule("transformer.ln_f")(h)),
    )


def _gemma2_parts(model: nn.Module) -> ModelParts:
    """Gemma2ForCausalLM: the Llama layout (its layers masked by their attention types, its
    embedding scaling itself), the logits soft-capped as its head does."""
    llama = _hf_decoder_parts(model)
    cap = model.config.final_logit_softcapping

    def head(m: nn.Module, h: Tensor) -> Tensor:
        logits = llama.head(m, h)
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    return replace(llama, head=head)


def _hf_sliding_parts(model: nn.Module) -> ModelParts:
    return _hf_decoder_parts(model, sliding=True)


def _gpt_neox_parts(model: nn.Module) -> ModelParts:
    return _hf_decoder_parts(model, names=_GPT_NEOX)


_HF = "transformers.models"
PARTS: MappingProxyType[str, Callable[[nn.Module], ModelParts]] = MappingProxyType(
    {
        "autopar.models.gpt.GPT": _gpt_parts,
        "autopar.models.llama.DecoderLM": _decoder_parts,  # Llama, MoE
        f"{_HF}.llama.modeling_llama.LlamaForCausalLM": _hf_decoder_parts,
        f"{_HF}.mistral.modeling_mistral.MistralForCausalLM": _hf_sliding_parts,
        f"{_HF}.phi3.modeling_phi3.Phi3ForCausalLM": _hf_sliding_parts,
        f"{_HF}.qwen2.modeling_qwen2.Qwen2ForCausalLM": _hf_decoder_parts,
        f"{_HF}.qwen3.modeling_qwen3.Qwen3ForCausalLM": _hf_decoder_parts,
        f"{_HF}.mixtral.modeling_mixtral.MixtralForCausalLM": _hf_sliding_parts,
        f"{_HF}.gpt2.modeling_gpt2.GPT2LMHeadModel": _gpt2_parts,
        f"{_HF}.gpt_neox.modeling_gpt_neox.GPTNeoXForCausalLM": _gpt_neox_parts,
        f"{_HF}.gemma2.modeling_gemma2.Gemma2ForCausalLM": _gemma2_parts,
        f"{_HF}.qwen2_moe.modeling_qwen2_moe.Qwen2MoeForCausalLM": _hf_decoder_parts,
        f"{_HF}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeForCausalLM": _hf_decoder_parts,
        f"{_HF}.deepseek_v3.modeling_deepseek_v3.DeepseekV3ForCausalLM": _hf_decoder_parts,
    }
)


def _class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def has_parts(model: nn.Module) -> bool:
    """Whether the registry knows how to cut ``model``."""
    return any(_class_key(c) in PARTS for c in type(model).__mro__)


def parts_of(model: nn.Module) -> ModelParts:
    """The `ModelParts` of ``model`` (the registry entry of its class or nearest base).

    Raises:
        ValueError: no entry for the class; the message lists the known classes.
    """
    for cls in type(model).__mro__:
        make = PARTS.get(_class_key(cls))
        if make is not None:
            return make(model)
    known = ", ".join(k.rsplit(".", 1)[-1] for k in PARTS)
    raise ValueError(
        f"autopar does not know how to cut {type(model).__name__} into pipeline stages "
        f"(known: {known}); add a ModelParts entry to autopar.runtime.parts.PARTS"
    )


def run(
    model: nn.Module,
    inputs: tuple[Tensor, ...],
    positions_S: Tensor | None = None,
    parts: ModelParts | None = None,
) -> Tensor:
    """embed -> every block -> head on the whole ``model`` (no pipelining): the reference the
    pipeline chunks are cut from, and a forward with explicit positions for context parallelism.
    """
    parts = parts or parts_of(model)
    positions_S = default_positions(inputs) if positions_S is None else positions_S
    h = parts.embed(model, inputs, positions_S)
    ctx = parts.context(model, h, positions_S)
    for block in model.get_submodule(parts.blocks):
        h = parts.block(block, h, ctx)
    return parts.head(model, h)


def tied_parameters(model: nn.Module, parts: ModelParts) -> tuple[tuple[str, str], ...]:
    """(head parameter path, embed parameter path) for every parameter object the head shares
    with the embedding (GPT-2's `lm_head.weight` is `tok_emb.weight`)."""
    embed_params = {}
    for path in parts.embed_modules:
        for name, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
            embed_params.setdefault(id(p), f"{path}.{name}")
    out = []
    for path in parts.head_modules:
        for name, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
            if id(p) in embed_params:
                out.append((f"{path}.{name}", embed_params[id(p)]))
    return tuple(out)
