"""Hugging Face transformers models built from configs written here: no download, no network.

In: a preset name (`names()`), a device and optional config overrides. Out: a
`transformers` causal LM (`AutoModelForCausalLM.from_config`) with `use_cache=False`, on the
meta device for the published shapes (a 405B model costs no memory) and on the CPU with real,
seeded weights for the tiny test variants (`*-tiny-hf`).

    model = hf.build("llama3-8b")                    # meta; 8,030,261,248 parameters
    model = hf.build("llama3-8b", num_hidden_layers=2)
    tiny = hf.build("mixtral-tiny-hf")               # CPU, real weights
    (ids,) = hf.example_inputs("mixtral-tiny-hf", tiny)

Mixture-of-experts presets set `experts_implementation="grouped_mm"`, what transformers 5
picks by default where `torch._grouped_mm` dispatches (elsewhere it falls back to "eager", which
loops over the experts that received tokens: data-dependent, it fails `torch.export` under
fake/meta tensors with GuardOnDataDependentSymNode). "grouped_mm" exports on every device (on
the CPU and meta device through transformers' `grouped_mm_fallback` custom op), its grouped GEMM
is counted with the routed FLOPs by the formulas `autopar.tracing.ops` registers, and it is
what a run should execute: it reads each expert's weights once. ("batched_mm", which this
module used before, exports too but gathers a `[tokens * top_k, F, H]` copy of the expert
weights and saves it for backward: 25x the activations of Mixtral's tiny preset at run time.)

transformers is an optional dependency (`pip install autopar[hf]`); it is imported inside the
functions here, never at module import.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.models.hf_presets import HF_PRESETS, HFPreset
from autopar.models.quiet import import_torchao

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "HFPreset",
    "build",
    "build_from_config",
    "config",
    "example_inputs",
    "names",
    "preset",
]

# Config keys every transformers config takes besides its own fields (popped in
# PretrainedConfig.__init__; transformers 5.x).
_BASE_KWARGS = frozenset({"attn_implementation", "experts_implementation", "dtype"})


def _transformers() -> Any:
    import_torchao()  # transformers imports it while building a model: without its noise
    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "autopar.models.hf needs Hugging Face transformers: pip install autopar[hf]"
        ) from err
    return transformers


def names() -> tuple[str, ...]:
    """The preset names, sorted."""
    return tuple(sorted(HF_PRESETS))


def preset(name: str) -> HFPreset:
    """The registry entry for `name`. Raises ValueError listing the known names."""
    try:
        return HF_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hf model {name!r}; known: {', '.join(names())}") from None


def config(name: str, **overrides: Any) -> PretrainedConfig:
    """The transformers config of preset `name`, with `overrides` applied.

    Raises:
        ValueError: unknown name, or an override that is no field of the config class
            (transformers itself would silently store a misspelt key and ignore it).
    """
    entry = preset(name)
    cls = getattr(_transformers(), entry.config_class)
    _check_overrides(name, cls, overrides)
    return cls(**{**copy.deepcopy(dict(entry.kwargs)), **overrides})


def _check_overrides(name: str, cls: type, overrides: Mapping[str, Any]) -> None:
    valid = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | _BASE_KWARGS
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"{name}: unknown config field(s) {unknown} for {cls.__name__}; "
            f"fields: {', '.join(sorted(valid))}"
        )


def build(
    name: str, *, device: str | torch.device | None = None, seed: int = 0, **overrides: Any
) -> nn.Module:
    """Build preset `name` with `AutoModelForCausalLM.from_config` (no weights are downloaded).

    Args:
        name: a preset from `names()`.
        device: "meta" (no memory) or "cpu"; default: the preset's own, meta for the published
            shapes, cpu for the `*-tiny-hf` variants.
        seed: init seed; the caller's CPU RNG state is restored afterwards.
        **overrides: config fields, e.g. `num_hidden_layers=2`.

    Raises:
        ImportError: transformers is not installed.
        ValueError: unknown name or config field.
        RuntimeError: an MoE model did not take the "grouped_mm" experts implementation.
    """
    entry = preset(name)
    cfg = config(name, **overrides)
    auto = _transformers().AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]), torch.device(device or entry.device):
        torch.manual_seed(seed)
        model = auto.from_config(cfg)
    # Guard: a model that did not take the asked implementation (transformers replaces an unset
    # one by "grouped_mm", or "eager" where grouped_mm cannot dispatch) may not export.
    asked, got = cfg._experts_implementation, model.config._experts_implementation
    if entry.is_moe and got != asked:
        raise RuntimeError(
            f"{name}: experts implementation is {got!r}, asked for {asked!r}; "
            "torch.export needs a data-independent one (grouped_mm)"
        )
    # how to build it again (with real weights): a plan records this for its generated program
    kwargs = {"name": name, "seed": seed, **overrides}
    model.autopar_factory = {"factory": "autopar.models.hf:build", "kwargs": kwargs}
    return model


def build_from_config(path: str, *, device: str = "cpu", seed: int = 0) -> Any:
    """A transformers causal LM from a ``config.json`` (no weights downloaded); MoE configs
    take the export-friendly "grouped_mm" experts (see `autopar.models.hf`)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, or not JSON
        raise AutoparError(f"{path}: cannot read a Hugging Face config.json: {e}") from None
    if not isinstance(data, dict):
        raise AutoparError(f"{path}: a Hugging Face config.json is a JSON object")
    transformers = _transformers()
    if "model_type" not in data:
        raise AutoparError(f"{path}: config.json has no model_type field")
    if problems := config_problems(data):
        raise AutoparError(f"{path}: {'; '.join(problems)}")
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    kwargs.setdefault("use_cache", False)
    kwargs.setdefault("attn_implementation", "sdpa")
    try:  # transformers raises what it will on a bad value (its strict dataclasses included)
        config = transformers.AutoConfig.for_model(data["model_type"], **kwargs)
    except Exception as e:  # noqa: BLE001 -- one line for the user, whatever the kind
        raise AutoparError(f"{path}: transformers cannot read this config: {_first(e)}") from None
    if "experts_implementation" not in data and _takes_grouped_experts(transformers, config):
        config._experts_implementation = "grouped_mm"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except Exception as e:  # noqa: BLE001 -- as above
            raise AutoparError(
                f"{path}: transformers cannot build a causal LM of this config: {_first(e)}"
            ) from None


