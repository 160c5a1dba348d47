"""The built-in model zoo: named presets -> `nn.Module`s, their example inputs and their loss.

In: a preset name (`names()`), a device ("cpu" builds real weights, "meta" shapes only) and
optional config overrides. Out: a module built under `torch.manual_seed(seed)` (so two builds
of the same name, overrides and seed hold the same weights; the caller's RNG state is left as
it was), one sample's example inputs, and the loss that trains it.

    model = zoo.build("gpt-tiny")                       # CPU, fp32, seeded init
    (ids,) = zoo.example_inputs("gpt-tiny", model)      # [1, seq_len] token ids
    logits = model(ids)                                 # [1, seq_len, vocab]
    loss = zoo.lm_loss(logits, ids)                     # shifted next-token cross-entropy
    big = zoo.build("llama-8b", device="meta")          # 8.03 B parameters, no memory

Loss convention: language models return logits `[B, S, V]` and are trained with
`lm_loss(logits, ids)`, which predicts `ids[:, 1:]` from `logits[:, :-1]`; classifiers return
`[B, num_classes]` and use `classification_loss(logits, labels)`. `loss_fn(name)` gives the
right one and `example_batch` inputs with matching targets.

Presets are a read-only registry, `PRESETS`; each names a model class, its frozen config and
the published shape it copies, where it copies one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.moe import MoE, MoEConfig
from autopar.models.simple import MLP, ConvNet, ConvNetConfig, MLPConfig

Device = str | torch.device
FACTORY = "autopar.models.zoo:build"  # the `module:function` path plans record
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: position t predicts `targets[:, t + 1]` (mean over B*(S-1))."""
    vocab = logits_BSV.shape[-1]
    return F.cross_entropy(
        logits_BSV[:, :-1].reshape(-1, vocab).float(), targets_BS[:, 1:].reshape(-1)
    )


def classification_loss(logits_BC: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits `[B, C]` against integer labels `[B]`."""
    return F.cross_entropy(logits_BC.float(), labels_B)


@dataclass(frozen=True)
class InputKind:
    """How a family of models is fed and trained.

    `make_inputs(config, seq_len, batch_size, generator)` returns the inputs on the CPU;
    `make_targets(inputs, config, generator)` the targets `loss` compares the outputs with.
    """

    make_inputs: Callable[[Any, int | None, int, torch.Generator], tuple[torch.Tensor, ...]]
    make_targets: Callable[[tuple[torch.Tensor, ...], Any, torch.Generator], torch.Tensor]
    loss: LossFn


def _token_ids(config: Any, seq_len: int | None, batch_size: int, gen: torch.Generator):
    seq_len = config.seq_len if seq_len is None else seq_len
    if not 1 <= seq_len <= config.seq_len:
        raise ValueError(f"seq_len={seq_len} must be in 1..config.seq_len={config.seq_len}")
    return (torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=gen),)


def _vectors(config: MLPConfig, seq_len: int | None, batch_size: int, gen: torch.Generator):
    _no_seq_len(seq_len, "MLP")
    return (torch.randn(batch_size, config.in_features, generator=gen),)


def _images(config: ConvNetConfig, seq_len: int | None, batch_size: int, gen: torch.Generator):
    _no_seq_len(seq_len, "ConvNet")
    side = config.image_size
    return (torch.randn(batch_size, config.in_channels, side, side, generator=gen),)


def _no_seq_len(seq_len: int | None, model: str) -> None:
    if seq_len is not None:
        raise ValueError(f"seq_len={seq_len} given, but a {model} takes no sequence")


def _labels(inputs: tuple[torch.Tensor, ...], config: Any, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, config.num_classes, (inputs[0].shape[0],), generator=gen)


LANGUAGE_MODEL = InputKind(_token_ids, lambda inputs, _config, _gen: inputs[0], lm_loss)
VECTORS = InputKind(_vectors, _labels, classification_loss)
IMAGES = InputKind(_images, _labels, classification_loss)


@dataclass(frozen=True)
class Preset:
    """A named model: class, config, input kind and where its shape comes from."""

    model_cls: Callable[[Any], nn.Module]
    config: Any
    kind: InputKind
    source: str


PRESETS: Mapping[str, Preset] = MappingProxyType(
    {
        "gpt-tiny": Preset(GPT, GPTConfig(), LANGUAGE_MODEL, "test size"),
        # GPT-2 small: Radford et al. 2019, table 2; equals HF gpt2's 124,439,808 parameters.
        "gpt-124m": Preset(
            GPT,
            GPTConfig(vocab_size=50257, seq_len=1024, num_layers=12, hidden=768, num_heads=12),
            LANGUAGE_MODEL,
            "GPT-2 small (Radford et al. 2019)",
        ),
        # GPT-3 XL: Brown et al. 2020, table 2.1 (24 layers, d_model 2048, d_head 128, ctx 2048;
        # the table's n_heads=24 contradicts 2048/128, so 16 heads of 128 as Megatron-LM uses).
        "gpt-1.3b": Preset(
            GPT,
            GPTConfig(vocab_size=50257, seq_len=2048, num_layers=24, hidden=2048, num_heads=16),
            LANGUAGE_MODEL,
            "GPT-3 XL (Brown et al. 2020, table 2.1)",
        ),
        "llama-tiny": Preset(Llama, LlamaConfig(), LANGUAGE_MODEL, "test size"),
        # Llama 2 7B: Touvron et al. 2023b and meta-llama/Llama-2-7b-hf config.json; no GQA.
        "llama-7b": Preset(
            Llama,
            LlamaConfig(
                vocab_size=32000,
                seq_len=4096,
                num_layers=32,
                hidden=4096,
                ffn_hidden=11008,
                num_heads=32,
                num_kv_heads=32,
            ),
            LANGUAGE_MODEL,
            "Llama 2 7B (Touvron et al. 2023)",
        ),
        # Llama 3 8B: meta-llama/Meta-Llama-3-8B config.json (rope_theta 500000, ctx 8192).
        "llama-8b": Preset(
            Llama,
            LlamaConfig(
                vocab_size=128256,
                seq_len=8192,
                num_layers=32,
                hidden=4096,
                ffn_hidden=14336,
                num_heads=32,
                num_kv_heads=8,
                rope_theta=500000.0,
            ),
            LANGUAGE_MODEL,
            "Llama 3 8B (Meta 2024)",
        ),
        "moe-tiny": Preset(MoE, MoEConfig(), LANGUAGE_MODEL, "test size"),
        # Mixtral 8x7B: Jiang et al. 2024, table 1 (ctx 32768, rope_theta 1e6).
        "moe-8x7b": Preset(
            MoE,
            MoEConfig(
                vocab_size=32000,
                seq_len=32768,
                num_layers=32,
                hidden=4096,
                ffn_hidden=14336,
                num_heads=32,
                num_kv_heads=8,
                rope_theta=1e6,
                num_experts=8,
                top_k=2,
                expert_ffn_hidden=14336,
            ),
            LANGUAGE_MODEL,
            "Mixtral 8x7B (Jiang et al. 2024, table 1)",
        ),
        "mlp-tiny": Preset(MLP, MLPConfig(), VECTORS, "test size"),
        "convnet-tiny": Preset(ConvNet, ConvNetConfig(), IMAGES, "test size"),
    }
)


def names() -> tuple[str, ...]:
    """The preset names, sorted."""
    return tuple(sorted(PRESETS))


def preset(name: str) -> Preset:
    """The registry entry for `name`. Raises ValueError listing the known names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(names())}") from None


