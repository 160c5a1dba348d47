"""Which model a command means: a zoo name, a Hugging Face preset, a config.json or
``module:factory``; and the same model again from a saved plan's `model_source`.

In: the user's model argument (and the sequence length to plan for). Out: `LoadedModel`, the
module on the meta device (nothing allocated), one sample's inputs and the factory a plan
records so that `compare`, `generate` and the generated program can build the model again.
Resolution order: zoo name, Hugging Face preset, a path to a ``.json`` file, ``module:function``.
"""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.errors import AutoparError

HF_CONFIG_FACTORY = "autopar.commands.models:build_hf_config"


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # torch.nn.Module
    inputs: tuple[Any, ...]
    factory: tuple[str, dict[str, Any]] | None  # None: the model records its own
    description: str


def load_model(spec: str, seq_len: int | None = None) -> LoadedModel:
    """Build the model ``spec`` names on the meta device, with one sample's inputs.

    Raises:
        AutoparError: ``spec`` names no model (the message lists what it tried), or the
            factory or config fails.
    """
    from autopar.models import hf, zoo

    if spec in zoo.PRESETS:
        model = _call(zoo.build, spec, device="meta")
        lm = hasattr(model.config, "seq_len")  # MLP and ConvNet take no sequence
        inputs = zoo.example_inputs(spec, model, seq_len=seq_len if lm else None)
        return LoadedModel(model, inputs, None, f"zoo model {spec}")
    if spec in hf.names():
        model = _call(hf.build, spec, device="meta")
        inputs = hf.example_inputs(spec, model, seq_len=seq_len)
        return LoadedModel(model, inputs, None, f"Hugging Face preset {spec}")
    if spec.endswith(".json") or Path(spec).is_file():
        path = str(Path(spec).resolve())
        model = build_hf_config(path, device="meta")
        factory = (HF_CONFIG_FACTORY, {"path": path})
        return LoadedModel(model, _token_ids(model, seq_len), factory, f"config {spec}")
    if ":" in spec:
        model = _call(_resolve(spec))
        return LoadedModel(model, _token_ids(model, seq_len), (spec, {}), f"factory {spec}")
    raise AutoparError(
        f"unknown model {spec!r}: not a zoo model ({', '.join(zoo.names())}), not a Hugging "
        f"Face preset ({', '.join(hf.names())}), not a config.json path, not module:factory "
        "(see `autopar list-models`)"
    )


def model_from_plan(plan: Any) -> LoadedModel:
    """The plan's model again (on meta), from its recorded factory, with inputs of its length.

    Raises:
        AutoparError: the plan records no factory, or it no longer builds.
    """
    source = plan.model_source
    if source is None:
        raise AutoparError(
            f"the plan of {plan.model} records no model factory, so its model cannot be built "
            "again: re-plan with `autopar plan` (zoo, Hugging Face preset, config.json or "
            "module:factory)"
        )
    kwargs = dict(source.kwargs)
    name = kwargs.get("name")
    if source.factory == "autopar.models.zoo:build":
        from autopar.models import zoo

        model = _call(zoo.build, **{**kwargs, "device": "meta"})
        lm = hasattr(model.config, "seq_len")
        inputs = zoo.example_inputs(name, model, seq_len=plan.seq_len if lm else None)
    elif source.factory == "autopar.models.hf:build":
        from autopar.models import hf

        model = _call(hf.build, **{**kwargs, "device": "meta"})
        inputs = hf.example_inputs(name, model, seq_len=plan.seq_len)
    else:
        fn = _resolve(source.factory)
        takes_device = "device" in inspect.signature(fn).parameters
        model = _call(fn, **({**kwargs, "device": "meta"} if takes_device else kwargs))
        inputs = _token_ids(model, plan.seq_len)
    return LoadedModel(model, inputs, (source.factory, kwargs), source.as_text())


def build_hf_config(path: str, *, device: str = "cpu", seed: int = 0) -> Any:
    """A transformers causal LM from a ``config.json`` (no weights downloaded); MoE configs
    take the export-friendly "batched_mm" experts (see `autopar.models.hf`)."""
    import torch

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AutoparError(f"{path}: cannot read a Hugging Face config.json: {e}") from None
    from autopar.models.hf import _transformers

    transformers = _transformers()
    if "model_type" not in data:
        raise AutoparError(f"{path}: config.json has no model_type field")
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    kwargs.setdefault("use_cache", False)
    kwargs.setdefault("attn_implementation", "sdpa")
    if any(k in data for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        kwargs.setdefault("experts_implementation", "batched_mm")
    try:
        config = transformers.AutoConfig.for_model(data["model_type"], **kwargs)
    except (ValueError, KeyError) as e:
        raise AutoparError(f"{path}: transformers cannot read this config: {e}") from None
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return transformers.AutoModelForCausalLM.from_config(config)


def _token_ids(model: Any, seq_len: int | None) -> tuple[Any, ...]:
    from autopar.api import infer_example_inputs

    if seq_len is None:
        try:
            return infer_example_inputs(model)
        except ValueError as e:
            raise AutoparError(f"{e}; or give --seq-len") from None
    import torch

    device = next(model.parameters()).device
    return (torch.zeros(1, seq_len, dtype=torch.long, device=device),)


def _resolve(path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except (ImportError, AttributeError) as e:
        raise AutoparError(f"cannot import model factory {path!r}: {e}") from None


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except AutoparError:
        raise
    except (ValueError, TypeError, ImportError, RuntimeError) as e:
        raise AutoparError(f"building the model failed: {e}") from None


def list_models() -> str:
    """The zoo's and the Hugging Face presets' names, each with where its shape comes from."""
    from autopar.models import hf, zoo

    lines = ["zoo (autopar.models.zoo):"]
    lines += [f"  {n:<20} {zoo.preset(n).source}" for n in zoo.names()]
    lines += ["Hugging Face presets (autopar.models.hf, built from configs, no download):"]
    lines += [f"  {n:<20} {hf.preset(n).source}" for n in hf.names()]
    lines.append("or: a path to a Hugging Face config.json, or module:factory")
    return "\n".join(lines)


def run_list_models(_args: object) -> str:
    return list_models()