def _takes_grouped_experts(transformers, config) -> bool:
    """Whether the config's causal LM has experts whose implementation can be chosen (a key
    like num_local_experts in a dense family's config is ignored, as transformers ignores it)."""
    model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    can_set = getattr(model_class, "_can_set_experts_implementation", None)
    return can_set is not None and can_set()


# the shape fields of published configs (each family's own names): a whole number >= 1 where
# given; None allowed where transformers derives the value (a head size, an MLP width)
_SIZES = ("num_hidden_layers", "n_layer", "num_layers", "hidden_size", "n_embd", "d_model",
          "num_attention_heads", "n_head", "vocab_size", "max_position_embeddings",
          "n_positions", "num_local_experts", "num_experts", "n_routed_experts",
          "num_experts_per_tok")  # fmt: skip
_OPTIONAL_SIZES = ("num_key_value_heads", "intermediate_size", "n_inner", "head_dim",
                   "sliding_window")  # fmt: skip
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
# the deepest published transformers have about 1,000 layers (DeepNet's 1,000-layer model);
# past that a config is a typo or hostile, and building and tracing it would take hours
MAX_LAYERS = 1024


def config_problems(data: dict[str, Any]) -> list[str]:
    """What in a config.json's shape no model can be built from, each naming the field: a
    size that is not a whole number >= 1, more than `MAX_LAYERS` layers, a hidden size the
    heads do not divide (where no head_dim is given), query heads the key-value heads do not
    divide."""
    out = []
    for key in (*_SIZES, *_OPTIONAL_SIZES):
        if key not in data or (data[key] is None and key in _OPTIONAL_SIZES):
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            out.append(f"{key} must be a whole number >= 1, got {value!r}")
        elif key in _LAYERS and value > MAX_LAYERS:
            out.append(f"{key} is {value:,}: autopar plans models of at most {MAX_LAYERS:,} "
                       "layers (the deepest published)")  # fmt: skip
    hidden = next((data[k] for k in ("hidden_size", "n_embd", "d_model") if k in data), None)
    heads = next((data[k] for k in ("num_attention_heads", "n_head") if k in data), None)
    if not out and hidden and heads and data.get("head_dim") is None and hidden % heads:
        out.append(f"the hidden size {hidden} is not a multiple of the {heads} attention heads")
    kv_heads = data.get("num_key_value_heads")
    if not out and heads and kv_heads and heads % kv_heads:
        out.append(f"the {heads} attention heads are not a multiple of the {kv_heads} "
                   "key-value heads (num_key_value_heads)")  # fmt: skip
    return out


def _first(error: BaseException) -> str:
    """An exception as one line: its kind and the last line of its message that says
    something (transformers' validation errors put the reason last)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def example_inputs(
    name: str, model: nn.Module, *, seq_len: int | None = None, batch_size: int = 1, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Token ids `[batch_size, seq_len]` on the model's device.

    `seq_len` defaults to the preset's training sequence length (`HFPreset.seq_len`), which can
    be shorter than the model's `max_position_embeddings`.
    """
    seq_len = preset(name).seq_len if seq_len is None else seq_len
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    return (ids.to(next(model.parameters()).device),)