def config(name: str, **overrides: Any) -> Any:
    """The preset's frozen config with `overrides` applied (ValueError names unknown fields)."""
    base = preset(name).config
    valid = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"{name}: unknown config field(s) {unknown} for {type(base).__name__}; "
            f"fields: {', '.join(sorted(valid))}"
        )
    return dataclasses.replace(base, **overrides)


def build(name: str, *, device: Device = "cpu", seed: int = 0, **overrides: Any) -> nn.Module:
    """Build preset `name` on `device` ("cpu" or "meta"), initialised under `manual_seed(seed)`.

    Args:
        name: a preset from `names()`.
        device: where parameters live; "meta" allocates nothing (for planning big shapes).
        seed: the init seed; the caller's CPU RNG state is restored afterwards.
        **overrides: config fields to change, e.g. `num_layers=4`.

    Raises:
        ValueError: unknown name (the message lists the known ones) or config field.

    Example: `zoo.build("moe-tiny", top_k=1)`.
    """
    entry = preset(name)
    cfg = config(name, **overrides)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = entry.model_cls(cfg)
    # how to build it again: a plan records this, and its generated program calls it
    model.autopar_factory = {
        "factory": FACTORY,
        "kwargs": {"name": name, "seed": seed, **overrides},
    }
    return model


def example_inputs(
    name: str, model: nn.Module, *, seq_len: int | None = None, batch_size: int = 1, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Inputs for `model` (built from preset `name`) on the model's device.

    Language models get random token ids `[batch_size, seq_len]` (default: the config's
    `seq_len`); the MLP vectors `[batch_size, in_features]`; the ConvNet images
    `[batch_size, C, side, side]`. The model's own config is read, so overrides are honoured.
    """
    return _example(name, model, seq_len, batch_size, seed)[0]


def example_batch(
    name: str, model: nn.Module, *, seq_len: int | None = None, batch_size: int = 1, seed: int = 0
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`(inputs, targets)` such that `loss_fn(name)(model(*inputs), targets)` is the loss."""
    return _example(name, model, seq_len, batch_size, seed)


def loss_fn(name: str) -> LossFn:
    """`lm_loss` for the language models, `classification_loss` for the classifiers."""
    return preset(name).kind.loss


def _example(
    name: str, model: nn.Module, seq_len: int | None, batch_size: int, seed: int
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    kind = preset(name).kind
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    inputs = kind.make_inputs(cfg, seq_len, batch_size, gen)
    targets = kind.make_targets(inputs, cfg, gen)
    device = next(model.parameters()).device
    return tuple(t.to(device) for t in inputs), targets.to(device)
